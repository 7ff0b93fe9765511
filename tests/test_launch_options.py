"""A launch's options travel as frozen values (#49): what the run decides once
(``case_launch.LaunchOptions``, ``runner.SweepOptions``, ``runner.SweepCallbacks``) and what
each launch's ranks are told (``protocol.CaseSpec``), not as loose parameters passed down by
hand. So no function from ``run_sweep`` to the worker takes more than ``MOST_PARAMETERS``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from bench_lib.launch import worker
from bench_lib.launch.protocol import CaseSpec
from bench_lib.nodes.coordination import Coordinator
from bench_lib.run import agent_launch, case_launch, follower_run, runner

MOST_PARAMETERS = 6

ON_THE_PATH: dict[str, Callable[..., Any]] = {
    "runner.run_sweep": runner.run_sweep,
    "runner._run_groups": runner._run_groups,
    "case_launch.run_case": case_launch.run_case,
    "case_launch._run_local": case_launch._run_local,
    "case_launch._run_torchrun": case_launch._run_torchrun,
    "agent_launch.run_agent": agent_launch.run_agent,
    "Coordinator.announce": Coordinator.announce,
    "follower_run.run_follower": follower_run.run_follower,
    "follower_run.follow_sweep": follower_run.follow_sweep,
    "follower_run._follow_launch": follower_run._follow_launch,
    "protocol.CaseSpec": CaseSpec,
    "worker.run_rank": worker.run_rank,
    "worker.main": worker.main,
}
"""Every function a launch passes through, from the sweep to the rank (a method counts
``self``)."""


@pytest.mark.parametrize("name", sorted(ON_THE_PATH))
def test_no_function_on_a_launch_s_path_takes_more_than_six_parameters(name):
    parameters = list(inspect.signature(ON_THE_PATH[name]).parameters)
    assert len(parameters) <= MOST_PARAMETERS, f"{name}({', '.join(parameters)})"


@pytest.mark.parametrize("kind", [case_launch.LaunchOptions, runner.SweepOptions,
                                  runner.SweepCallbacks, CaseSpec])
def test_the_values_a_launch_carries_are_frozen(kind):
    assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen
