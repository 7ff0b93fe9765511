"""Issue 13 (5-8): whole physical cores per cpu worker from sysfs, the FLOP peak probed with a
convolution beside the GEMM on every device at once, MFU over 100% flagged, CPU utilisation
0-100 of what a worker holds, and energy net of idle power from long enough windows only."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench_lib.launch import sampling
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.math_modes import math_mode, set_math_mode
from bench_lib.measure import cpu_sources, environment, flop_peak, flop_probe, flops
from bench_lib.measure.cpu_sources import ProcessSource, RaplSource
from bench_lib.measure.energy import IdlePower, idle_power, rig_packages
from bench_lib.measure.sampler import Sampler
from bench_lib.results.fingerprint import fingerprint_id
from bench_lib.results.schema import CASE_COLUMNS, SAMPLE_METRIC_NAMES
from bench_lib.rig import Rig, RigError
from bench_lib.rig_detection import detect_rig
from bench_lib.rows.rows import case_row, derived_columns
from bench_lib.rows.sampler_columns import window_columns
from bench_lib.sweep.cases import new_case
from bench_lib.topology import CpuTopology, read_cpu_topology
from tests.conftest import PYTHON, REPO

# ---- a fake sysfs ---------------------------------------------------------------------------

def fake_sysfs(root, packages: int, cores: int, threads: int):
    """Linux's numbering: logical CPU t*(P*C) + p*C + c is thread t of core c on package p,
    so cpu k and cpu k + P*C are hyper-thread siblings."""
    physical = packages * cores
    for p in range(packages):
        for c in range(cores):
            siblings = [t * physical + p * cores + c for t in range(threads)]
            for cpu in siblings:
                topo = root / f"cpu{cpu}" / "topology"
                topo.mkdir(parents=True)
                (topo / "physical_package_id").write_text(f"{p}\n")
                (topo / "core_id").write_text(f"{c}\n")
                (topo / "thread_siblings_list").write_text(",".join(map(str, siblings)) + "\n")
    return root


@pytest.fixture
def ht_topology(tmp_path) -> CpuTopology:
    """2 sockets x 4 cores x 2 threads: 16 logical CPUs."""
    return read_cpu_topology(range(16), fake_sysfs(tmp_path / "ht", 2, 4, 2))


@pytest.fixture
def two_core_topology(tmp_path) -> CpuTopology:
    """A 2-core machine without hyper-threading, like the one the suite is built on."""
    return read_cpu_topology([0, 1], fake_sysfs(tmp_path / "plain", 1, 2, 1))


def _physical(topology: CpuTopology, cpus: list[int]) -> set[tuple[int, ...]]:
    return {c.cpus for c in topology.cores if set(c.cpus) & set(cpus)}


def test_topology_groups_hyperthread_siblings(ht_topology):
    assert ht_topology.counts() == {"packages": 2, "physical_cores": 8, "logical_cpus": 16,
                                     "threads_per_core": 2, "source": "sysfs"}
    assert ht_topology.cores[0].cpus == (0, 8) and ht_topology.cores[4].package == 1
    assert ht_topology.package_of(13) == 1  # thread 1 of core 1 on package 1


def test_default_ht_rig_gives_each_worker_whole_physical_cores(ht_topology):
    rig = detect_rig("cpu", topology=ht_topology)
    # 8 physical cores over 2 workers: 4 threads each, one per physical core. (Sorted ids
    # handed out 8 at a time gave worker 1 the siblings of worker 0's cores.)
    assert (rig.num_devices, rig.threads_per_worker) == (2, 4)
    w0, w1 = rig.cores_of(0), rig.cores_of(1)
    assert sorted(w0) == [0, 1, 2, 3, 8, 9, 10, 11]  # package 0, siblings included
    assert sorted(w1) == [4, 5, 6, 7, 12, 13, 14, 15]  # package 1
    assert not _physical(ht_topology, w0) & _physical(ht_topology, w1)
    for cpus in (w0, w1):  # whole cores only: every sibling of a core it touches
        assert {c for core in _physical(ht_topology, cpus) for c in core} == set(cpus)
    assert Rig.from_dict(rig.as_dict()) == rig


def test_ht_rig_with_one_thread_per_worker_never_shares_a_core(ht_topology):
    rig = detect_rig("cpu", 2, 1, topology=ht_topology)
    assert rig.cores_of(0) == [0, 8] and rig.cores_of(1) == [1, 9]
    assert rig.device_names() == ["cpu worker 0 (cores 0,8)", "cpu worker 1 (cores 1,9)"]
    # 3 threads: each worker stays within one package rather than straddling both.
    rig3 = detect_rig("cpu", 2, 3, topology=ht_topology)
    packages = [{ht_topology.package_of(c) for c in rig3.cores_of(i)} for i in range(2)]
    assert packages == [{0}, {1}]


def test_too_few_physical_cores_is_a_rig_error(ht_topology, two_core_topology):
    with pytest.raises(RigError, match=r"needs 10 physical cores .* use 8 \(16 logical CPUs"):
        detect_rig("cpu", 2, 5, topology=ht_topology)
    with pytest.raises(RigError, match="3 devices asked for, but this cpu rig has 2 physical"):
        detect_rig("cpu", 3, topology=two_core_topology)
    with pytest.raises(RigError, match="needs 4 physical cores"):
        Rig("cpu", 2, 2, (0, 8, 1, 9), ((0, 8), (1, 9)))


def test_two_core_machine_without_smt(two_core_topology):
    rig = detect_rig("cpu", topology=two_core_topology)
    assert rig.label == "cpu:2x1t" and rig.cores_of(0) == [0] and rig.cores_of(1) == [1]
    assert two_core_topology.counts()["threads_per_core"] == 1


def test_unreadable_sysfs_assumes_one_core_per_cpu_and_says_so(tmp_path):
    topo = read_cpu_topology([0, 1, 2], tmp_path / "nothing")
    assert [c.cpus for c in topo.cores] == [(0,), (1,), (2,)]
    assert topo.source.startswith("assumed")


def test_fingerprint_and_env_carry_the_topology(ht_topology, two_core_topology):
    ht_rig = detect_rig("cpu", 2, 1, topology=ht_topology)
    plain_rig = detect_rig("cpu", 2, 1, topology=two_core_topology)
    ht = environment.hardware_fingerprint(ht_rig, ht_topology)
    plain = environment.hardware_fingerprint(plain_rig, two_core_topology)
    assert ht["cpu_topology"] == ht_topology.counts()
    assert plain["cpu_topology"]["physical_cores"] == 2
    assert fingerprint_id(ht) != fingerprint_id(plain)
    assert not {"torch", "driver"} & set(ht)  # hardware only: versions are env.json's
    record = environment.cpu_topology(ht_rig, ht_topology)
    assert record["workers"][1] == {"device": 1, "cpus": [1, 9], "physical_cores": [[1, 9]],
                                    "packages": [0]}
    assert len(record["physical_cores_list"]) == 8


# ---- RAPL: the packages holding the rig's cores ---------------------------------------------

def _powercap(root, domains: dict[str, tuple[str, str]]):
    """domains: dir name -> (name file, energy_uj)."""
    for d, (name, energy) in domains.items():
        (root / d).mkdir(parents=True)
        (root / d / "name").write_text(name + "\n")
        (root / d / "energy_uj").write_text(energy)
        (root / d / "max_energy_range_uj").write_text("1000000000")
    return root


def test_rapl_reads_only_the_packages_of_the_rig_cores(tmp_path):
    sysfs = fake_sysfs(tmp_path / "cpu", 2, 4, 2)
    # A rig confined to package 1 (as under taskset/cgroups): cores 4-7 and their siblings.
    topo = read_cpu_topology([4, 5, 6, 7, 12, 13, 14, 15], sysfs)
    rig = detect_rig("cpu", topology=topo)
    assert rig_packages(rig, topo) == {1}
    root = _powercap(tmp_path / "powercap", {
        "intel-rapl:0": ("package-0", "1000"), "intel-rapl:1": ("package-1", "5000"),
        "intel-rapl:1:0": ("core", "0"), "intel-rapl:2": ("psys", "0")})
    rapl = RaplSource(root, packages=rig_packages(rig, topo))
    assert rapl.domains == ["intel-rapl:1 (package 1)"]
    rapl.read()
    (root / "intel-rapl:0" / "energy_uj").write_text("9000000")  # the other package: ignored
    (root / "intel-rapl:1" / "energy_uj").write_text("2005000")
    assert rapl.read() == [{"device": "host", "energy_j": pytest.approx(2.0)}]
    # Without a package filter: both packages, never psys (platform, not a package).
    assert len(RaplSource(root).domains) == 2


# ---- idle power and the window rules ---------------------------------------------------------

class SteadyCounter:
    """A fake energy counter drawing ``watts`` (device ``host``)."""

    def __init__(self, watts: float) -> None:
        self.watts, self.t0 = watts, time.time()

    def read(self):
        return [{"device": "host", "energy_j": self.watts * (time.time() - self.t0)}]

    def close(self):
        pass


def test_idle_power_is_the_counters_mean_power():
    idle = idle_power([SteadyCounter(12.0)], ["fake"], seconds=0.4, interval_s=0.05)
    assert idle.watts["host"] == pytest.approx(12.0, rel=0.05) and idle.sources == ["fake"]
    assert IdlePower.from_dict(idle.as_dict()) == idle
    none = idle_power([], [])
    assert none.unsupported.startswith("no readable energy counter")
    assert IdlePower.from_dict(None).unsupported == "not measured"


def test_measure_idle_power_on_this_rig_is_a_figure_or_a_reason(cpu_rig):
    idle = sampling.measure_idle_power(cpu_rig, seconds=0.3)
    assert idle.watts or idle.unsupported


def test_idle_power_of_a_cuda_rig_reads_every_gpu_through_nvml(monkeypatch):
    from tests.test_monitor import fake_nvml

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setattr(sampling, "_cuda_bus_ids",
                        lambda n: {"0": "00000000:3B:00.0", "1": "00000000:5E:00.0"})
    idle = sampling.measure_idle_power(Rig("cuda", 2), seconds=0.3)
    assert set(idle.watts) == {"0", "1"} and all(w > 0 for w in idle.watts.values())
    assert idle.sources == ["nvml gpu 0", "nvml gpu 1"]


def _sample(t, device, energy=None, cpu=None, gpu=None):
    return {"time_unix_s": t, "device": device, **dict.fromkeys(SAMPLE_METRIC_NAMES),
            "energy_j": energy, "cpu_pct": cpu, "util_gpu_pct": gpu}


def test_net_energy_subtracts_idle_power_of_the_same_counters():
    # Two GPUs read by NVML: 200 W and 150 W during the case, idle 50 W and 40 W.
    samples = [_sample(100 + t, d, energy=w * t, gpu=90.0)
               for t in (0.0, 0.5, 1.0, 1.5, 2.0) for d, w in (("0", 200.0), ("1", 150.0))]
    out = window_columns(samples, [(100.0, 102.0)], images=100, idle_w={"0": 50.0, "1": 40.0,
                                                                     "2": 60.0})
    assert out["power_w_mean"] == pytest.approx(350.0)
    assert out["energy_j_per_img"] == pytest.approx(350 * 2 / 100)  # 7 J
    assert out["energy_j_per_img_net"] == pytest.approx((350 - 90) * 2 / 100)  # GPU 2 not read
    assert out["energy_source"] == "nvml-gpus" and out["util_pct_mean"] == 90.0
    unknown = window_columns(samples, [(100.0, 102.0)], images=100, idle_w=None)
    assert unknown["energy_j_per_img_net"] is None and "no idle power" in unknown["sampler_note"]


def test_short_windows_and_few_samples_leave_util_and_energy_empty_with_the_reason():
    samples = [_sample(10 + t / 10, d, energy=t if d == "host" else None,
                       cpu=None if d == "host" else 80.0)
               for t in range(0, 30, 2) for d in ("0", "host")]
    short = window_columns(samples, [(10.0, 10.6)], images=10, idle_w={"host": 1.0})
    assert short["util_pct_mean"] is None and short["energy_j_per_img"] is None
    assert short["util_pct_mean_by_device"] == "" and short["power_w_mean"] is None
    assert short["sampler_note"].startswith("timed window 0.60 s is under 1 s")
    # Long enough, but device 1 has only 2 samples inside: its utilisation is not a mean.
    samples += [_sample(10.5, "1", cpu=10.0), _sample(11.5, "1", cpu=20.0)]
    few = window_columns(samples, [(10.0, 12.8)], images=10, idle_w={"host": 1.0})
    assert few["util_pct_mean"] is None and "(1: 2) under 3" in few["sampler_note"]
    assert few["energy_j_per_img"] is not None  # the counter had enough samples


# ---- utilisation 0-100 of what a worker holds ------------------------------------------------

@pytest.mark.integration
def test_process_source_normalises_cpu_percent_by_the_worker_threads():
    busy = subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline() == "up\n"
        source = ProcessSource({"0": busy.pid, "1": busy.pid}, {"0": 1, "1": 4})
        with Sampler([source], interval_s=0.1) as s:
            time.sleep(0.8)
    finally:
        busy.kill()
        busy.wait()
        busy.stdout.close()
    by = {d: [r["cpu_pct"] for r in s.samples if r["device"] == d and r["cpu_pct"] is not None]
          for d in ("0", "1")}
    one, four = sum(by["0"]) / len(by["0"]), sum(by["1"]) / len(by["1"])
    assert 0 < four <= 35  # one busy thread of a worker holding 4 cores: about 25
    assert four == pytest.approx(one / 4, rel=0.35)


def test_a_read_too_soon_after_the_last_gives_no_percent_and_loses_no_cpu_time(monkeypatch):
    """Where the sampler's last tick comes a moment after a regular one, one clock tick of CPU
    time over a millisecond read 400-700% for one busy thread (a CI run on Intel Xeon): such a
    read gives nothing and the next covers the whole time since the last percent."""
    clock = iter([10.0, 10.001, 10.2])  # first read, one a millisecond later, one 0.2 s on
    cpu = iter([1.0, 1.01, 1.1])  # a tick of CPU time shows up at the second read
    monkeypatch.setattr(cpu_sources.time, "monotonic", lambda: next(clock))
    source = ProcessSource({"0": os.getpid()})
    proc = types.SimpleNamespace(
        oneshot=contextlib.nullcontext,
        cpu_times=lambda: types.SimpleNamespace(user=next(cpu), system=0.0),
        memory_info=lambda: types.SimpleNamespace(rss=64 * 2**20))
    source._procs["0"] = proc
    assert [r["cpu_pct"] for r in source.read()] == [None]  # no interval yet
    assert [r["cpu_pct"] for r in source.read()] == [None]  # 1 ms: too short to tell
    (last,) = source.read()
    assert last["cpu_pct"] == pytest.approx(100 * 0.1 / 0.2)  # since the first read: 50%
    assert cpu_sources.MIN_CPU_INTERVAL_S >= 4 * cpu_sources.CLOCK_TICK_S


# ---- the peak: a conv probe beside the GEMM, all devices together ----------------------------

def test_conv_probe_flops_are_counted_exactly():
    shape = flop_probe.ConvShape(2, 8, 6, 3)
    assert shape.flops == 2 * 2 * 8 * 6 * 6 * 8 * 3 * 3
    x, w = torch.randn(2, 8, 6, 6), torch.randn(8, 8, 3, 3)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.conv2d(x, w, padding=1)
    assert counter.get_total_flops() == shape.flops
    assert flops.conv_flops(1, 3, 64, 32, 32, 7) == 2 * 64 * 32 * 32 * 3 * 49
    big = flop_probe.PEAK_CONV["cpu"]
    assert big.channels == 256 and big.kernel == 3


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_cpu_workers_are_probed_together_pinned(cpu_rig):
    peak = flop_peak.measure_peak(cpu_rig, ["fp32"], n=96, min_time_s=0.3,
                                  conv=flop_probe.ConvShape(1, 16, 16), math_mode="ieee")
    assert not peak.unsupported
    (s0, e0), (s1, e1) = peak.window_unix_s["0"], peak.window_unix_s["1"]
    assert max(s0, s1) < min(e0, e1)  # the two pinned processes probed at the same time
    for dev in ("0", "1"):
        assert peak.probe["fp32"][dev] in flop_probe.PROBES
    assert peak.math_mode["cudnn_benchmark"] is True
    assert peak.math_mode["cuda_matmul_allow_tf32"] is False
    assert peak.math_mode["cudnn_allow_tf32"] is False  # the run's mode, given the probes
    recorded = peak.as_dict()
    assert recorded["conv_batch_channels_size_kernel"] == [1, 16, 16, 3]
    assert recorded["probed_together"] is True


def test_math_mode_is_set_explicitly_and_read_back():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.backends.cudnn.benchmark)
    try:
        torch.backends.cudnn.allow_tf32 = True  # torch's own default for cuDNN
        mode = set_math_mode("ieee")
        assert mode == math_mode()
        assert mode["cudnn_allow_tf32"] is False and mode["cuda_matmul_allow_tf32"] is False
        assert mode["cudnn_benchmark"] is True
        torch.backends.cudnn.allow_tf32 = False
        mode = set_math_mode()  # the default: torch's own flags, set back explicitly
        assert mode == math_mode()
        assert mode["cudnn_allow_tf32"] is True and mode["cuda_matmul_allow_tf32"] is False
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = before


@pytest.mark.integration
def test_env_command_records_math_mode_and_topology():
    # The cpu rig asked for: on a GPU box the detected rig is cuda, which has no workers.
    proc = subprocess.run([PYTHON, "-m", "bench_lib", "env", "--rig", "cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["math_mode"]["cudnn_allow_tf32"] is True  # torch's own mode, the default
    assert env["math_mode"]["cuda_matmul_allow_tf32"] is False
    assert env["math_mode"]["cudnn_benchmark"] is True
    assert env["rig"]["kind"] == "cpu"
    assert env["cpu_topology"]["workers"][0]["cpus"] == env["rig"]["cores"][:len(
        env["cpu_topology"]["workers"][0]["cpus"])]
    assert env["fingerprint"]["cpu_topology"]["physical_cores"] >= 1


# ---- MFU over 100% is flagged ----------------------------------------------------------------

def _ok(times, mem, window=None, samples=()):
    return CaseOutcome("ok", step_times_s=times, peak_mem_mib=mem, peak_mem_net_mib=mem,
                       stop_reason="step_cap", timed_window_unix_s=window,
                       samples=list(samples))


def test_mfu_over_100_is_flagged_not_stated(cpu_rig):
    case = new_case(cpu_rig, "single", "resnet-tiny", 32, 8)
    per_img = flops.train_flops_per_image("resnet-tiny", 32)
    achieved = per_img * 80 / 1e12  # 8 images per 0.1 s
    beaten = flop_peak.AttainablePeak({"fp32": {"0": achieved / 1.06, "1": 1.0}},
                                      probe={"fp32": {"0": "conv", "1": "gemm"}})
    cols = derived_columns(case, _ok([0.1] * 3, {"0": 300}), 80.0, beaten)
    assert cols["mfu_pct"] == pytest.approx(106.0)
    assert cols["mfu_note"].startswith("over 100%: the case beat the measured peak (conv probe)")
    fine = flop_peak.AttainablePeak({"fp32": {"0": achieved * 2, "1": 1.0}})
    assert derived_columns(case, _ok([0.1] * 3, {"0": 300}), 80.0, fine)["mfu_note"] == ""
    missing = derived_columns(case, _ok([0.1] * 3, {"0": 300}), 80.0,
                              flop_peak.AttainablePeak(unsupported="probe crashed"))
    assert missing["mfu_pct"] is None and missing["mfu_note"] == "no attainable peak: probe crashed"
    assert {"mfu_note", "energy_j_per_img_net", "sampler_note"} <= set(CASE_COLUMNS)


def test_cpu_mp_mfu_is_of_the_one_worker_it_is_pinned_to(cpu_rig):
    case = new_case(cpu_rig, "mp", "resnet-tiny", 32, 8)
    peak = flop_peak.AttainablePeak({"fp32": {"0": 0.5, "1": 0.5}})
    row = case_row(case, cpu_rig, _ok([0.1] * 3, {"0+1": 300}), peak)
    achieved = flops.train_flops_per_image("resnet-tiny", 32) * 80 / 1e12
    assert row["mfu_pct"] == pytest.approx(100 * achieved / 0.5)  # not / (0.5 + 0.5)
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8)
    row = case_row(ddp, cpu_rig, _ok([0.1] * 3, {"0": 300, "1": 300}), peak)
    assert row["mfu_pct"] == pytest.approx(100 * achieved / 1.0)


def test_a_case_across_nodes_leaves_energy_empty(cpu_rig):
    """Only node 0 samples: its joules over every node's images would read about 1/N of the
    truth (#28 item 11). A case across nodes keeps node 0's utilisation; its power and
    energy are empty, with the reason; node 0's own single case keeps them."""
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.nodes.multinode import plan_nodes
    from bench_lib.rows.rows import case_row
    from bench_lib.sweep.profile import Profile

    profile = Profile(strategies=("single", "ddp"), models=("resnet-tiny",), image_sizes=(32,),
                      batch_sizes=(8,))
    rig, cases = plan_nodes(profile, cpu_rig, 2)
    samples = [_sample(100 + t, d, energy=100.0 * t, cpu=90.0)
               for t in (0.0, 0.5, 1.0, 1.5, 2.0) for d in ("0", "1", "host")]
    rows = {}
    for case in cases:
        outcome = CaseOutcome("ok", step_times_s=[0.5] * 4, peak_mem_mib={"0": 1.0},
                              timed_window_unix_s=(100.0, 102.0), samples=samples)
        rows[case.strategy] = case_row(case, rig, outcome)
    assert rows["single"]["energy_j_per_img"] is not None
    across = rows["ddp"]
    assert across["energy_j_per_img"] is None and across["power_w_mean"] is None
    assert across["energy_j_per_img_net"] is None and across["util_pct_mean"] == 90.0
    assert across["sampler_note"].endswith("only node 0 is sampled: power and energy of a "
                                           "case across 2 nodes left empty")
