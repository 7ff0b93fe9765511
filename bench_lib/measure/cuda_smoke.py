"""The pre-flight's CUDA smoke test, the child's side: CUDA started on one GPU, a small
matrix product and a convolution run there, synchronised and checked against the CPU's.

Why: every CUDA failure that is the machine's, not a case's, then stops the run in seconds
(exit 2, ``preflight_probes.cuda_smoke``) instead of making every case an error: a driver
too old for this torch's CUDA, a GPU the wheel has no kernels for (sm_70 under a CUDA 13
build), no GPU in a container, a GPU held by another process. On a one-GPU rig this is the only
pre-flight check that touches CUDA (the all-reduce needs two devices).

    python -m bench_lib.measure.cuda_smoke DEVICE RESULT_JSON [PARENT_PID]

DEVICE is ``cuda:N`` (``cpu`` runs the same code on the CPU: the tests' way through it).
The result (JSON): ``ok``, ``device``, and where CUDA could tell, ``name``, ``capability``
(``sm_90``), the wheel's ``arch_list`` and CUDA version, the ``error`` (first line) and any
warnings torch gave (its "not compatible with the current PyTorch installation").

With several devices (``cuda:0,cuda:1``) the child checks the copies between them instead
(``copy_check``, ``preflight_probes.peer_copy``): a known pattern each way and back, each
copy compared on the host; the result: ``ok``, ``copies``, ``corrupt`` (each wrong copy:
its path, dtype, way, wrong elements, first wrong index, checksums), ``error``.
Exit 0 when ok, 1 otherwise; 4 where PARENT_PID was gone before the child started.
"""

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in launch.worker)
from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if TYPE_CHECKING:
    import torch

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 3))

MATMUL_N = 256
TOLERANCE = 0.05
"""Absolute and relative: the GPU's figures against the CPU's (cuDNN may use TF32)."""

ADVICE: tuple[tuple[tuple[str, ...], str], ...] = (
    (("no kernel image is available", "not compatible with the current PyTorch installation",
      "cudaErrorNoKernelImageForDevice"),
     "this torch build has no kernels for the GPU (its compute capability is not in the "
     "wheel's arch list; CUDA 13 builds start at sm_75): install a torch build for an older "
     "CUDA that still covers it (https://pytorch.org/get-started/locally/), or use a newer GPU"),
    (("too old (found version", "driver version is insufficient", "Insufficient Driver",
      "cudaErrorInsufficientDriver"),
     "the NVIDIA driver is older than this torch's CUDA runtime needs: update the driver "
     "(nvidia-smi shows its version and the newest CUDA it supports), or install a torch "
     "build for the CUDA the driver supports"),
    (("Found no NVIDIA driver", "no CUDA-capable device is detected", "cudaErrorNoDevice"),
     "CUDA sees no GPU in this process: no driver loaded, a container started without its "
     "GPUs (docker run --gpus all), or CUDA_VISIBLE_DEVICES naming none"),
    (("busy or unavailable", "cudaErrorDevicesUnavailable"),
     "another process holds the GPU in exclusive-process compute mode (nvidia-smi -q -d "
     "COMPUTE shows the mode; nvidia-smi lists the processes)"),
    (("system not yet initialized", "cudaErrorSystemNotReady"),
     "on an NVSwitch machine (HGX, DGX) the fabric manager is not running: start "
     "nvidia-fabricmanager, of the driver's version"),
    (("forward compatibility was attempted on non supported HW",),
     "CUDA's forward-compatibility libraries (cuda-compat) are loaded on a GPU that does not "
     "support them: take them off LD_LIBRARY_PATH"),
    (("out of memory",),
     "another process holds the GPU's memory (nvidia-smi lists it): the cases would not get "
     "theirs"),
    (("ECC error", "uncorrectable ECC"),
     "the GPU reports memory errors: reset it (nvidia-smi -r) or take it out of service"),
)
"""(texts any of which names the failure, what to do about it), first match wins."""


def advice(text: str) -> str:
    """What to do about a CUDA failure whose text (error, warnings, log) is ``text``;
    empty where no known failure is named."""
    for needles, what in ADVICE:
        if any(n in text for n in needles):
            return what
    return ""


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def smoke_device(device_name: str) -> dict[str, Any]:
    """CUDA started on ``device_name`` (``cuda:N``; ``cpu`` runs the same code), a matrix
    product and a convolution run there, synchronised, and checked against the CPU's."""
    import torch

    from bench_lib.rig import synchronize

    device = torch.device(device_name)
    out: dict[str, Any] = {"device": device_name, "ok": False, "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda}
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if device.type == "cuda":
                out["arch_list"] = torch.cuda.get_arch_list()
                torch.cuda.set_device(device)  # the driver, the context: CUDA's start
                out["name"] = torch.cuda.get_device_name(device)
                major, minor = torch.cuda.get_device_capability(device)
                out["capability"] = f"sm_{major}{minor}"
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(MATMUL_N, MATMUL_N, generator=gen)
            x = torch.randn(2, 8, 16, 16, generator=gen)
            w = torch.randn(8, 8, 3, 3, generator=gen)
            product = a.to(device) @ a.to(device)
            conv = torch.nn.functional.conv2d(x.to(device), w.to(device), padding=1)
            synchronize([device])
            wrong = [what for what, got, want in (
                ("matrix product", product, a @ a),
                ("convolution", conv, torch.nn.functional.conv2d(x, w, padding=1)))
                if not torch.allclose(got.cpu(), want, rtol=TOLERANCE, atol=TOLERANCE)]
            if wrong:
                out["error"] = (f"wrong results ({', '.join(wrong)} differ from the CPU's): "
                                "the GPU computes garbage")
            else:
                out["ok"] = True
        except Exception as e:  # the failure is the result
            out["error"] = _first_line(e)
    out["warnings"] = [" ".join(str(w.message).split()) for w in caught]
    out["seconds"] = time.monotonic() - start
    return out


COPY_ELEMENTS = 2**20
"""Elements of each copied pattern: 4 MiB of int32, 1 MiB of uint8 (past the small-copy
paths, seconds in all)."""
COPY_WAYS = (".to()", "copy_(non_blocking=True)")
Move = Callable[["torch.Tensor", "torch.device", str], "torch.Tensor"]


def _patterns() -> dict[str, torch.Tensor]:
    """Known patterns on the host: int32 from a multiplicative hash of the index (every
    element distinct, no run of zeros), uint8 the index modulo 251 (not aligned to 256)."""
    import torch

    index = torch.arange(COPY_ELEMENTS, dtype=torch.int64)
    return {"int32": (index * 2654435761 % 2**32 - 2**31).to(torch.int32),
            "uint8": (index % 251).to(torch.uint8)}


def _move(tensor: torch.Tensor, device: torch.device, way: str) -> torch.Tensor:
    """``tensor`` copied to ``device`` one of ``COPY_WAYS``: a peer copy between GPUs."""
    import torch

    if way == ".to()":
        return tensor.to(device)
    return torch.empty_like(tensor, device=device).copy_(tensor, non_blocking=True)


def copy_check(device_names: Sequence[str], move: Move = _move) -> dict[str, Any]:
    """A known pattern copied from each device to each other and back, each of
    ``COPY_WAYS``, every copy checked element by element on the host: a peer copy that
    corrupts without an error (NVIDIA/open-gpu-kernel-modules#1257) shows as ``corrupt``.
    ``move`` makes each copy (a test's seam)."""
    import torch

    from bench_lib.rig import synchronize

    devices = [torch.device(d) for d in device_names]
    out: dict[str, Any] = {"devices": list(device_names), "ok": False, "copies": 0,
                           "corrupt": [], "mib": 0.0}
    start = time.monotonic()
    try:
        for dtype, want in _patterns().items():
            out["mib"] += want.numel() * want.element_size() / 2**20
            for i, a in enumerate(devices):
                for b in (d for j, d in enumerate(devices) if j != i):
                    for way in COPY_WAYS:
                        there = move(want.to(a), b, way)
                        back = move(there, a, way)
                        synchronize([a, b])
                        for path, got in ((f"{a}->{b}", there), (f"{a}->{b}->{a}", back)):
                            out["copies"] += 1
                            wrong = (got.cpu() != want).nonzero()
                            if len(wrong):
                                out["corrupt"].append({
                                    "path": path, "dtype": dtype, "way": way,
                                    "wrong": len(wrong), "of": want.numel(),
                                    "first": int(wrong[0]),
                                    "checksum": int(got.cpu().to(torch.int64).sum()),
                                    "expected": int(want.to(torch.int64).sum())})
        out["ok"] = not out["corrupt"]
    except Exception as e:  # the failure is the result
        out["error"] = _first_line(e)
    out["seconds"] = time.monotonic() - start
    return out


def describe(result: Mapping[str, Any]) -> str:
    """``GPU 0 (NVIDIA H100, sm_90)``: a result's device, as far as it got."""
    known = ", ".join(str(result[k]) for k in ("name", "capability") if result.get(k))
    return f"{result.get('device', '?')}{f' ({known})' if known else ''}"


def main(argv: list[str]) -> int:
    """The child: smoke ``argv[0]`` (several devices, comma-separated: ``copy_check``
    between them), write the result to ``argv[1]`` (atomically)."""
    from bench_lib.results.store import write_json_atomic

    result = copy_check(argv[0].split(",")) if "," in argv[0] else smoke_device(argv[0])
    write_json_atomic(Path(argv[1]), result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
