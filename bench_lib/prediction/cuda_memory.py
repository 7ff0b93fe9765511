"""A process's peak on a GPU from its counted step: the caching allocator and the libraries.

``prediction.fake_step`` counts tensor bytes. What ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` report on a GPU is that step run through the caching allocator
(``prediction.allocator``: blocks rounded and left unsplit, segments cached and fragmented), with
what CUDA's libraries allocate through it beside the tensors:

- cuBLAS's workspace (``cublas_workspace_bytes``), one per cuBLAS handle and stream, a
  handle per thread: the forward's thread and the autograd engine's device thread, which
  runs a GPU's backward, each get one at their first matmul and keep it (torch keeps them
  in ``cublas_handle_stream_to_workspace``); a process whose step runs no matmul (a
  pipeline stage without the head) gets none;
- cuDNN's workspace, allocated and freed around each convolution (``CUDNN_WORKSPACE_BYTES``).

Measured against the first GPU run (one H100 80GB, torch 2.11.0+cu130, cuDNN 9.19;
``tests/data/h100-2026-11-26``), where the bare count was under the allocator's peak in all
14 cases (0.8-9.0% at 224 px, 19-39% at 64 px, where 64 MiB weighs most): the allocator's
blocks add 0.2-0.6% at 224 px, the two cuBLAS workspaces 64 MiB (all of batch 120's gap),
and what was left (0-15 MiB) came where a convolution ran at the peak. With all three every
case is within -0.1% and +3.8% of the allocator's peak, and its reserved peak within -4.5%
and +5.6%, but for DDP on NCCL's (-14%) (``tests/test_predict_memory_gpu_evidence.py``,
``docs/prediction.md``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping

from bench_lib.prediction.allocator import KIB, MIB, Peaks, replay
from bench_lib.prediction.fake_step import Footprint

CUBLAS_WORKSPACE_BYTES = 32 * MIB
"""torch's cuBLAS workspace when ``CUBLAS_WORKSPACE_CONFIG`` is unset: 32 MiB on compute
capability 9.x (Hopper; some torch versions 10.x and 12.x too), 8 MiB + 128 KiB before it
(``:4096:2:16:8``). The larger is taken (the GPU is not read before launch): at most 48 MiB
over on an older GPU, two workspaces of it. On the H100 the evidence's batch-120 cases sit
exactly 64 MiB over the replayed count: two of them."""
CUDNN_WORKSPACE_BYTES = 16 * MIB
"""cuDNN's workspace at a convolution: its algorithm, so its workspace, is picked by cuDNN's
autotuner (``torch.backends.cudnn.benchmark``) as the case runs, and is not known before. A
measured allowance: on the H100 evidence what was left of each allocator peak over the
replayed count and the cuBLAS workspaces was 0 where the peak fell away from a convolution
(batch 120) and at most 15 MiB where it fell on one (batch 20 at 224 px, fp32), and 16 MiB
allocated at every convolution leaves no evidence case under."""


def cublas_workspace_bytes(env: Mapping[str, str] = os.environ) -> int:
    """One cuBLAS workspace: what ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT``, pairs
    summed, as torch reads it) sets, else ``CUBLAS_WORKSPACE_BYTES``."""
    pairs = re.findall(r":(\d+):(\d+)", env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if not pairs:
        return CUBLAS_WORKSPACE_BYTES
    return sum(int(size) * KIB * int(count) for size, count in pairs)


@functools.cache
def on_gpu(f: Footprint, cublas_workspace: int = CUBLAS_WORKSPACE_BYTES) -> Peaks:
    """The allocator's peaks of ``f``'s step on a GPU (module docstring): its held tensors
    and one cuBLAS workspace per thread that runs a matmul, allocated before the step, then
    the step replayed with a cuDNN workspace at each convolution."""
    held = f.held_sizes + (cublas_workspace,) * f.matmul_threads
    return replay(held, f.trace, conv_workspace=CUDNN_WORKSPACE_BYTES)
