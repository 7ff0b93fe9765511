"""Profiles and their expansion into cases."""

from __future__ import annotations

import pytest

from bench_lib.launch.protocol import CaseSpec, RankResult
from bench_lib.rig import Rig
from bench_lib.strategies import Microbatching
from bench_lib.sweep.expansion import baselines_first, expand
from bench_lib.sweep.profile import (
    Measurement,
    Profile,
    UsageError,
    load_profile,
    profile_names,
    profile_path,
)

RIG = Rig("cpu", 2, 1, (0, 1))


def test_expansion_is_the_product_with_splits_only_where_used():
    p = Profile(strategies=("single", "pipeline"), image_sizes=(32, 64), batch_sizes=(8,),
                split_sizes=(2, 4))
    cases = expand(p, RIG)
    assert [(c.strategy, c.image_size, c.split_size) for c in cases] == [
        ("single", 32, None), ("pipeline", 32, 2), ("pipeline", 32, 4),
        ("single", 64, None), ("pipeline", 64, 2), ("pipeline", 64, 4),
    ]
    assert len({c.case_id for c in cases}) == len(cases)


def test_combinations_some_cases_cannot_use_become_skipped_rows():
    p = Profile(strategies=("pipeline", "ddp", "dp"), batch_sizes=(32, 7, 120),
                split_sizes=(40,))
    cases = {c.case_id: c for c in expand(p, RIG)}
    skipped = {k: c.reason for k, c in cases.items() if c.status == "skipped"}
    assert "split size 40 is larger than batch size 32" in skipped.pop(
        "pipeline_resnet50_img128_b32_s40_fp32")
    assert "split size 40 is larger than batch size 7" in skipped.pop(
        "pipeline_resnet50_img128_b7_s40_fp32")
    assert "not divisible by world size 2" in skipped.pop("ddp_resnet50_img128_b7_s-_fp32")
    assert not skipped
    assert cases["dp_resnet50_img128_b32_s-_fp32"].status == "unsupported"
    assert cases["pipeline_resnet50_img128_b120_s40_fp32"].status is None


def test_shipped_profiles_load_and_expand():
    names = profile_names()
    assert {"default", "smoke", "tutorial"} <= set(names)
    for name in names:
        profile = load_profile(profile_path(name, RIG.kind))
        assert profile.description, f"profile {name} needs a description"
        assert expand(profile, RIG)


@pytest.mark.parametrize(
    "text,message",
    [
        ("strategies = ['single']\nimage_size = [64]\n", r"bad.toml: unknown key 'image_size'"),
        ("strategies = 'single'\n", r"bad.toml: key 'strategies' must be a list"),
        ("strategies = [\n", r"bad.toml: not valid TOML"),
        ("batch_sizes = ['eight']\n", r"bad.toml: batch_sizes must hold positive integers"),
    ],
)
def test_profile_errors_name_the_file_and_key(tmp_path, text, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(UsageError, match=message):
        load_profile(bad)


def test_cli_values_override_the_profile():
    p = Profile(image_sizes=(64,)).override(image_sizes=(128,), batch_sizes=None)
    assert p.image_sizes == (128,) and p.batch_sizes == Profile().batch_sizes


def test_each_workloads_single_case_runs_before_its_other_cases():
    p = Profile(strategies=("ddp", "pipeline", "single"), image_sizes=(32, 64),
                batch_sizes=(8,), split_sizes=(2,))
    order = [(c.image_size, c.strategy) for c in expand(p, RIG)]
    assert order == [(32, "single"), (32, "ddp"), (32, "pipeline"),
                     (64, "single"), (64, "ddp"), (64, "pipeline")]
    shuffled = list(reversed(expand(p, RIG)))
    assert [c.strategy for c in baselines_first(shuffled)][::3] == ["single", "single"]


def test_a_case_carries_its_resolved_facts():
    (ddp, pipeline) = expand(Profile(strategies=("ddp", "gpipe"), batch_sizes=(12,),
                                     split_sizes=(5,)), RIG)
    assert (ddp.world_size, ddp.processes, ddp.micro) == (2, 2, None)
    assert "gloo" in ddp.note
    assert pipeline.micro == Microbatching(5, 3, even=False)
    assert pipeline.status == "skipped" and "equal micro-batches" in pipeline.reason


def test_case_spec_and_rank_result_survive_their_json(tmp_path):
    profile = Profile(strategies=("1f1b",), microbatches=(4,), split_sizes=(),
                      partitions=("balanced",), measurement=Measurement(0, 3))
    (case,) = expand(profile, RIG)
    CaseSpec(case, RIG).write(tmp_path / "spec.json")
    back = CaseSpec.read(tmp_path / "spec.json")
    assert back == CaseSpec(case, RIG) and back.case.measurement == case.measurement
    result = RankResult(1, "ok", step_times_s=(0.5, 0.25), timed_window_unix_s=(1.0, 2.0),
                        stop_reason="step_cap", peak_mem_mib={"1": 12.5}, partition="balanced:9",
                        timeline=({"stage": 1, "phase": "fwd", "start_s": 0.0, "end_s": 1.0},))
    result.write(tmp_path / "rank1.json")
    assert RankResult.read(tmp_path / "rank1.json") == result
    with pytest.raises(ValueError, match="bad rank status"):
        RankResult(0, "fine")
