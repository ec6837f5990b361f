"""The row-local kernels of a forward on a GPU: RMSNorm and the rotary tables, one Triton kernel each.

Each program computes whole rows, and a row's arithmetic is its own: the norm's sum of squares runs
over the row's `dim` values in one fixed-shape reduction (the block is the row, padded to a power
of two), so its bits do not depend on the rows beside it or how many there are. Both round exactly
where the eager composition they replace rounds (`backend.cpu`): the norm in float32, cast to the
model's dtype, then times the weight, rounded; cos and sin of position x frequency in float32,
times the scaling, rounded.

`rmsnorm_reference` and `rope_reference` spell the same arithmetic in numpy (the interpreter's
operations, `TRITON_INTERPRET=1`), which the tests compare the kernels with bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from ygg_runtime.backend.triton_linear import _DTYPES, as_dtype, to_dtype

ROWS = 4  # rows a program normalises


@triton.jit(do_not_specialize=["M"])  # one kernel for every number of rows (Triton specialises 1)
def _rmsnorm(x, weight, out, M, N, eps, stride_xm, stride_om, DTYPE: tl.constexpr, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    """Program i: rows i·ROWS .. (i+1)·ROWS - 1, each normalised over its N values."""
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n = tl.arange(0, BLOCK)
    mask = (m < M)[:, None] & (n < N)[None, :]
    h = tl.load(x + m[:, None] * stride_xm + n[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(h * h, axis=1) / N
    h = (h * tl.math.rsqrt(mean + eps)[:, None]).to(DTYPE).to(tl.float32)
    w = tl.load(weight + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out + m[:, None] * stride_om + n[None, :], (w[None, :] * h).to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["W"])
def _rope(positions, inv_freq, cos, sin, W, HALF, scaling, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Program w: row w's cos and sin of position x frequency, for the HALF frequencies."""
    w = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    f = tl.load(positions + w).to(tl.float32) * tl.load(inv_freq + j, mask=mask, other=0.0).to(tl.float32)
    scaling = tl.cast(scaling, tl.float32)
    tl.store(cos + w * HALF + j, (tl.cos(f) * scaling).to(DTYPE), mask=mask)
    tl.store(sin + w * HALF + j, (tl.sin(f) * scaling).to(DTYPE), mask=mask)


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., N] normalised: round(weight · round(x / rms(x))), rms in float32."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    out = torch.empty_like(flat)
    m = flat.shape[0]
    if m:
        _rmsnorm[(triton.cdiv(m, ROWS),)](flat, weight, out, m, n, eps, flat.stride(0), out.stride(0),
                                         DTYPE=_DTYPES[x.dtype], ROWS=ROWS, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def rope(positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [W, head_dim / 2] of positions [W] x inv_freq, times scaling, in `dtype` (the
    second half of a head uses the same frequencies: `triton_linear`'s ROPE epilogue reads these)."""
    w, half = positions.numel(), inv_freq.numel()
    cos = torch.empty(w, half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if w:
        _rope[(w,)](positions, inv_freq, cos, sin, w, half, float(scaling), DTYPE=_DTYPES[dtype],
                    BLOCK=triton.next_power_of_2(half))
    return cos, sin


# --- the kernels' arithmetic in numpy (tests) ---------------------------------------------------


def rmsnorm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    n = x.shape[-1]
    rows = x.reshape(-1, n).float().numpy()
    h = np.zeros((rows.shape[0], triton.next_power_of_2(n)), np.float32)
    h[:, :n] = rows
    mean = (h * h).sum(axis=1) / np.float32(n)
    h = to_dtype(h * (np.float32(1.0) / np.sqrt(mean + np.float32(eps)))[:, None], x.dtype)[:, :n]
    return as_dtype(to_dtype(weight.float().numpy()[None, :] * h, x.dtype), x.dtype).view(x.shape)


def rope_reference(positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    f = positions.numpy().astype(np.float32)[:, None] * inv_freq.float().numpy()[None, :]
    return (as_dtype(to_dtype(np.cos(f) * np.float32(scaling), dtype), dtype),
            as_dtype(to_dtype(np.sin(f) * np.float32(scaling), dtype), dtype))
