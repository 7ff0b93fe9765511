"""Peak memory is what the case adds: peaks reset after warm-up, CPU figures net of the
runtime, a pipelining rank holding only its own stages, and the CPU cap per device."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from bench_lib import strategies
from bench_lib.launch import ranks
from bench_lib.launch.protocol import CaseOutcome, baseline_path
from bench_lib.measure import memory
from bench_lib.measure.memory import PeakMemory, status_field_mib
from bench_lib.measure.timing import time_steps
from bench_lib.rows.rows import case_row
from bench_lib.strategies import BuildContext
from bench_lib.strategies.base import Microbatching
from bench_lib.sweep.cases import new_case
from bench_lib.workloads import Workload, blocks, split_stages
from tests.dist_harness import run_ranks

CPU = torch.device("cpu")
STATUS = """Name:\tpython
VmPeak:\t 9000000 kB
VmHWM:\t  %d kB
VmRSS:\t  %d kB
Threads:\t2
"""


def fake_proc(tmp_path: Path, rss_kib: int, hwm_kib: int, writable: bool = True) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "status").write_text(STATUS % (hwm_kib, rss_kib))
    if writable:
        (proc / "clear_refs").write_text("")
    else:
        (proc / "clear_refs").mkdir(exist_ok=True)  # writing to it raises an OSError
    return proc


def test_status_fields_parse_as_mib():
    text = STATUS % (2048 * 1024, 512 * 1024)
    assert status_field_mib(text, "VmHWM") == 2048.0
    assert status_field_mib(text, "VmRSS") == 512.0
    assert status_field_mib(text, "VmSwap") is None


def test_cpu_peak_is_vmhwm_after_the_reset_net_of_the_baseline(tmp_path):
    proc = fake_proc(tmp_path, rss_kib=400 * 1024, hwm_kib=900 * 1024)  # 900: the import peak
    mem = PeakMemory([CPU, CPU], ["0", "1"], proc=proc)
    assert mem.baseline_mib == 400.0
    # The model was built and warmed up; the reset writes 5 (VmHWM := VmRSS, proc(5)).
    mem.reset()
    assert (proc / "clear_refs").read_text() == "5" and mem.source == "vmhwm"
    fake_proc(tmp_path, rss_kib=700 * 1024, hwm_kib=1000 * 1024)  # after the timed steps
    peaks = mem.read()
    assert peaks.gross_mib == {"0+1": 1000.0}  # one process drives both devices
    assert peaks.net_mib == {"0+1": 600.0}
    assert peaks.source == "vmhwm"


def test_cpu_peak_falls_back_to_ru_maxrss_where_clear_refs_is_not_writable(tmp_path,
                                                                           monkeypatch):
    proc = fake_proc(tmp_path, rss_kib=300 * 1024, hwm_kib=300 * 1024, writable=False)
    monkeypatch.setattr(memory, "lifetime_peak_rss_mib", lambda: 1250.0)
    mem = PeakMemory([CPU], ["1"], proc=proc)
    mem.reset()
    assert mem.source == "ru_maxrss"
    peaks = mem.read()
    assert peaks.gross_mib == {"1": 1250.0} and peaks.net_mib == {"1": 950.0}
    assert peaks.source == "ru_maxrss"


_RESET_PROBE = """
import json, torch
from bench_lib.measure import memory
from bench_lib.measure.memory import PeakMemory
hoard = b"\\x01" * (300 * memory.MIB)
del hoard
mem = PeakMemory([torch.device("cpu")], ["0"])
mem.reset()
before = mem.read().net_mib["0"]
hoard = b"\\x01" * (200 * memory.MIB)
peaks = mem.read()
del hoard
print(json.dumps({"before": before, "net": peaks.net_mib["0"], "gross": peaks.gross_mib["0"],
                  "baseline": mem.baseline_mib, "source": peaks.source}))
"""


@pytest.mark.skipif(not memory.reset_rss_peak(), reason="/proc/self/clear_refs not writable")
@pytest.mark.integration
def test_real_reset_forgets_an_earlier_peak_and_sees_a_later_one():
    """In a fresh process, as a worker measures: in pytest's long-lived one, heap that
    earlier tests freed is returned to the system at unpredictable moments and moved the
    baseline under the test (CI read a 200 MiB hoard as 0 MiB net, twice). Filled bytes, so
    every page is touched (calloc's untouched pages are not resident)."""
    import subprocess
    import sys

    repo = Path(__file__).parents[1]
    proc = subprocess.run([sys.executable, "-c", _RESET_PROBE], cwd=repo, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["before"] < 100, "the 300 MiB before the reset is forgotten"
    assert 190 < got["net"] < 300 and got["source"] == "vmhwm", got
    assert got["gross"] == pytest.approx(got["net"] + got["baseline"])


def test_cuda_peaks_are_allocator_peaks_reset_per_device(monkeypatch):
    resets: list[torch.device] = []
    allocated = {0: 3 * memory.MIB * 1024, 1: memory.MIB * 1024}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: allocated[d.index])
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    mem = PeakMemory(devices, ["0", "1"])
    assert mem.baseline_mib == 0.0  # the allocator holds only what the case allocated
    mem.reset()
    assert resets == devices
    peaks = mem.read()
    assert peaks.gross_mib == peaks.net_mib == {"0": 3072.0, "1": 1024.0}
    assert peaks.source == "cuda-allocator"


def test_slots_of_one_gpu_in_one_process_read_one_peak_under_their_joined_label(monkeypatch):
    """mp on --gpu-slots 2: both slots are cuda:0, one allocator; its peak is read once, as
    '0+1' (it read the same figure under '0' and '1', each the whole process's)."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 300 * memory.MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 332 * memory.MIB)
    slots = [torch.device("cuda", 0), torch.device("cuda", 0)]
    mem = PeakMemory(slots, ["0", "1"])
    mem.reset()
    assert mem.read().gross_mib == {"0+1": 300.0}
    assert memory.peak_reserved_mib(slots, ["0", "1"]) == {"0+1": 332.0}


def test_after_warmup_runs_between_the_warmup_and_the_timed_steps():
    events: list[str] = []
    times = time_steps(lambda: events.append("step"), [CPU], warmup_steps=2, timed_steps=3,
                       after_warmup=lambda: events.append("reset"))
    assert len(times) == 3
    assert events == ["step", "step", "reset", "step", "step", "step"]


def test_rows_report_net_figures_and_their_imbalance(cpu_rig):
    case = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8)
    outcome = CaseOutcome("ok", step_times_s=[0.1, 0.1, 0.1], stop_reason="step_cap",
                          peak_mem_mib={"0": 1300.0, "1": 1400.0},
                          peak_mem_net_mib={"0": 300.0, "1": 400.0}, peak_mem_source="vmhwm")
    row = case_row(case, cpu_rig, outcome)
    assert row["peak_mem_mib_max"] == 1400.0 and row["peak_mem_net_mib_max"] == 400.0
    assert row["peak_mem_net_mib_by_device"] == "0:300.0;1:400.0"
    assert row["peak_mem_source"] == "vmhwm"
    assert row["mem_imbalance_ratio"] == pytest.approx(400 / 300)  # not 1400 / 1300


class _FakeProcess:
    RSS: dict[int, int] = {}

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def memory_info(self):
        return type("mem", (), {"rss": self.RSS[self.pid]})()

    def children(self, recursive: bool = False):
        return []


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def test_cpu_cap_counts_what_a_process_adds_per_device_it_drives(tmp_path, monkeypatch):
    monkeypatch.setattr(ranks.psutil, "Process", _FakeProcess)
    mib = memory.MIB
    procs = [_Proc(11)]
    _FakeProcess.RSS = {11: (400 + 1500) * mib}  # 400 MiB of runtime, 1500 MiB of case
    # Before the rank recorded its runtime it has built nothing: not checked.
    assert ranks.rss_over_cap(procs, 1000, tmp_path, 1) is None
    baseline_path(tmp_path, 0).write_text(json.dumps({"rss_mib": 400.0}))
    one = ranks.rss_over_cap(procs, 1000, tmp_path, 1)
    assert one is not None and "1500 MiB resident beyond its 400 MiB runtime" in one
    assert "over the 1000 MiB cap (--max-memory-per-device)" in one
    # mp / pipeline: one process drives 2 devices, so it gets 2 caps.
    assert ranks.rss_over_cap(procs, 1000, tmp_path, 2) is None
    _FakeProcess.RSS = {11: (400 + 2500) * mib}
    two = ranks.rss_over_cap(procs, 1000, tmp_path, 2)
    assert two is not None and "over the 2000 MiB cap (2 devices x 1000 MiB" in two
    # 1400 MiB of runtime alone is no longer over a 1000 MiB cap.
    baseline_path(tmp_path, 0).write_text(json.dumps({"rss_mib": 2000.0}))
    assert ranks.rss_over_cap(procs, 1000, tmp_path, 1) is None


def test_make_batch_leaves_unread_inputs_empty():
    workload = Workload("resnet-tiny", image_size=32, batch_size=4, num_classes=10)
    x, y = workload.make_batch(4, CPU, images=False)
    assert x.numel() == 0 and x.dim() == 4 and y.shape == (4,)
    x, y = workload.make_batch(4, CPU, targets=False)
    assert x.shape == (4, 3, 32, 32) and y.numel() == 0
    x.contiguous(memory_format=torch.channels_last)  # the worker's channels-last still works
    workload.make_batch(4, CPU, images=False)[0].contiguous(memory_format=torch.channels_last)


def _own_stages_only(rank: int, world_size: int, name: str) -> dict[str, object]:
    torch.set_num_threads(1)
    workload = Workload("resnet-tiny", image_size=32, batch_size=4, num_classes=10)
    torch.manual_seed(0)
    model = workload.build_model()
    ctx = BuildContext(workload, Microbatching.of(4, 2), rank, world_size,
                       partition="balanced-flops")
    trainer = strategies.get(name).build(model, [CPU], ctx)
    cuts = list(trainer.partition.cuts)  # type: ignore[attr-defined]
    stage_params = [[weakref.ref(p) for p in s.parameters()] for s in split_stages(model, cuts)]
    n_blocks = len(blocks(model))
    del model
    gc.collect()
    own = sorted(trainer.stage_ids)  # type: ignore[attr-defined]
    alive = [i for i, refs in enumerate(stage_params) if any(r() is not None for r in refs)]
    held = {id(p) for p in trainer.parameters_in_order()}
    own_params = {id(r()) for i in own for r in stage_params[i]}
    return {"own": own, "alive": alive, "held_is_own": held == own_params,
            "images": trainer.needs_images, "targets": trainer.needs_targets,
            "blocks": n_blocks, "placement": trainer.partition.placement}  # type: ignore[attr-defined]


@pytest.mark.timeout(240)
@pytest.mark.integration
def test_a_pipelining_rank_holds_only_its_own_stages():
    for name, stages in [("gpipe", [[0], [1]]), ("zbv", [[0, 3], [1, 2]]),
                         ("interleaved-1f1b", [[0, 2], [1, 3]])]:
        rank0, rank1 = run_ranks(_own_stages_only, 2, (name,))
        for rank, res in enumerate((rank0, rank1)):
            assert res["own"] == stages[rank], name
            # Once the caller drops the model, the other stages' parameters are gone.
            assert res["alive"] == res["own"], f"{name} rank {rank}: {res}"
            assert res["held_is_own"], f"{name} rank {rank}"
        first = [r["images"] for r in (rank0, rank1)]
        last = [r["targets"] for r in (rank0, rank1)]
        assert first == [True, False], f"{name}: only the first stage's rank makes images"
        if name == "zbv":  # the V folds back: rank 0 owns the last stage too
            assert last == [True, False] and rank0["placement"] == (0, 1, 1, 0)
        elif name == "gpipe":
            assert last == [False, True] and rank0["placement"] == ()
        else:
            assert last == [False, True] and rank0["placement"] == (0, 1, 0, 1)

