"""The memory prediction against the first GPU run (tests/data/h100-2026-11-26: one H100
80GB, torch 2.11.0+cu130, cuDNN 9.19): each ok case predicted again from its row, on the rig
its env.json records, against the allocator's peaks it measured."""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

import pytest

from bench_lib.prediction import memory
from bench_lib.rig import Rig
from bench_lib.sweep.cases import new_case

EVIDENCE = Path(__file__).parent / "data" / "h100-2026-11-26"
FOLDERS = ("resnet50-224-single-accum", "smoke-1gpu", "smoke-2slots")


def _evidence() -> list[tuple[str, Rig, dict[str, str]]]:
    found = []
    for folder in FOLDERS:
        env = json.loads((EVIDENCE / folder / "env.json").read_text())
        with (EVIDENCE / folder / "cases.csv").open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
        found += [(folder, Rig.from_dict(env["rig"]), r) for r in rows]
    return found


@pytest.fixture(autouse=True)
def _torchs_default_cublas_workspace(monkeypatch):
    """As the evidence ran: a machine's own CUBLAS_WORKSPACE_CONFIG would change the
    prediction (``prediction.cuda_memory.cublas_workspace_bytes``), not what was measured."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


CASES = _evidence()
IDS = [f"{folder}:{row['case_id']}" for folder, _, row in CASES]


def _predicted(rig: Rig, row: dict[str, str]) -> memory.Prediction:
    return _prediction(rig, tuple(row.items()))


# Once per case and test process: both bounds below read the same prediction, and one of a
# ResNet50 at 224 px takes seconds (a prediction is a pure function of the case and rig).
@functools.cache
def _prediction(rig: Rig, items: tuple[tuple[str, str], ...]) -> memory.Prediction:
    row = dict(items)
    split = int(row["split_size"]) if row["split_size"] else None
    case = new_case(rig, row["strategy"], row["model"], int(row["image_size"]),
                    int(row["batch_size"]), row["precision"], split_size=split)
    return memory.predict(case, rig)


def test_the_evidence_holds_every_kind_of_case():
    """What the bounds below cover: 14 ok cases, at 64 and 224 px, fp32 and bf16, one
    process and several (ddp on NCCL and on gloo), slots sharing the GPU."""
    assert len(CASES) == 14
    assert {r["strategy"] for _, _, r in CASES} == {"single", "accum", "dp", "ddp", "mp",
                                                    "pipeline"}
    assert {r["precision"] for _, _, r in CASES} == {"fp32", "bf16"}


@pytest.mark.parametrize(("folder", "rig", "row"), CASES, ids=IDS)
def test_the_allocators_peak_is_predicted_within_5_percent_and_never_2_under(folder, rig,
                                                                              row):
    """The allocator's peak (``max_memory_allocated`` after warm-up) against the
    prediction: the bare count was 0.8-39% under it in every case. A one-process case
    on two slots of one GPU reads its one allocator under each slot's label: its
    prediction is the process's, under the joined label; the largest figures compare."""
    error = _predicted(rig, row).max_mib / float(row["peak_mem_mib_max"]) - 1
    assert -0.02 <= error <= 0.05, f"{error:+.1%}"


NCCL_DDP = "smoke-1gpu:ddp_resnet50_img64_b8_s-_fp32"


@pytest.mark.parametrize(("folder", "rig", "row"), [
    pytest.param(*c, marks=pytest.mark.xfail(
        strict=True, reason="DDP on NCCL reserved 498 MiB against 430 predicted (-14%): "
                            "more segments than its allocations need, unexplained"))
    if i == NCCL_DDP else c for c, i in zip(CASES, IDS)], ids=IDS)
def test_the_reserved_peak_is_predicted_within_6_percent(folder, rig, row):
    """What admission compares with a card's memory: ``max_memory_reserved``, 10-22% above
    the allocated peak on the evidence; replayed through the allocator's segments it comes
    within -4.5% and +5.6%, but for DDP on NCCL."""
    error = _predicted(rig, row).reserved_max_mib / float(row["peak_mem_reserved_mib_max"]) - 1
    assert abs(error) <= 0.06, f"{error:+.1%}"


PRE_HOPPER_SLACK_MIB = 2 * (32 - 8.125)
"""Two cuBLAS workspaces are predicted at Hopper's 32 MiB; before Hopper torch's default is
8 MiB + 128 KiB (``prediction.cuda_memory.CUBLAS_WORKSPACE_BYTES``): over by this much there."""


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_real_gpu_cases_peak_is_never_predicted_more_than_2_percent_under(precision, tmp_path):
    """The rule on any GPU this runs on: one real case's allocator peak against its
    prediction, never more than 2% under it (a prediction that admits a case must not be
    low), and within 5% over, plus two workspaces' difference on a GPU before Hopper."""
    from bench_lib.launch.protocol import CaseSpec
    from bench_lib.rig_detection import detect_rig
    from bench_lib.run.case_launch import run_case
    from bench_lib.sweep.profile import Measurement

    rig = detect_rig("cuda", 1)
    case = new_case(rig, "single", "resnet50", 64, 8, precision,
                    measurement=Measurement(warmup_steps=2, timed_steps=2, max_time_s=30))
    outcome = run_case(CaseSpec(case, rig, trace=False), tmp_path)
    assert outcome.status == "ok", outcome.reason
    measured = max(outcome.peak_mem_mib.values())
    predicted = memory.predict(case, rig).max_mib
    assert predicted >= 0.98 * measured
    assert predicted <= 1.05 * measured + PRE_HOPPER_SLACK_MIB
