"""`ygg::attention` on a GPU: Triton kernels of the same schema and semantics as the CPU's C++ kernel
(csrc/attention.cpp), registered as that op's CUDA implementation by `ygg_runtime.backend.cuda`.

q [1, H, W, D] and the W new rows' k, v [1, KV, W, D] are written to `slots` of layer `layer` of
the cache [layers, 2, KV, S, D] first (one kernel); row i then attends to slots [lo_i, hi_i) (its
sequence's committed prefix) and hi_i + j wherever tree[i, j] (its tree window) (a second).

Row invariance, the reason this kernel exists (PyTorch's attention on the GPU picks its blocks and
splits by the width and the cache layout, so a token's row differed between plain decoding and a
tree verify on an H200: docs/exactness.md). A row's *visible keys* are numbered t = 0, 1, ... in
position order — its prefix slots lo, lo + 1, ..., then its tree window's set slots in ascending
order — and everything is blocked by t, never by slot:
  - block b holds keys t in [b·BLOCK_N, (b+1)·BLOCK_N): the same keys for a token whether its
    ancestors sit in the committed prefix (plain decoding) or at scattered tree slots (a verify);
  - per block: scores s = q·k / sqrt(D) for the row's query heads (float32, a dot product of fixed
    shape), then the online softmax (running max m, denominator l, accumulator acc, each rescaled
    at block boundaries), all in float32;
  - flash-decoding with a fixed split *size*: the keys are cut into chunks of SPLIT positions, and
    chunk c goes to part c mod PARTS, which runs its chunks in order; the program that finishes
    last (a counter per row and kv head) merges the PARTS results in part order. How many programs
    run a row's parts is the launch's choice (up to PARTS at one row, fewer at 64: the grid stays
    near PROGRAMS), and no bit depends on it. A one-row forward over a long context so spreads over
    PARTS x KV programs, and since SPLIT and PARTS are constants, neither the width, the other
    rows, the cache's size nor where the sequence sits in it enters a row's arithmetic.
The kernel's arithmetic is a function of the row's query and its visible keys and values in
position order, and of the compile-time constants below. On a GPU the compile-time row check
(`ygg_compile.invariance`) measures that it holds there; on a CPU, Triton's interpreter runs this
same kernel (`TRITON_INTERPRET=1`), and the tests compare it bit for bit with `reference`, which
spells the same blocks in numpy, and check that a row's bits do not depend on the forward around it.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 32  # visible keys per block, in position order
SPLIT = 128  # visible keys per chunk: a row's keys are cut into chunks of this many, in position order
PARTS = 16  # parts a row's chunks are dealt to (chunks v, v + PARTS, ... to part v: fixed, so a row's bits are its own)
PROGRAMS = 256  # programs an attention call aims at: its parts run in W x KV x P programs, P <= PARTS
# Launch options: 8 warps a program, no software pipelining of its gathered key loads (compiled for
# sm_90 by Triton 3.9: 56 registers, no spills; 4 warps or 2+ stages spill). The warps fix how a
# program's sums are laid out, so they are part of the arithmetic: constants, never a width's choice.
WARPS, STAGES = 8, 1
TREE_CHUNK = 32  # tree-window slots scanned at a time when a block reaches the row's tree keys
MIN_DOT = 16  # tl.dot's smallest dimension: query heads and head dimensions are padded up to it


@triton.jit(do_not_specialize=["layer"])
def _write_kv(k, v, cache, slots, layer, stride_kh, stride_kw, stride_vh, stride_vw, stride_cl, stride_c2,
              stride_ch, stride_cs, D: tl.constexpr, DP: tl.constexpr):
    """Program (w, h): row w's key and value of kv head h to slot slots[w] of the cache's layer."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DP)
    dm = d < D
    slot = tl.load(slots + w)
    base = cache + layer * stride_cl + h * stride_ch + slot * stride_cs
    tl.store(base + d, tl.load(k + h * stride_kh + w * stride_kw + d, mask=dm), mask=dm)
    tl.store(base + stride_c2 + d, tl.load(v + h * stride_vh + w * stride_vw + d, mask=dm), mask=dm)


@triton.jit(do_not_specialize=["layer", "T"])  # one kernel for every layer and tree window (Triton specialises 1)
def _attend(q, cache, lo, hi, tree, out, part, count, layer, T, scale, stride_qh, stride_qw, stride_cl, stride_c2,
            stride_ch, stride_cs, stride_tw, stride_oh, stride_ow, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
            DP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr, PARTS: tl.constexpr):
    """Program (w, h, p) of row w's attention for the G query heads of kv head h (module docstring):
    its parts v = p, p + P, ... (P programs a row: any number, a launch's choice), part v being the
    row's chunks v, v + PARTS, ... in order; then, in the program that finishes last, the PARTS
    parts' results merged in part order. PARTS = 1: one program a row, no merge."""
    scale = tl.cast(scale, tl.float32)  # AOTInductor passes a float argument as fp64 (a launch, as fp32): the same value
    w = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    gm = g < G
    dm = d < D
    first = tl.load(lo + w)
    end = tl.load(hi + w)
    prefix = end - first
    trow = tree + w * stride_tw
    count_t = 0  # the row's tree keys
    for j0 in range(0, T, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        count_t += tl.sum(tl.load(trow + j, mask=j < T, other=0).to(tl.int32), axis=0)
    total = prefix + count_t
    heads = h * G + g
    qb = tl.load(q + heads[:, None] * stride_qh + w * stride_qw + d[None, :], mask=gm[:, None] & dm[None, :],
                 other=0.0).to(tl.float32)
    keys = cache + layer * stride_cl + h * stride_ch
    values = keys + stride_c2
    o = out + heads[:, None] * stride_oh + w * stride_ow + d[None, :]
    row = DP + 2  # a part's (acc, m, den) of one query head: DP + 2 floats
    rows = part + (w * tl.num_programs(1) + h) * PARTS * GP * row + g * row
    for v in range(p, PARTS, tl.num_programs(2)):  # this program's parts
        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for c0 in range(v * SPLIT, total, PARTS * SPLIT):  # part v's chunks, in order
            for t0 in range(c0, tl.minimum(c0 + SPLIT, total), BLOCK):
                t = t0 + tl.arange(0, BLOCK)
                valid = t < total
                # the slot of visible key t: in the prefix, first + t; past it, the (t - prefix)-th set
                # slot of the tree window (found by counting the window's set slots up to each slot)
                rank = t - prefix + 1
                offset = tl.zeros([BLOCK], tl.int32)
                if t0 + BLOCK > prefix:
                    seen = 0
                    for j0 in range(0, T, CHUNK):
                        j = j0 + tl.arange(0, CHUNK)
                        bits = tl.load(trow + j, mask=j < T, other=0).to(tl.int32)
                        upto = tl.cumsum(bits, axis=0) + seen
                        hit = (upto[None, :] == rank[:, None]) & (bits[None, :] != 0)
                        offset += tl.sum(tl.where(hit, j[None, :], 0), axis=1)
                        seen += tl.sum(bits, axis=0)
                slot = tl.where(t < prefix, first + t, end + offset)
                slot = tl.where(valid, slot, 0)
                kv_mask = valid[:, None] & dm[None, :]
                kb = tl.load(keys + slot[:, None] * stride_cs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
                s = tl.dot(qb, tl.trans(kb), input_precision="ieee") * scale
                s = tl.where(valid[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                pr = tl.exp(s - m_new[:, None])
                den = den * alpha + tl.sum(pr, axis=1)
                vb = tl.load(values + slot[:, None] * stride_cs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(pr, vb, input_precision="ieee")
                m = m_new
        if PARTS == 1:
            tl.store(o, (acc / tl.where(den > 0, den, 1.0)[:, None]).to(out.dtype.element_ty),
                     mask=gm[:, None] & dm[None, :])
        else:
            at = rows + v * GP * row
            tl.store(at[:, None] + d[None, :], acc)
            tl.store(at + DP, m)
            tl.store(at + DP + 1, den)
    if PARTS > 1:
        tl.debug_barrier()  # every thread's share stored before the counter says so
        lock = count + w * tl.num_programs(1) + h
        if tl.atomic_add(lock, 1, sem="acq_rel") == tl.num_programs(2) - 1:  # the last program of this row: merge
            top = tl.full([GP], float("-inf"), tl.float32)
            for i in range(PARTS):
                top = tl.maximum(top, tl.load(rows + i * GP * row + DP, cache_modifier=".cg"))
            top = tl.maximum(top, -3.4028234663852886e38)  # a row that sees nothing: weights exp(-inf) = 0, not NaN
            den = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, DP], tl.float32)
            for i in range(PARTS):
                at = rows + i * GP * row
                weight = tl.exp(tl.load(at + DP, cache_modifier=".cg") - top)  # a part without keys: 0
                den += weight * tl.load(at + DP + 1, cache_modifier=".cg")
                acc += weight[:, None] * tl.load(at[:, None] + d[None, :], cache_modifier=".cg")
            tl.store(o, (acc / tl.where(den > 0, den, 1.0)[:, None]).to(out.dtype.element_ty),
                     mask=gm[:, None] & dm[None, :])
            tl.atomic_xchg(lock, 0)  # ready for the next forward


def _padded(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


def attention(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor, hi: Tensor,
              tree: Tensor, counters: Tensor | None = None) -> Tensor:
    """`ygg::attention` (the module docstring): writes k, v to the cache's slots, then returns
    [1, H, W, D], a view of [1, W, H, D] memory (what the wo projection reads: no copy between).
    counters: int32 zeros, one a (row, kv head) at least, which the kernel leaves zero: a row's
    keys are then dealt to PARTS parts, run by up to PARTS programs (as many as keep the call near
    PROGRAMS programs: the count changes no bit); None: one part, one program a row (other bits: a
    generation keeps to one of the two)."""
    _, heads, width, dim = q.shape
    kv = k.shape[1]
    out = q.new_empty(1, width, heads, dim).transpose(1, 2)
    dp = _padded(dim)
    _write_kv[(width, kv)](
        k, v, cache, slots, layer, k.stride(1), k.stride(2), v.stride(1), v.stride(2), cache.stride(0),
        cache.stride(1), cache.stride(2), cache.stride(3), D=dim, DP=dp)
    parts = PARTS if counters is not None else 1
    programs = max(1, min(parts, PROGRAMS // (width * kv)))  # how many run a row's parts: no bit depends on it
    if counters is not None and counters.numel() < width * kv:
        raise ValueError(f"attention over {width} rows and {kv} kv heads needs {width * kv} counters, not {counters.numel()}")
    gp = _padded(heads // kv)
    part = (torch.empty(width * kv * parts * gp * (dp + 2), dtype=torch.float32, device=q.device) if parts > 1
            else out)
    _attend[(width, kv, programs)](
        q, cache, lo, hi, tree, out, part, counters if counters is not None else lo, layer, tree.shape[1], dim ** -0.5,
        q.stride(1), q.stride(2), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), tree.stride(0),
        out.stride(1), out.stride(2), G=heads // kv, GP=gp, D=dim, DP=dp, BLOCK=BLOCK_N, CHUNK=TREE_CHUNK,
        SPLIT=SPLIT, PARTS=parts, num_warps=WARPS, num_stages=STAGES)
    return out


def reference(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor, hi: Tensor,
              tree: Tensor, parts: int = PARTS) -> Tensor:
    """The kernel's arithmetic spelled out in numpy, block by block as the kernel does it (the same
    padded shapes, the same float32 operations in the same order), writing the cache as the op
    does; returns the float32 result [1, H, W, D], before it is rounded to q's dtype. Under Triton's
    interpreter, which runs tl.* as these numpy operations, the kernel gives these bits exactly.
    Which keys a row sees, and in what order, is found here the plain way (a list of slots), not as
    the kernel finds them."""
    cache[layer, 0][:, slots] = k[0]
    cache[layer, 1][:, slots] = v[0]
    _, heads, width, dim = q.shape
    kv = k.shape[1]
    group = heads // kv
    gp, dp = _padded(group), _padded(dim)
    scale = np.float32(dim ** -0.5)
    out = torch.empty(q.shape, dtype=torch.float32)
    rows = cache[layer].float().numpy()
    for w in range(width):
        seen = list(range(int(lo[w]), int(hi[w]))) + [int(hi[w]) + j for j in torch.nonzero(tree[w]).flatten().tolist()]
        for h in range(kv):
            qb = np.zeros((gp, dp), np.float32)
            qb[:group, :dim] = q[0, h * group : (h + 1) * group, w].float().numpy()
            partial = []
            for p in range(parts):
                m = np.full(gp, -np.inf, np.float32)
                den = np.zeros(gp, np.float32)
                acc = np.zeros((gp, dp), np.float32)
                for c0 in range(p * SPLIT, len(seen), parts * SPLIT):
                    for t0 in range(c0, min(c0 + SPLIT, len(seen)), BLOCK_N):
                        block = seen[t0 : min(t0 + BLOCK_N, c0 + SPLIT)]
                        kb = np.zeros((BLOCK_N, dp), np.float32)
                        vb = np.zeros((BLOCK_N, dp), np.float32)
                        kb[: len(block), :dim] = rows[0, h, block]
                        vb[: len(block), :dim] = rows[1, h, block]
                        s = np.matmul(qb, kb.T) * scale
                        s[:, len(block) :] = -np.inf
                        m_new = np.maximum(m, s.max(axis=1))
                        alpha = np.exp(m - m_new)
                        pr = np.exp(s - m_new[:, None])
                        den = den * alpha + pr.sum(axis=1)
                        acc = acc * alpha[:, None] + np.matmul(pr, vb)
                        m = m_new
                partial.append((m, den, acc))
            if parts > 1:  # merged in part order, each weighted by exp(its max - the largest max)
                top = np.full(gp, -np.inf, np.float32)
                for m, _, _ in partial:
                    top = np.maximum(top, m)
                top = np.maximum(top, np.float32(-3.4028234663852886e38))
                den, acc = np.zeros(gp, np.float32), np.zeros((gp, dp), np.float32)
                for m, d, a in partial:
                    weight = np.exp(m - top)
                    den = den + weight * d
                    acc = acc + weight[:, None] * a
            res = acc / np.where(den > 0, den, np.float32(1.0))[:, None]
            out[0, h * group : (h + 1) * group, w] = torch.from_numpy(res[:group, :dim])
    return out
