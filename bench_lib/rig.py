"""The rig: the devices a run may use, CPU worker pinning, and process groups.

A ``cuda`` rig is the visible GPUs. A ``cpu`` rig is N workers of T intra-op threads,
each worker a process pinned to its own cores, so that a "device" on a CPU-only machine
is a real, separate compute resource and distributed strategies talk through gloo.

A cpu worker of T threads holds T whole *physical* cores (with their hyper-thread siblings,
read from sysfs): one thread per physical core, and no two workers ever share one, so a
worker's threads never compete with another worker's for a core's execution units.

A cpu worker keeps its heap (``keep_heap``): memory it frees stays its own for the next
pass, as a GPU's caching allocator keeps device memory, rather than going back to the
system and being paged in afresh.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench_lib.nvml import cuda_visible_gpus

RIG_KINDS = ("cpu", "cuda")


class RigError(ValueError):
    """A rig that cannot be built from what the user asked for."""


def available_cores() -> list[int]:
    """The CPU cores this process may run on (respects taskset/cgroups affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


SYSFS_CPU = Path("/sys/devices/system/cpu")


class PhysicalCore(NamedTuple):
    """One physical core: its package (socket), core id and the logical CPUs we may use."""

    package: int
    core_id: int
    cpus: tuple[int, ...]
    """Its hyper-thread siblings that this process may run on (sorted)."""


def _cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` (sysfs cpu list) -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


@dataclass(frozen=True)
class CpuTopology:
    """The physical cores behind a set of logical CPUs (from sysfs, or assumed)."""

    cores: tuple[PhysicalCore, ...]
    """Physical cores, ordered by package then core id."""
    source: str = "sysfs"
    """``sysfs``, or ``assumed: <why>`` when every logical CPU is taken as its own core."""

    def package_of(self, cpu: int) -> int | None:
        """The package (socket) holding logical CPU ``cpu``, or None if unknown."""
        return next((c.package for c in self.cores if cpu in c.cpus), None)

    def counts(self) -> dict[str, Any]:
        """Counts that identify the hardware (part of the hardware fingerprint)."""
        cpus = [cpu for c in self.cores for cpu in c.cpus]
        return {
            "packages": len({c.package for c in self.cores}),
            "physical_cores": len(self.cores),
            "logical_cpus": len(cpus),
            "threads_per_core": max((len(c.cpus) for c in self.cores), default=0),
            "source": self.source,
        }


def read_cpu_topology(cpus: Iterable[int] | None = None, root: Path = SYSFS_CPU) -> CpuTopology:
    """Group logical CPUs (default: those we may use) into physical cores through sysfs.

    Siblings come from ``cpuN/topology/thread_siblings_list`` (only those in ``cpus`` are
    kept), the socket from ``physical_package_id``. Where sysfs cannot be read (not Linux,
    a container hiding it) every CPU is assumed to be its own core, and ``source`` says so.
    """
    wanted = sorted(set(available_cores() if cpus is None else cpus))
    groups: dict[tuple[int, tuple[int, ...]], int] = {}
    try:
        for cpu in wanted:
            topo = root / f"cpu{cpu}" / "topology"
            package = int((topo / "physical_package_id").read_text())
            core_id = int((topo / "core_id").read_text())
            siblings = tuple(_cpu_list((topo / "thread_siblings_list").read_text()))
            groups.setdefault((package, siblings), core_id)
    except (OSError, ValueError) as e:
        reason = f"assumed: no sysfs topology ({type(e).__name__}); one core per logical CPU"
        return CpuTopology(tuple(PhysicalCore(0, c, (c,)) for c in wanted), reason)
    keep = set(wanted)
    cores = [PhysicalCore(pkg, core_id, tuple(c for c in sib if c in keep))
             for (pkg, sib), core_id in groups.items()]
    return CpuTopology(tuple(sorted(cores, key=lambda c: (c.package, c.core_id, c.cpus))))


def allot_cores(topology: CpuTopology, workers: int, threads: int) -> list[list[PhysicalCore]]:
    """``threads`` whole physical cores for each of ``workers``, none shared.

    A worker takes its cores from one package where one has enough left (the lowest such),
    else from the packages in order. Raises ``RigError`` when there are too few cores.
    """
    need, have = workers * threads, len(topology.cores)
    if need > have:
        logical = sum(len(c.cpus) for c in topology.cores)
        smt = f" ({logical} logical CPUs: hyper-thread siblings stay with their core)" \
            if logical > have else ""
        raise RigError(
            f"a cpu rig of {workers} workers x {threads} threads needs {need} physical cores "
            f"(one per thread, never shared between workers); this machine lets us use "
            f"{have}{smt}. Ask for fewer --devices or --threads-per-worker"
        )
    free = list(topology.cores)
    out: list[list[PhysicalCore]] = []
    for _ in range(workers):
        packages = sorted({c.package for c in free})
        home = next((p for p in packages if sum(c.package == p for c in free) >= threads), None)
        pool = [c for c in free if c.package == home] if home is not None else free
        mine = pool[:threads]
        out.append(mine)
        free = [c for c in free if c not in mine]
    return out


@dataclass(frozen=True)
class Rig:
    """Devices a run may use."""

    kind: str
    """``cuda`` (one device per visible GPU) or ``cpu`` (one device per pinned worker)."""
    num_devices: int
    """How many devices the rig has (GPUs, or CPU workers)."""
    threads_per_worker: int = 1
    """Intra-op threads of each CPU worker (ignored on cuda rigs)."""
    cores: tuple[int, ...] = ()
    """Logical CPUs the rig may use, in hand-out order (siblings of a core together)."""
    physical_cores: tuple[tuple[int, ...], ...] = ()
    """The physical cores of ``cores`` in hand-out order, each as its logical CPUs; worker i
    gets physical cores [i*T, (i+1)*T). Empty: each logical CPU counts as a core."""
    nodes: int = 1
    """Nodes of a multi-node run (``run.multinode``), each with this node's devices:
    ``num_devices`` and the cores stay this node's, so device slots index this node."""
    gpu_slots: int = 1
    """Device slots per GPU (cuda only). Above 1 is the validation mode (``--gpu-slots``):
    slot i runs on GPU i // gpu_slots, so two "devices" share one card and the two-device
    code paths run on a one-GPU machine; its numbers are no multi-GPU measurement
    (``validation_note``), and its process groups use gloo (NCCL refuses two ranks on one
    GPU: "Duplicate GPU detected")."""

    def __post_init__(self) -> None:
        if self.kind not in RIG_KINDS:
            raise RigError(f"unknown rig kind {self.kind!r}; valid: {', '.join(RIG_KINDS)}")
        if self.num_devices < 1:
            raise RigError(f"a rig needs at least one device, got {self.num_devices}")
        if self.nodes < 1:
            raise RigError(f"a rig needs at least one node, got {self.nodes}")
        if self.gpu_slots < 1 or (self.gpu_slots > 1 and self.kind != "cuda"):
            raise RigError(f"--gpu-slots {self.gpu_slots}: slots per GPU are >= 1, and above 1 "
                           f"only on a cuda rig (a cpu rig's devices are its workers)")
        if self.kind == "cpu":
            if self.threads_per_worker < 1:
                raise RigError(f"threads per worker must be >= 1, got {self.threads_per_worker}")
            need = self.num_devices * self.threads_per_worker
            if need > len(self.core_groups):
                physical = " physical" if self.physical_cores else ""
                raise RigError(
                    f"a cpu rig of {self.num_devices} workers x {self.threads_per_worker} "
                    f"threads needs {need}{physical} cores; this machine lets us use "
                    f"{len(self.core_groups)}"
                )

    @property
    def core_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rig's physical cores as logical CPU tuples (one per CPU when unknown)."""
        return self.physical_cores or tuple((c,) for c in self.cores)

    @property
    def label(self) -> str:
        """Short rig name used in result rows, e.g. ``cpu:2x1t`` or ``cuda:2``; across nodes
        ``cuda:8@2nodes`` (8 GPUs on each of 2 nodes)."""
        if self.kind == "cpu":
            label = f"cpu:{self.num_devices}x{self.threads_per_worker}t"
        elif self.gpu_slots > 1:  # never mistaken for cuda:N
            label = f"cuda:{self.num_devices}slots-on-{self.num_gpus}gpu-validation"
        else:
            label = f"cuda:{self.num_devices}"
        return label if self.nodes == 1 else f"{label}@{self.nodes}nodes"

    @property
    def num_gpus(self) -> int:
        """GPUs the rig's devices run on (per node); 0 on a cpu rig."""
        if self.kind != "cuda":
            return 0
        return -(-self.num_devices // self.gpu_slots)

    @property
    def validation_note(self) -> str:
        """Empty, or why this rig's numbers are no measurement of its device count."""
        if self.gpu_slots == 1:
            return ""
        return (f"validation run: {self.num_devices} device slots on {self.num_gpus} GPU(s) "
                f"(--gpu-slots {self.gpu_slots}) check the multi-device code paths; the slots "
                f"share each GPU's compute and memory, and ranks talk through gloo, so the "
                f"numbers are not a {self.num_devices}-GPU measurement")

    @property
    def backend(self) -> str:
        """The process groups' backend: NCCL on GPUs, gloo on CPUs and in the validation mode
        (NCCL refuses two ranks on one GPU)."""
        return "nccl" if self.kind == "cuda" and self.gpu_slots == 1 else "gloo"

    def cuda_index(self, index: int) -> int:
        """The CUDA device index (this process's numbering) of device slot ``index``."""
        self._check_index(index)
        return index // self.gpu_slots

    def device(self, index: int) -> torch.device:
        """The torch device of device slot ``index``."""
        self._check_index(index)
        if self.kind == "cuda":
            return torch.device("cuda", self.cuda_index(index))
        return torch.device("cpu")

    def moves_between(self, a: int, b: int) -> bool:
        """Whether one process moving a tensor from device slot ``a`` to ``b`` (``.to()``)
        copies it: between distinct GPUs; not between a cpu rig's workers (one memory) nor
        between the slots of one GPU (``--gpu-slots``)."""
        return self.device(a) != self.device(b)

    def devices(self, count: int | None = None) -> list[torch.device]:
        """The first ``count`` devices (all when None)."""
        return [self.device(i) for i in range(count or self.num_devices)]

    def cores_of(self, index: int) -> list[int]:
        """Logical CPUs owned by worker ``index`` on a cpu rig: its whole physical cores."""
        self._check_index(index)
        t = self.threads_per_worker
        return [c for core in self.core_groups[index * t : (index + 1) * t] for c in core]

    def device_names(self) -> list[str]:
        """Human-readable names of the devices.

        On a cuda rig, read without a CUDA context in this process (the runner's: a context
        would hold memory on a GPU the cases measure): through NVML, else from a child
        process (``cuda_device_names``).
        """
        if self.kind == "cuda":
            gpus = cuda_device_names(self.num_gpus)
            return [gpus[self.cuda_index(i)] for i in range(self.num_devices)]
        return [
            f"cpu worker {i} (cores {','.join(map(str, self.cores_of(i)))})"
            for i in range(self.num_devices)
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_devices": self.num_devices,
            "threads_per_worker": self.threads_per_worker,
            "cores": list(self.cores),
            "physical_cores": [list(c) for c in self.physical_cores],
            "nodes": self.nodes,
            "gpu_slots": self.gpu_slots,
            "label": self.label,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rig:
        physical = tuple(tuple(c) for c in d.get("physical_cores") or ())
        return cls(d["kind"], d["num_devices"], d["threads_per_worker"], tuple(d["cores"]),
                   physical, int(d.get("nodes", 1)), int(d.get("gpu_slots", 1)))

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_devices:
            raise RigError(f"device {index} does not exist on rig {self.label}")


def cuda_device_count() -> int:
    """GPUs visible to CUDA, counted without initialising CUDA in this process.

    ``torch.cuda.device_count`` asks NVML first (no ``cuInit``, no context; it honours
    CUDA_VISIBLE_DEVICES) and falls back to the CUDA runtime only where NVML fails;
    ``torch.cuda.is_available`` would call ``cudaGetDeviceCount`` and initialise the driver.
    A GPU that NVML sees but CUDA cannot use fails the pre-flight check, before any case.
    """
    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def cuda_device_names(count: int, nvml: Any = None,
                      child: Callable[[int], list[str]] | None = None) -> list[str]:
    """Names of CUDA devices 0..count-1 in CUDA's numbering, without a CUDA context here.

    NVML first (``nvml.cuda_visible_gpus``: CUDA_VISIBLE_DEVICES and bus order applied);
    where NVML cannot be read, or sees fewer GPUs, a child process asks torch
    (``_names_from_child``) and exits, taking its context with it.
    """
    try:
        gpus = cuda_visible_gpus(nvml)
    except Exception:  # no NVML library or driver: ask CUDA, in a child
        gpus = []
    if len(gpus) >= count:
        return [g.name for g in gpus[:count]]
    return (child or _names_from_child)(count)


def _names_from_child(count: int, timeout_s: float = 120.0) -> list[str]:
    code = ("import json, sys, torch; "
            "print(json.dumps([torch.cuda.get_device_name(i) for i in range(int(sys.argv[1]))]))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(count)], capture_output=True,
                              text=True, timeout=timeout_s, check=True)
        names = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise RigError(f"cannot read the names of {count} CUDA device(s) through NVML or "
                       f"torch in a child process: {e}") from e
    return [str(n) for n in names]


def detect_rig(
    kind: str | None = None, num_devices: int | None = None, threads: int | None = None,
    topology: CpuTopology | None = None, plan_only: bool = False, gpu_slots: int = 1,
) -> Rig:
    """Detect the rig, with optional overrides from the CLI.

    Default: every visible GPU when CUDA is available; otherwise two CPU workers (one on a
    machine with one physical core) that share the available physical cores evenly, one
    thread per physical core. ``topology`` defaults to this machine's (sysfs).

    ``plan_only`` (a dry run): a cuda rig of ``num_devices`` GPUs is built without asking
    CUDA or NVML anything, whatever this machine has, so that a sweep for an N-GPU box can be
    planned anywhere; nothing may run on such a rig.

    ``gpu_slots`` above 1 (the validation mode, ``Rig.gpu_slots``): ``num_devices`` slots
    (default: every GPU's slots) on ceil(num_devices / gpu_slots) GPUs; cuda only.
    """
    if gpu_slots > 1:
        if kind == "cpu":
            raise RigError(f"--gpu-slots {gpu_slots} needs a cuda rig (it puts several device "
                           f"slots on one GPU); a cpu rig's devices are its workers")
        kind = "cuda"
    if kind == "cuda" and plan_only and num_devices is not None:
        return Rig("cuda", num_devices, gpu_slots=gpu_slots)
    if kind is None:
        kind = "cuda" if cuda_device_count() > 0 else "cpu"
    if kind == "cuda":
        have = cuda_device_count()
        if have == 0:
            raise RigError("--rig cuda asked for, but no CUDA GPU is visible"
                           + (": give --devices N to plan a sweep for N GPUs" if plan_only
                              else ": a run needs GPUs (--dry-run --devices N plans the "
                                   "sweep for N GPUs without them)"))
        n = have * gpu_slots if num_devices is None else num_devices
        rig = Rig("cuda", n, gpu_slots=gpu_slots)
        if rig.num_gpus > have:
            slots = f" at {gpu_slots} slots per GPU" if gpu_slots > 1 else ""
            raise RigError(f"{n} devices asked for{slots}, but this cuda rig has {have} GPU(s)")
        return rig
    if kind != "cpu":
        raise RigError(f"unknown rig kind {kind!r}; valid: {', '.join(RIG_KINDS)}")
    topology = topology or read_cpu_topology()
    have = len(topology.cores)
    n = num_devices if num_devices is not None else min(2, have)
    if n > have:
        raise RigError(f"{n} devices asked for, but this cpu rig has {have} physical core(s)")
    t = threads if threads is not None else max(1, have // max(n, 1))
    workers = allot_cores(topology, n, t)
    handed = [c for w in workers for c in w]
    order = handed + [c for c in topology.cores if c not in handed]
    return Rig("cpu", n, t, tuple(cpu for c in order for cpu in c.cpus),
               tuple(c.cpus for c in order))


def pin_worker(rig: Rig, index: int) -> None:
    """Pin this process to CPU worker ``index``'s cores, with that worker's thread count.

    A process that drives several CPU "devices" (``mp``, ``pipeline``) is pinned like
    ``single``, to its first device's worker: its stages run one after another, so one
    worker's cores is what it can use, and pinning it to more would let its one busy
    thread migrate over cores that another case's worker would own.
    """
    if rig.kind != "cpu":
        return
    cores = rig.cores_of(index)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(rig.threads_per_worker)
    # Inter-op threads would add parallelism the rig does not promise.
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process; harmless
        pass
    keep_heap()


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
"""glibc's ``mallopt`` parameters (malloc.h)."""

KEPT_HEAP = "kept: glibc mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD 2**31 - 1"
"""What ``keep_heap`` does where it can (env.json ``cpu_heap``)."""


def keep_heap(libc: Any = None) -> str:
    """Make this process keep the memory it frees, for a cpu worker; returns what was done
    (``KEPT_HEAP``, or why not: ``heap_policy``).

    glibc by default serves big blocks by ``mmap`` and unmaps them when freed, under a
    threshold that moves with the sizes freed, and gives the top of its heap back past a
    second one, so a pass may page its buffers in afresh every time (ResNet50 at 64 px: a
    pipeline stage's 45 MiB of layer4 and fc gradients each backward, 30 ms of a 99 ms
    pass; the tutorial pipeline's held micro-batches, 375 MiB a step, on a 2-core AMD
    EPYC), depending on the order of allocations rather than on the strategy. No ``mmap``
    and no trimming keep every freed block in the heap for reuse, as a GPU's caching
    allocator does and as torch's own cpu launcher (``torch.backends.xeon.run_cpu``) does
    with jemalloc or tcmalloc.

    What it costs: a heap that gives nothing back fragments where a strategy frees buffers
    of many sizes. FSDP2's gathered buffers raised fsdp's peak at 64 px from 617 to 933 MiB
    (96 px: 682 to 1014; one run each, 2-core AMD EPYC), which the memory prediction does
    not count. A fixed 32 MiB mmap threshold instead (glibc's largest) kept fsdp's peak near
    the default's, but paged its bigger gathered buffers in afresh and the rest not, which
    the copy rate the calibration times (one size) cannot price: fsdp's waterfall remainder
    went from -6% to -29% (#41)."""
    mallopt = _mallopt(libc)
    if isinstance(mallopt, str):
        return mallopt
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1)):
        return "the C library's own: it refused mallopt"
    return KEPT_HEAP


def heap_policy(libc: Any = None) -> str:
    """What ``keep_heap`` does in a cpu worker here, without doing it (env.json
    ``cpu_heap``): ``KEPT_HEAP``, or the C library's own ways and why."""
    found = _mallopt(libc)
    return found if isinstance(found, str) else KEPT_HEAP


def _mallopt(libc: Any) -> Callable[[int, int], int] | str:
    if libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
        except (OSError, TypeError) as e:  # TypeError: no C library found by that name
            return f"the C library's own: {e}"
    found = getattr(libc, "mallopt", None)
    return found if found is not None else "the C library's own: it has no mallopt"


MATH_MODES = ("torch", "ieee")
"""The fp32 math a run computes in (``Measurement.math_mode``, ``run --math-mode``):
``torch``, PyTorch's own TF32 flags (``TORCH_TF32``: in torch 2.14 cuDNN convolutions may use
TF32 on Ampere and later, cuBLAS matmuls may not), the arithmetic users train in; ``ieee``,
TF32 off in both: IEEE fp32, slower convolutions, so compute weighs more against
communication than users will see."""
DEFAULT_MATH_MODE = "torch"
TORCH_TF32 = {"cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
              "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}
"""torch's own TF32 flags, read as this module is imported, before any of ours is set (a
fresh process's: ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` turns cuBLAS's on)."""
CUDNN_BENCHMARK = True
"""cuDNN autotunes each convolution shape on first use (the warm-up steps pay for it), in
either math mode: it picks kernels, not their arithmetic's precision."""


def math_flags(mode: str) -> dict[str, bool]:
    """The TF32 flags of math mode ``mode`` (``MATH_MODES``; ValueError naming them)."""
    if mode not in MATH_MODES:
        raise ValueError(f"unknown math mode {mode!r}; valid: {', '.join(MATH_MODES)}")
    return dict(TORCH_TF32) if mode == "torch" else dict.fromkeys(TORCH_TF32, False)


def set_math_mode(mode: str = DEFAULT_MATH_MODE) -> dict[str, Any]:
    """Set the math flags of every measuring process (workers, the calibration, the FLOP
    peak probe) to math mode ``mode``, so that training and the probe compute in one mode;
    returns them as read back. Each flag is set, ``torch``'s too: a process that set another
    mode before (a test, a library) is put back.

    The legacy ``allow_tf32`` setters, not torch 2.9's ``fp32_precision`` ones: setting
    cuDNN's through the new API leaves ``torch.backends.cudnn.allow_tf32`` unreadable
    (torch raises on a "mix of APIs"), and TorchInductor still reads it. bf16 cases run
    under autocast, which these flags do not change.
    """
    flags = math_flags(mode)
    torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    torch.backends.cudnn.benchmark = CUDNN_BENCHMARK
    return math_mode()


def math_mode() -> dict[str, Any]:
    """The fp32 math flags and cuDNN autotuning in effect in this process (env.json)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    mode: dict[str, Any] = {
        "cuda_matmul_allow_tf32": bool(matmul.allow_tf32),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_deterministic": bool(cudnn.deterministic),
    }
    if hasattr(matmul, "fp32_precision"):  # torch 2.9+: the same flags, as the new API reads
        backends = {"cuda_matmul": matmul, "cudnn_conv": getattr(cudnn, "conv", None),
                    "mkldnn_matmul": getattr(torch.backends.mkldnn, "matmul", None),
                    "mkldnn_conv": getattr(torch.backends.mkldnn, "conv", None)}
        mode["fp32_precision"] = {k: getattr(b, "fp32_precision", None)
                                  for k, b in backends.items()}
    return mode


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device in ``devices`` has finished its queued work.

    One ``torch.cuda.synchronize`` per distinct CUDA device; CPU work is synchronous, so
    CPU devices need nothing. Every clock read in the suite (timed steps, partition
    profiling, the FLOP-peak probe, the traced step) goes through here.
    """
    for device in sorted({d for d in devices if d.type == "cuda"}, key=str):
        torch.cuda.synchronize(device)


def init_process_group(
    rig: Rig, rank: int, world_size: int, init_file: str, timeout_s: float,
    local_rank: int | None = None, loopback: bool = True,
) -> None:
    """Join a case's process group: through a ``file://`` rendezvous (``init_file``, unique
    per case: the local launcher), or through ``env://`` where ``init_file`` is empty (the
    store torchrun's rendezvous set up, at its MASTER_ADDR and MASTER_PORT).

    NCCL on cuda rigs, gloo on cpu rigs. A group on one node (``loopback``) talks over
    loopback only: on Linux both libraries are told so (``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` = ``lo``, unless already set), so NCCL's bootstrap and socket
    fallback never pick another interface (a docker bridge, a VPN) to reach a rank on the
    same host. NCCL's intra-node transports (P2P, NVLink, shared memory) are unaffected. A
    group that spans nodes leaves the interface to the libraries (or to those variables, set
    by the user). A cuda rank selects its GPU (``local_rank``, default ``rank``: its slot on
    this node) before joining, and passes it as ``device_id`` (NCCL binds its communicator
    eagerly).
    """
    import torch.distributed as dist

    if loopback and platform.system() == "Linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    slot = rank if local_rank is None else local_rank
    device_id = None
    if rig.kind == "cuda":
        device = rig.device(slot)
        torch.cuda.set_device(rig.cuda_index(slot))
        if rig.backend == "nccl":
            device_id = device
    dist.init_process_group(
        backend=rig.backend,
        init_method=f"file://{init_file}" if init_file else "env://",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
