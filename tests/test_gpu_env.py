"""Multi-GPU plumbing without a GPU: NVML through fakes (bus ids, topology, the sampler's
failures and GPM span), the loopback and device setup of process groups through a patched
torch.distributed, and the pre-flight's child processes on a cpu rig (gloo) and with fakes
that fail or hang."""

from __future__ import annotations

import datetime
import json
import sys
import time
import types

import psutil
import pytest
import torch

from bench_lib import commands, exit_codes, process_groups, rig_detection
from bench_lib import rig as rig_module
from bench_lib.commands import plan as run_plan
from bench_lib.launch import sampling
from bench_lib.measure import environment, preflight, preflight_probes, preflight_static
from bench_lib.measure.nvml_source import NvmlSource
from bench_lib.measure.sampler import Sampler, UnavailableSource
from bench_lib.nvml import cuda_visible_gpus
from bench_lib.rig import Rig, RigError
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement
from tests.test_monitor import FakeNvmlError, fake_nvml

# NVML numbers these GPUs 0 = 5E, 1 = 3B: not PCI bus order, which CUDA's PCI_BUS_ID uses.
GPUS = (("00000000:5E:00.0", "GPU-bbbb-2222", "NVIDIA H100 80GB HBM3"),
        ("00000000:3B:00.0", "GPU-aaaa-1111", "NVIDIA H100 80GB HBM3"))


def topo_nvml(gpus=GPUS, nvlinks=None, p2p=lambda index: 0, level=10, init_error=None):
    """A stand-in for pynvml's device-query and topology calls (handles are NVML indices).

    ``nvlinks``: NVML index -> the bus ids its active links end on (None: no NVLink);
    ``p2p``: P2P capability index -> status.
    """
    state = {"inits": 0, "shutdowns": 0}
    by_bus = {g[0]: i for i, g in enumerate(gpus)}

    def init():
        if init_error is not None:
            raise init_error
        state["inits"] += 1

    def nvlink_state(h, link):
        if nvlinks is None:
            raise FakeNvmlError("not supported")
        if link >= len(nvlinks.get(h, [])):
            raise FakeNvmlError("invalid argument")
        return 1

    def mig_parent(handle):
        if handle != "mig-of-5E":
            raise FakeNvmlError("not a MIG device")
        return by_bus["00000000:5E:00.0"]

    def by_uuid(uuid):
        if uuid != b"MIG-cccc-3333":
            raise FakeNvmlError("not found")
        return "mig-of-5E"

    return types.SimpleNamespace(
        state=state, NVMLError=FakeNvmlError,
        nvmlInit=init,
        nvmlShutdown=lambda: state.update(shutdowns=state["shutdowns"] + 1),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByPciBusId=lambda bus: by_bus[bus],
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=gpus[h][0].encode()),
        nvmlDeviceGetUUID=lambda h: gpus[h][1],
        nvmlDeviceGetName=lambda h: gpus[h][2].encode(),  # bytes, as older pynvml gives
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=mig_parent,
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, link: types.SimpleNamespace(
            busId=nvlinks[h][link].encode()),
        nvmlDeviceGetP2PStatus=lambda a, b, index: p2p(index),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: level,
        nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlSystemGetNVMLVersion=lambda: b"12.550.54.15",
    )


@pytest.fixture
def no_cuda_calls(monkeypatch):
    """Any CUDA call from the runner's side fails the test: no context may be created."""
    def forbidden(*_args, **_kwargs):
        raise AssertionError("the runner called CUDA")

    for name in ("get_device_properties", "init", "device_count", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


# --- Bus ids through NVML, as CUDA numbers the GPUs ---------------------------------------

@pytest.mark.parametrize("visible, expected", [
    (None, ["00000000:3B:00.0", "00000000:5E:00.0"]),  # PCI bus order, not NVML's
    ("1", ["00000000:5E:00.0"]),
    ("1,0", ["00000000:5E:00.0", "00000000:3B:00.0"]),
    (" 1 , 0 ", ["00000000:5E:00.0", "00000000:3B:00.0"]),
    ("GPU-aaaa", ["00000000:3B:00.0"]),  # a unique UUID prefix
    ("GPU-bbbb-2222,0", ["00000000:5E:00.0", "00000000:3B:00.0"]),
    ("MIG-cccc-3333", ["00000000:5E:00.0"]),  # a MIG instance: its parent GPU
    ("0,7,1", ["00000000:3B:00.0"]),  # CUDA stops at the first invalid entry
    ("0,0,1", ["00000000:3B:00.0"]),  # ... and at a repeated one
    ("GPU-", []),  # ambiguous prefix: invalid
    ("", []),
])
def test_visible_gpus_follow_cuda_visible_devices(visible, expected, no_cuda_calls):
    nvml = topo_nvml()
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    gpus = cuda_visible_gpus(nvml, environ)
    assert [g.bus_id for g in gpus] == expected
    assert [g.cuda_index for g in gpus] == list(range(len(expected)))
    assert all(g.name == "NVIDIA H100 80GB HBM3" for g in gpus)  # bytes decoded
    assert nvml.state["inits"] == nvml.state["shutdowns"] == 1


def test_cuda_bus_ids_come_from_nvml_without_a_cuda_context(monkeypatch, no_cuda_calls):
    nvml = topo_nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert sampling._cuda_bus_ids(2, nvml) == {"0": "00000000:5E:00.0", "1": "00000000:3B:00.0"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match=r"sees 1 GPU\(s\).*'1'.*needs 2"):
        sampling._cuda_bus_ids(2, nvml)
    assert nvml.state["inits"] == nvml.state["shutdowns"] == 2
    # The default (no fake) goes through pynvml too.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setitem(sys.modules, "pynvml", topo_nvml())
    assert sampling._cuda_bus_ids(1) == {"0": "00000000:3B:00.0"}


def test_bus_ids_open_the_sampler_on_the_right_gpus(monkeypatch, no_cuda_calls):
    nvml = fake_nvml()  # knows 3B as handle 0 and 5E as handle 1
    topo = topo_nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # CUDA's device 0 is the GPU at 5E
    source = NvmlSource(sampling._cuda_bus_ids(1, topo), nvml=nvml)
    (row,) = source.read()
    assert row["device"] == "0" and row["util_gpu_pct"] == 91.0  # handle 1's reading
    source.close()


# --- The NVML sampler: no leaked init, reasons instead of silence, GPM spans ---------------

def test_nvml_source_shuts_nvml_down_when_a_handle_lookup_fails():
    nvml = fake_nvml()
    inits = []
    nvml.nvmlInit = lambda: inits.append(1)
    with pytest.raises(KeyError):
        NvmlSource({"0": "00000000:3B:00.0", "1": "00000000:99:00.0"}, nvml=nvml)
    assert inits == [1] and nvml.state["shutdown"]  # the init is undone
    assert nvml.state["freed"] == 0  # no GPM sample was taken before the failure


def test_nvml_source_close_is_idempotent():
    nvml = fake_nvml()
    shutdowns = []
    nvml.nvmlShutdown = lambda: shutdowns.append(1)
    source = NvmlSource({"0": 0}, nvml=nvml)
    source.close()
    source.close()
    assert shutdowns == [1] and nvml.state["freed"] == 1


def test_first_gpm_figure_waits_for_its_minimum_span():
    nvml = fake_nvml()
    source = NvmlSource({"0": 0}, nvml=nvml, gpm_min_span_s=0.2)
    (first,) = source.read()  # ~0 ms after opening: no GPM figure, the opening sample kept
    assert "sm_util_pct" not in first and first["util_gpu_pct"] == 90.0
    assert nvml.state["gpm_samples"] == 1 and nvml.state["freed"] == 0
    time.sleep(0.25)
    (second,) = source.read()
    assert second["sm_util_pct"] == 71.0 and second["tensor_active_pct"] == 33.0
    assert nvml.state["gpm_samples"] == 2 and nvml.state["freed"] == 1
    source.close()


def test_case_sampler_takes_no_gpm_figure_from_its_first_tick(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setattr(sampling, "_cuda_bus_ids", lambda n: {"0": "00000000:3B:00.0"})
    rig = Rig("cuda", 1)
    case = new_case(rig, "single", "resnet-tiny", 32, 8,
                    measurement=Measurement(sample_interval_ms=50))
    with sampling.case_sampler(case, rig, [1]) as s:
        time.sleep(0.3)
    gpm = [r["sm_util_pct"] for r in s.samples]
    assert gpm[0] is None  # the tick right after opening spans ~0 ms
    assert 71.0 in gpm[1:] and s.note == ""


def test_case_sampler_says_why_nvml_is_unavailable(monkeypatch):
    rig = Rig("cuda", 2)
    case = new_case(rig, "ddp", "resnet-tiny", 32, 8,
                    measurement=Measurement(sample_interval_ms=20))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py installed
    with sampling.case_sampler(case, rig, [1, 2]) as s:
        pass
    assert s.samples == []
    assert s.note.startswith("NVML unavailable (ModuleNotFoundError")
    assert "its columns are empty" in s.note
    monkeypatch.setattr(sampling, "_cuda_bus_ids",
                        lambda n: (_ for _ in ()).throw(FakeNvmlError("driver not loaded")))
    with sampling.case_sampler(case, rig, [1, 2]) as s:
        pass
    assert s.note == ("NVML unavailable (FakeNvmlError: driver not loaded): its columns "
                      "are empty")


def test_idle_power_says_why_nvml_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    idle = sampling.measure_idle_power(Rig("cuda", 2), seconds=0.1)
    assert idle.unsupported.startswith("NVML unavailable (ModuleNotFoundError")


def test_sampler_drops_a_source_that_fails_and_keeps_the_others():
    class Flaky:
        reads = 0

        def read(self):
            self.reads += 1
            if self.reads > 1:
                raise OSError("device gone")
            return [{"device": "x", "rss_mib": 1.0}]

        def close(self):
            raise RuntimeError("cannot close")

    class Steady:
        def read(self):
            return [{"device": "y", "rss_mib": 2.0}]

        def close(self):
            pass

    flaky = Flaky()
    with Sampler([flaky, Steady(), UnavailableSource("RAPL", "root only")], 0.02) as s:
        time.sleep(0.2)
    assert flaky.reads == 2  # not read again after it failed
    assert sum(r["device"] == "x" for r in s.samples) == 1
    assert sum(r["device"] == "y" for r in s.samples) >= 3
    assert "RAPL unavailable (root only)" in s.note
    assert "Flaky read failed" in s.note and "OSError: device gone" in s.note
    assert "not read again" in s.note


# --- env.json's multi_gpu record ---------------------------------------------------------

def test_multi_gpu_record_of_an_nvlink_box(tmp_path, no_cuda_calls):
    # Two direct NVLinks between the GPUs, P2P fine everywhere.
    nvml = topo_nvml(nvlinks={0: ["00000000:3B:00.0"] * 2, 1: ["00000000:5e:00.0"] * 2})
    environ = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_P2P_LEVEL": "NVL", "HOME": "/root"}
    rec = environment.multi_gpu_environment(Rig("cuda", 2), nvml, environ, shm=tmp_path,
                                            nvidia_smi=lambda: "GPU0\tX\tNV2")
    assert rec["cuda_device_order"] == "PCI_BUS_ID" and rec["cuda_visible_devices"] is None
    assert rec["nccl_env"] == {"NCCL_P2P_LEVEL": "NVL"}
    assert rec["dev_shm"]["total_mib"] > 0 and rec["dev_shm"]["path"] == str(tmp_path)
    topo = rec["topology"]
    assert [g["bus_id"] for g in topo["gpus"]] == ["00000000:3B:00.0", "00000000:5E:00.0"]
    assert [g["nvml_index"] for g in topo["gpus"]] == [1, 0]
    assert [g["nvlinks_active"] for g in topo["gpus"]] == [2, 2]
    pair = topo["pairs"]["0-1"]
    assert pair["link"] == "NVLink x2" and pair["nvlinks_direct"] == 2
    assert pair["p2p"] == {"read": "ok", "write": "ok", "nvlink": "ok", "atomics": "ok"}
    assert rec["cuda_driver_version"] == "12.4" and rec["nvml_version"] == "12.550.54.15"
    assert rec["nvidia_smi_topo_m"] == "GPU0\tX\tNV2"
    json.dumps(rec)  # env.json must hold it as it is
    assert nvml.state["inits"] == nvml.state["shutdowns"]


def test_multi_gpu_record_of_a_pcie_box_and_of_one_without_nvml(tmp_path):
    pcie = topo_nvml(level=50, p2p=lambda index: 2 if index == 2 else 5 if index == 3 else 0)
    rec = environment.multi_gpu_environment(Rig("cuda", 2), pcie, {}, shm=tmp_path,
                                            nvidia_smi=lambda: None)
    pair = rec["topology"]["pairs"]["0-1"]
    assert pair["link"] == "PCIe SYS" and pair["nvlinks_direct"] == 0
    assert pair["pcie_common_ancestor"].startswith("SYS")
    assert pair["p2p"] == {"read": "ok", "write": "ok", "nvlink": "gpu not supported",
                           "atomics": "not supported"}
    # An NVSwitch box: no link ends on the peer, but NVML says P2P over NVLink works.
    switched = topo_nvml(nvlinks={0: ["00000000:C0:00.0"], 1: ["00000000:C1:00.0"]})
    rec = environment.multi_gpu_environment(Rig("cuda", 2), switched, {}, shm=tmp_path,
                                            nvidia_smi=lambda: None)
    assert rec["topology"]["pairs"]["0-1"]["link"] == "NVLink (switched)"
    broken = topo_nvml(init_error=FakeNvmlError("Driver Not Loaded"))
    rec = environment.multi_gpu_environment(Rig("cuda", 2), broken, {}, shm=tmp_path,
                                            nvidia_smi=lambda: None)
    assert rec["topology"] == {"unsupported": "NVML unavailable (FakeNvmlError: Driver Not "
                                              "Loaded)"}
    assert rec["cuda_driver_version"] is None and rec["dev_shm"]["total_mib"] > 0


def test_multi_gpu_record_of_a_cpu_rig_and_in_env_json(cpu_rig, tmp_path):
    rec = environment.multi_gpu_environment(cpu_rig, environ={"CUDA_VISIBLE_DEVICES": ""},
                                            shm=tmp_path / "missing")
    assert "topology" not in rec and rec["cuda_visible_devices"] == ""
    assert rec["dev_shm"]["unsupported"].startswith("FileNotFoundError")
    env = environment.collect(cpu_rig, {}, [])
    assert set(env["multi_gpu"]) >= {"dev_shm", "cuda_device_order", "nccl_env"}


# --- Process groups: loopback for gloo and NCCL, the GPU chosen before joining ------------

@pytest.fixture
def group_calls(monkeypatch):
    """torch.distributed.init_process_group and torch.cuda.set_device, recorded in order;
    both socket variables unset (and restored after)."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kwargs: calls.append(("init", kwargs)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "placeholder")  # so that the test's value is undone after
        monkeypatch.delenv(name)
    monkeypatch.setattr(process_groups.platform, "system", lambda: "Linux")
    return calls


def test_a_cuda_rank_selects_its_gpu_then_joins_nccl_over_loopback(group_calls):
    import os

    process_groups.init_process_group(Rig("cuda", 2), 1, 2, "/tmp/rendezvous", 30.0)
    assert [c[0] for c in group_calls] == ["set_device", "init"]
    assert group_calls[0] == ("set_device", 1)
    kwargs = group_calls[1][1]
    assert kwargs["backend"] == "nccl" and kwargs["device_id"] == torch.device("cuda", 1)
    assert kwargs["rank"] == 1 and kwargs["world_size"] == 2
    assert kwargs["init_method"] == "file:///tmp/rendezvous"
    assert kwargs["timeout"] == datetime.timedelta(seconds=30)
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_socket_interfaces_set_by_the_user_are_kept(group_calls, monkeypatch):
    import os

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    process_groups.init_process_group(Rig("cuda", 2), 0, 2, "/tmp/rendezvous", 30.0)
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_cpu_rank_joins_gloo_without_a_gpu_and_other_systems_keep_their_defaults(
        group_calls, cpu_rig, monkeypatch):
    import os

    process_groups.init_process_group(cpu_rig, 0, 2, "/tmp/rendezvous", 30.0)
    (call,) = group_calls
    assert call[1]["backend"] == "gloo" and call[1]["device_id"] is None
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name)
    monkeypatch.setattr(process_groups.platform, "system", lambda: "Darwin")
    process_groups.init_process_group(cpu_rig, 0, 2, "/tmp/rendezvous", 30.0)
    assert "NCCL_SOCKET_IFNAME" not in os.environ and "GLOO_SOCKET_IFNAME" not in os.environ


# --- Pre-flight --------------------------------------------------------------------------

def test_shm_check_fails_docker_default_with_the_hint():
    docker = {"path": "/dev/shm", "total_mib": 64.0, "free_mib": 64.0}
    fail = preflight_static.shm_check(Rig("cuda", 2), docker, environ={})
    assert fail.status == "fail"
    assert "64 MiB" in fail.detail and "--shm-size" in fail.detail
    assert "NCCL_SHM_DISABLE=1" in fail.detail
    assert preflight_static.shm_check(Rig("cuda", 2), docker,
                                      {"NCCL_SHM_DISABLE": "1"}).status == "warn"
    assert preflight_static.shm_check(Rig("cuda", 1), docker, {}).status == "ok"  # no shared memory
    big = {"path": "/dev/shm", "total_mib": 16384.0, "free_mib": 16000.0}
    assert preflight_static.shm_check(Rig("cuda", 8), big, {}).status == "ok"
    unreadable = {"path": "/dev/shm", "unsupported": "FileNotFoundError: no"}
    assert preflight_static.shm_check(Rig("cuda", 2), unreadable, {}).status == "warn"


def test_nvml_check(no_cuda_calls):
    assert preflight_static.nvml_check(Rig("cuda", 2), topo_nvml(), {}).status == "ok"
    few = preflight_static.nvml_check(Rig("cuda", 2), topo_nvml(), {"CUDA_VISIBLE_DEVICES": "0"})
    assert few.status == "warn" and "1 of the rig's 2" in few.detail
    mixed = topo_nvml(gpus=(GPUS[0], ("00000000:3B:00.0", "GPU-aaaa-1111", "NVIDIA L4")))
    warn = preflight_static.nvml_check(Rig("cuda", 2), mixed, {})
    assert warn.status == "warn" and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in warn.detail
    ordered = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert preflight_static.nvml_check(Rig("cuda", 2), mixed, ordered).status == "ok"
    missing = topo_nvml(init_error=FakeNvmlError("no driver"))
    assert "empty" in preflight_static.nvml_check(Rig("cuda", 2), missing, {}).detail


@pytest.mark.timeout(240)
@pytest.mark.integration
def test_all_reduce_runs_the_real_routine_with_gloo_on_a_cpu_rig(cpu_rig):
    (check,) = preflight_probes.all_reduce(cpu_rig, timeout_s=180)
    assert check.name == "all_reduce" and check.status == "ok", check.detail
    assert check.detail.startswith("gloo all-reduce between the 2 workers")


def _children_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if marker in p.cmdline():
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.integration
def test_all_reduce_that_hangs_is_killed_at_its_timeout(cpu_rig):
    marker = "preflight-hang-marker"
    hang = [sys.executable, "-c", f"{JOIN}time.sleep(600)  # {marker}"]
    start = time.monotonic()
    (check,) = preflight_probes.all_reduce(cpu_rig, timeout_s=2, command=hang)
    assert time.monotonic() - start < 30
    assert check.status == "fail" and check.fault == "hang"
    assert "did not finish within 2 s of joining its group" in check.detail
    assert "gloo" in check.detail and "NCCL_DEBUG" not in check.detail  # hints are NCCL's
    assert _children_with(marker) == []  # the whole group was killed and reaped


JOIN = "import json, sys, time; open(sys.argv[5] + '.joined', 'w').close(); "
"""A fake rank's first line: its group is up (``preflight_probes.JOINED``)."""


@pytest.mark.integration
def test_a_slow_start_is_not_taken_for_a_hung_all_reduce(cpu_rig):
    """The ranks' start (torch's import, NCCL's communicator) has its own time: a start
    slower than the all-reduce's ``timeout_s`` passes, so that no slow box has peer-to-peer
    switched off for nothing; a rank that never joins is a hang of the start (``fault`` start)."""
    slow = ("import json, sys, time; time.sleep(3); open(sys.argv[5] + '.joined', 'w').close();"
            " open(sys.argv[5], 'w').write(json.dumps({'ok': True}))")
    (check,) = preflight_probes.all_reduce(cpu_rig, timeout_s=1, join_timeout_s=30,
                                           command=[sys.executable, "-c", slow])
    assert check.status == "ok", check.detail
    never = [sys.executable, "-c", "import time; time.sleep(600)"]
    start = time.monotonic()
    (check,) = preflight_probes.all_reduce(cpu_rig, timeout_s=1, join_timeout_s=2,
                                           command=never)
    assert time.monotonic() - start < 30
    assert check.status == "fail" and check.fault == "start"
    assert "did not start: rank 0, 1 had not joined the group within 2 s" in check.detail


@pytest.mark.integration
def test_all_reduce_ranks_that_fail_are_named(cpu_rig):
    (check,) = preflight_probes.all_reduce(
        cpu_rig, timeout_s=60, command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    assert check.status == "fail"
    assert "rank 0 exited with code 3 without a result" in check.detail
    wrong = ("import json, sys; open(sys.argv[5], 'w').write(json.dumps("
             "{'ok': False, 'value': 1.0} if sys.argv[2] == '1' else {'ok': True}))")
    (check,) = preflight_probes.all_reduce(cpu_rig, timeout_s=60,
                                           command=[sys.executable, "-c", wrong])
    assert check.status == "fail" and "rank 1: wrong sum 1.0 (expected 3)" in check.detail


OK_RANK = ("import json, sys; open(sys.argv[5], 'w').write(json.dumps({'ok': True, "
           "'peer_access': {'0-1': True, '1-0': False} if sys.argv[2] == '0' else None}))")


OK_SMOKE = ("import json, sys; open(sys.argv[2], 'w').write(json.dumps({'ok': True, "
            "'device': sys.argv[1]}))")


@pytest.mark.integration
def test_check_stops_on_a_failure_and_prints_warnings(capsys, monkeypatch):
    monkeypatch.setattr(preflight, "SETTLE_S", 0.0)
    docker = {"path": "/dev/shm", "total_mib": 64.0}
    fakes = {"command": [sys.executable, "-c", OK_RANK], "nvml": topo_nvml(),
             "smoke_command": [sys.executable, "-c", OK_SMOKE],
             "copy_command": [sys.executable, "-c", OK_SMOKE],
             "host": {"iommu": {"state": "off"}, "acs": {"state": "unknown"}}}
    two = Rig("cuda", 2)
    with pytest.raises(preflight.PreflightError, match="dev_shm: /dev/shm is 64 MiB") as e:
        preflight.check(two, shm=docker, environ={}, **fakes)
    assert isinstance(e.value, RigError)  # the command line's exit 2
    checks = preflight.check(two, shm={"path": "/dev/shm", "total_mib": 1024.0}, environ={},
                             **fakes)
    assert [(c.name, c.status) for c in checks] == [
        ("dev_shm", "ok"), ("nvml", "ok"), ("topology", "ok"), ("cuda_smoke", "ok"),
        ("peer_copy", "ok"), ("all_reduce", "ok"), ("peer_access", "warn")]
    err = capsys.readouterr().err
    assert "pre-flight warning: peer_access: no peer access between GPUs 1-0" in err


def _plan(rig):
    from bench_lib.sweep.profile import Profile

    return lambda args: (rig, Profile(), [])


def test_cli_runs_the_preflight_before_a_cuda_run_and_exits_2(monkeypatch, tmp_path, capsys):
    calls = []

    def failing(rig, quiet=False):
        calls.append(rig.label)
        raise preflight.PreflightError("pre-flight of rig cuda:2 failed; all_reduce: hang")

    monkeypatch.setattr(preflight, "check", failing)
    monkeypatch.setattr(run_plan, "plan_new", _plan(Rig("cuda", 2)))
    out = tmp_path / "out"
    assert commands.main(["run", "--out", str(out)]) == exit_codes.EXIT_USAGE
    assert calls == ["cuda:2"] and not out.exists()  # stopped before the run folder
    assert "error: pre-flight of rig cuda:2 failed; all_reduce: hang" in capsys.readouterr().err
    # A dry run only plans: no pre-flight.
    assert commands.main(["run", "--dry-run", "--out", str(out)]) == exit_codes.EXIT_OK
    assert calls == ["cuda:2"]


@pytest.mark.integration
def test_cli_runs_no_preflight_on_a_cpu_rig(monkeypatch, tmp_path, cpu_rig):
    from bench_lib.results import store
    from bench_lib.sweep.profile import UsageError

    monkeypatch.setattr(preflight, "check", lambda *a, **k: pytest.fail("pre-flight ran"))
    monkeypatch.setattr(run_plan, "plan_new", _plan(cpu_rig))

    def stop(*_args):
        raise UsageError("stopped where the run folder would be created")

    monkeypatch.setattr(store, "create_run_dir", stop)
    assert commands.main(["run", "--out", str(tmp_path / "out")]) == exit_codes.EXIT_USAGE


# --- The runner's device names: NVML, else a child process; never a CUDA call here --------

def test_cuda_device_names_come_from_nvml_without_a_cuda_call(monkeypatch, no_cuda_calls):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    child_asked: list[int] = []
    names = rig_module.cuda_device_names(2, topo_nvml(), child=child_asked.append)
    assert names == ["NVIDIA H100 80GB HBM3"] * 2
    assert child_asked == []  # NVML answered: no child process
    # The rig's own method takes the same path (pynvml is the default NVML).
    monkeypatch.setitem(sys.modules, "pynvml", topo_nvml())
    assert Rig("cuda", 2).device_names() == ["NVIDIA H100 80GB HBM3"] * 2


def test_cuda_device_names_fall_back_to_a_child_process(monkeypatch, no_cuda_calls):
    broken = topo_nvml(init_error=FakeNvmlError("no driver"))
    asked: list[int] = []

    def child(count: int) -> list[str]:
        asked.append(count)
        return [f"gpu {i}" for i in range(count)]

    assert rig_module.cuda_device_names(2, broken, child=child) == ["gpu 0", "gpu 1"]
    assert asked == [2]
    # NVML that sees fewer GPUs than the rig (CUDA_VISIBLE_DEVICES naming one) also asks.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert rig_module.cuda_device_names(2, topo_nvml(), child=child) == ["gpu 0", "gpu 1"]


@pytest.mark.integration
def test_a_child_that_cannot_name_the_gpus_is_a_rig_error(monkeypatch):
    # This machine's torch in a child process that sees no GPU (the child inherits the
    # variable, on a GPU box too): the failure is a RigError that says what was tried.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RigError, match="NVML or torch in a child process"):
        rig_module._names_from_child(1)


def test_rig_detection_counts_gpus_without_initialising_cuda(monkeypatch):
    def no_runtime(*_args, **_kwargs):
        raise AssertionError("cudaGetDeviceCount called: CUDA initialised in the runner")

    monkeypatch.setattr(torch.cuda, "is_available", no_runtime)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # NVML-based in torch
    assert rig_detection.detect_rig("cuda").num_devices == 2
    assert rig_detection.detect_rig().kind == "cuda"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert rig_detection.detect_rig().kind == "cpu"
    with pytest.raises(RigError, match="no CUDA GPU is visible"):
        rig_detection.detect_rig("cuda")
