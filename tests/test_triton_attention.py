"""The GPU attention kernel (ygg_runtime/backend/triton_attention.py), run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py where there is no GPU): the kernel itself, bit for bit
against the reference that spells its blocks in numpy, in one part a row and split in PARTS parts
(flash-decoding, merged by the last part); right against float64; a row's bits independent of the
forward around it; one operator, `ygg::attention`, with a CPU and a CUDA kernel. Bits on a GPU are
the GPU's own business (`make gpu-check`): the interpreter computes with numpy."""

from __future__ import annotations

import pytest
import torch

from ygg_runtime.backend import native, triton_attention
from ygg_runtime.backend.triton_attention import BLOCK_N, PARTS, SPLIT, TREE_CHUNK, reference
from ygg_runtime.backend.triton_linear import as_dtype, to_dtype


def attention(*args, parts: int = PARTS):
    """The kernel, its row's keys spread over PARTS programs (as a forward runs it), or in one."""
    counters = torch.zeros(256, dtype=torch.int32) if parts > 1 else None
    out = triton_attention.attention(*args, counters=counters)
    assert counters is None or not counters.any()  # left zero for the next call
    return out


def rounded(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference's float32 result as the interpreted kernel stores it in `dtype` (bfloat16: the
    interpreter drops the low 16 bits, where a GPU rounds to nearest)."""
    return as_dtype(to_dtype(ref.numpy(), dtype), dtype)


def case(heads=6, kv=2, dim=64, width=5, slots=420, prefix=370, window=40, dtype=torch.float32, seed=0):
    """A forward of `width` new rows after a `prefix`-token sequence at slot 3 of the cache: rows
    0..2 see the prefix and a tree window with holes (window > TREE_CHUNK, so the window is read in
    several chunks), row 3 sees a single slot, the last row nothing at all."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, width, heads, dim, generator=g) * 2).to(dtype).transpose(1, 2)  # strided, as the model's
    k = torch.randn(1, kv, width, dim, generator=g).to(dtype)
    v = torch.randn(1, kv, width, dim, generator=g).to(dtype)
    cache = torch.randn(2, 2, kv, slots, dim, generator=g).to(dtype)
    base, hi = 3, 3 + prefix
    tree = torch.rand(width, window, generator=g) < 0.4
    slots_t = torch.tensor([hi + 1 + 7 * i for i in range(width)])
    lo = torch.full((width,), base)
    his = torch.full((width,), hi)
    lo[-2], his[-2], tree[-2] = 50, 50, False
    tree[-2, 0] = True  # one slot: hi + 0
    lo[-1], his[-1], tree[-1] = 9, 9, False  # nothing visible
    return q, k, v, cache, 1, slots_t, lo, his, tree


@pytest.mark.parametrize("dtype,heads,kv,dim,parts", [(torch.float32, 6, 2, 64, PARTS), (torch.bfloat16, 6, 2, 64, PARTS),
                                                      (torch.bfloat16, 4, 4, 16, 1), (torch.float16, 12, 2, 24, PARTS),
                                                      (torch.float32, 6, 2, 64, 1)])
def test_the_gpu_kernel_gives_its_references_bits_under_the_interpreter(dtype, heads, kv, dim, parts):
    """GQA groups of 1 to 6 heads, a head dimension that is not a power of two, a prefix over
    several chunks of keys (so several parts, merged), rows seeing one slot and none; the cache
    written at exactly the slots."""
    q, k, v, cache, layer, slots, lo, hi, tree = case(heads, kv, dim, dtype=dtype)
    assert 370 > 2 * SPLIT and SPLIT > 2 * BLOCK_N and tree.shape[1] > TREE_CHUNK
    mine, theirs = cache.clone(), cache.clone()
    out = attention(q, k, v, mine, layer, slots, lo, hi, tree, parts=parts)
    ref = reference(q, k, v, theirs, layer, slots, lo, hi, tree, parts=parts)
    assert out.dtype == dtype and out.shape == q.shape and out.stride() == q.stride()
    assert torch.equal(mine, theirs)
    assert torch.equal(out, rounded(ref, dtype))
    assert not out[0, :, -1].any()  # a row that sees nothing gives zeros, not NaN


def test_the_reference_tells_a_merge_in_another_order_apart():
    """The bit-for-bit comparison has the power to see the merge's order: the same keys merged in
    one part and in PARTS parts differ in float32 (so a kernel that merged its parts in arrival
    order, or split by the width, would fail the test above)."""
    q, k, v, cache, layer, slots, lo, hi, tree = case()
    one = reference(q, k, v, cache.clone(), layer, slots, lo, hi, tree, parts=1)
    split = reference(q, k, v, cache.clone(), layer, slots, lo, hi, tree, parts=PARTS)
    assert not torch.equal(one, split) and torch.allclose(one, split, atol=1e-5)


@pytest.mark.parametrize("parts", [1, PARTS])
def test_the_gpu_kernel_matches_a_float64_softmax(parts):
    q, k, v, cache, layer, slots, lo, hi, tree = case()
    out = attention(q, k, v, cache, layer, slots, lo, hi, tree, parts=parts)
    group = q.shape[1] // k.shape[1]
    for w in range(q.shape[2] - 1):
        seen = list(range(lo[w], hi[w])) + [int(hi[w]) + j for j in tree[w].nonzero().flatten().tolist()]
        keys, values = cache[layer, 0][:, seen].double(), cache[layer, 1][:, seen].double()
        for h in range(q.shape[1]):
            s = keys[h // group] @ q[0, h, w].double() / q.shape[-1] ** 0.5
            expect = torch.softmax(s, 0) @ values[h // group]
            assert (out[0, h, w].double() - expect).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [45, 2 * SPLIT + 45])
def test_a_rows_bits_under_the_gpu_kernel_do_not_depend_on_the_forward_around_it(dtype, context):
    """A token at depth 2 of a tree, its ancestors at scattered tree slots between siblings, scored
    (a) as plain decoding scores it: one row, every earlier token in the contiguous prefix of a
    sequence at slot 0; (b) in a tree verify of width 6 whose sequence sits at slot 37, its prefix
    ending mid-block; (c) the same verify with other rows and a wider window around it. Bitwise
    the same output and the same cache row (float32 shows any change of the arithmetic's order)."""
    dim, heads, kv = 32, 4, 2
    g = torch.Generator().manual_seed(3)
    # committed tokens: the prefix ends inside the second key block (of the third chunk: three parts merged)
    hist_k = torch.randn(kv, context + 3, dim, generator=g).to(dtype)  # every position's key...
    hist_v = torch.randn(kv, context + 3, dim, generator=g).to(dtype)
    q = torch.randn(1, heads, 1, dim, generator=g).to(dtype)  # ... and the depth-2 token's query

    def plain():
        cache = torch.zeros(1, 2, kv, context + 60, dim, dtype=dtype)
        n = context + 2  # the prefix and both ancestors, committed
        cache[0, 0, :, :n], cache[0, 1, :, :n] = hist_k[:, :n], hist_v[:, :n]
        k, v = hist_k[None, :, n : n + 1], hist_v[None, :, n : n + 1]
        one = torch.ones(1, 1, dtype=torch.bool)
        out = attention(q, k, v, cache, 0, torch.tensor([n]), torch.tensor([0]), torch.tensor([n]), one)
        return out[0, :, 0], cache[0, :, :, n]

    def verify(width: int, window: int, seed: int):
        base = 37
        cache = torch.randn(1, 2, kv, context + 160, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
        cache[0, 0, :, base : base + context], cache[0, 1, :, base : base + context] = hist_k[:, :context], hist_v[:, :context]
        tree = torch.zeros(width, window, dtype=torch.bool)
        at = {0: 0, 1: 2, 2: width - 1}  # ancestors at tree slots 0 and 2, the token at the last row
        for depth, slot in at.items():
            tree[slot, [at[d] for d in range(depth + 1)]] = True
        for r in range(width):
            if r not in at.values():
                tree[r, r] = True
                tree[r, 0] = True  # siblings, seeing the root
        qs = torch.randn(1, heads, width, dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        ks = torch.randn(1, kv, width, dim, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
        vs = torch.randn(1, kv, width, dim, generator=torch.Generator().manual_seed(seed + 3)).to(dtype)
        for depth, slot in at.items():
            ks[0, :, slot], vs[0, :, slot] = hist_k[:, context + depth], hist_v[:, context + depth]
        qs[0, :, width - 1] = q[0, :, 0]
        start = base + context
        out = attention(qs, ks, vs, cache, 0, torch.arange(start, start + width), torch.full((width,), base),
                        torch.full((width,), start), tree)
        return out[0, :, width - 1], cache[0, :, :, start + width - 1]

    expect = plain()
    for got in (verify(6, 6, 10), verify(8, 40, 20)):
        assert torch.equal(got[0], expect[0])
        assert torch.equal(got[1], expect[1])


def test_attention_is_one_operator_with_a_cpu_and_a_cuda_kernel_that_declares_its_cache_write():
    from ygg_runtime.backend import cuda  # noqa: F401  (registers the CUDA kernel)

    native.load()
    op = torch.ops.ygg.attention.default
    assert all(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key) for key in ("CPU", "CUDA"))
    written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["cache"]
    assert not hasattr(torch.ops.ygg, "attention_cuda")
