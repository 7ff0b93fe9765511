"""The strategy registry: one explicit dict, ``name -> Strategy``."""

from __future__ import annotations

from bench_lib.strategies import accum, ddp, dp, fsdp, mp, pipeline, schedules, single
from bench_lib.strategies.base import BuildContext, Microbatching, Strategy, Trainer

__all__ = ["REGISTRY", "BuildContext", "Microbatching", "Strategy", "Trainer", "get", "register"]

REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add a strategy; a duplicate name is a ValueError naming the known ones."""
    if strategy.name in REGISTRY:
        raise ValueError(
            f"strategy {strategy.name!r} is already registered; "
            f"known: {', '.join(sorted(REGISTRY))}"
        )
    REGISTRY[strategy.name] = strategy
    return strategy


def get(name: str) -> Strategy:
    """Look a strategy up; an unknown name is a ValueError naming the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; valid: {', '.join(sorted(REGISTRY))}"
        ) from None


for _module in (single, dp, ddp, mp, pipeline, accum, fsdp):
    register(_module.STRATEGY)
register(ddp.ONE_DEVICE)
for _strategy in schedules.STRATEGIES:
    register(_strategy)
