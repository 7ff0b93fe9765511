"""The pre-flight of a sick two-GPU box, without a GPU: fake NVML, fake children that copy
wrong or hang their all-reduce unless NCCL_P2P_DISABLE=1, the IOMMU and ACS read from fake
sysfs trees; and what the run then does (goes on with the fallback, or exits 2 before its
folder exists) and records (env.json, duty.json, the captions)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import types

import pytest

from bench_lib import commands, exit_codes, topology
from bench_lib.commands import plan as run_plan
from bench_lib.commands import run as run_command
from bench_lib.measure import cuda_smoke, environment, preflight, preflight_probes
from bench_lib.processes import forkserver
from bench_lib.report.runs import caption
from bench_lib.rig import Rig
from bench_lib.sweep.profile import Profile, UsageError
from tests.test_gpu_env import topo_nvml

QUIET_HOST = {"iommu": {"state": "off", "units": [], "cmdline": []},
              "acs": {"state": "unknown", "bridges": {}}}
"""A machine whose IOMMU is off and whose ACS cannot be read (the IOMMU and ACS records
``preflight.run_checks`` takes instead of this machine's)."""
BIG_SHM = {"path": "/dev/shm", "total_mib": 16384.0}
OK_SMOKE = ("import json, sys; open(sys.argv[2], 'w').write(json.dumps({'ok': True, "
            "'device': sys.argv[1], 'name': 'NVIDIA RTX 6000 Ada', 'capability': 'sm_89'}))")
OK_COPY = ("import json, sys; open(sys.argv[2], 'w').write(json.dumps({'ok': True, "
           "'copies': 16, 'mib': 5.0, 'corrupt': []}))")
CORRUPT_COPY = (
    "import json, sys; open(sys.argv[2], 'w').write(json.dumps({'ok': False, 'copies': 16, "
    "'mib': 5.0, 'corrupt': [{'path': 'cuda:0->cuda:1', 'dtype': 'int32', 'way': '.to()', "
    "'wrong': 4096, 'of': 1048576, 'first': 65536, 'checksum': 12, 'expected': 34}]}))")
_P2P_ON = "os.environ.get('NCCL_P2P_DISABLE') != '1'"
OK_RANK = ("import json, os, sys, time\n"
           "open(sys.argv[5] + '.joined', 'w').close()\n"  # its group is up (JOINED)
           "def ok(): open(sys.argv[5], 'w').write(json.dumps({'ok': True, 'value': 3.0}))\n")
HANGS_WITH_P2P = OK_RANK + f"time.sleep(600) if {_P2P_ON} else ok()"
WRONG_WITH_P2P = OK_RANK + (
    f"open(sys.argv[5], 'w').write(json.dumps({{'ok': False, 'value': 2.0}})) if {_P2P_ON} "
    "else ok()")
HANGS = OK_RANK + "time.sleep(600)"


def two_gpu_nvml(level: int = 30) -> types.SimpleNamespace:
    """Two GPUs under one PCIe host bridge (``level``: NVML's common ancestor), P2P read and
    write ok, no NVLink; driver 550.54.15."""
    nv = topo_nvml(level=level, p2p=lambda index: 0 if index < 2 else 2)
    nv.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    return nv


def fakes(copy: str = OK_COPY, rank: str = OK_RANK + "ok()", **extra: object
          ) -> dict[str, object]:
    """``preflight.run_checks``'s keywords for a fake two-GPU box whose children are these."""
    return {"shm": BIG_SHM, "nvml": two_gpu_nvml(), "host": QUIET_HOST,
            "smoke_command": [sys.executable, "-c", OK_SMOKE],
            "copy_command": [sys.executable, "-c", copy],
            "command": [sys.executable, "-c", rank], "timeout_s": 2.0} | extra


@pytest.fixture
def no_settle(monkeypatch):
    monkeypatch.setattr(preflight, "SETTLE_S", 0.0)


@pytest.fixture
def p2p_on(monkeypatch):
    """NCCL_P2P_DISABLE not set to 1 here (restored after the test, which may set it)."""
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")


# --- the checks and their verdict ---------------------------------------------------------

@pytest.mark.integration
def test_a_healthy_two_gpu_box_passes_and_says_its_topology(capsys, no_settle, p2p_on):
    checks = preflight.check(Rig("cuda", 2), **fakes())
    assert [(c.name, c.status) for c in checks] == [
        ("dev_shm", "ok"), ("nvml", "ok"), ("topology", "ok"), ("cuda_smoke", "ok"),
        ("peer_copy", "ok"), ("all_reduce", "ok")]
    err = capsys.readouterr().err
    assert ("pre-flight topology: 2 GPUs: PCIe host bridge, P2P read/write ok, no NVLink, "
            "IOMMU off, ACS unknown; driver 550.54.15, CUDA 12.4") in err
    assert "pre-flight passed in" in err and "NCCL_P2P_DISABLE" not in err
    assert os.environ["NCCL_P2P_DISABLE"] == "0"  # no fallback: nothing set
    assert preflight.record(checks)["nccl_fallback"] is None


@pytest.mark.integration
def test_a_copy_that_corrupts_stops_the_preflight_with_the_fixes(no_settle, p2p_on):
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(Rig("cuda", 2), quiet=True,
                        **fakes(copy=CORRUPT_COPY, command=["/nonexistent/never-started"]))
    text = str(e.value)
    assert "peer_copy: copies between GPUs cuda:0,cuda:1: 1 of 16 copies came back wrong" in text
    assert "silent corruption" in text and "4,096 of 1,048,576 elements wrong" in text
    for fix in ("newer NVIDIA driver", "iommu=pt", "ACS off"):
        assert fix in text
    assert "NCCL_P2P_DISABLE" not in text  # CUDA's copies, not NCCL's: it would not help
    assert "all_reduce" not in text  # not run on GPUs whose copies corrupt


@pytest.mark.parametrize("rank, what", [(HANGS_WITH_P2P, "hung"),
                                        (WRONG_WITH_P2P, "summed wrong")])
@pytest.mark.integration
def test_an_all_reduce_that_fails_with_p2p_falls_back_to_p2p_off(capsys, no_settle, p2p_on,
                                                                 rank, what):
    checks = preflight.check(Rig("cuda", 2), quiet=True, **fakes(rank=rank))
    found = {c.name: c for c in checks}
    assert found["all_reduce"].status == "warn"
    assert "with NCCL_P2P_DISABLE=1" in found["all_reduce"].detail
    reason = f"NCCL_P2P_DISABLE=1: the all-reduce {what} with peer-to-peer on"
    assert found["nccl_fallback"].detail == reason
    assert os.environ["NCCL_P2P_DISABLE"] == "1"  # every process of the run inherits it
    assert preflight.record(checks, 3.0)["nccl_fallback"] == reason
    assert f"this run goes on with {reason}" in capsys.readouterr().err  # even when quiet


@pytest.mark.integration
def test_an_all_reduce_that_always_hangs_stops_the_preflight_within_its_timeouts(
        no_settle, p2p_on):
    start = time.monotonic()
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(Rig("cuda", 2), quiet=True, **fakes(rank=HANGS))
    assert time.monotonic() - start < 30  # 2 s an attempt, two attempts, and the rest
    text = str(e.value)
    assert "did not finish within 2 s of joining its group: a hang" in text and "and again" in text
    assert "with NCCL_P2P_DISABLE=1 did not finish" in text and "iommu=pt" in text
    assert text.count("NCCL_DEBUG=INFO") == 1  # the hint once, not once an attempt
    assert os.environ["NCCL_P2P_DISABLE"] == "0"


@pytest.mark.integration
def test_a_start_that_hangs_is_not_retried_and_names_its_fixes(no_settle, p2p_on, monkeypatch):
    """Ranks that never join their group hang before NCCL connects any peer (NCCL >= 2.22
    connects them at the first collective): no retry with P2P off, exit 2 with the fixes,
    within the start's own time."""
    monkeypatch.setattr(preflight_probes, "JOIN_TIMEOUT_S", 2.0)
    start = time.monotonic()
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(Rig("cuda", 2), quiet=True, **fakes(rank="import time; time.sleep(600)"))
    assert time.monotonic() - start < 20  # one attempt of 2 s, and the rest
    text = str(e.value)
    assert "had not joined the group within 2 s" in text and "and again" not in text
    assert "NCCL_P2P_DISABLE=1" in text and "a newer NVIDIA driver" in text
    assert os.environ["NCCL_P2P_DISABLE"] == "0"


@pytest.mark.integration
def test_no_retry_where_p2p_is_already_off_or_the_ranks_crash(no_settle, monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    checks = preflight.run_checks(Rig("cuda", 2), **fakes(rank=HANGS))
    assert checks[-1].name == "all_reduce" and "and again" not in checks[-1].detail
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    crash = fakes(rank="import sys; sys.exit(3)")
    checks = preflight.run_checks(Rig("cuda", 2), **crash)
    assert checks[-1].fault == "error" and "and again" not in checks[-1].detail


@pytest.mark.integration
def test_ranks_get_the_retrys_variable(tmp_path):
    seen = tmp_path / "seen"
    echo = ("import json, os, sys; open(sys.argv[5], 'w').write(json.dumps({'ok': True}));"
            f" open({str(seen)!r} + sys.argv[2], 'w').write(os.environ['NCCL_P2P_DISABLE'])")
    (check,) = preflight_probes.all_reduce(Rig("cuda", 2, gpu_slots=2), 30,
                                           [sys.executable, "-c", echo], preflight.P2P_OFF)
    assert check.status == "ok" and "with NCCL_P2P_DISABLE=1" in check.detail
    assert (tmp_path / "seen0").read_text() == (tmp_path / "seen1").read_text() == "1"


def test_the_topology_warns_where_the_iommu_remaps_or_acs_redirects(p2p_on):
    on = {"iommu": {"state": "on"}, "acs": {"state": "on"}}
    check = preflight.topology_check(Rig("cuda", 2), two_gpu_nvml(level=50), {}, on)
    assert check.status == "warn" and "across sockets" in check.detail
    assert "IOMMU on, ACS on" in check.detail and "NVIDIA/nccl#257" in check.detail
    one = preflight.topology_check(Rig("cuda", 1), topo_nvml(gpus=topo_nvml_gpus()[:1]), {},
                                   on)
    assert one.status == "ok" and one.detail.startswith("one GPU; driver")


def test_a_topology_that_cannot_be_read_only_warns(monkeypatch):
    def broken(*_args):
        raise ValueError("odd bus id")

    monkeypatch.setattr(topology, "gpu_link_line", broken)
    check = preflight.topology_check(Rig("cuda", 2), two_gpu_nvml(), {}, QUIET_HOST)
    assert check.status == "warn" and "ValueError: odd bus id" in check.detail


def topo_nvml_gpus() -> tuple[tuple[str, str, str], ...]:
    from tests.test_gpu_env import GPUS

    return GPUS


# --- the copies' child, run on the CPU ----------------------------------------------------

def test_copy_check_passes_true_copies_and_finds_a_corrupt_one():
    good = cuda_smoke.copy_check(["cpu", "cpu"])
    assert good["ok"] and good["corrupt"] == [] and "error" not in good
    assert good["copies"] == 16  # 2 dtypes x 2 directions x 2 ways x (there, back)

    def corrupting(tensor, device, way):  # one element flipped by copy_ (the silent fault)
        out = cuda_smoke._move(tensor, device, way).clone()
        if way.startswith("copy_") and out.dtype == cuda_smoke._patterns()["int32"].dtype:
            out[1234] += 1
        return out

    bad = cuda_smoke.copy_check(["cpu", "cpu"], corrupting)
    assert not bad["ok"] and len(bad["corrupt"]) == 4  # both directions, there and back
    first = bad["corrupt"][0]
    assert first == {"path": "cpu->cpu", "dtype": "int32", "way": "copy_(non_blocking=True)",
                     "wrong": 1, "of": cuda_smoke.COPY_ELEMENTS, "first": 1234,
                     "checksum": first["expected"] + 1, "expected": first["expected"]}


@pytest.mark.integration
def test_the_copy_child_runs_through_its_command_line(tmp_path):
    check = preflight_probes.peer_copy(
        Rig("cuda", 2), 60, [sys.executable, "-c",
                             "import sys; from bench_lib.measure import cuda_smoke as c; "
                             "sys.argv[1] = 'cpu,cpu'; sys.exit(c.main(sys.argv[1:3]))"])
    assert check.status == "ok" and check.detail.startswith("16 copies of 5 MiB")
    hung = preflight_probes.peer_copy(Rig("cuda", 2), 1, [sys.executable, "-c",
                                                          "import time; time.sleep(600)"])
    assert hung.status == "fail" and hung.fault == "hang"


# --- the IOMMU, ACS and the line that names the links ---------------------------------

def test_iommu_state_from_sysfs_and_the_command_line(tmp_path):
    sysfs, cmdline = tmp_path / "iommu", tmp_path / "cmdline"
    cmdline.write_text("quiet splash\n")
    assert topology.iommu_state(sysfs, cmdline)["state"] == "unknown"  # nothing to read
    sysfs.mkdir()
    assert topology.iommu_state(sysfs, cmdline)["state"] == "off"
    (sysfs / "dmar0").mkdir()
    assert topology.iommu_state(sysfs, cmdline) == {"state": "on", "units": ["dmar0"],
                                                    "cmdline": []}
    cmdline.write_text("quiet intel_iommu=on iommu=pt\n")
    found = topology.iommu_state(sysfs, cmdline)
    assert found["state"] == "passthrough" and found["cmdline"] == ["intel_iommu=on", "iommu=pt"]
    cmdline.write_text("amd_iommu=off\n")
    assert topology.iommu_state(tmp_path / "none", cmdline)["state"] == "off"


def _config(acs_control: int | None) -> bytes:
    """4 KiB of PCI config space: an AER capability at 0x100, then (where given) ACS at
    0x140 with this control register."""
    space = bytearray(4096)
    space[0x100:0x104] = (0x0001 | 1 << 16 | (0x140 if acs_control is not None else 0) << 20
                          ).to_bytes(4, "little")
    if acs_control is not None:
        space[0x140:0x144] = (topology.ACS_CAP_ID | 1 << 16).to_bytes(4, "little")
        space[0x146:0x148] = acs_control.to_bytes(2, "little")
    return bytes(space)


def test_acs_control_is_read_from_extended_config_space():
    assert topology.acs_control(_config(0x1D)) == 0x1D
    assert topology.acs_control(_config(None)) is None
    assert topology.acs_control(_config(0x1D)[:256]) is None  # not root: 256 bytes only


def _pci_tree(tmp_path, bridge_config: bytes):
    """sysfs's PCI tree: GPU 0000:3b:00.0 under bridge 0000:3a:00.0 under root port
    0000:00:01.0 (its config unreadable), and bus/pci/devices links to them."""
    devices = tmp_path / "devices" / "pci0000:00"
    root_port = devices / "0000:00:01.0"
    bridge = root_port / "0000:3a:00.0"
    gpu = bridge / "0000:3b:00.0"
    gpu.mkdir(parents=True)
    (bridge / "config").write_bytes(bridge_config)
    links = tmp_path / "bus"
    links.mkdir()
    for path in (root_port, bridge, gpu):
        (links / path.name).symlink_to(path)
    return links


@pytest.mark.integration
def test_acs_state_reads_the_bridges_above_the_gpus(tmp_path):
    links = _pci_tree(tmp_path, _config(0x1D))  # SrcValid ReqRedir CmpltRedir UpstreamFwd
    assert topology.upstream_bridges("0000:3b:00.0", links) == ["0000:00:01.0", "0000:3a:00.0"]
    found = topology.acs_state(["00000000:3B:00.0"], links, lspci="/nonexistent/lspci")
    assert found == {"state": "on", "bridges": {"0000:3a:00.0": "ReqRedir+ CmpltRedir+"}}
    off = _pci_tree(tmp_path / "off", _config(0x01))
    assert topology.acs_state(["00000000:3B:00.0"], off, lspci="/nonexistent/lspci") == {
        "state": "off", "bridges": {"0000:3a:00.0": "no redirect"}}
    short = _pci_tree(tmp_path / "short", _config(0x1D)[:256])
    assert topology.acs_state(["00000000:3B:00.0"], short, lspci="/nonexistent/lspci")[
        "state"] == "unknown"


@pytest.mark.integration
def test_acs_state_falls_back_to_lspci(tmp_path):
    short = _pci_tree(tmp_path, _config(0x1D)[:256])
    lspci = tmp_path / "lspci"
    lspci.write_text("#!/bin/sh\n[ \"$3\" = 0000:3a:00.0 ] && echo '\\tACSCtl:\\tSrcValid+ "
                     "TransBlk- ReqRedir+ CmpltRedir- UpstreamFwd+ EgressCtrl- DirectTrans-'\n"
                     "exit 0\n")
    lspci.chmod(0o755)
    found = topology.acs_state(["00000000:3B:00.0"], short, lspci=str(lspci))
    assert found == {"state": "on", "bridges": {"0000:3a:00.0": "ReqRedir+"}}


def test_the_link_line_and_env_json_summary(tmp_path):
    rec = environment.multi_gpu_environment(Rig("cuda", 2), two_gpu_nvml(level=10), {},
                                            shm=tmp_path, nvidia_smi=lambda: None,
                                            **QUIET_HOST)
    assert rec["summary"] == ("2 GPUs: one PCIe switch, P2P read/write ok, no NVLink, "
                              "IOMMU off, ACS unknown")
    assert rec["iommu"]["state"] == "off" and rec["acs"]["state"] == "unknown"
    broken = topo_nvml(level=50, p2p=lambda index: 4 if index == 1 else 0,
                       nvlinks={0: ["00000000:3B:00.0"] * 4, 1: ["00000000:5E:00.0"] * 4})
    rec = environment.multi_gpu_environment(Rig("cuda", 2), broken, {}, shm=tmp_path,
                                            nvidia_smi=lambda: None, **QUIET_HOST)
    assert rec["summary"].startswith("2 GPUs: across sockets, P2P write disabled by regkey, "
                                     "NVLink x4, IOMMU off")
    one = environment.multi_gpu_environment(Rig("cuda", 2, gpu_slots=2),
                                            topo_nvml(gpus=topo_nvml_gpus()[:1]), {},
                                            shm=tmp_path, nvidia_smi=lambda: None,
                                            **QUIET_HOST)
    assert one["summary"] is None


def test_every_caption_names_the_links_and_the_fallback():
    env = {"rig": {"label": "cuda:2"}, "versions": {"torch": "2.9", "cuda": "12.8"},
           "multi_gpu": {"summary": "2 GPUs: PCIe host bridge, P2P read/write ok, no NVLink, "
                                    "IOMMU off, ACS unknown"},
           "preflight": {"nccl_fallback": "NCCL_P2P_DISABLE=1: the all-reduce hung with "
                                          "peer-to-peer on"}}
    text = caption("run", env)
    assert "2 GPUs: PCIe host bridge, P2P read/write ok, no NVLink, IOMMU off" in text
    assert "NCCL_P2P_DISABLE=1: the all-reduce hung with peer-to-peer on" in text
    plain = caption("run", {k: v for k, v in env.items() if k != "preflight"} | {
        "multi_gpu": {}})
    assert "GPUs:" not in plain and "NCCL_P2P_DISABLE" not in plain  # an old folder


# --- the command line: goes on with the fallback, or exits 2 before its folder ----------

class _Stop(UsageError):
    """Raised where the run folder would be started (a test's stop)."""


def _cli(monkeypatch, tmp_path, **kw):
    """``run`` on a fake two-GPU box whose pre-flight has ``fakes(**kw)``; stops where the
    run folder would start, returning what it was given, or None where it never got there."""
    monkeypatch.setattr(preflight, "check", functools.partial(preflight.check, **fakes(**kw)))
    monkeypatch.setattr(run_plan, "plan_new", lambda args: (Rig("cuda", 2), Profile(), []))
    server = types.SimpleNamespace(ensure=lambda: None)
    monkeypatch.setattr(forkserver.ForkServer, "take",
                        classmethod(lambda cls, warm: contextlib.nullcontext(server)))
    given: dict[str, object] = {}

    def start_folder(args, plan, server, coordinator, duty=None, checked=None):
        given.update(duty=duty.finish(), preflight=checked)
        raise _Stop("stopped where the run folder starts")

    monkeypatch.setattr(run_command, "start_folder", start_folder)
    out = tmp_path / "out"
    code = commands.main(["run", "--out", str(out)])
    return code, out, given


@pytest.mark.integration
def test_the_run_goes_on_with_p2p_off_and_records_it(monkeypatch, tmp_path, capsys,
                                                    no_settle, p2p_on):
    code, _, given = _cli(monkeypatch, tmp_path, rank=HANGS_WITH_P2P)
    assert code == exit_codes.EXIT_USAGE and given  # the test's stop, past the pre-flight
    assert os.environ["NCCL_P2P_DISABLE"] == "1"
    record = given["preflight"]
    assert record["nccl_fallback"] == ("NCCL_P2P_DISABLE=1: the all-reduce hung with "
                                       "peer-to-peer on")
    assert [c["name"] for c in record["checks"]][-2:] == ["all_reduce", "nccl_fallback"]
    assert record["seconds"] >= 2.0  # the hung attempt's timeout, at least
    assert given["duty"].run_parts_s["preflight_s"] >= record["seconds"]  # in duty.json
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "pre-flight of rig cuda:2 ..."
    said = next(i for i, line in enumerate(err) if "this run goes on with" in line)
    assert said < 8  # among its first lines


@pytest.mark.parametrize("kw, why", [({"copy": CORRUPT_COPY}, "silent corruption"),
                                     ({"rank": HANGS}, "and again")])
@pytest.mark.integration
def test_a_sick_box_exits_2_before_its_run_folder(monkeypatch, tmp_path, capsys, no_settle,
                                                  p2p_on, kw, why):
    code, out, given = _cli(monkeypatch, tmp_path, **kw)
    assert code == exit_codes.EXIT_USAGE and not given  # stopped in the pre-flight
    assert not out.exists()  # nothing written: the pre-flight's log is stderr
    err = capsys.readouterr().err
    assert "error: pre-flight of rig cuda:2 failed; no case was run" in err and why in err
    assert "newer NVIDIA driver" in err and "iommu=pt" in err
    assert os.environ["NCCL_P2P_DISABLE"] == "0"
