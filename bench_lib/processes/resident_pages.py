"""A forked process's resident memory read as a fresh interpreter's: the parent lists the
file pages (libraries, mapped files) in its page tables (``resident_file_ranges``), and the
child maps the same pages as its own (``mirror_resident``). The fork server
(``forkserver_process``) lists its pages once its imports are done, and each rank it forks
mirrors them before it runs. Linux's /proc; torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_POPULATE_READ = 22
"""Linux 5.14+: map a range's pages into the page tables as a read of each would."""
PAGEMAP_PRESENT = 1 << 63
"""/proc/self/pagemap: the page is in this process's page tables (readable unprivileged)."""


def resident_file_ranges(proc: Path = Path("/proc/self")) -> list[tuple[int, int]] | None:
    """The (address, length) runs of this process's file-backed mappings (libraries, mapped
    files) that are in its page tables, so counted in its resident set (``RssFile``); None
    where /proc cannot tell.

    Why: ``fork`` does not copy the page tables of a file mapping the parent never wrote
    (the kernel refaults such pages from the page cache on demand), so a forked rank starts
    with ~300 MiB less resident memory than a fresh interpreter that imported the same
    libraries (ResNet50 on a cpu rig: gross peak ~780 against ~1054 MiB), then faults in,
    during its steps, library pages a fresh rank counted before its baseline (net peak ~5%
    higher). ``mirror_resident`` in the child puts them back: its memory reads as a fresh
    rank's.
    """
    ranges: list[tuple[int, int]] = []
    try:
        with open(proc / "maps") as maps, open(proc / "pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split(maxsplit=5)
                # address perms offset dev inode path: a file has an inode; [vdso] and
                # the like have none, anonymous memory neither (fork copies it anyway).
                if len(fields) < 6 or fields[4] == "0" or fields[5].startswith("["):
                    continue
                low, high = (int(x, 16) for x in fields[0].split("-"))
                pages = (high - low) // PAGE
                pagemap.seek(low // PAGE * 8)
                entries = memoryview(pagemap.read(pages * 8)).cast("Q")
                start = None
                for i in range(len(entries)):
                    present = entries[i] & PAGEMAP_PRESENT
                    if present and start is None:
                        start = i
                    elif not present and start is not None:
                        ranges.append((low + start * PAGE, (i - start) * PAGE))
                        start = None
                if start is not None:
                    ranges.append((low + start * PAGE, (len(entries) - start) * PAGE))
    except (OSError, ValueError):
        return None
    return ranges


def mirror_resident(ranges: Sequence[tuple[int, int]]) -> None:
    """Map ``ranges`` (``resident_file_ranges`` of the parent) into this process's page
    tables: ``madvise(MADV_POPULATE_READ)``, or a read of one byte per page where the kernel
    is older than 5.14. Only pages already in the page cache: it reads no file."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, length in ranges:
        if libc.madvise(address, length, MADV_POPULATE_READ) != 0:
            for page in range(address, address + length, PAGE):
                ctypes.c_char.from_address(page).value  # noqa: B018  the read maps it

