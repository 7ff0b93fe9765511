"""Every label that names a run's devices (report captions, the runs table; gpu_check's
header reads the same ``results.read.devices_label``), on the first GPU run's folders: two
slots sharing one H100 are one card shared, never "2x" H100s."""

from __future__ import annotations

from typing import Any

from bench_lib.report.html import _runs_table
from bench_lib.report.runs import caption, load_runs
from bench_lib.results.read import devices_label, read_env
from tests.conftest import REPO

GPU_RUN = REPO / "tests" / "data" / "h100-2026-11-26"
H100 = "NVIDIA H100 80GB HBM3"


def test_two_slots_on_one_gpu_are_named_as_one_card_shared():
    env = read_env(GPU_RUN / "smoke-2slots")
    assert env["device_names"] == [H100, H100]  # a name per slot, as env.json records them
    shared = f"1x {H100} shared by 2 slots (validation mode)"
    assert devices_label(env) == shared
    line = caption("A", env)
    assert line.startswith(f"A: rig cuda:2slots-on-1gpu-validation on {shared}; CPU ")
    assert "2x" not in line
    runs = load_runs([GPU_RUN / "smoke-2slots"])
    table = _runs_table(runs.envs, runs.names, runs.swept)
    assert f"<td>{shared}</td>" in table and f"{H100}, {H100}" not in table


def test_one_gpu_and_real_gpus_are_counted_by_name():
    one = read_env(GPU_RUN / "smoke-1gpu")
    assert devices_label(one) == f"1x {H100}"
    assert f"rig cuda:1 on 1x {H100}; " in caption("A", one)

    def env(kind: str, names: list[str], slots: int = 1) -> dict[str, Any]:
        return {"rig": {"kind": kind, "num_devices": len(names), "gpu_slots": slots},
                "device_names": names}

    assert devices_label(env("cuda", [H100] * 8)) == f"8x {H100}"
    assert devices_label(env("cuda", ["A100", "A100", "H100"])) == "2x A100, 1x H100"
    assert devices_label(env("cuda", ["A100", "A100", "H100", "H100"], 2)) == (
        "1x A100, 1x H100 shared by 4 slots (2 per GPU, validation mode)")
    workers = ["cpu worker 0 (cores 0)", "cpu worker 1 (cores 1)"]
    assert devices_label(env("cpu", workers)) == ", ".join(workers)  # not "2x" one worker
    assert devices_label({"rig": {"kind": "cuda"}}) == "no device names"
