"""The ops of a forward on a GPU: our own Triton kernels, every one row-invariant by construction,
eight a target layer (RMSNorm, the qkv GEMM with bias and RoPE, the KV write, attention, the wo GEMM
with the residual, RMSNorm, the w13 GEMM with SiLU·mul, the w2 GEMM with the residual), replayed as
one CUDA graph a forward width by the runner (`ygg_runtime.model.graphs`).

Why not cuBLAS and PyTorch's eager ops (docs/design.md, "Backends"): replayed as CUDA graphs they
took the 1.5B target's one-row forward to 9.0 ms on an H200, 10x the 0.88 ms its weights take to
stream, about 50 kernels a layer; and cuBLAS is only row-invariant with split-K off, which leaves a
one-row product of a narrow projection on a handful of SMs. Here split-K is fixed by the weight's
shape (`triton_linear.tiling`), so a one-row product spreads over the GPU and its rows keep their
bits at every width.

The kernels that split a sum across programs (the GEMMs' K splits, attention's parts) finish it in
the program that arrives last at a counter; the counters are int32 zeros this module keeps per
device, which every kernel leaves zero again. The forwards of one device run on one stream, one
after another, so one set of counters serves them all.

Also `ygg::attention`'s CUDA kernel (`backend.schema`): `torch.ops.ygg.attention` on CUDA tensors.
Under Triton's interpreter these same ops run on CPU tensors (the tests set a model's `ops` to
`CudaOps()`), which is how the CUDA path is tested on a machine without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ygg_runtime.backend import schema  # noqa: F401  (defines ygg::attention, whose CUDA kernel is below)
from ygg_runtime.backend import triton_attention, triton_linear, triton_rowwise
from ygg_runtime.backend.ops import Ops
from ygg_runtime.errors import YggError

COUNTERS = 1 << 16  # int32 counters kept per device at first (grown when a forward needs more)
_outgrown: list = []  # counters a larger set replaced (captured graphs may still use them)


class CudaOps(Ops):
    """invariant=False: the linears' K splits may follow the rows (`triton_linear.tiling`), for a
    model whose rows decide nothing alone — the drafter's (its one-row and its 64-row forwards then
    both split as suits them); the counters are shared with the invariant instance's."""

    name = "cuda"

    def __init__(self, invariant: bool = True, counters: dict | None = None):
        self.invariant = invariant
        self._counters: dict[torch.device, Tensor] = {} if counters is None else counters

    def counters(self, device: torch.device, n: int) -> Tensor:
        """At least n int32 zeros on `device`, which the kernels leave zero (module docstring). A
        larger set, when a forward needs one, is made beside the old, which stays allocated: a CUDA
        graph captured before holds the old one's address."""
        have = self._counters.get(device)
        if have is None or have.numel() < n:
            _outgrown.append(have)
            have = self._counters[device] = torch.zeros(max(n, COUNTERS), dtype=torch.int32, device=device)
        return have

    def _weight(self, layer: nn.Module) -> Tensor:
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, Tensor):
            raise YggError("quantized weights run on CPUs only (compile with --weights bf16 for this device)")
        return weight

    def embed(self, tokens: Tensor, table: nn.Module) -> Tensor:
        return F.embedding(tokens, self._weight(table))

    def rope(self, positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return triton_rowwise.rope(positions, inv_freq, scaling, dtype)

    def rmsnorm(self, x: Tensor, norm: nn.Module) -> Tensor:
        return triton_rowwise.rmsnorm(x, norm.weight, norm.eps)

    def qkv(self, x: Tensor, layer: nn.Module, rope: tuple[Tensor, Tensor], heads: int, kv_heads: int,
            head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
        b, w, _ = x.shape
        weight = self._weight(layer)
        cos, sin = rope
        out = triton_linear.linear(x, weight, self.counters(x.device, triton_linear.counters_needed(
            weight.shape[0], weight.shape[1], b * w, paired=True)), bias=layer.bias, epilogue=triton_linear.ROPE,
            rope=(cos, sin, head_dim // 2, heads + kv_heads), invariant=self.invariant)
        q, k, v = out.view(b, w, heads + 2 * kv_heads, head_dim).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
        return q, k, v

    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor,
                  hi: Tensor, tree: Tensor) -> Tensor:
        return triton_attention.attention(q, k, v, cache, layer, slots, lo, hi, tree,
                                          counters=self.counters(q.device, q.shape[2] * k.shape[1]))

    def linear(self, x: Tensor, layer: nn.Module, residual: Tensor | None = None) -> Tensor:
        weight = self._weight(layer)
        rows = x.numel() // x.shape[-1]
        return triton_linear.linear(x, weight, self.counters(x.device, triton_linear.counters_needed(*weight.shape, rows)),
                                    bias=layer.bias, residual=residual, invariant=self.invariant)

    def gated(self, x: Tensor, layer: nn.Module) -> Tensor:
        weight = self._weight(layer)
        rows = x.numel() // x.shape[-1]
        need = triton_linear.counters_needed(*weight.shape, rows, paired=True)
        return triton_linear.linear(x, weight, self.counters(x.device, need), epilogue=triton_linear.GATED,
                                    invariant=self.invariant)

    def logits(self, h: Tensor, layer: nn.Module, heads: Tensor | None) -> Tensor:
        weight = self._weight(layer)
        b, w, dim = h.shape
        rows = heads if heads is not None else torch.arange(w, device=h.device)
        need = triton_linear.counters_needed(*weight.shape, rows.numel())
        out = triton_linear.linear(h.view(b * w, dim), weight, self.counters(h.device, need), rows=rows,
                                   out_dtype=torch.float32, invariant=self.invariant)
        return out.view(b, rows.numel(), weight.shape[0])


OPS = CudaOps()  # the invariant ops (a target's) and a drafter's, one set of counters a device (`backend.for_device`)
FREE = CudaOps(invariant=False, counters=OPS._counters)


def _attention_kernel(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor, hi: Tensor,
                      tree: Tensor) -> Tensor:
    """`ygg::attention`'s CUDA kernel."""
    return OPS.attention(q, k, v, cache, layer, slots, lo, hi, tree)


torch.library.register_kernel("ygg::attention", "cuda", _attention_kernel)
