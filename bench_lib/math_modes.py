"""The fp32 math a measuring process computes in: TF32 or IEEE, and cuDNN's autotuning.

Every measuring process (the workers, the calibration, the FLOP peak probe) sets the same
mode (``set_math_mode``), so that training and the probe compute alike; env.json records
the flags as read back (``math_mode``).
"""

from __future__ import annotations

from typing import Any

import torch

MATH_MODES = ("torch", "ieee")
"""The fp32 math a run computes in (``Measurement.math_mode``, ``run --math-mode``):
``torch``, PyTorch's own TF32 flags (``TORCH_TF32``: in torch 2.14 cuDNN convolutions may use
TF32 on Ampere and later, cuBLAS matmuls may not), the arithmetic users train in; ``ieee``,
TF32 off in both: IEEE fp32, slower convolutions, so compute weighs more against
communication than users will see."""
DEFAULT_MATH_MODE = "torch"
TORCH_TF32 = {"cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
              "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}
"""torch's own TF32 flags, read as this module is imported, before any of ours is set (a
fresh process's: ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` turns cuBLAS's on)."""
CUDNN_BENCHMARK = True
"""cuDNN autotunes each convolution shape on first use (the warm-up steps pay for it), in
either math mode: it picks kernels, not their arithmetic's precision."""


def math_flags(mode: str) -> dict[str, bool]:
    """The TF32 flags of math mode ``mode`` (``MATH_MODES``; ValueError naming them)."""
    if mode not in MATH_MODES:
        raise ValueError(f"unknown math mode {mode!r}; valid: {', '.join(MATH_MODES)}")
    return dict(TORCH_TF32) if mode == "torch" else dict.fromkeys(TORCH_TF32, False)


def set_math_mode(mode: str = DEFAULT_MATH_MODE) -> dict[str, Any]:
    """Set the math flags of every measuring process (workers, the calibration, the FLOP
    peak probe) to math mode ``mode``, so that training and the probe compute in one mode;
    returns them as read back. Each flag is set, ``torch``'s too: a process that set another
    mode before (a test, a library) is put back.

    The legacy ``allow_tf32`` setters, not torch 2.9's ``fp32_precision`` ones: setting
    cuDNN's through the new API leaves ``torch.backends.cudnn.allow_tf32`` unreadable
    (torch raises on a "mix of APIs"), and TorchInductor still reads it. bf16 cases run
    under autocast, which these flags do not change.
    """
    flags = math_flags(mode)
    torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    torch.backends.cudnn.benchmark = CUDNN_BENCHMARK
    return math_mode()


def math_mode() -> dict[str, Any]:
    """The fp32 math flags and cuDNN autotuning in effect in this process (env.json)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    mode: dict[str, Any] = {
        "cuda_matmul_allow_tf32": bool(matmul.allow_tf32),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_deterministic": bool(cudnn.deterministic),
    }
    if hasattr(matmul, "fp32_precision"):  # torch 2.9+: the same flags, as the new API reads
        backends = {"cuda_matmul": matmul, "cudnn_conv": getattr(cudnn, "conv", None),
                    "mkldnn_matmul": getattr(torch.backends.mkldnn, "matmul", None),
                    "mkldnn_conv": getattr(torch.backends.mkldnn, "conv", None)}
        mode["fp32_precision"] = {k: getattr(b, "fp32_precision", None)
                                  for k, b in backends.items()}
    return mode
