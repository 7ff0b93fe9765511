"""The DDP knobs (``strategies.ddp_knobs.DdpKnobs``): planning, rows, and what each does to
gradients.

Transparency, as ``test_transparency.py`` (float64, BatchNorm in eval mode, 2 gloo ranks):

- bucket size, gradients as bucket views and static graph leave the arithmetic alone: the
  gradients equal single's to ~1e-12, on the first step and on the second (where bucket
  views and the static graph's rebuilt buckets are in use).
- fp16 / bf16 compression rounds: rank r puts fl(a_r) / W into the all-reduce (a_r its
  local gradient, W ranks, dividing by 2 is exact) and the ranks' shares are summed in that
  format. Each element of the result is then off the exact mean by at most
  u x mean_r |a_r| (rounding each share) + u x |their sum| (rounding the sum)
  <= 2u(1 + u) x mean_r |a_r|, u the format's unit roundoff (2^-11 fp16, 2^-8 bf16); fp16
  adds up to 2^-25 absolute per rounding where a value falls below its normal range
  (2^-14), W + 1 roundings in all. The test holds each element to that bound, and checks
  the hook did round (some element off by more than float64 noise).
- PowerSGD is not claimed equal to single. What holds: before ``POWERSGD_START_ITER`` it
  all-reduces exactly; after, every rank applies identical gradients, each compressed
  matrix has rank <= r, they differ from the exact ones, and training on them still lowers
  the loss.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from bench_lib import commands, strategies
from bench_lib.commands.plan import profile_overrides
from bench_lib.launch.protocol import CaseOutcome, CaseSpec
from bench_lib.prediction.duration import case_seconds
from bench_lib.results.schema import ADDED_CASE_COLUMNS, CASE_COLUMNS
from bench_lib.rig import Rig
from bench_lib.rig_detection import detect_rig
from bench_lib.rows.rows import case_row
from bench_lib.run.case_launch import LaunchOptions, run_case
from bench_lib.strategies import BuildContext
from bench_lib.strategies.ddp_knobs import (
    COMM_HOOKS,
    KNOB_GRIDS,
    POWERSGD_GLOO_NOTE,
    POWERSGD_START_ITER,
    POWERSGD_WARMUP_STEPS,
    UNIT_ROUNDOFF,
    DdpKnobs,
    knob_grid,
)
from bench_lib.sweep.cases import Case, new_case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import (
    PROFILE_DIR,
    Measurement,
    Profile,
    UsageError,
    load_profile,
)
from bench_lib.workloads import Workload
from tests.dist_harness import run_ranks
from tests.reference import BATCH, reference_grads, reference_model, reference_shard

RIG = Rig("cpu", 2, 1, (0, 1))
TINY = Workload("resnet-tiny", image_size=32, batch_size=BATCH, num_classes=10)


# --- the knobs and their grid ---------------------------------------------------------------


@pytest.mark.parametrize("kwargs,named", [
    ({"bucket_cap_mb": 0}, "0"), ({"bucket_cap_mb": -5.0}, "-5.0"),
    ({"bucket_cap_mb": float("nan")}, "nan"), ({"bucket_cap_mb": True}, "True"),
    ({"gradient_as_bucket_view": "yes"}, "'yes'"), ({"static_graph": 1}, "1"),
    ({"comm_hook": "int8"}, "'int8'"), ({"powersgd_rank": 0}, "0"),
    ({"powersgd_rank": 2.5}, "2.5"),
])
def test_a_bad_knob_is_refused_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=named):
        DdpKnobs(**kwargs)


def test_default_knobs_add_nothing_to_the_id_and_others_say_what_they_are():
    assert DdpKnobs().id_suffix == "" and DdpKnobs().arithmetic_note == ""
    knobs = DdpKnobs(100, True, True, "powersgd", 4)
    assert knobs.id_suffix == "_bucket100_gradview_static_powersgd-r4"
    assert DdpKnobs(comm_hook="fp16", powersgd_rank=4).hook_label == "fp16"
    assert DdpKnobs(bucket_cap_mb=25).id_suffix == "_bucket25", "25 given is not the default"
    for hook in ("fp16", "bf16", "powersgd"):
        assert "not equal to single's" in DdpKnobs(comm_hook=hook).arithmetic_note
    assert set(COMM_HOOKS) == {"none", "fp16", "bf16", "powersgd"}


def test_the_product_grid_crosses_every_list_and_powersgd_once_per_rank():
    grid = knob_grid((None, 100.0), (False, True), (False,), ("none", "fp16", "powersgd"),
                     (1, 4), "product")
    assert len(grid) == 2 * 2 * 1 * (2 + 2)  # none, fp16, powersgd-r1, powersgd-r4
    assert len(set(grid)) == len(grid)
    assert DdpKnobs(100.0, True, False, "powersgd", 4) in grid


def test_one_at_a_time_varies_each_knob_alone_from_the_first_values():
    grid = knob_grid((None, 100.0), (False, True), (False, True),
                     ("none", "fp16", "bf16", "powersgd"), (1, 2), "one-at-a-time")
    base = DdpKnobs()
    assert grid[0] == base
    assert grid[1:] == (
        DdpKnobs(bucket_cap_mb=100.0), DdpKnobs(gradient_as_bucket_view=True),
        DdpKnobs(static_graph=True), DdpKnobs(comm_hook="fp16"), DdpKnobs(comm_hook="bf16"),
        DdpKnobs(comm_hook="powersgd", powersgd_rank=1),
        DdpKnobs(comm_hook="powersgd", powersgd_rank=2))
    with pytest.raises(ValueError, match="'diagonal'.*product, one-at-a-time"):
        knob_grid(grid="diagonal")
    assert KNOB_GRIDS == ("product", "one-at-a-time")


# --- planning: profile, CLI, cases ----------------------------------------------------------


def test_default_profiles_plan_todays_cases_with_torch_default_knobs():
    cases = expand(Profile(strategies=("single", "ddp", "mp")), RIG)
    assert [c.case_id for c in cases] == [
        "single_resnet50_img128_b32_s-_fp32", "ddp_resnet50_img128_b32_s-_fp32",
        "mp_resnet50_img128_b32_s-_fp32"]
    by = {c.strategy: c for c in cases}
    assert by["ddp"].ddp == DdpKnobs() and by["single"].ddp is None and by["mp"].ddp is None


def test_knob_lists_multiply_ddp_cases_only():
    profile = Profile(strategies=("single", "ddp", "ddp-1", "pipeline"), split_sizes=(8,),
                      ddp_bucket_cap_mb=(None, 50.0), ddp_comm_hooks=("none", "bf16"))
    cases = expand(profile, RIG)
    count = {s: sum(c.strategy == s for c in cases) for s in profile.strategies}
    assert count == {"single": 1, "ddp": 4, "ddp-1": 4, "pipeline": 1}
    bf16 = next(c for c in cases if c.case_id == "ddp_resnet50_img128_b32_s-_fp32_bucket50_bf16")
    assert bf16.ddp == DdpKnobs(50.0, comm_hook="bf16")
    assert "bf16-compressed gradient all-reduce" in bf16.note


def test_ddp_1_is_one_process_in_a_group_beside_single():
    single, one = (new_case(RIG, s, "resnet50", 64, 16) for s in ("single", "ddp-1"))
    assert (one.world_size, one.process_group, one.processes) == (1, True, 1)
    assert one.workload_key == single.workload_key, "its speedup is against single"
    assert one.status is None and "DDP's own cost" in one.note


def test_a_powersgd_case_warms_up_past_its_first_compressed_step():
    m = Measurement(warmup_steps=1)
    ps = new_case(RIG, "ddp", "resnet50", 64, 16, ddp=DdpKnobs(comm_hook="powersgd"),
                  measurement=m)
    plain = new_case(RIG, "ddp", "resnet50", 64, 16, measurement=m)
    assert ps.measurement.warmup_steps == POWERSGD_WARMUP_STEPS == POWERSGD_START_ITER + 1
    assert plain.measurement.warmup_steps == 1
    assert case_seconds(ps, RIG) > case_seconds(plain, RIG)
    # Over gloo its buckets run in order (powersgd_in_order), and the note says what it costs.
    assert POWERSGD_GLOO_NOTE in ps.note and POWERSGD_GLOO_NOTE not in plain.note
    gpus = detect_rig("cuda", 2, plan_only=True)
    on_nccl = new_case(gpus, "ddp", "resnet50", 64, 16, ddp=DdpKnobs(comm_hook="powersgd"))
    assert "PowerSGD rank 1" in on_nccl.note and POWERSGD_GLOO_NOTE not in on_nccl.note


def test_bf16_is_unsupported_where_torch_would_refuse_its_hook(monkeypatch):
    knobs = DdpKnobs(comm_hook="bf16")
    assert new_case(RIG, "ddp", "resnet50", 64, 16, ddp=knobs).status is None  # this build
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    case = new_case(RIG, "ddp", "resnet50", 64, 16, ddp=knobs)
    assert case.status == "unsupported" and "bf16_compress_hook needs a torch built" in case.reason
    assert new_case(RIG, "ddp", "resnet50", 64, 16, ddp=DdpKnobs(comm_hook="fp16")).status is None


@pytest.mark.parametrize("changes,message", [
    ({"ddp_comm_hooks": ("none", "int8")}, "unknown ddp comm hook 'int8'"),
    ({"ddp_knob_grid": "diagonal"}, "unknown ddp knob grid 'diagonal'"),
    ({"ddp_bucket_cap_mb": ("big",)}, "'big'"),
    ({"ddp_bucket_cap_mb": ()}, "bucket_cap_mb needs at least one value"),
    ({"ddp_powersgd_rank": (0,)}, "powersgd_rank must be a positive integer, got 0"),
    ({"ddp_static_graph": ("maybe",)}, "static_graph must be true or false, got 'maybe'"),
])
def test_bad_knob_lists_are_usage_errors(changes, message):
    with pytest.raises(UsageError, match=message):
        Profile(**changes)


def test_cli_flags_override_the_profile_and_round_trip_through_env_json():
    args = commands.build_parser().parse_args([
        "run", "--profile", "ddp-knobs", "--ddp-bucket-caps-mib", "default,10",
        "--ddp-comm-hooks", "none,powersgd", "--ddp-powersgd-ranks", "2",
        "--ddp-gradient-as-bucket-view", "false", "--ddp-static-graph", "off",
        "--ddp-knob-grid", "product"])
    profile = load_profile(PROFILE_DIR / "ddp-knobs.toml").override(
        **profile_overrides(args))
    assert profile.ddp_bucket_cap_mb == (None, 10.0)
    assert profile.ddp_knob_sets == knob_grid((None, 10.0), (False,), (False,),
                                              ("none", "powersgd"), (2,), "product")
    assert profile.as_dict()["ddp_bucket_cap_mb"] == ["default", 10.0]
    assert Profile.from_dict(profile.as_dict()) == profile  # env.json -> --resume


@pytest.mark.parametrize("flag,value", [("--ddp-gradient-as-bucket-view", "sometimes"),
                                        ("--ddp-bucket-caps-mib", "lots")])
def test_a_flag_value_that_does_not_parse_exits_2(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        commands.build_parser().parse_args(["run", flag, value])
    assert e.value.code == 2 and repr(value) in capsys.readouterr().err


def test_the_ddp_knobs_profile_varies_each_knob_alone_within_its_budget():
    profile = load_profile(PROFILE_DIR / "ddp-knobs.toml")
    cases = expand(profile, RIG)
    assert [c.strategy for c in cases].count("single") == 1
    suffixes = {c.ddp.id_suffix for c in cases if c.strategy == "ddp" and c.ddp}
    assert suffixes == {"", "_bucket100", "_gradview", "_static", "_fp16", "_bf16",
                        "_powersgd-r1"}
    assert all(c.status is None for c in cases) and cases[0].strategy == "single"
    assert {c.image_size for c in cases} == {64}
    assert sum(case_seconds(c, RIG) for c in cases) < 8 * 60


def test_spec_json_carries_the_knobs(tmp_path):
    case = new_case(RIG, "ddp", "resnet-tiny", 32, 4,
                    ddp=DdpKnobs(1.5, True, True, "powersgd", 3))
    CaseSpec(case, RIG).write(tmp_path / "spec.json")
    assert CaseSpec.read(tmp_path / "spec.json").case == case
    plain = new_case(RIG, "single", "resnet-tiny", 32, 4)
    assert Case.from_dict(plain.as_dict()) == plain


def test_rows_record_the_knobs_of_ddp_cases_and_the_hook_in_the_note():
    fp16 = new_case(RIG, "ddp", "resnet-tiny", 32, 4,
                    ddp=DdpKnobs(bucket_cap_mb=100, comm_hook="fp16"))
    row = case_row(fp16, RIG, CaseOutcome("skipped"))
    assert (row["ddp_bucket_cap_mb"], row["ddp_gradient_as_bucket_view"],
            row["ddp_static_graph"], row["ddp_comm_hook"]) == ("100", 0, 0, "fp16")
    assert "fp16-compressed gradient all-reduce: gradients not equal" in row["note"]
    one = case_row(new_case(RIG, "ddp-1", "resnet-tiny", 32, 4), RIG, CaseOutcome("skipped"))
    assert one["ddp_bucket_cap_mb"] == "default" and one["ddp_comm_hook"] == "none"
    single = case_row(new_case(RIG, "single", "resnet-tiny", 32, 4), RIG, CaseOutcome("error"))
    assert not any(k.startswith("ddp_") for k in single)
    cols = ["ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view", "ddp_static_graph",
            "ddp_comm_hook"]
    assert set(cols) <= set(CASE_COLUMNS) and set(cols) <= set(ADDED_CASE_COLUMNS)


# --- transparency on 2 gloo ranks -----------------------------------------------------------


def _trainer(rank: int, world_size: int, knobs: DdpKnobs) -> strategies.Trainer:
    return strategies.get("ddp").build(
        reference_model(TINY), [torch.device("cpu")],
        BuildContext(TINY, rank=rank, world_size=world_size, ddp=knobs))


def _grads(trainer: strategies.Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.parameters_in_order()]


def _two_steps_of_grads(rank: int, world_size: int, knob_sets: list[DdpKnobs],
                        ) -> list[tuple[list[torch.Tensor], list[torch.Tensor], bool]]:
    """Per knob set: the gradients of two backward passes (cleared between as the trainer
    does, no optimizer step, so both should equal single's) and whether the gradients
    stayed in the same memory (bucket views zeroed in place)."""
    torch.set_num_threads(1)
    out = []
    for knobs in knob_sets:
        trainer = _trainer(rank, world_size, knobs)
        x, y = reference_shard(TINY, rank, world_size)
        steps = []
        for _ in range(2):
            trainer.zero_grad()  # type: ignore[attr-defined]
            trainer.forward_backward(x, y)
            steps.append(_grads(trainer))
            pointers = [p.grad.data_ptr() for p in trainer.parameters_in_order()]
        trainer.zero_grad()  # type: ignore[attr-defined]
        kept = all(p.grad is not None and p.grad.data_ptr() == q
                   for p, q in zip(trainer.parameters_in_order(), pointers))
        out.append((steps[0], steps[1], kept))
    return out


KEEPING = [DdpKnobs(bucket_cap_mb=0.01), DdpKnobs(gradient_as_bucket_view=True),
           DdpKnobs(static_graph=True), DdpKnobs(0.01, True, True)]


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_bucket_size_bucket_views_and_static_graph_keep_gradients_equal_to_single():
    per_rank = run_ranks(_two_steps_of_grads, world_size=2, args=(KEEPING,))
    reference = reference_grads(TINY)
    for rank, results in enumerate(per_rank):
        for knobs, (first, second, kept) in zip(KEEPING, results):
            for step in (first, second):
                assert len(step) == len(reference)
                for i, (g, r) in enumerate(zip(step, reference)):
                    torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12,
                                               msg=f"rank {rank} {knobs} parameter {i}")
            # Bucket views are zeroed in place: the gradients stay where the buckets are.
            assert kept == knobs.gradient_as_bucket_view, knobs


def _compressed_and_local(rank: int, world_size: int, hooks: list[str],
                          ) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per hook: the all-reduced gradients and this rank's own (its shard alone, no DDP)."""
    torch.set_num_threads(1)
    x, y = reference_shard(TINY, rank, world_size)
    local = reference_model(TINY)
    TINY.loss_fn()(local(x), y).backward()
    mine = [p.grad.clone() for p in local.parameters()]
    out = {}
    for hook in hooks:
        trainer = _trainer(rank, world_size, DdpKnobs(comm_hook=hook))
        trainer.forward_backward(x, y)
        out[hook] = (_grads(trainer), mine)
    return out


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_fp16_and_bf16_hooks_stay_within_their_rounding_bound():
    world = 2
    per_rank = run_ranks(_compressed_and_local, world_size=world, args=(["fp16", "bf16"],))
    reference = reference_grads(TINY)
    for hook, u in UNIT_ROUNDOFF.items():
        got = per_rank[0][hook][0]
        locals_ = [r[hook][1] for r in per_rank]
        worst = 0.0
        for i, g in enumerate(got):
            assert torch.equal(g, per_rank[1][hook][0][i]), "every rank applies the same"
            mean_abs = sum(lr[i].abs() for lr in locals_) / world
            # The exact mean of the ranks' local gradients is single's gradient.
            torch.testing.assert_close(sum(lr[i] for lr in locals_) / world, reference[i],
                                       rtol=1e-9, atol=1e-12)
            subnormal = (world + 1) * 2.0**-25 if hook == "fp16" else 0.0
            bound = 2 * u * (1 + u) * mean_abs + subnormal
            err = (g - reference[i]).abs()
            assert (err <= bound).all(), (
                f"{hook} parameter {i}: error {err.max():.3g} over bound "
                f"{bound.flatten()[err.argmax()]:.3g}")
            worst = max(worst, float((err / (mean_abs + 1e-30)).max()))
        # It did round: some element is off by more than float64 arithmetic could be.
        assert worst > 1e-3 * u, f"{hook}: gradients equal to float64's; hook not applied?"


def _powersgd_run(rank: int, world_size: int, r: int) -> dict[str, object]:
    torch.set_num_threads(1)
    # Small buckets: many of them, each one's all-reduces issued in bucket order on gloo.
    trainer = _trainer(rank, world_size,
                       DdpKnobs(bucket_cap_mb=1, comm_hook="powersgd", powersgd_rank=r))
    x, y = reference_shard(TINY, rank, world_size)
    grads = []
    for _ in range(POWERSGD_START_ITER + 1):  # parameters unchanged: same exact gradients
        trainer.zero_grad()  # type: ignore[attr-defined]
        trainer.forward_backward(x, y)
        grads.append(_grads(trainer))
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.05  # a visible change in a few steps
    losses = []
    for _ in range(4):
        trainer.zero_grad()  # type: ignore[attr-defined]
        losses.append(float(trainer.forward_backward(x, y)))
        trainer.optimizer.step()
    return {"grads": grads, "losses": losses}


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_powersgd_is_exact_before_it_starts_then_low_rank_and_still_trains():
    rank_r = 1
    per_rank = run_ranks(_powersgd_run, world_size=2, args=(rank_r,))
    reference = reference_grads(TINY)
    exact, compressed = per_rank[0]["grads"][:POWERSGD_START_ITER], per_rank[0]["grads"][-1]
    for step in exact:
        for g, ref in zip(step, reference):
            torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-12)
    low_rank = 0
    for i, (g, ref) in enumerate(zip(compressed, reference)):
        assert torch.equal(g, per_rank[1]["grads"][-1][i]), f"ranks differ at parameter {i}"
        n, m = g.shape[0], g.numel() // g.shape[0]
        if (n + m) * rank_r * 2 < n * m:  # torch compresses it (min compression rate 2)
            low_rank += 1
            assert torch.linalg.matrix_rank(g.reshape(n, m)) <= rank_r, f"parameter {i}"
            assert not torch.allclose(g, ref, rtol=1e-3), f"parameter {i} not approximated"
    assert low_rank >= 10, "resnet-tiny's convolutions and classifier are compressed"
    for rank in per_rank:
        losses = rank["losses"]
        assert losses[-1] < losses[0], f"loss did not fall: {losses}"


def _powersgd_where_cuda_is_visible(rank: int, world_size: int) -> dict[str, object]:
    """A cpu rig's PowerSGD rank on a box that sees a GPU: ``torch.cuda.is_available`` is
    all torch's hook asks (``ddp.tolerate_powersgd_on_cpu``), so it is faked here."""
    torch.set_num_threads(1)
    torch.cuda.is_available = lambda: True
    trainer = _trainer(rank, world_size, DdpKnobs(comm_hook="powersgd", powersgd_rank=1))
    x, y = reference_shard(TINY, rank, world_size)
    for _ in range(POWERSGD_START_ITER + 1):  # the last step compresses, then decompresses
        trainer.zero_grad()  # type: ignore[attr-defined]
        trainer.forward_backward(x, y)
    return {"grads": _grads(trainer)}


@pytest.mark.compat
@pytest.mark.timeout(300)
@pytest.mark.integration
def test_powersgd_reduces_cpu_buckets_on_a_box_that_sees_a_gpu():
    # torch's hook synchronizes the bucket's device whenever CUDA is available, a CPU one
    # too; on the H100 box the cpu rig's PowerSGD failed with "Expected a cuda device".
    per_rank = run_ranks(_powersgd_where_cuda_is_visible, world_size=2)
    for a, b in zip(per_rank[0]["grads"], per_rank[1]["grads"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()


# --- through the runner ---------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.integration
def test_a_knobbed_ddp_case_runs_through_the_worker(tmp_path, forks):
    m = Measurement(warmup_steps=1, timed_steps=2, max_time_s=30, case_timeout_s=120,
                    interval_target_pct=0)
    case = new_case(RIG, "ddp", "resnet-tiny", 32, 4, measurement=m,
                    ddp=DdpKnobs(0.5, True, True, "powersgd", 2))
    assert case.status is None, case.reason
    outcome = run_case(CaseSpec(case, RIG), tmp_path, options=LaunchOptions(server=forks))
    assert outcome.status == "ok", outcome.reason
    row = case_row(case, RIG, outcome)
    assert row["warmup_steps"] >= POWERSGD_WARMUP_STEPS
    assert row["ddp_comm_hook"] == "powersgd-r2" and "PowerSGD rank 2" in row["note"]
    assert POWERSGD_GLOO_NOTE in row["note"]
    # The no_sync steps after the timed ones ran (static graph, bucket views and a hook
    # included) and gave the bound its compute part, the slowest rank's.
    assert outcome.compute_step_s is not None and 0 < outcome.compute_step_s < 30
    assert dataclasses.replace(case, ddp=DdpKnobs()).case_id == "ddp_resnet-tiny_img32_b4_s-_fp32"


def test_compute_only_steps_time_a_quiet_step_and_raise_on_failure():
    """``diagnostics.compute_only``: the median of its steps where the strategy has a quiet mode,
    None where it has none; a step's failure is raised, for ``diagnostics.run_diagnostics`` to
    end the diagnostics with (a note: the timed steps are kept)."""
    import contextlib
    import types

    from bench_lib.launch import diagnostics

    calls: list[int] = []

    def trainer(quiet: bool, fail: bool = False) -> types.SimpleNamespace:
        def step(x, y):
            calls.append(1)
            if fail:
                raise RuntimeError("out of memory")
        return types.SimpleNamespace(
            devices=[torch.device("cpu")], step=step,
            without_communication=lambda: contextlib.nullcontext() if quiet else None)

    x = y = torch.zeros(1)
    seconds = diagnostics.compute_only(trainer(True), x, y, process_group=False)
    assert seconds is not None and seconds >= 0 and len(calls) == diagnostics.COMPUTE_ONLY_STEPS
    assert diagnostics.compute_only(trainer(False), x, y, process_group=False) is None
    with pytest.raises(RuntimeError, match="out of memory"):
        diagnostics.compute_only(trainer(True, fail=True), x, y, process_group=False)


def test_sync_batch_norm_has_no_communication_free_steps():
    """DDP's ``no_sync`` stops the gradient all-reduce, not SyncBatchNorm's all-gather of
    statistics in the forward: the compute-only steps would still communicate (and a rank
    failing in them would leave its peers blocked before their timed result is written), so
    a DDP model with SyncBatchNorm says it has no such mode (#28 item 5)."""
    import types

    from bench_lib.strategies.ddp import DdpTrainer

    synced = types.SimpleNamespace(module=nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4)))
    assert DdpTrainer.without_communication(synced) is None  # type: ignore[arg-type]
