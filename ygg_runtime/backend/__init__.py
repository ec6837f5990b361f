"""A device is a backend: the ops a forward is made of, one signature each, an implementation per device.

`model.Transformer` is one readable decoder that calls `Ops` (`backend.ops`) and never asks which device it
runs on; `for_device` gives the implementation of the device its weights are on:

  ops         CPU (`backend.cpu`)                          CUDA (`backend.cuda`)
  embed       the embedding module (quantized or not)      the same (one gather)
  rope        cos, sin [W, head_dim] (today's composition)  one Triton kernel, [W, head_dim / 2]
  rmsnorm     float32 norm, cast, weight (eager ops)        one Triton kernel a row block
  qkv         the linear, bias, RoPE (eager ops)            one GEMM, bias and RoPE in its epilogue
  attention   `ygg::attention`'s C++ kernel                `ygg::attention`'s Triton kernels (2)
  linear      the linear (+ residual)                       one GEMM, the residual in its epilogue
  gated       silu(gate) · up of the w13 linear             one GEMM, SiLU·mul in its epilogue
  logits      the head on the wanted rows, float32          one GEMM, the rows gathered in it

so a target layer on CUDA is 8 kernels: norm, qkv, KV write, attention, wo, norm, w13, w2
(tests/test_backend.py counts them). Every CUDA kernel is row-invariant by construction (its
tiling fixed by the weight's shape, never by the number of rows: `backend.triton_linear`), so the
target's rows have the same bits at every width; the CPU ops are the eager composition the CPU's
compiled graphs are exported from (their row invariance is the compile-time check's to measure).

`ygg::attention` is also a torch operator with one schema (`backend.schema`) and a kernel per
device (C++ on CPUs, Triton on CUDA), so `torch.ops.ygg.attention` runs anywhere.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from ygg_runtime.backend import cpu
from ygg_runtime.backend.ops import Ops

HERE = Path(__file__).parent
# The sources whose code a forward on a GPU runs: profiles measured with other sources are other timings.
CUDA_SOURCES = ("cuda.py", "triton_attention.py", "triton_linear.py", "triton_rowwise.py")


@functools.cache
def _for(kind: str, invariant: bool) -> Ops:
    if kind == "cuda":
        from ygg_runtime.backend import cuda  # Triton, which a CUDA build of torch brings, imported on a GPU only

        return cuda.OPS if invariant else cuda.FREE
    return cpu.CpuOps()


def for_device(device: torch.device | str, invariant: bool = True) -> Ops:
    """The ops of a forward on `device` (every device kind but CUDA runs the CPU's composition:
    the meta and fake tensors of tracing, too). invariant=False: for a model whose rows need not
    keep their bits across widths — a drafter's, which only proposes — where a device has faster
    ops that do not (CUDA's linears split their sums by the rows too); the CPU's are the same."""
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    return _for(kind, invariant or kind == "cpu")


def version(device: str = "cpu") -> str:
    """Which kernels a forward on `device` runs, as a hash of their sources (latency profiles record
    it: other kernels, other timings): the C++ attention on a CPU (`ygg::qlinear`, quantized
    weights only, is recorded apart), every Triton source on a GPU."""
    if device.startswith("cpu"):
        files = [HERE / "csrc" / "attention.cpp"]
    else:
        files = [HERE / f for f in CUDA_SOURCES]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
