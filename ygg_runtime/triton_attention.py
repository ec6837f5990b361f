"""`ygg::attention_cuda`: the GPU implementation of `ygg::attention` (csrc/attention.cpp), a Triton
kernel registered with `torch.library.triton_op`, so that `torch.export` keeps it as one op and
AOTInductor compiles the kernel itself into a model's `model.pt2`.

Same schema and semantics as the CPU op: q [1, H, W, D] and the W new rows' k, v [1, KV, W, D]
are written to `slots` of layer `layer` of the cache [layers, 2, KV, S, D] first; row i then
attends to slots [lo_i, hi_i) (its sequence's committed prefix) and hi_i + j wherever tree[i, j]
(its tree window). Here the cache write is declared as a mutation (the op's schema says so): the
CPU op writes in place unannounced, and a triton_op must say what its kernels write. Why its own
name rather than a CUDA kernel of `ygg::attention`: a triton_op defines its operator itself, and
only a triton_op is traced into by AOTInductor (an opaque op with a Python kernel would need Python
and Triton at run time).

Row invariance, the reason this kernel exists (PyTorch's attention on the GPU picks its blocks and
splits by the width and the cache layout, so a token's row differed between plain decoding and a
tree verify on an H200: DESIGN.md §11). A row's *visible keys* are numbered t = 0, 1, ... in
position order — its prefix slots lo, lo + 1, ..., then its tree window's set slots in ascending
order — and everything is blocked by t, never by slot:
  - block b holds keys t in [b·BLOCK_N, (b+1)·BLOCK_N): the same keys for a token whether its
    ancestors sit in the committed prefix (plain decoding) or at scattered tree slots (a verify);
  - per block: scores s = q·k / sqrt(D) for the row's query heads (float32, a dot product of fixed
    shape), then the online softmax (running max m, denominator l, accumulator acc, each rescaled
    at block boundaries), all in float32;
  - one program per (row, kv head), the kv head's query heads together: no split of a row's keys,
    so neither the width, the other rows, the cache's size nor where the sequence sits in it enters
    a row's arithmetic.
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
from torch.library import triton_op, wrap_triton

BLOCK_N = 32  # visible keys per block, in position order
TREE_CHUNK = 32  # tree-window slots scanned at a time when a block reaches the row's tree keys
MIN_DOT = 16  # tl.dot's smallest dimension: query heads and head dimensions are padded up to it


@triton.jit
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


@triton.jit
def _attend(q, cache, lo, hi, tree, out, layer, T, scale, stride_qh, stride_qw, stride_cl, stride_c2, stride_ch,
            stride_cs, stride_tw, stride_oh, stride_ow, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
            DP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program (w, h): row w's attention for the G query heads of kv head h (module docstring)."""
    scale = tl.cast(scale, tl.float32)  # AOTInductor passes a float argument as fp64 (a launch, as fp32): the same value
    w = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    gm = g < G
    dm = d < D
    first = tl.load(lo + w)
    end = tl.load(hi + w)
    prefix = end - first
    trow = tree + w * stride_tw
    count = 0  # the row's tree keys
    for j0 in range(0, T, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        count += tl.sum(tl.load(trow + j, mask=j < T, other=0).to(tl.int32), axis=0)
    total = prefix + count
    heads = h * G + g
    qb = tl.load(q + heads[:, None] * stride_qh + w * stride_qw + d[None, :], mask=gm[:, None] & dm[None, :],
                 other=0.0).to(tl.float32)
    keys = cache + layer * stride_cl + h * stride_ch
    values = keys + stride_c2
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for t0 in range(0, total, BLOCK):
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
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        vb = tl.load(values + slot[:, None] * stride_cs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")
        m = m_new
    res = acc / tl.where(den > 0, den, 1.0)[:, None]  # a row that sees nothing: 0 / 1
    tl.store(out + heads[:, None] * stride_oh + w * stride_ow + d[None, :], res.to(out.dtype.element_ty),
             mask=gm[:, None] & dm[None, :])


def _padded(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


@triton_op("ygg::attention_cuda", mutates_args={"cache"})
def attention_cuda(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor, hi: Tensor,
                   tree: Tensor) -> Tensor:
    """`ygg::attention` on a GPU (the module docstring): writes k, v to the cache's slots, then
    returns [1, H, W, D] laid out like q."""
    _, heads, width, dim = q.shape
    kv = k.shape[1]
    out = torch.empty_like(q)
    dp = _padded(dim)
    wrap_triton(_write_kv)[(width, kv)](
        k, v, cache, slots, layer, k.stride(1), k.stride(2), v.stride(1), v.stride(2), cache.stride(0),
        cache.stride(1), cache.stride(2), cache.stride(3), D=dim, DP=dp)
    wrap_triton(_attend)[(width, kv)](
        q, cache, lo, hi, tree, out, layer, tree.shape[1], dim ** -0.5, q.stride(1), q.stride(2), cache.stride(0),
        cache.stride(1), cache.stride(2), cache.stride(3), tree.stride(0), out.stride(1), out.stride(2),
        G=heads // kv, GP=_padded(heads // kv), D=dim, DP=dp, BLOCK=BLOCK_N, CHUNK=TREE_CHUNK)
    return out


def reference(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor, hi: Tensor,
              tree: Tensor) -> Tensor:
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
            m = np.full(gp, -np.inf, np.float32)
            den = np.zeros(gp, np.float32)
            acc = np.zeros((gp, dp), np.float32)
            for t0 in range(0, len(seen), BLOCK_N):
                block = seen[t0 : t0 + BLOCK_N]
                kb = np.zeros((BLOCK_N, dp), np.float32)
                vb = np.zeros((BLOCK_N, dp), np.float32)
                kb[: len(block), :dim] = rows[0, h, block]
                vb[: len(block), :dim] = rows[1, h, block]
                s = np.matmul(qb, kb.T) * scale
                s[:, len(block) :] = -np.inf
                m_new = np.maximum(m, s.max(axis=1))
                alpha = np.exp(m - m_new)
                p = np.exp(s - m_new[:, None])
                den = den * alpha + p.sum(axis=1)
                acc = acc * alpha[:, None] + np.matmul(p, vb)
                m = m_new
            res = acc / np.where(den > 0, den, np.float32(1.0))[:, None]
            out[0, h * group : (h + 1) * group, w] = torch.from_numpy(res[:group, :dim])
    return out
