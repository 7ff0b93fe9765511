"""Planning GPU sweeps without GPUs: what torch would refuse is skipped, odd GPU counts plan,
default-cuda fits a 24 GB card, and a dry run for N GPUs touches no GPU (issue #14)."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed import pipelining as pp
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from bench_lib import commands, exit_codes, strategies
from bench_lib.prediction.duration import (
    SAVED_MIB_PER_IMAGE_224PX,
    fits_card,
    single_device_mib,
)
from bench_lib.rig import Rig
from bench_lib.strategies import schedules
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import (
    PROFILE_DIR,
    Profile,
    UsageError,
    load_profile,
    profile_names,
)
from bench_lib.sweep.refusals import PIPELINING_STAGES_PER_RANK, schedule_refusal
from bench_lib.workloads import MODELS, blocks

GPU_COUNTS = (1, 2, 4, 7, 8)
SHIPPED = sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))
SCHEDULE_CLASSES = {
    "gpipe": pp.ScheduleGPipe,
    "1f1b": pp.Schedule1F1B,
    "interleaved-1f1b": pp.ScheduleInterleaved1F1B,
    "interleaved-zb": pp.ScheduleInterleavedZeroBubble,
    "zbv": pp.ScheduleZBVZeroBubble,
}


@functools.cache
def torch_refuses(strategy: str, ranks: int, microbatches: int) -> str | None:
    """What torch's own schedule constructor says to this schedule over ``ranks`` ranks and
    ``microbatches`` micro-batches (mock stages, as torch's schedule visualizer builds them),
    or None when it builds."""
    try:
        get_schedule_ops(SCHEDULE_CLASSES[strategy], ranks, microbatches,
                         PIPELINING_STAGES_PER_RANK[strategy])
    except (ValueError, RuntimeError, AssertionError) as e:
        return str(e) or type(e).__name__
    return None


@functools.cache
def model_blocks(model: str) -> int:
    return len(blocks(MODELS[model].build(10)))


def test_the_table_of_stages_covers_every_pipelining_strategy():
    assert set(PIPELINING_STAGES_PER_RANK) == {s.name for s in schedules.STRATEGIES}
    assert set(SCHEDULE_CLASSES) == set(PIPELINING_STAGES_PER_RANK)


@pytest.mark.parametrize("strategy", sorted(SCHEDULE_CLASSES))
@pytest.mark.integration
def test_schedule_rules_are_torchs_own(strategy):
    # Both ways: nothing refused that torch builds, nothing planned that torch refuses.
    for ranks in range(1, 9):
        if ranks * PIPELINING_STAGES_PER_RANK[strategy] > model_blocks("resnet50"):
            continue
        for m in range(1, 33):
            ours = schedule_refusal(strategy, "resnet50", ranks, m)
            theirs = torch_refuses(strategy, ranks, m)
            assert (ours is None) == (theirs is None), (strategy, ranks, m, ours, theirs)


def test_a_schedule_needs_a_block_per_stage():
    assert schedule_refusal("gpipe", "resnet50", 16, 16) is None  # 16 stages, 18 blocks
    reason = schedule_refusal("interleaved-1f1b", "resnet50", 16, 32)
    assert reason and "32 stages" in reason and "only 18 blocks" in reason
    assert schedule_refusal("zbv", "resnet-tiny", 4, 8)  # 8 stages, 6 blocks


@pytest.mark.parametrize("gpus", GPU_COUNTS)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_plan_nothing_torch_would_refuse(name, gpus):
    rig = Rig("cuda", gpus)
    cases = expand(load_profile(PROFILE_DIR / f"{name}.toml"), rig)
    assert any(c.status is None for c in cases)
    for case in cases:
        strat = strategies.get(case.strategy)
        if case.status is not None:
            assert case.reason, case.case_id
            continue
        if strat.data_parallel:
            assert case.batch_size % case.world_size == 0, case.case_id
        if case.strategy in PIPELINING_STAGES_PER_RANK:
            assert case.micro is not None and case.micro.even
            stages = case.world_size * PIPELINING_STAGES_PER_RANK[case.strategy]
            assert stages <= model_blocks(case.model), case.case_id
            refusal = torch_refuses(case.strategy, case.world_size, case.micro.count)
            assert refusal is None, (case.case_id, refusal)


def test_default_cuda_on_4_and_8_gpus_skips_1f1b_with_fewer_microbatches_than_stages():
    profile = load_profile(PROFILE_DIR / "default-cuda.toml")
    for gpus in (4, 8):
        short = [c for c in expand(profile, Rig("cuda", gpus))
                 if c.strategy == "1f1b" and c.num_microbatches < gpus]
        assert short and all(c.status == "skipped" for c in short)
        assert all("at least as many micro-batches as stages" in c.reason for c in short)


def test_seven_gpus_give_skipped_rows_with_a_reason_not_a_refused_sweep():
    # Weak scaling is one flag away from the default (--scaling strong,weak): asked for here.
    profile = dataclasses.replace(load_profile(PROFILE_DIR / "default-cuda.toml"),
                                  scaling=("strong", "weak"))
    cases = expand(profile, Rig("cuda", 7))
    data_parallel = [c for c in cases if c.strategy in ("ddp", "fsdp")]
    strong = [c for c in data_parallel if c.scaling == "strong"]
    assert strong and all(c.status == "skipped" for c in strong)
    assert all("not divisible by world size 7" in c.reason for c in strong)
    # Under weak scaling each GPU gets the batch: 7 x 120 runs.
    weak = [c for c in data_parallel if c.scaling == "weak"]
    assert weak and all(c.status is None and c.batch_size % 7 == 0 for c in weak)
    # Pipelining splits micro-batches, not the batch over ranks: 120 on 7 GPUs runs.
    assert any(c.strategy == "gpipe" and c.status is None for c in cases)
    assert all(c.status is None for c in cases if c.strategy in ("single", "mp", "dp"))
    # A sweep in which nothing else could run stays a usage error.
    with pytest.raises(UsageError, match="divisible by ddp's world size 7"):
        expand(Profile(strategies=("ddp", "fsdp"), batch_sizes=(120,)), Rig("cuda", 7))


@pytest.fixture
def cuda_untouchable(monkeypatch):
    """Any question to CUDA or NVML fails the test, but whether CUDA is available (the
    memory prediction's FakeTensorMode asks, to avoid initialising a device): no."""
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run asked CUDA/NVML")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("device_count", "get_device_name", "get_device_properties",
                 "init", "mem_get_info", "set_device"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(pynvml, "nvmlInit", refuse)


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_dry_run_plans_every_profile_for_n_gpus_without_touching_cuda(
        gpus, tmp_path, capsys, cuda_untouchable):
    out = tmp_path / "out"
    for name in profile_names():  # "default" is default-cuda on a cuda rig
        code = commands.main(["run", "--dry-run", "--rig", "cuda", "--devices", str(gpus),
                         "--profile", name, "--out", str(out)])
        captured = capsys.readouterr()
        assert code == exit_codes.EXIT_OK, (name, captured.err)
        assert f"on rig cuda:{gpus}; estimated duration" in captured.out, name
    assert not out.exists()


def test_dry_run_for_7_gpus_lists_skipped_rows_with_their_reason(tmp_path, capsys,
                                                                 cuda_untouchable):
    code = commands.main(["run", "--dry-run", "--rig", "cuda", "--devices", "7",
                     "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert code == exit_codes.EXIT_OK
    row = next(line for line in text.splitlines()
               if line.startswith("ddp_resnet50_img128_b120_s-_fp32 "))
    assert "skipped" in row and "batch size 120 is not divisible by world size 7" in row


@pytest.mark.integration
def test_dry_run_shows_each_case_predicted_peak_and_what_a_cap_refuses(tmp_path, capsys,
                                                                      cuda_untouchable):
    """The dry run predicts as the run would (no device read: a planned rig), so a user sees
    which cases fit before renting the GPUs."""
    args = ["run", "--dry-run", "--rig", "cuda", "--devices", "2", "--strategies",
            "single,gpipe", "--image-sizes", "224", "--batch-sizes", "64", "--split-sizes",
            "16", "--scaling", "strong", "--predict-memory", "--out", str(tmp_path / "out")]
    assert commands.main(args) == exit_codes.EXIT_OK
    text = capsys.readouterr().out
    single = next(line for line in text.splitlines() if line.startswith("single_"))
    gpipe = next(line for line in text.splitlines() if line.startswith("gpipe_"))
    (peak,) = [int(v) for v in re.findall(r"\b0:(\d+)\b", single)]
    assert 2000 < peak < 20000, single  # ResNet50, 64 images of 224 px: GiBs, not MiBs
    assert re.search(r"0:\d+;1:\d+", gpipe), gpipe  # one figure per device
    assert "memory not predicted" not in text
    assert "device memory not read in a dry run" in text
    capped = f"{peak - 1}MiB"
    assert commands.main([*args, "--max-memory-per-device", capped]) == exit_codes.EXIT_OK
    text = capsys.readouterr().out
    single = next(line for line in text.splitlines() if line.startswith("single_"))
    # Refused by the allocator's reserved segments, which hold its peak and more.
    reserved = re.search(rf"predicted: (\d+) MiB reserved > {peak - 1} MiB", single)
    assert " oom " in single and reserved and int(reserved.group(1)) > peak, single
    planned, to_run = map(int, re.search(r"(\d+) cases \((\d+) to run\)", text).groups())
    assert to_run == planned - 1  # all but the refused one
    assert not (tmp_path / "out").exists()
    assert commands.main(["run", "--predict-memory", "--out", str(tmp_path / "out")]) == \
        exit_codes.EXIT_USAGE
    assert "--predict-memory goes with --dry-run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_real_cuda_run_without_gpus_exits_2_with_a_clear_message(tmp_path, capsys,
                                                                   visible_gpus):
    visible_gpus(0)  # a machine without GPUs, whatever this one has
    out = tmp_path / "out"
    code = commands.main(["run", "--rig", "cuda", "--devices", "2", "--profile", "smoke",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == exit_codes.EXIT_USAGE
    assert err.startswith("error: --rig cuda asked for, but no CUDA GPU is visible")
    assert "--dry-run --devices N" in err  # says how to plan without GPUs instead
    assert not out.exists()
    # A plan needs a GPU count when there are no GPUs to count.
    code = commands.main(["run", "--dry-run", "--rig", "cuda", "--out", str(out)])
    assert code == exit_codes.EXIT_USAGE and "give --devices N" in capsys.readouterr().err


def _saved_mib_per_image(model_name: str, image_size: int) -> float:
    """MiB autograd keeps for backward of one image (fp32, CPU), weights excluded."""
    torch.manual_seed(0)
    model = MODELS[model_name].build(1000).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, 3, image_size, image_size)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x), torch.zeros(1, dtype=torch.long))
    return sum(saved.values()) / 2**20


@pytest.mark.parametrize("model", sorted(SAVED_MIB_PER_IMAGE_224PX))
@pytest.mark.integration
def test_the_activation_figure_is_torchs_saved_tensors(model):
    # At 224 px itself: BatchNorm's per-channel statistics and the head do not scale with
    # the pixels, so a count at a smaller size scaled up would overstate it.
    counted = _saved_mib_per_image(model, 224)
    assert counted == pytest.approx(SAVED_MIB_PER_IMAGE_224PX[model], rel=0.02)


def test_default_cuda_fits_a_24gb_card_at_every_image_size():
    profile = load_profile(PROFILE_DIR / "default-cuda.toml")
    for size in profile.image_sizes:
        for batch in profile.batch_sizes_for(size):
            assert fits_card("resnet50", size, batch, 24), (size, batch)
            # Splits stay meaningful for each batch: every count cuts it into equal parts.
            assert all(batch % m == 0 for m in profile.microbatches), (size, batch)
    # The figure behind it: batch 120 at 512 px is what issue #14 saw run out of memory.
    assert not fits_card("resnet50", 512, 120, 24)
    assert 60 * 1024 < single_device_mib("resnet50", 512, 120) < 75 * 1024
    # large-image keeps a size where only model parallelism fits such a card.
    large = load_profile(PROFILE_DIR / "large-image.toml")
    assert any(not fits_card("resnet50", size, batch, 24)
               for size in large.image_sizes for batch in large.batch_sizes_for(size))


def test_batch_sizes_by_image_size_replace_the_batch_at_their_size(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('strategies = ["single", "ddp"]\nimage_sizes = [64, 128]\n'
                    'batch_sizes = [32]\nbatch_sizes_by_image_size = { 128 = [8, 16] }\n')
    profile = load_profile(path)
    assert profile.batch_sizes_for(64) == (32,) and profile.batch_sizes_for(128) == (8, 16)
    cases = expand(profile, Rig("cpu", 2, 1, (0, 1)))
    assert sorted({(c.image_size, c.batch_size) for c in cases}) == [
        (64, 32), (128, 8), (128, 16)]
    # env.json keeps it (string keys, as JSON writes them) and --resume reads it back.
    assert Profile.from_dict(profile.as_dict()) == profile
    # --batch-sizes on the command line replaces it too.
    assert profile.override(batch_sizes=(4,)).batch_sizes_for(128) == (4,)


@pytest.mark.parametrize("table,message", [
    ("[512, 24]", "must be a table like"),
    ("{ big = [24] }", "image size 'big' is not a positive integer"),
    ("{ 512 = [] }", "image size 512 needs a list of positive batch sizes"),
    ("{ 512 = 24 }", "image size 512 needs a list of positive batch sizes"),
])
def test_a_bad_batch_table_names_the_file_and_the_key(tmp_path, table, message):
    path = tmp_path / "bad.toml"
    path.write_text(f"batch_sizes_by_image_size = {table}\n")
    with pytest.raises(UsageError, match=f"bad.toml: batch_sizes_by_image_size.*{message}"):
        load_profile(path)


def test_split_sizes_on_the_command_line_replace_the_profiles_counts(tmp_path, capsys,
                                                                     cuda_untouchable):
    code = commands.main(["run", "--dry-run", "--rig", "cuda", "--devices", "2",
                     "--strategies", "pipeline", "--image-sizes", "128", "--split-sizes", "30",
                     "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert code == exit_codes.EXIT_OK
    assert "pipeline_resnet50_img128_b120_s30_fp32" in text
    assert "_s60_" not in text  # the profile's count 2 is gone
