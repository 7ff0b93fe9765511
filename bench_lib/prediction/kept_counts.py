"""Counts made on fake tensors, kept on disk so that the next process reads them.

A run predicts each case's memory before it launches anything (``prediction.memory``): one
fake training step per process's program (``fake_step.simulate``) and, for a ``balanced``
cut, the blocks' FLOPs (``memory._chosen_cut``). They are pure functions of their arguments,
of this package's code and of torch's and torchvision's, yet cost about a second each on
a CPU (docs/prediction.md gives a run's figures), paid again by every run and every round
of a ``gate``.

``kept(kind, ...)`` keeps a function's results in ``<cache>/<kind>/<code>/<key>.json``:
``<cache>`` is ``$PARABENCH_CACHE_DIR`` (empty: nothing is kept on disk), else
``$XDG_CACHE_HOME/parabench``, else ``~/.cache/parabench``; ``<code>`` a hash of every source
file of ``bench_lib``, of torch's, torchvision's and Python's versions (``code_version``),
so that any change of code makes a new folder instead of reading an old count; ``<key>`` a
hash of the arguments' ``repr``, which the file also holds whole and which must match
before its value is used. The newest ``KEEP_VERSIONS`` code folders of a kind are kept, the
older ones removed. A file that cannot be read or parsed is counted again and rewritten; a
folder that cannot be written leaves the counts in the process alone. Writes go through a
temporary file and ``os.replace``, so processes that count the same thing at once (a
``gate``'s sides, a test suite's workers) each leave a whole file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

CACHE_ENV = "PARABENCH_CACHE_DIR"
KEEP_VERSIONS = 8
"""Code folders kept per kind: a ``gate``'s two trees and a few edits back."""
KEY_CHARS = 32

T = TypeVar("T")


def cache_root() -> Path | None:
    """The folder counts are kept under, or None where ``$PARABENCH_CACHE_DIR`` is empty."""
    given = os.environ.get(CACHE_ENV)
    if given is not None:
        return Path(given) if given else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "parabench"


@functools.cache
def code_version() -> str:
    """A hash of the code a count depends on: ``bench_lib``'s sources (every ``.py`` file,
    by path and content) and the versions of torch, torchvision and Python."""
    import torch
    import torchvision

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for text in (torch.__version__, torchvision.__version__, sys.version):
        h.update(text.encode() + b"\0")
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:KEY_CHARS]


def _folder(kind: str) -> Path | None:
    """This code's folder for ``kind``, made and marked as just used, the older code
    folders beyond ``KEEP_VERSIONS`` removed; None where there is none to write."""
    root = cache_root()
    if root is None:
        return None
    folder = root / kind / code_version()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.utime(folder)
        versions = sorted((p for p in folder.parent.iterdir() if p.is_dir()),
                          key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for old in versions[KEEP_VERSIONS:]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _read(path: Path, key: str, decode: Callable[[Any], T]) -> T | None:
    """The value kept at ``path`` for ``key``; None where there is none, or it is damaged
    or for another key."""
    try:
        kept = json.loads(path.read_text())
        if kept["key"] != key:
            return None
        return decode(kept["value"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _write(path: Path, key: str, value: Any) -> None:
    """Keep ``value`` for ``key`` at ``path``, whole or not at all. A temporary file of
    its own (not ``results.store.write_json_atomic``'s one name): two processes may keep
    the same count at once."""
    tmp = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp",
                                         delete=False) as f:
            tmp = f.name
            json.dump({"key": key, "value": value}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def kept(kind: str, encode: Callable[[T], Any],
         decode: Callable[[Any], T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A decorator: the function's result for its positional arguments read from disk
    where this code has kept it (module docstring), else computed and kept. ``encode``
    makes the result JSON's, ``decode`` makes it back and raises on what it cannot."""
    def wrap(count: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(count)
        def read_or_count(*args: Any) -> T:
            folder = _folder(kind)
            if folder is None:
                return count(*args)
            key = repr(args)
            path = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:KEY_CHARS]}.json"
            found = _read(path, key, decode)
            if found is not None:
                return found
            value = count(*args)
            _write(path, key, encode(value))
            return value
        return read_or_count
    return wrap
