"""The fp32 math mode (#28 item 10): PyTorch's own by default, IEEE fp32 on request.

Every default-cuda fp32 figure used to be IEEE fp32 (TF32 off in cuBLAS and cuDNN), while
PyTorch's default lets cuDNN convolutions use TF32 on Ampere and later: compute was slower
than users see, so communication weighed less and data-parallel speedups read better. A run
now computes in ``torch`` mode (torch's own flags) unless asked for ``ieee``; the workers,
the calibration and the FLOP peak probe all set the run's mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from bench_lib import commands, exit_codes, math_modes
from bench_lib.measure import flop_peak, flop_probe
from bench_lib.rig import Rig
from bench_lib.sweep.profile import Measurement, Profile, UsageError
from bench_lib.topology import available_cores

IEEE = {"cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": False}


def tf32_now() -> dict[str, bool]:
    return {"cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


@pytest.mark.integration  # starts processes or waits on real time
def test_torch_mode_is_what_a_fresh_torch_process_computes_in():
    fresh = subprocess.run(
        [sys.executable, "-c", "import json, torch; print(json.dumps(["
         "torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]))"],
        capture_output=True, text=True, check=True, timeout=120)
    matmul, cudnn = json.loads(fresh.stdout)
    assert math_modes.TORCH_TF32 == {"cuda_matmul_allow_tf32": matmul,
                                     "cudnn_allow_tf32": cudnn}
    # torch 2.14 (checked in its source, torch/backends/cudnn/__init__.py and ATen's
    # Context): TF32 allowed in cuDNN convolutions, not in cuBLAS matmuls.
    assert (matmul, cudnn) == (False, True)


@pytest.mark.parametrize("mode,expected", [("torch", {"cuda_matmul_allow_tf32": False,
                                                      "cudnn_allow_tf32": True}),
                                           ("ieee", IEEE)])
def test_set_math_mode_sets_each_modes_flags(restore_math_flags, mode, expected):
    # Start from the other mode's flags, so that every flag has to be set.
    torch.backends.cuda.matmul.allow_tf32 = not expected["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = not expected["cudnn_allow_tf32"]
    torch.backends.cudnn.benchmark = False
    recorded = math_modes.set_math_mode(mode)
    assert tf32_now() == expected
    assert torch.backends.cudnn.benchmark  # autotuning in either mode (warm-up pays for it)
    assert {k: recorded[k] for k in expected} == expected  # what env.json records
    # The new API reads the same ("none": inherited from the generic default, IEEE).
    conv = ("tf32",) if expected["cudnn_allow_tf32"] else ("none", "ieee")
    assert recorded["fp32_precision"]["cudnn_conv"] in conv


def test_an_unknown_math_mode_is_refused(restore_math_flags, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown math mode 'tf32'; valid: torch, ieee"):
        math_modes.set_math_mode("tf32")
    with pytest.raises(UsageError, match="unknown math mode 'tf32'; valid: torch, ieee"):
        Measurement(math_mode="tf32")
    with pytest.raises(UsageError, match="unknown math mode"):
        Profile.from_dict({"math_mode": "fast"})
    assert Profile().measurement.math_mode == "torch"  # the default: PyTorch's own
    assert Profile.from_dict({"math_mode": "ieee"}).measurement.math_mode == "ieee"
    out = tmp_path / "out"
    code = commands.main(["run", "--profile", "smoke", "--strategies", "single",
                          "--math-mode", "tf32", "--dry-run", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "unknown math mode 'tf32'; valid: torch, ieee" in err
    assert not out.exists()


@pytest.mark.parametrize("mode", ["torch", "ieee"])
def test_the_worker_trains_in_the_cases_math_mode(monkeypatch, tmp_path, restore_math_flags,
                                                  mode):
    from bench_lib.launch import worker
    from bench_lib.launch.protocol import CaseSpec
    from bench_lib.sweep.cases import new_case

    class Timed(Exception):
        pass

    seen: list[dict[str, bool]] = []

    def spy(step: Any, devices: Any, **kwargs: Any) -> None:
        seen.append(tf32_now())  # the flags the timed steps would compute under
        raise Timed

    monkeypatch.setattr(worker, "measure_steps", spy)
    monkeypatch.setattr(worker, "pin_worker", lambda rig, index: None)  # the test's process
    rig = Rig("cpu", 1, 1, tuple(available_cores()[:1]))
    case = new_case(rig, "single", "toy", 0, 8, measurement=Measurement(math_mode=mode))
    flipped = {k: not v for k, v in math_modes.math_flags(mode).items()}
    torch.backends.cuda.matmul.allow_tf32 = flipped["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flipped["cudnn_allow_tf32"]
    with pytest.raises(Timed):
        worker.run_rank(CaseSpec(case, rig, trace=False), worker.RankPlace(0, 0), tmp_path)
    assert seen == [math_modes.math_flags(mode)]


def test_the_calibration_is_keyed_by_and_computes_in_the_math_mode():
    from bench_lib.prediction.calibration import CalibrationKey
    from bench_lib.prediction.calibration_file import _calibrations_of
    from bench_lib.sweep.cases import new_case

    rig = Rig("cpu", 1, 1, tuple(available_cores()[:1]))
    case = new_case(rig, "single", "toy", 0, 8, measurement=Measurement(math_mode="ieee"))
    assert CalibrationKey.of(case).math_mode == "ieee"
    # A calibration.json from before the mode was recorded was measured in IEEE fp32.
    old = {"calibrations": [{"key": {"model": "toy", "image_size": 0, "precision": "fp32",
                                     "loss": "mse"}, "failed": "x"}]}
    assert [k.math_mode for k in _calibrations_of(old)] == ["ieee"]


@pytest.mark.parametrize("mode", ["torch", "ieee"])
def test_the_peak_probe_receives_the_mode_and_probes_in_it(monkeypatch, cpu_rig,
                                                           restore_math_flags, mode):
    class Started(Exception):
        pass

    argv: list[str] = []

    def start_module(server: Any, module: str, args: list[str], *_: Any) -> Any:
        argv.extend(args)
        raise Started

    monkeypatch.setattr(flop_peak, "start_module", start_module)
    with pytest.raises(Started):
        flop_peak.measure_peak(cpu_rig, ["fp32"], min_time_s=0.0, math_mode=mode)
    # The probe process's entry point, on the arguments the runner gave it.
    seen: list[dict[str, bool]] = []

    def op() -> None:
        seen.append(tf32_now())
        torch.ones(16).sum()

    monkeypatch.setattr(flop_probe, "pin_worker", lambda rig, index: None)
    monkeypatch.setattr(flop_probe, "gemm_probe", lambda device, dtype, n: (op, 1))
    monkeypatch.setattr(flop_probe, "conv_probe", lambda device, dtype, shape, channels_last=False:
                        (op, 1))
    monkeypatch.setattr(flop_probe, "FileBarrier", lambda *a, **k: None)
    torch.backends.cudnn.allow_tf32 = mode == "ieee"  # the opposite of torch's default
    assert flop_probe.main(argv) == 0
    assert seen and all(flags == math_modes.math_flags(mode) for flags in seen)


def test_a_run_folder_from_before_the_choice_resumes_in_ieee(tmp_path, cpu_rig):
    import argparse

    from bench_lib.commands.plan import plan_resume
    from bench_lib.results.schema import SCHEMA_VERSION

    profile = Profile(strategies=("single",), models=("toy",)).as_dict()
    for recorded, expected in ((profile | {"math_mode": "torch"}, "torch"),
                               ({k: v for k, v in profile.items() if k != "math_mode"},
                                "ieee")):
        (tmp_path / "env.json").write_text(json.dumps(
            {"schema_version": SCHEMA_VERSION, "rig": cpu_rig.as_dict(), "profile": recorded}))
        args = argparse.Namespace(sweep_flags=(), resume=tmp_path, dry_run=True)
        _, resumed, cases = plan_resume(args)
        assert resumed.measurement.math_mode == expected
        assert {c.measurement.math_mode for c in cases} == {expected}


def _flip_math_flags(mode: str) -> None:
    """Set the TF32 flags opposite to ``mode``'s, so that a worker must set every one."""
    flipped = {k: not v for k, v in math_modes.math_flags(mode).items()}
    torch.backends.cuda.matmul.allow_tf32 = flipped["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flipped["cudnn_allow_tf32"]


@pytest.mark.parametrize("mode", ["torch", "ieee"])
def test_parity_trains_and_records_in_the_math_mode_asked_for(
        monkeypatch, tmp_path, cpu_rig, restore_math_flags, mode):
    """#28: parity had no --math-mode and its ranks always set torch's own flags."""
    from bench_lib.commands.parity import plan_of
    from bench_lib.commands.parser import build_parser
    from bench_lib.parity import check as parity_check
    from bench_lib.parity import launch as parity_launch
    from bench_lib.parity import train as parity_train
    from bench_lib.results.read import run_dirs_in

    specs: list[Any] = []

    def fake_launch(spec: Any, workdir: Any, processes: int, server: Any = None) -> Any:
        specs.append(spec)
        return [parity_train.EpochResult(0, 1.0, 0.3, 0.9, 0.1)], ""

    monkeypatch.setattr(parity_launch, "launch", fake_launch)
    args = build_parser().parse_args(["parity", "--models", "mlp", "--strategies",
                                      "single,ddp", "--math-mode", mode, "--out",
                                      str(tmp_path)])
    assert parity_check.run_parity(plan_of(args), cpu_rig, args.out) == 0
    assert specs and {s.math_mode for s in specs} == {mode}  # every run's ranks are told
    (run_dir,) = run_dirs_in(tmp_path)
    env = json.loads((run_dir / "env.json").read_text())
    assert {k: env["math_mode"][k] for k in IEEE} == math_modes.math_flags(mode)
    assert env["profile"]["parity"]["math_mode"] == mode
    # A rank sets the mode of its spec before it trains.
    seen: list[dict[str, bool]] = []

    def train(spec: Any, rank: int) -> list[Any]:
        seen.append(tf32_now())
        return []

    monkeypatch.setattr(parity_train, "pin_worker", lambda rig, index: None)  # the test's
    monkeypatch.setattr(parity_train, "train", train)
    spec_path = tmp_path / "rank" / "spec.json"
    spec_path.parent.mkdir()
    specs[0].write(spec_path)
    _flip_math_flags(mode)
    assert parity_train.main([str(spec_path), "0"]) == 0
    assert seen == [math_modes.math_flags(mode)]


@pytest.mark.parametrize("mode", ["torch", "ieee"])
def test_distance_computes_and_records_in_the_math_mode_asked_for(
        monkeypatch, tmp_path, cpu_rig, restore_math_flags, mode):
    """#28: distance had no --math-mode and its workers always set torch's own flags."""
    import contextlib

    from bench_lib.distance import benchmark as distance_benchmark
    from bench_lib.distance import worker as distance_worker
    from bench_lib.distance.spec import DistanceSpec
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.results.read import run_dirs_in

    class NoServer:  # no fork server started: no launch forks anything here
        @staticmethod
        def take(warm: Any) -> Any:
            return contextlib.nullcontext(None)

    specs: list[DistanceSpec] = []

    def fake_launch(spec: DistanceSpec, work_root: Any, server: Any = None) -> Any:
        specs.append(spec)
        return CaseOutcome("error", "not launched: a test"), None

    monkeypatch.setattr(distance_benchmark, "ForkServer", NoServer)
    monkeypatch.setattr(distance_benchmark, "launch", fake_launch)
    out = tmp_path / "out"
    code = commands.main(["distance", "--rig", "cpu", "--layers", "8x2x1x1", "--methods",
                          "blocked", "--launches", "1", "--math-mode", mode, "--out", str(out)])
    assert code == 1  # the fake's error row
    assert [s.measurement.math_mode for s in specs] == [mode]
    (run_dir,) = run_dirs_in(out)
    env = json.loads((run_dir / "env.json").read_text())
    assert {k: env["math_mode"][k] for k in IEEE} == math_modes.math_flags(mode)
    assert env["profile"]["distance"]["measurement"]["math_mode"] == mode
    # The spec a worker reads carries the mode, and the worker sets it before its steps.
    spec_path = tmp_path / "spec.json"
    specs[0].write(spec_path)
    spec = DistanceSpec.read(spec_path)
    assert spec.measurement.math_mode == mode

    class Built(Exception):
        pass

    seen: list[dict[str, bool]] = []

    def make_step(*args: Any) -> Any:
        seen.append(tf32_now())  # the flags the timed steps would compute under
        raise Built

    monkeypatch.setattr(distance_worker, "pin_worker", lambda rig, index: None)
    monkeypatch.setattr(distance_worker, "make_step", make_step)
    _flip_math_flags(mode)
    with pytest.raises(Built):
        distance_worker.run_rank(spec, 0, tmp_path)
    assert seen == [math_modes.math_flags(mode)]


@pytest.mark.parametrize("command", ["parity", "distance"])
def test_parity_and_distance_refuse_an_unknown_math_mode(tmp_path, capsys, command):
    with pytest.raises(SystemExit) as exit_:
        commands.main([command, "--rig", "cpu", "--math-mode", "tf32", "--out",
                       str(tmp_path / "out")])
    assert exit_.value.code == exit_codes.EXIT_USAGE
    assert "invalid choice: 'tf32'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
