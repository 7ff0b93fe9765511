"""What a ``gate`` is asked to do: ``GatePlan`` (the flags' values, typed, as the command
built it), the defaults its flags show, and the refusals that need nothing but the plan
(exit 2 before git or any side is touched): too few rounds, a threshold or metric that is
none, a malformed ``--head-env``, run flags the gate sets itself, an output folder that
does not exist."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROUNDS = 5
DEFAULT_STEPS = ("--warmup-steps", "2", "--timed-steps", "6")
"""Each launch's steps unless the run flags say otherwise. Taking turns, the pairs of every
round are pooled, so each timed step counts; the rounds guard against what a round's
launches share, and each costs its start and its warm-up (about 30 s of a 65-s round on 2
cores): 5 rounds of 6 pairs keep a ``ci`` gate near 6 minutes (302-430 s over ten gates).
Ten or eleven steps a launch would reach intervals of about 2%, at about 30 s a gate for
each pair more (docs/ci-gate.md, "What 2% costs")."""
MIN_ROUNDS = 2
DEFAULT_THRESHOLD_PCT = 2.5
"""Over 24 gates re-judged at the default 5 rounds of 6 pairs (2 Intel Xeon cores,
docs/ci-gate.md): the 48 A/A cases' estimates spread 0.97% (SD), so an unchanged case reads
over 2.5% about 0.5% of the time (about 2% a gate of four; at 2%, about 7.5%); 12 of 12
A/A gates passed and 11 of 12 with a planted 3% failed (at 3%: 9 of 12)."""
DEFAULT_PROFILE = "ci"
DEFAULT_OUT = Path("results/gates")
METRICS = ("step_time", "speedup", "auto")
GATE_SETS = ("--launches", "--out", "--quiet", "--resume", "--shard", "--dry-run",
             "--report", "--compare-to", "--save-baseline", "--profile", "--calibration")
"""``run`` flags the gate sets itself (``--profile`` is the gate's own flag)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class GateError(ValueError):
    """Input the gate refuses, or a side that could not be measured: exit 2."""


@dataclass(frozen=True)
class GatePlan:
    """A ``gate`` as its flags ask for it (``bench_lib.commands.gate`` builds it); checked
    by ``check`` when the gate starts, so that a refusal is said as the gate's others are."""

    base_ref: str
    """``--base``: the commit to compare against."""
    head_ref: str | None = None
    """``--head``: the commit to judge; None: the working tree as it is when the gate starts."""
    head_env: tuple[str, ...] = ()
    """``--head-env``: ``NAME=VALUE`` strings, set on the head's side only."""
    profile: str = DEFAULT_PROFILE
    """The sweep both sides run: a profile's name or a ``.toml`` path."""
    rounds: int = DEFAULT_ROUNDS
    """Rounds of base and head, one launch per case each (at least ``MIN_ROUNDS``)."""
    threshold_pct: float = DEFAULT_THRESHOLD_PCT
    """The smallest change in percent that counts."""
    metric: str = "step_time"
    """What decides a verdict (``METRICS``)."""
    out: Path = DEFAULT_OUT
    """The folder that receives the gate folder."""
    run_args: tuple[str, ...] = ()
    """The flags after ``--``, for each side's ``run`` (a leading ``--`` is dropped)."""
    markdown: Path | None = None
    """Where to write the Markdown for a pull-request comment too."""
    json_path: Path | None = None
    """Where to write github-action-benchmark's ``customBiggerIsBetter`` JSON."""
    apart: bool = False
    """``--apart``: run the sides one after the other in every round, even where both
    could run at once taking turns (``bench_lib.gate.rounds``)."""


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``NAME=VALUE`` strings as a mapping; GateError on a malformed one."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not ENV_NAME.fullmatch(name):
            raise GateError(f"--head-env {item!r}: expected NAME=VALUE, NAME a variable name")
        out[name] = value
    return out


def check_run_args(run_args: Sequence[str]) -> list[str]:
    """The flags after ``--``, for each side's ``run``; GateError on one the gate sets."""
    args = list(run_args)
    if args[:1] == ["--"]:
        args = args[1:]
    flags = {arg.split("=", 1)[0] for arg in args}
    if taken := sorted(flags & set(GATE_SETS)):
        raise GateError(f"{', '.join(taken)} is set by the gate itself; drop it from the run "
                        f"flags (the gate's own: --profile, --rounds, --out)")
    steps = [] if flags & {"--warmup-steps", "--timed-steps"} else list(DEFAULT_STEPS)
    return steps + args


def check(plan: GatePlan) -> tuple[dict[str, str], list[str]]:
    """The plan's refusals (GateError), in the order they are said; the head's variables
    (``parse_env``) and each side's run flags (``check_run_args``)."""
    if plan.rounds < MIN_ROUNDS:
        raise GateError(f"--rounds must be at least {MIN_ROUNDS} (an interval over rounds "
                        f"needs 2), got {plan.rounds}")
    if not (plan.threshold_pct >= 0 and math.isfinite(plan.threshold_pct)):
        raise GateError(f"--threshold-pct must be a percentage >= 0, got {plan.threshold_pct}")
    if plan.metric not in METRICS:
        raise GateError(f"unknown metric {plan.metric!r}; valid: {', '.join(METRICS)}")
    head_env = parse_env(plan.head_env)
    run_args = check_run_args(plan.run_args)
    for flag, path in (("--markdown", plan.markdown), ("--json", plan.json_path)):
        if path is not None and not path.resolve().parent.is_dir():
            raise GateError(f"{flag} {path}: its folder {path.resolve().parent} does not "
                            "exist (checked now, not after the measurement)")
    return head_env, run_args
