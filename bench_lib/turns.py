"""Turns: the same-job gate's two sides take turns, step by step, on the same devices.

A gate's base and head, run one after the other, meet the machine at different moments: on
2 Intel Xeon cores two launches of the same code, one after the other on one core, differed
by 11.8% (SD of the log ratio of their medians over 10 rounds; docs/methodology.md, "What
the noise is made of"). Run at the same moment on disjoint cores (duet benchmarking) they
differ as much, for each core's speed moves on its own there. Run at the same moment on the
**same** core, taking turns step by step, the two sides meet the same core in the same
second: the median of their steps' paired log ratios spread 1.5% over the same rounds
(``benchmarks/duet_aa.py``).

So where the gate runs both sides at once (``gate.rounds``), it sets ``TURNS_DIR_ENV`` (a
folder both sides share, one per round) and ``TURNS_SIDE_ENV`` (``base`` or ``head``) on
each. Every rank then meets the rank of the same case and slot on the other side
(``Turns.meet``, a Unix socket in that folder) and the two alternate steps, warm-up and timed
alike, in the order A B B A A B B A ... (A: the base), so that a drift within a launch
hits both alike. A rank waits for its turn in a blocking read: it takes no CPU from the one
stepping. The ranks of a multi-process case each take turns with their counterpart; the
side's collectives keep its own ranks together, so the turns of every slot agree.

A side that ends its steps says so, and the other goes on alone; at the end each waits
(bounded) for the other to end too, so that neither side's next case starts beside the
other's steps (a rank whose steps failed does not wait: its result is not held back). A
counterpart that never comes (the other side's case failed or is missing) is waited for
``MEET_TIMEOUT_S``; one that stops answering, ``TURN_TIMEOUT_S``; then the rank steps
alone. Torch-free.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

TURNS_DIR_ENV = "PARABENCH_TURNS_DIR"
TURNS_SIDE_ENV = "PARABENCH_TURNS_SIDE"
FIRST, SECOND = "base", "head"
"""The sides' names, as the gate names them (``gate.sides.SIDES``): the base steps first."""
MEET_TIMEOUT_S = 120.0
"""How long a rank waits for its counterpart to arrive: the two sides' runs start together,
but one may reach a case later by a calibration, a process start or a failed case."""
TURN_TIMEOUT_S = 300.0
"""How long a rank waits for its counterpart's step (or its end): past it, the counterpart
hung or died without closing, and this rank steps alone."""
STEP, END = b"s", b"e"


def owner(turn: int) -> str:
    """Whose turn ``turn`` is: A B B A A B B A ... (A: ``FIRST``)."""
    return FIRST if turn % 4 in (0, 3) else SECOND


def socket_path(folder: Path, key: str) -> Path:
    """The meeting point of ``key``'s two ranks in ``folder``: short, for a Unix socket's
    path is at most 107 bytes."""
    return folder / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".sock")


class Turns:
    """One rank's turns with its counterpart on the other side: call ``before`` before each
    step, ``after`` after it (its time read), ``close`` once the steps are done."""

    def __init__(self, side: str, conn: socket.socket | None,
                 turn_timeout_s: float = TURN_TIMEOUT_S) -> None:
        if side not in (FIRST, SECOND):
            raise ValueError(f"{TURNS_SIDE_ENV}={side!r}: {FIRST} or {SECOND}")
        self.side = side
        self.conn = conn
        self.turn = 0
        self.peer_done = conn is None
        self.met = conn is not None
        """Whether the counterpart came: the steps alternated with its."""
        if conn is not None:
            conn.settimeout(turn_timeout_s)

    @classmethod
    def meet(cls, folder: Path, side: str, key: str,
             timeout_s: float = MEET_TIMEOUT_S,
             turn_timeout_s: float = TURN_TIMEOUT_S) -> Turns:
        """Meet ``key``'s counterpart in ``folder``: the first to come listens, the second
        connects. Waits up to ``timeout_s``; alone past it (``met`` False)."""
        path = socket_path(folder, key)
        deadline = time.monotonic() + timeout_s
        while True:
            conn = _connect(path)
            if conn is not None:
                return cls(side, conn, turn_timeout_s)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(str(path))
            except OSError as e:
                listener.close()
                if e.errno != errno.EADDRINUSE:
                    raise
                if time.monotonic() > deadline:
                    return cls(side, None, turn_timeout_s)
                time.sleep(0.05)  # the other is binding or accepting: connect again
                continue
            try:
                listener.listen(1)
                listener.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    return cls(side, None, turn_timeout_s)
                conn.setblocking(True)
                return cls(side, conn, turn_timeout_s)
            finally:
                listener.close()
                path.unlink(missing_ok=True)

    def _hear(self) -> None:
        """Read one word of the counterpart's: its step, its end, or silence (alone)."""
        assert self.conn is not None
        try:
            word = self.conn.recv(1)
        except OSError:  # a timeout (it hung) or a reset (it died)
            word = b""
        if word == STEP:
            self.turn += 1
        else:  # END, or the connection gone
            self.peer_done = True

    def before(self) -> None:
        """Wait (blocking, no CPU) until this side's turn, or the counterpart's end."""
        while not self.peer_done and owner(self.turn) != self.side:
            self._hear()

    def after(self) -> None:
        """This side's step is done: the turn passes on."""
        self.turn += 1
        if not self.peer_done:
            self._say(STEP)

    def close(self, wait: bool = True) -> None:
        """Say this side is done, then, where ``wait``, wait (up to the turn timeout) for
        the counterpart to be done too. A rank whose steps failed does not wait: its result
        and its exit are not held back by the other side's steps."""
        if self.conn is None:
            return
        self._say(END)
        while wait and not self.peer_done:
            self._hear()
        self.conn.close()
        self.conn = None

    def _say(self, word: bytes) -> None:
        assert self.conn is not None
        try:
            self.conn.sendall(word)
        except OSError:
            self.peer_done = True


def _connect(path: Path) -> socket.socket | None:
    """A connection to a counterpart listening at ``path``; None where none listens."""
    if not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn
    except (FileNotFoundError, ConnectionRefusedError):
        # Gone, or bound and not listening yet: ``meet`` tries again. (A file left by a rank
        # killed between the two is never removed here: removing a live one would part the
        # pair; the folder is the round's own, and the wait ends at the timeout.)
        conn.close()
        return None


def requested_side(environ: Mapping[str, str] | None = None) -> str | None:
    """The gate's side whose turns this process's ranks take (``TURNS_SIDE_ENV``), where
    the gate asked for turns (both variables set); None otherwise."""
    environ = os.environ if environ is None else environ
    side = environ.get(TURNS_SIDE_ENV)
    return side if side and environ.get(TURNS_DIR_ENV) else None


def from_env(key: str, environ: Mapping[str, str] | None = None) -> Turns | None:
    """The turns ``key``'s rank takes where the gate asked for them (``requested_side``);
    None otherwise."""
    environ = os.environ if environ is None else environ
    side = requested_side(environ)
    return None if side is None else Turns.meet(Path(environ[TURNS_DIR_ENV]), side, key)
