"""Ctrl-C in a process that runs torch itself: held inside a shield, raised as it ends
(``processes.interrupts``), never an abort. The whole run's exit codes under Ctrl-C at many
moments: tests/test_reliability.py."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator

import pytest

from bench_lib.prediction.kept_counts import CACHE_ENV
from bench_lib.processes import interrupts
from tests.conftest import PYTHON, REPO


@pytest.fixture
def caught() -> Iterator[None]:
    """SIGINT and SIGTERM caught as the runner catches them; put back after."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    interrupts.catch(signal.SIGINT, signal.SIGTERM)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def test_a_signal_outside_a_shield_raises_at_once(caught):
    for signum in (signal.SIGINT, signal.SIGTERM):
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signum)
            pytest.fail("not raised at once")


def test_a_signal_inside_a_shield_is_raised_as_the_outermost_one_ends(caught):
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.shielded():
            with interrupts.shielded():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)  # a second Ctrl-C: still one interrupt
                reached.append("inner")
            reached.append("outer")  # the inner shield's end does not raise
    assert reached == ["inner", "outer"]
    with interrupts.shielded():  # held once, raised once: the next shield is quiet
        reached.append("again")
    assert reached[-1] == "again"


def test_a_shield_is_a_decorator_too(caught):
    @interrupts.shielded()
    def work() -> str:
        signal.raise_signal(signal.SIGTERM)
        return "finished"

    with pytest.raises(KeyboardInterrupt):
        work()


def test_once_the_exit_code_is_kept_a_signal_changes_nothing(caught):
    interrupts.keep_exit_code()
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


# A Ctrl-C at each of the first Python calls of the runner's in-process torch work: the fake
# step of a memory prediction and a FLOP count. Unshielded, a Ctrl-C raised in a Python
# callback that torch's C++ called from a noexcept frame (autograd making a fresh parameter's
# AccumulateGrad) ended the process: "terminate called after throwing an instance of
# 'python_error'", SIGABRT; or one raised inside torch's mode stack left it corrupt.
CHILD = textwrap.dedent("""
    import signal, sys
    from bench_lib.measure import flops
    from bench_lib.processes import interrupts
    import bench_lib.prediction.memory
    from bench_lib.prediction import fake_step
    from bench_lib.rig import Rig
    from bench_lib.sweep.expansion import expand
    from bench_lib.sweep.profile import Profile

    interrupts.catch(signal.SIGINT)  # as the run command does
    rig = Rig("cpu", 2, 1, (0, 1))
    profile = Profile(strategies=("single",), models=("toy",), batch_sizes=(4,))
    (case,) = [c for c in expand(profile, rig) if c.status is None]

    def memory():
        fake_step.simulate.cache_clear()
        bench_lib.prediction.memory.predict(case, rig)

    def flop_count():
        flops.train_flops_per_image.cache_clear()
        flops.train_flops_per_image("toy", 32)

    calls, at = [0], [0]

    def tracer(frame, event, arg):
        if event == "call":
            calls[0] += 1
            if calls[0] == at[0]:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)

    for work in (memory, flop_count):
        work()  # warm: every later call runs the same code
        for k in range(1, CALLS):
            calls[0], at[0] = 0, k
            sys.settrace(tracer)
            try:
                work()
            except KeyboardInterrupt:
                pass
            else:
                sys.exit(f"{work.__name__}: no KeyboardInterrupt for a Ctrl-C at call {k}")
            finally:
                sys.settrace(None)
    print("every Ctrl-C raised")
""")


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_ctrl_c_at_any_call_of_the_runners_torch_work_is_raised_never_an_abort():
    # Nothing read from disk (prediction.kept_counts): each call counts on fake tensors.
    done = subprocess.run([PYTHON, "-c", CHILD.replace("CALLS", "300")], cwd=REPO,
                          env={**os.environ, CACHE_ENV: ""},
                          capture_output=True, text=True, timeout=110)
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every Ctrl-C raised" in done.stdout
