"""The linear layers of a forward on a GPU: one Triton kernel, a row-invariant skinny GEMM with its
epilogue fused (bias, SiLU·mul, residual add, rotary embedding, float32 logits).

Why our own (docs/design.md, "Backends"): cuBLAS picks its kernel and its split-K from the whole
shape, so a row's bits change with the number of rows beside it; with split-K turned off to stop
that, a one-row product of a 1 536-wide projection runs on a handful of the GPU's SMs. Here the
work a row gets is fixed by the weight alone:

  - rows in blocks of BM = 64 (a forward's widest batch of rows, `options.MAX_ROWS`): every forward
    of 1..64 rows runs the same compiled kernel on the same tile, padding rows masked (loaded as 0);
  - columns in tiles of BN, the reduction dimension in blocks of BK, and the blocks split into
    SPLITS contiguous ranges, all three chosen by `tiling(n, k)` from the weight's shape only, never
    from the number of rows: a one-row product still spreads over tiles × SPLITS programs;
  - each split sums its blocks in order into a float32 tile (`tl.dot`); the split's tile goes to a
    float32 workspace, and the program that finishes last (a counter per tile) adds the SPLITS
    tiles in the order 0, 1, ..., SPLITS - 1 — whichever arrived first — and applies the epilogue.
A row's arithmetic is therefore a function of the row and the weight: its bits do not depend on
the width of the forward, the other rows, or which program finished first.

Epilogues (constexpr EPILOGUE), each rounding exactly where the eager composition it replaces
rounds (every `round` is a conversion to the model's dtype and back):
  PLAIN   out = round(round(acc + bias) + residual)      (bias, residual optional; fp32 out allowed)
  GATED   out = round(silu(round(gate)) · round(up))     w13's rows [gate; up] -> w2's input
  ROPE    q, k heads rotated: lo' = round(round(lo·cos) - round(hi·sin)),
          hi' = round(round(hi·cos) + round(lo·sin)); v heads as they are (after the bias)
GATED and ROPE compute column pairs (j, j + HALF) in one program — (gate, up) with HALF = the
intermediate size, (lo, hi) halves of a head with HALF = head_dim / 2 — so each epilogue is
elementwise on the two accumulators.

`reference` spells the same blocks in numpy (the same padded shapes, the same float32 operations
in the same order); under Triton's interpreter (`TRITON_INTERPRET=1`) the kernel gives its bits
exactly, which the tests check, and that a row's bits do not depend on the rows beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

BM = 64  # rows a program computes: every forward of 1..64 rows runs this one tile
BN = 64  # output columns a program computes (pairs, for GATED and ROPE), at most
BK = 128  # reduction elements a block, at most
PROGRAMS = 256  # how many programs a split aims at (tiles × splits): fixed, so the splits are the weight's
PLAIN, GATED, ROPE = 0, 1, 2
# Launch options: 4 warps (one warpgroup: sm_90's wgmma), 3 stages of cp.async loads in flight
# (compiled for sm_90 by Triton 3.9 with the 1.5B's shapes: 80-156 registers, no spills, 96-144 KB
# of shared memory). Constants: the warps lay a tile's sums out, so they are part of the arithmetic.
WARPS, STAGES = 4, 3
# The interpreter multiplies bfloat16 tiles as their raw 16-bit patterns (Triton 3.9's `create_dot`
# hands numpy the storage integers), so under it tiles are widened to float32 first: the products of
# two bfloat16 values are exact in float32 either way.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Tiling:
    """How a weight's product is cut: BN columns a tile, BK inputs a block, SPLITS ranges of blocks."""

    bn: int
    bk: int
    splits: int

    def programs(self, n: int) -> int:
        return triton.cdiv(n, self.bn) * self.splits


def tiling(n: int, k: int, width: int | None = None) -> Tiling:
    """The tiling of an [n, k] product (n: output columns, or column pairs): from the weight's
    shape alone, so every forward of every width cuts a row's sum the same way. width (the rows of
    a product), for a model that needs no row invariance (a drafter: only the target's rows decide
    the output): the splits also fall as the rows grow, so that the float32 partial sums (2 x splits
    x rows x n x 4 bytes) stay within a quarter of the weight's own bytes — other bits at other widths."""
    bn = max(16, min(BN, triton.next_power_of_2(n)))
    bk = max(16, min(BK, triton.next_power_of_2(k)))
    blocks = triton.cdiv(k, bk)
    splits = max(1, min(blocks, triton.cdiv(PROGRAMS, triton.cdiv(n, bn))))
    if width is not None:
        splits = max(1, min(splits, k // (16 * max(width, 1))))
    per = triton.cdiv(blocks, splits)
    return Tiling(bn, bk, triton.cdiv(blocks, per))  # no split left empty


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x rounded to the model's dtype, back in float32."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _mma(a, b, acc, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _finish(acc_a, acc_b, m, j, col_a, col_b, mmask, jmask, bias, res, out, cos, sin, HALF, ROTATED, stride_rm,
            stride_om, stride_cm, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
            DTYPE: tl.constexpr):
    """The epilogue of a tile whose sums are complete (module docstring)."""
    mask = mmask[:, None] & jmask[None, :]
    if EPILOGUE == 1:  # GATED
        g = _round(acc_a, DTYPE)
        y = _round(_round(g / (1.0 + tl.exp(-g)), DTYPE) * _round(acc_b, DTYPE), DTYPE)
        tl.store(out + m[:, None] * stride_om + j[None, :], y.to(out.dtype.element_ty), mask=mask)
    else:
        if HAS_BIAS:
            acc_a += tl.load(bias + col_a, mask=jmask, other=0.0).to(tl.float32)[None, :]
            acc_b += tl.load(bias + col_b, mask=jmask, other=0.0).to(tl.float32)[None, :]
        a = _round(acc_a, DTYPE)
        if EPILOGUE == 2:  # ROPE
            b = _round(acc_b, DTYPE)
            half = j % HALF
            c = tl.load(cos + m[:, None] * stride_cm + half[None, :], mask=mask, other=0.0).to(tl.float32)
            s = tl.load(sin + m[:, None] * stride_cm + half[None, :], mask=mask, other=0.0).to(tl.float32)
            turn = ((j // HALF) < ROTATED)[None, :]
            lo = tl.where(turn, _round(_round(a * c, DTYPE) - _round(b * s, DTYPE), DTYPE), a)
            hi = tl.where(turn, _round(_round(b * c, DTYPE) + _round(a * s, DTYPE), DTYPE), b)
            tl.store(out + m[:, None] * stride_om + col_a[None, :], lo.to(out.dtype.element_ty), mask=mask)
            tl.store(out + m[:, None] * stride_om + col_b[None, :], hi.to(out.dtype.element_ty), mask=mask)
        else:
            if HAS_RES:
                a = _round(a + tl.load(res + m[:, None] * stride_rm + col_a[None, :], mask=mask, other=0.0
                                       ).to(tl.float32), DTYPE)
            tl.store(out + m[:, None] * stride_om + col_a[None, :], a.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _linear(x, rows, w, bias, res, out, part, count, cos, sin, M, NJ, K, HALF, ROTATED, stride_xm, stride_rm,
            stride_om, stride_cm, SPLITS: tl.constexpr, EPILOGUE: tl.constexpr, PAIRED: tl.constexpr,
            GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, DTYPE: tl.constexpr,
            F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (t, s, mb): column tile t, split s, row block mb (module docstring). M is not
    specialised on (Triton compiles another kernel for M = 1 otherwise): one kernel for every width."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    mb = tl.program_id(2)
    r = tl.arange(0, BLOCK_M)
    m = mb * BLOCK_M + r
    mmask = m < M
    if GATHER:  # the rows of x to multiply (the output head's wanted rows)
        xm = tl.load(rows + m, mask=mmask, other=0)
    else:
        xm = m
    j = t * BLOCK_N + tl.arange(0, BLOCK_N)
    jmask = j < NJ
    if PAIRED:
        col_a = (j // HALF) * (2 * HALF) + j % HALF
        col_b = col_a + HALF
    else:
        col_a = j
        col_b = j
    blocks = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(blocks, SPLITS)
    first = s * per
    last = tl.minimum(first + per, blocks)
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(first, last):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = tl.load(x + xm[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wa = tl.load(w + col_a[None, :] * K + k[:, None], mask=jmask[None, :] & kmask[:, None], other=0.0)
        acc_a = _mma(a, wa, acc_a, F32)
        if PAIRED:
            wb = tl.load(w + col_b[None, :] * K + k[:, None], mask=jmask[None, :] & kmask[:, None], other=0.0)
            acc_b = _mma(a, wb, acc_b, F32)
    if SPLITS == 1:
        _finish(acc_a, acc_b, m, j, col_a, col_b, mmask, jmask, bias, res, out, cos, sin, HALF, ROTATED, stride_rm,
                stride_om, stride_cm, EPILOGUE, HAS_BIAS, HAS_RES, DTYPE)
    else:
        width = NJ * (2 if PAIRED else 1)  # a workspace row: the a sums, then the b sums
        tile = part + ((mb * SPLITS + s) * BLOCK_M + r[:, None]) * width + j[None, :]
        live = mmask[:, None] & jmask[None, :]  # a padding row's sums are never read: not stored
        tl.store(tile, acc_a, mask=live)
        if PAIRED:
            tl.store(tile + NJ, acc_b, mask=live)
        tl.debug_barrier()  # every thread's share stored before the counter says so
        lock = count + mb * tl.num_programs(0) + t
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLITS - 1:  # the last split of this tile: sum them all
            tot_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            tot_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for i in range(SPLITS):
                at = part + ((mb * SPLITS + i) * BLOCK_M + r[:, None]) * width + j[None, :]
                tot_a += tl.load(at, mask=live, other=0.0, cache_modifier=".cg")
                if PAIRED:
                    tot_b += tl.load(at + NJ, mask=live, other=0.0, cache_modifier=".cg")
            _finish(tot_a, tot_b, m, j, col_a, col_b, mmask, jmask, bias, res, out, cos, sin, HALF, ROTATED,
                    stride_rm, stride_om, stride_cm, EPILOGUE, HAS_BIAS, HAS_RES, DTYPE)
            tl.atomic_xchg(lock, 0)  # ready for the next product


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def counters_needed(n: int, k: int, rows: int, paired: bool = False) -> int:
    """How many zeroed int32 counters a product needs (one a tile of every row block)."""
    nj = n // 2 if paired else n
    return triton.cdiv(nj, tiling(nj, k).bn) * triton.cdiv(max(rows, 1), BM)


def linear(x: Tensor, weight: Tensor, counters: Tensor, *, bias: Tensor | None = None, residual: Tensor | None = None,
           epilogue: int = PLAIN, rows: Tensor | None = None, rope: tuple[Tensor, Tensor, int, int] | None = None,
           out_dtype: torch.dtype | None = None, invariant: bool = True) -> Tensor:
    """x [..., K] times weight [N, K]ᵀ with the epilogue (module docstring) -> [..., N] (GATED:
    [..., N / 2]; rows [R] given: only those rows of x, [R, N]). counters: int32 zeros, at least
    `counters_needed` of them (the kernel leaves them zero). rope: (cos, sin [rows, head_dim / 2]
    in the model's dtype, head_dim / 2, the rotated heads' count). out_dtype: float32 for logits.
    invariant=False: the splits may follow the rows (`tiling`: a drafter's)."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n = weight.shape[0]
    paired = epilogue != PLAIN
    nj = n // 2 if paired else n
    m = rows.numel() if rows is not None else flat.shape[0]
    lead = (rows.numel(),) if rows is not None else x.shape[:-1]
    out = torch.empty(*lead, n // 2 if epilogue == GATED else n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    tl_dtype = _DTYPES[x.dtype]
    t = tiling(nj, k, None if invariant else m)
    blocks_m = triton.cdiv(m, BM)
    need = triton.cdiv(nj, t.bn) * blocks_m
    if t.splits > 1 and counters.numel() < need:
        raise ValueError(f"a {n}x{k} product of {m} rows needs {need} counters, not {counters.numel()}")
    part = (torch.empty(blocks_m * t.splits * BM * nj * (2 if paired else 1), dtype=torch.float32, device=x.device)
            if t.splits > 1 else counters)
    res = residual.reshape(-1, n) if residual is not None else flat
    cos, sin, half, rotated = rope if rope is not None else (flat, flat, n // 2 if epilogue == GATED else 1, 0)
    _linear[(triton.cdiv(nj, t.bn), t.splits, blocks_m)](
        flat, rows if rows is not None else counters, weight, bias if bias is not None else weight, res, out, part,
        counters, cos, sin, m, nj, k, half, rotated, flat.stride(0), res.stride(0), out.stride(-2) if out.dim() > 1 else n,
        cos.stride(0), SPLITS=t.splits, EPILOGUE=epilogue, PAIRED=paired, GATHER=rows is not None,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, DTYPE=tl_dtype,
        F32=x.dtype == torch.float32 or INTERPRETED, BLOCK_M=BM, BLOCK_N=t.bn, BLOCK_K=t.bk, num_warps=WARPS,
        num_stages=STAGES)
    return out


# --- the kernel's arithmetic in numpy (tests) ---------------------------------------------------


def to_dtype(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 values rounded to `dtype` and back, as the interpreter converts (bfloat16: the low 16
    bits dropped; a GPU rounds to nearest, which is the GPU's own business: `make gpu-check`)."""
    x = np.asarray(x, np.float32)
    if dtype == torch.bfloat16:
        return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    if dtype == torch.float16:
        return x.astype(np.float16).astype(np.float32)
    return x


def reference(x: Tensor, weight: Tensor, *, bias: Tensor | None = None, residual: Tensor | None = None,
              epilogue: int = PLAIN, rows: Tensor | None = None, rope: tuple[Tensor, Tensor, int, int] | None = None,
              out_dtype: torch.dtype | None = None) -> Tensor:
    """`linear`'s arithmetic spelled out in numpy, block by block as the kernel does it (the padded
    tile, each split's blocks in order, the splits added in order, the epilogue's roundings)."""
    dtype = x.dtype
    k = x.shape[-1]
    flat = x.reshape(-1, k).float().numpy()
    if rows is not None:
        flat = flat[rows.numpy()]
    m, n = flat.shape[0], weight.shape[0]
    paired = epilogue != PLAIN
    nj = n // 2 if paired else n
    half = (rope[2] if epilogue == ROPE else n // 2) if paired else 1
    t = tiling(nj, k)
    wf = weight.float().numpy()
    j_all = np.arange(nj)
    col_a = (j_all // half) * 2 * half + j_all % half if paired else j_all
    col_b = col_a + half if paired else col_a
    blocks = triton.cdiv(k, t.bk)
    per = triton.cdiv(blocks, t.splits)
    out_n = nj if epilogue == GATED else n
    out = np.zeros((triton.cdiv(m, BM) * BM, out_n), np.float32)
    for mb in range(triton.cdiv(m, BM)):
        a_rows = np.zeros((BM, blocks * t.bk), np.float32)
        take = flat[mb * BM : (mb + 1) * BM]
        a_rows[: len(take), :k] = take
        for t0 in range(0, nj, t.bn):
            j = np.arange(t0, t0 + t.bn)
            valid = j < nj
            sums = []
            for s in range(t.splits):
                acc = {c: np.zeros((BM, t.bn), np.float32) for c in "ab"}
                for kb in range(s * per, min(s * per + per, blocks)):
                    a = a_rows[:, kb * t.bk : (kb + 1) * t.bk]
                    for c, cols in (("a", col_a), ("b", col_b)) if paired else (("a", col_a),):
                        wt = np.zeros((t.bk, t.bn), np.float32)
                        kk = slice(kb * t.bk, min((kb + 1) * t.bk, k))
                        wt[: kk.stop - kk.start, valid] = wf[cols[j[valid]], kk].T
                        acc[c] = np.matmul(a, wt, dtype=np.float32) + acc[c]
                sums.append(acc)
            if t.splits == 1:
                acc_a, acc_b = sums[0]["a"], sums[0]["b"]
            else:
                acc_a, acc_b = np.zeros((BM, t.bn), np.float32), np.zeros((BM, t.bn), np.float32)
                for acc in sums:
                    acc_a, acc_b = acc_a + acc["a"], acc_b + acc["b"]
            jv = j[valid]
            acc_a, acc_b = acc_a[:, valid], acc_b[:, valid]
            rnd = lambda v: to_dtype(v, dtype)  # noqa: E731
            if epilogue == GATED:
                g = rnd(acc_a)
                out[mb * BM : (mb + 1) * BM, jv] = rnd(rnd(g / (np.float32(1.0) + np.exp(-g))) * rnd(acc_b))
                continue
            if bias is not None:
                b = bias.float().numpy()
                acc_a, acc_b = acc_a + b[col_a[jv]][None, :], acc_b + b[col_b[jv]][None, :]
            a = rnd(acc_a)
            if epilogue == ROPE:
                bb = rnd(acc_b)
                cos, sin, _, rotated = rope
                rr = slice(mb * BM, min((mb + 1) * BM, m))
                c = np.zeros((BM, len(jv)), np.float32)
                sn = np.zeros((BM, len(jv)), np.float32)
                c[: rr.stop - rr.start] = cos.float().numpy()[rr][:, jv % half]
                sn[: rr.stop - rr.start] = sin.float().numpy()[rr][:, jv % half]
                turn = (jv // half < rotated)[None, :]
                out[mb * BM : (mb + 1) * BM, col_a[jv]] = np.where(turn, rnd(rnd(a * c) - rnd(bb * sn)), a)
                out[mb * BM : (mb + 1) * BM, col_b[jv]] = np.where(turn, rnd(rnd(bb * c) + rnd(a * sn)), bb)
                continue
            if residual is not None:
                rs = np.zeros((BM, len(jv)), np.float32)
                rsd = residual.reshape(-1, n).float().numpy()[mb * BM : (mb + 1) * BM]
                rs[: len(rsd)] = rsd[:, col_a[jv]]
                a = rnd(a + rs)
            out[mb * BM : (mb + 1) * BM, col_a[jv]] = a
    lead = (m,) if rows is not None else x.shape[:-1]
    result = torch.from_numpy(out[:m]).reshape(*lead, out_n)
    return result if out_dtype == torch.float32 else as_dtype(result, dtype)


def as_dtype(x: Tensor | np.ndarray, dtype: torch.dtype) -> Tensor:
    """float32 values already representable in `dtype` (`to_dtype`'s), as `dtype` (exact)."""
    t = x if isinstance(x, Tensor) else torch.from_numpy(np.ascontiguousarray(x, np.float32))
    return (t.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16) if dtype == torch.bfloat16 else t.to(dtype)
