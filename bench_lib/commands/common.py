"""What the commands share: argument types, the rig and sweep flag groups.

Torch-free to import: a flag group that names the registries' entries (strategies, models,
rig kinds, math modes) imports them as it is added, so that a command that only reads files
(``report``, ``compare``, ``merge``) never builds those flags and starts without torch
(``parser.build_parser`` builds the flags of the command asked for alone).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from bench_lib.rig import Rig
    from bench_lib.run.shard import Shard

SWEEP_GROUP = "sweep (flags > profile file > defaults; --resume takes them from the run folder)"
RIG_GROUP = "rig (detected; these override)"


class SweepFlag(NamedTuple):
    """A run flag that shapes the sweep (a profile key, ``--profile`` or a rig flag)."""

    flag: str
    dest: str
    takes_value: bool


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


_UNITS_MIB = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024**2}


def memory_mib(text: str) -> float:
    """``12GiB``, ``16G``, ``512MiB`` or ``512m`` -> MiB. A bare number is refused: ``12``
    meant as GiB would cap every case at 12 MiB and turn the sweep into ``oom`` rows."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if not t or t[-1] not in _UNITS_MIB:
            float(t)  # a number without its unit, or no number at all
            raise argparse.ArgumentTypeError(
                f"give the size's unit: {text}GiB or {text}MiB, not {text!r}")
        value, unit = float(t[:-1]), t[-1]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 12GiB or 512MiB, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory cap must be positive, got {text!r}")
    return value * _UNITS_MIB[unit]


def gpu_slots(args: argparse.Namespace) -> int:
    """``--gpu-slots``, 1 when not given (None, so that ``--resume`` can refuse it given)."""
    return 1 if args.gpu_slots is None else int(args.gpu_slots)


def rig_of(args: argparse.Namespace, plan_only: bool = False) -> Rig:
    """The rig the rig flags (``add_rig_args``) ask for, detected where they are silent;
    ``plan_only``: a dry run's, which asks no GPU anything (``rig_detection.detect_rig``)."""
    from bench_lib.rig_detection import detect_rig

    return detect_rig(args.rig, args.devices, args.threads_per_worker, plan_only=plan_only,
                      gpu_slots=gpu_slots(args))


def add_out(p: argparse.ArgumentParser | argparse._ArgumentGroup, made: str) -> None:
    """``--out``, the one meaning it has in every command: the folder that receives the new
    run folder, ``<UTC time>_<host>_<git sha7>_<made>``, and its ``latest-`` link."""
    link = made.split("-<", 1)[0]
    p.add_argument("--out", type=Path, default=Path("results"), metavar="DIR",
                   help=f"folder that receives the run folder (<UTC time>_<host>_<git sha7>_"
                        f"{made}) and its link latest-{link} (default: results)")


MATH_MODE_HELP = ("torch (PyTorch's defaults: TF32 in cuDNN convolutions on Ampere and later, "
                  "IEEE in cuBLAS matmuls) or ieee (TF32 off in both)")
"""What ``--math-mode``'s two values mean (``math_modes.MATH_MODES``), the same in every command."""


def add_math_mode(p: argparse.ArgumentParser, what: str) -> None:
    """``--math-mode`` of a command whose workers set it themselves (``math_modes.set_math_mode``)
    and whose env.json records it; ``what``: what computes in it."""
    from bench_lib.math_modes import DEFAULT_MATH_MODE, MATH_MODES

    p.add_argument("--math-mode", choices=MATH_MODES, default=DEFAULT_MATH_MODE,
                   metavar="torch|ieee",
                   help=f"fp32 arithmetic of {what}: {MATH_MODE_HELP} (default "
                        f"{DEFAULT_MATH_MODE})")


def str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


_BOOLS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}


def bool_list(text: str) -> tuple[bool, ...]:
    """``false,true`` (or on/off, 1/0) -> (False, True)."""
    try:
        values = tuple(_BOOLS[v.lower()] for v in str_list(text))
    except KeyError as e:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated true/false, got {e.args[0]!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one of true, false")
    return values


def bucket_caps(text: str) -> tuple[float | None, ...]:
    """``default,100`` -> (None, 100.0): DDP bucket caps in MiB, None for torch's."""
    try:
        values = tuple(None if v == "default" else float(v) for v in str_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated MiB or 'default', got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one bucket cap")
    return values


def shard_part(text: str) -> Shard:
    """``K/N`` -> ``Shard`` (argparse's type: bad input exits 2 with the form to use)."""
    from bench_lib.run.shard import Shard
    from bench_lib.sweep.profile import UsageError

    try:
        return Shard.parse(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_rig_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    from bench_lib.rig import RIG_KINDS

    g = p.add_argument_group(RIG_GROUP)
    return [
        g.add_argument("--rig", choices=RIG_KINDS, help="device kind (default: cuda if available)"),
        g.add_argument("--devices", type=int, metavar="N",
                       help="number of devices (GPUs or CPU workers)"),
        g.add_argument("--threads-per-worker", type=int, metavar="N",
                       help="intra-op threads per CPU worker"),
        g.add_argument("--gpu-slots", type=int, metavar="K",
                       help="validation only: K device slots per GPU, so that the multi-device "
                            "code paths run on fewer GPUs (e.g. --devices 2 --gpu-slots 2 on "
                            "one GPU; gloo between ranks; rows say they are no multi-GPU "
                            "measurement)"),
    ]


def add_sweep_args(run: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags that shape a sweep; every dest but ``profile_flag`` is a ``Profile`` key."""
    from bench_lib import strategies
    from bench_lib.sweep.profile import profile_names
    from bench_lib.workloads import MODELS

    g = run.add_argument_group(SWEEP_GROUP)
    add = g.add_argument
    return [
        add("--profile", dest="profile_flag", metavar="NAME|PATH",
            help=f"profile name ({', '.join(profile_names())}) or a .toml path (default: default)"),
        add("--strategies", type=str_list, metavar="NAME,...",
            help=f"comma-separated, from: {', '.join(sorted(strategies.REGISTRY))}"),
        add("--models", type=str_list, metavar="NAME,...",
            help=f"comma-separated, from: {', '.join(sorted(MODELS))}"),
        add("--image-sizes", type=int_list, metavar="PX,...", help="comma-separated pixel sizes"),
        add("--batch-sizes", type=int_list, metavar="N,...",
            help="global batch sizes, comma-separated"),
        add("--split-sizes", type=int_list, metavar="N,...",
            help="micro-batch sizes, comma-separated"),
        add("--microbatches", type=int_list, metavar="N,...",
            help="micro-batch counts, comma-separated (split = ceil(batch / count))"),
        add("--scaling", type=str_list, metavar="strong,weak",
            help="strong: each batch size split over a strategy's devices; weak: each "
                 "device gets the batch size (throughput compared with single at it)"),
        add("--precisions", type=str_list, metavar="fp32,bf16", help="fp32 and/or bf16"),
        add("--partitions", type=str_list, metavar="NAME,...",
            help="stage cuts, comma-separated: tutorial, balanced (profiled block times), "
                 "balanced-flops"),
        add("--channels-last", action="store_true", default=None,
            help="channels-last memory format for model and inputs"),
        add("--compile", action="store_true", default=None,
            help="torch.compile each strategy's modules"),
        add("--sync-bn", action="store_true", default=None,
            help="SyncBatchNorm in ddp/fsdp (GPU rigs only)"),
        add("--loss", metavar="ce|mse-onehot",
            help="the classifiers' loss (toy always trains with mse)"),
        add("--ddp-bucket-caps-mib", type=bucket_caps, dest="ddp_bucket_cap_mb",
            metavar="MIB,...",
            help="DDP bucket caps in MiB, comma-separated; 'default' is torch's (25 MiB after "
                 "a 1 MiB first bucket)"),
        add("--ddp-gradient-as-bucket-view", type=bool_list, metavar="false,true",
            help="DDP gradients as views into its buckets (zeroed in place), off and/or on"),
        add("--ddp-static-graph", type=bool_list, metavar="false,true",
            help="DDP static_graph, off and/or on"),
        add("--ddp-comm-hooks", type=str_list, metavar="HOOK,...",
            help="DDP communication hooks, comma-separated: none, fp16, bf16, powersgd "
                 "(fp16/bf16/powersgd change the gradients; the row's note says so)"),
        add("--ddp-powersgd-ranks", type=int_list, dest="ddp_powersgd_rank", metavar="R,...",
            help="PowerSGD approximation ranks, comma-separated"),
        add("--ddp-knob-grid", metavar="product|one-at-a-time",
            help="how the DDP knob lists combine: every combination (product), or each "
                 "list's first value and then each other value alone"),
        add("--launches", type=int, metavar="N",
            help="fresh launches per case, interleaved in rounds (intervals come from their "
                 "spread, so 1 gives none)"),
        add("--warmup-steps", type=int, metavar="N", help="warm-up steps per launch, at least"),
        add("--timed-steps", type=int, metavar="N",
            help="most timed steps per launch, unless --min-time-s needs more"),
        add("--min-time-s", type=float, metavar="S",
            help="time each launch for at least S seconds of steps, past its CI target and "
                 "--timed-steps (the profile's max_time_s stays the cap); unset: 3 on cuda "
                 "rigs, 0 on cpu (utilisation, power and energy need a 1 s window)"),
        add("--case-timeout-s", type=float, metavar="S",
            help="seconds before a case is killed and recorded as timeout"),
        add("--interval-target-pct", type=float, metavar="PCT",
            help="stop timing a launch once its median's 95%% confidence interval over its "
                 "own steps is narrower than this %% of it on each side (0: off)"),
        add("--sample-interval-ms", type=float, metavar="MS",
            help="utilisation/memory/power sampling interval"),
        add("--math-mode", metavar="torch|ieee",
            help=f"fp32 arithmetic of the cases, their calibration and the FLOP peak: "
                 f"{MATH_MODE_HELP}"),
        add("--max-memory-per-device", type=memory_mib, dest="max_memory_per_device_mib",
            metavar="SIZE",
            help="memory cap per device, e.g. 12GiB: a case above it is recorded as oom "
                 "(CPU workers: resident memory; GPUs: the caching allocator's limit only, "
                 "so the CUDA context and NCCL buffers come on top of it)"),
        add("--no-predict-skip", dest="predict_skip", action="store_false", default=None,
            help="launch a case even where its predicted peak memory exceeds a device's "
                 "memory (--max-memory-per-device, else a GPU's total memory); by default it "
                 "is recorded oom, reason 'predicted: ...', without being launched"),
    ]


def sweep_flags(actions: list[argparse.Action]) -> tuple[SweepFlag, ...]:
    """The ``SweepFlag`` of each action (a parser's ``sweep_flags`` default: the profile
    overrides and ``--resume``'s refusals both come from it)."""
    return tuple(SweepFlag(a.option_strings[0], a.dest, a.nargs != 0) for a in actions)
