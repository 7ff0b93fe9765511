"""Before a case launches: its predicted peak memory against each device's memory.

The runner asks ``Admission`` twice per case: ``refusal`` before its first launch (a case
predicted not to fit is recorded ``oom``, reason "predicted: X MiB > Y MiB", and never
launched, unless the sweep says ``predict_skip = false``: ``--no-predict-skip``) and
``columns`` when its row is written (the prediction, made again with the stage cut the
case ran where its ``balanced`` cut was only profiled in its first launch).

A device's memory is ``--max-memory-per-device`` where given (any rig); else, on a cuda
rig, the GPU's total memory read through NVML (never CUDA: the runner holds no CUDA
context), shared by the device slots of ``--gpu-slots``; a cpu rig without a cap has no
limit, and nothing is refused there. A process that drives several devices (``mp``,
``pipeline`` on a cpu rig: label "0+1") gets their memory summed, as the runner's memory
cap gives it.

On a cuda rig what is compared is the predicted reserved peak (``Prediction.
reserved_mib_by_device``: the caching allocator's segments, its blocks' rounding, cache and
fragmentation, 10-22% above its allocated peak on the first GPU run), not the allocated
one: the segments are what the device gives. Against a GPU's total that is not all a case
takes there: each process's CUDA context (``CUDA_CONTEXT_MIB``) and, on each GPU of an NCCL
communicator (a multi-process case on NCCL; ``dp``, whose broadcast and gradient reduction
run on NCCL across its GPUs: ``nccl_ranks``), NCCL's buffers (``nccl_mib``: the one-rank
figure measured, ``NCCL_BUFFERS_MIB``, and with peers an assumed allowance for their
buffers) come on top, and are added before comparing.
A cap is compared with the reserved prediction alone: it bounds the allocator's segments,
as the workers apply it (``measure.memory.cap_cuda_memory``). Under MIG a process has an
instance, not the GPU: the instance's memory is read where CUDA_VISIBLE_DEVICES names it
(``MIG-...``); a GPU in MIG mode with none named is refused as a figure (which instance
CUDA takes cannot be read without CUDA): nothing is refused then, and ``Admission.note``
says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench_lib import strategies
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.nvml import VisibleGpu, cuda_visible_gpus, nvml_session
from bench_lib.prediction.memory import Prediction, predict
from bench_lib.results.cells import by_device
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case

MIB = 2**20
CUDA_CONTEXT_MIB = 770.0
"""What one process holds on a GPU it uses outside the caching allocator, and so outside
every prediction: the CUDA context (driver state, the kernels loaded), cuBLAS's and cuDNN's
handles. Measured on the first GPU run (one H100 80GB, driver 580, torch 2.11.0+cu130,
cuDNN 9.19; ``tests/data/h100-2026-11-26``): NVML's used memory over a case's timed steps,
less the idle GPU's (483 MiB) and the allocator's reserved peak, was 742-770 MiB in each of
its 9 one-process cases; the most is taken (it differs by GPU, driver and CUDA version). A
case's process touches its own GPU(s) only (``process_groups.init_process_group`` selects its GPU
first), so each GPU a process uses counts one."""
NCCL_BUFFERS_MIB = 600.0
"""What NCCL holds on the GPU of a one-rank communicator (a process group on NCCL of one
process), the base of every communicator's figure (``nccl_mib``). Measured on the first GPU
run: 564 MiB beside the context for DDP's one-rank communicator (NVML's used memory as for
``CUDA_CONTEXT_MIB``), taken at 600. A communicator with peers adds their buffers, which a
one-rank one has none of (``NCCL_CHANNEL_PEER_MIB``). gloo (``--gpu-slots``) keeps its
buffers in host memory."""
NCCL_CHANNEL_PEER_MIB = 12.0
"""ASSUMED, not measured here: what one NCCL channel holds on a GPU toward one peer it is
connected to. Derived from NCCL's defaults: the receive FIFOs of its three protocols,
Simple's ``NCCL_BUFFSIZE`` (4 MiB), LL128's (120 elements x 640 threads x 8 steps x 8 B,
4.69 MiB) and LL's (8 lines x 512 threads x 8 steps x 16 B, 0.5 MiB), 9.2 MiB, mapped as
10 MiB in cuMem's 2 MiB granules, and the 2 MiB its sending side maps: the 10485760- and
2097152-byte allocations ``NCCL_DEBUG_SUBSYS=ALLOC`` logs per channel and peer on 8 H100s
(NVIDIA/nccl#1685). An ``NCCL_BUFFSIZE`` set larger takes more."""
NCCL_MAX_CHANNELS = 32
"""ASSUMED: the channels NCCL opens between two GPUs, at most: NCCL 2's ``MAXCHANNELS``
for collectives, reached over NVLink (32 per pair of H100s in NVIDIA/nccl#1685); over PCIe
it opens a few, so this overstates there."""
NCCL_MAX_PEERS = 3
"""ASSUMED: the distinct peers one GPU's collective channels connect to, at most: a ring's
previous and next rank and a tree's parent and children, which within a node are mostly
the ring's (a ring keeps two connections whatever the scale: NVIDIA/nccl#986). Send/recv
channels (pipelining's hand-offs) and NVLS, NVSwitch's in-switch all-reduce on boards that
have it (``NCCL_NVLS_ENABLE=0`` turns it off), allocate beyond this and are not counted."""


def nccl_mib(ranks: int) -> float:
    """What NCCL holds on each GPU of a communicator of ``ranks`` GPUs, MiB: the one-rank
    figure measured (``NCCL_BUFFERS_MIB``) plus, with peers, the assumed buffers toward
    each (``NCCL_MAX_CHANNELS`` x ``NCCL_CHANNEL_PEER_MIB`` per peer, up to
    ``NCCL_MAX_PEERS``): 984 MiB on 2 GPUs, 1368 on 3, 1752 on 4 or more. Meant to err
    high: what was published lies under it, 544 MiB a GPU for a process group of 2 of 4
    NVLinked A100s and 688 for larger ones (NVIDIA/nccl#964), and the one-rank base may
    itself hold a buffer that a communicator with peers does not map (NVIDIA/nccl#2363: a
    one-rank communicator's 512 MiB shared buffer)."""
    peers = min(max(ranks - 1, 0), NCCL_MAX_PEERS)
    return NCCL_BUFFERS_MIB + peers * NCCL_MAX_CHANNELS * NCCL_CHANNEL_PEER_MIB


def nccl_ranks(case: Case, rig: Rig) -> int:
    """The GPUs of the NCCL communicator ``case`` builds on ``rig`` (0: none): its process
    group's on NCCL; ``dp``'s on two GPUs or more, since ``nn.DataParallel`` broadcasts the
    model and reduces its gradients through ``torch.cuda.comm``, which runs NCCL across
    them (one communicator per GPU, all in its one process)."""
    if case.process_group and rig.backend == "nccl":
        return case.world_size
    if rig.kind == "cuda" and case.world_size > 1 and strategies.get(case.strategy).replicas:
        return case.world_size
    return 0


MIG_ENABLED = 1
"""``NVML_DEVICE_MIG_ENABLE``: the current mode ``nvmlDeviceGetMigMode`` gives a GPU in
MIG mode."""
Predictor = Callable[[Case, Rig, str], Prediction]
"""(case, rig, the cut it ran or '') -> its prediction: ``prediction.memory.predict``."""


@dataclass(frozen=True)
class DeviceMemory:
    """The memory each device slot of the rig may use, and where that figure comes from."""

    mib: tuple[float, ...]
    """Per device slot of a node, MiB."""
    source: str
    """``--max-memory-per-device``, or the GPUs' (or MIG instances') total memory (NVML)."""
    whole_device: bool = False
    """True: a device's whole memory (a GPU's, a MIG instance's), from which each process's
    CUDA context and NCCL's buffers come too; False: a cap on the caching allocator."""

    def limit_mib(self, label: str) -> float:
        """The memory of the device(s) a peak label names ("1", or "0+1": summed); across
        nodes a rank's slot on its node (nodes alike)."""
        return sum(self.mib[int(i) % len(self.mib)] for i in label.split("+"))


def device_memory(rig: Rig, cap_mib: float, nvml: Any = None) -> DeviceMemory | None:
    """The rig's device memory (module docstring); None where nothing limits it.

    Raises where a cuda rig's NVML cannot be read (the runner then predicts without
    refusing: ``Admission.of``)."""
    if cap_mib:
        return DeviceMemory((cap_mib,) * rig.num_devices, "--max-memory-per-device")
    if rig.kind != "cuda":
        return None
    gpus = cuda_visible_gpus(nvml)
    with nvml_session(nvml) as nv:
        total = [_memory_mib(nv, g) for g in gpus]
    if len(total) < rig.num_gpus:
        raise RuntimeError(f"NVML sees {len(total)} GPU(s) visible to CUDA; the rig has "
                           f"{rig.num_gpus}")
    slots = tuple(total[rig.cuda_index(s)] / rig.gpu_slots for s in range(rig.num_devices))
    what = ("MIG instance" if any(g.mig_uuid for g in gpus[:rig.num_gpus]) else "GPU")
    return DeviceMemory(slots, f"{what} total memory (NVML)" + (
        f" over {rig.gpu_slots} slots" if rig.gpu_slots > 1 else ""), whole_device=True)


def _memory_mib(nv: Any, gpu: VisibleGpu) -> float:
    """The memory CUDA gets of ``gpu``, MiB: the MIG instance CUDA_VISIBLE_DEVICES names on
    it, else the whole GPU's; raises for a GPU in MIG mode with no instance named (its total
    would overstate what a process gets)."""
    if gpu.mig_uuid:
        instance = nv.nvmlDeviceGetHandleByUUID(gpu.mig_uuid.encode())
        return float(nv.nvmlDeviceGetMemoryInfo(instance).total) / MIB
    handle = nv.nvmlDeviceGetHandleByIndex(gpu.nvml_index)
    try:
        mig_mode = nv.nvmlDeviceGetMigMode(handle)[0]
    except Exception:  # a GPU without MIG ("not supported"), or an NVML without the call
        mig_mode = None
    if mig_mode == MIG_ENABLED:
        raise RuntimeError(
            f"GPU {gpu.cuda_index} ({gpu.name}) is in MIG mode and CUDA_VISIBLE_DEVICES names "
            "none of its instances: which one CUDA takes, so its memory, cannot be read "
            "without CUDA, and the GPU's total would overstate it; set "
            "CUDA_VISIBLE_DEVICES=MIG-<uuid> (nvidia-smi -L lists them) or "
            "--max-memory-per-device")
    return float(nv.nvmlDeviceGetMemoryInfo(handle).total) / MIB


class Admission:
    """Predicts each case's memory (once per stage cut) and refuses what will not fit."""

    def __init__(self, rig: Rig, memory: DeviceMemory | None,
                 predictor: Predictor = predict, note: str = "") -> None:
        self.rig, self.memory, self._predictor = rig, memory, predictor
        self.note = note
        """Why nothing is refused where a limit was wanted (NVML unreadable), or ''."""
        self._made: dict[tuple[str, str], Prediction | str] = {}

    @classmethod
    def of(cls, rig: Rig, cases: list[Case], nvml: Any = None,
           read_devices: bool = True) -> Admission:
        """The admission of a sweep's cases on ``rig`` (their memory cap is the sweep's).
        ``read_devices=False`` (a dry run, which may plan a rig this machine is not): only
        the cap limits; the GPUs' own memory is not read."""
        cap = max((c.measurement.max_memory_per_device_mib for c in cases), default=0.0)
        if not read_devices and not cap:
            note = ("device memory not read in a dry run: only --max-memory-per-device "
                    "refuses" if rig.kind == "cuda" else "")
            return cls(rig, None, note=note)
        try:
            return cls(rig, device_memory(rig, cap, nvml))
        except Exception as e:  # no NVML: predict, but refuse nothing
            return cls(rig, None, note=f"GPU memory unknown ({type(e).__name__}: {e})")

    def prediction(self, case: Case, cut: str = "") -> Prediction | str:
        """The case's prediction with ``cut`` (cached), or why there is none."""
        key = (case.case_id, cut)
        if key not in self._made:
            try:
                self._made[key] = self._predictor(case, self.rig, cut)
            except Exception as e:  # a model the replay cannot run: the case still runs
                self._made[key] = f"memory not predicted: {type(e).__name__}: {e}"[:300]
        return self._made[key]

    def refusal(self, case: Case) -> str | None:
        """Why ``case`` must not launch (predicted over a device's memory), or None."""
        if self.memory is None or not case.measurement.predict_skip:
            return None
        pred = self.prediction(case)
        if isinstance(pred, str):
            return None
        what = " reserved" if self.rig.kind == "cuda" else ""  # the allocator's segments
        for label, mib in sorted(pred.reserved_mib_by_device.items()):
            limit = self.memory.limit_mib(label)
            beside = self.outside_allocator(case, label)
            if mib + sum(beside.values()) > limit:
                also = "".join(f" + {v:.0f} MiB {name}" for name, v in beside.items())
                return (f"predicted: {mib:.0f} MiB{what}{also} > {limit:.0f} MiB (device "
                        f"{label}, {self.memory.source}; --no-predict-skip launches it)")
        return None

    def outside_allocator(self, case: Case, label: str) -> dict[str, float]:
        """What ``case`` holds on the device(s) ``label`` names beside the prediction, MiB,
        by what it is: against a whole device's memory, each process's CUDA context and,
        on a GPU of an NCCL communicator (``nccl_ranks``), NCCL's buffers; against a cap,
        nothing. Slots of one GPU that one process drives (``--gpu-slots``: "0+1") are one
        GPU."""
        if self.memory is None or not self.memory.whole_device:
            return {}
        devices = len({self.rig.cuda_index(int(i)) for i in label.split("+")})
        beside = {"CUDA context": CUDA_CONTEXT_MIB * devices}
        ranks = nccl_ranks(case, self.rig)
        if ranks:
            beside["NCCL buffers"] = nccl_mib(ranks) * devices
        return beside

    def columns(self, case: Case, launches: list[CaseOutcome]) -> dict[str, Any]:
        """The row's prediction columns, made with the cut the case's first launch ran."""
        ran = next((o.partition for o in launches if o.partition), "")
        pred = self.prediction(case, ran if ran != self._cut_of(case) else "")
        if isinstance(pred, str):
            return {"note": "; ".join(filter(None, [case.note, pred]))}
        cols = {"peak_mem_mib_predicted_max": round(pred.max_mib, 1),
                "peak_mem_mib_predicted_by_device": by_device(pred.mib_by_device)}
        if self.rig.kind == "cuda":  # the allocator's segments; on a cpu rig the same figure
            cols |= {"peak_mem_reserved_mib_predicted_max": round(pred.reserved_max_mib, 1),
                     "peak_mem_reserved_mib_predicted_by_device":
                         by_device(pred.reserved_mib_by_device)}
        return cols

    def _cut_of(self, case: Case) -> str:
        """The cut an earlier prediction of ``case`` assumed ('' where none was made)."""
        made = self._made.get((case.case_id, ""))
        return made.cut if isinstance(made, Prediction) else ""
