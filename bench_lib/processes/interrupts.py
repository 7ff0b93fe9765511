"""Ctrl-C (and a caught SIGTERM) as a ``KeyboardInterrupt`` on the main thread, held while
that thread runs torch code that calls back into Python (``shielded``), raised as it leaves.

Why: the runner runs some torch in its own process (``prediction.fake_step.simulate``'s fake
step and ``predict_memory._chosen_cut``'s cut, counted under ``FakeTensorMode``;
``measure.flops.count_train_flops`` under ``FlopCounterMode``). There torch's C++ calls
back into Python (a dispatch mode's ``__torch_dispatch__``, a fake tensor's device, a
weak reference's callback), and Python raises a pending Ctrl-C in whatever Python code
runs next. Raised in a callback that C++ called from a ``noexcept`` frame (torch 2.14:
``torch::autograd::InputMetadata``, as autograd makes a parameter's ``AccumulateGrad``
in its first forward), the exception becomes ``python_error`` (or pybind11's
``error_already_set``) thrown through that frame: ``std::terminate``, SIGABRT, exit -6
instead of 130 (issue #47; tests/test_interrupts.py raises the signal at each of the
first Python calls of a fake step). Held until the shield ends, it is raised in our own
Python frame, where it unwinds as any exception does.

A signal outside a shield raises at once, as Python's ``default_int_handler`` does.
Python runs signal handlers on the main thread only, so a shield counts there only.
Torch-free.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_depth = 0
"""How many shields the main thread is inside."""
_held = False
"""A signal came while shielded: raised as the outermost shield ends."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _held
    if _depth:
        _held = True
        return
    raise KeyboardInterrupt


def catch(*signums: int) -> None:
    """Each of ``signums`` raises ``KeyboardInterrupt`` on the main thread, held while it
    is ``shielded`` (main thread only, as ``signal.signal``)."""
    for signum in signums:
        signal.signal(signum, _on_signal)


def catching(signum: int) -> bool:
    """Whether ``signum`` is caught here (``catch``)."""
    return signal.getsignal(signum) is _on_signal


def keep_exit_code() -> None:
    """Once the process's exit code is decided: SIGINT and SIGTERM ignored, so that a late
    Ctrl-C cannot make the exit a death by signal (the interpreter's teardown puts SIGINT's
    default action back, which kills with -2), and CPython's mark of an unhandled
    ``KeyboardInterrupt`` cleared. CPython 3.11 sets that mark when a ``KeyboardInterrupt``
    leaves an ``exec`` of a string (dataclasses and namedtuples make their methods so, in
    every import), caught later or not, and ``python -m`` then ends by SIGINT (-2)
    whatever code it exits with; an ``exec`` of a string that completes clears it."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    exec("")  # clears the mark (above); runs nothing


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold a caught signal while the body runs (module docstring); raise it after.
    Nests; a decorator too (``@shielded()``)."""
    global _depth, _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _held:
            _held = False
            raise KeyboardInterrupt
