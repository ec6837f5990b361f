"""The ops of a forward on a CPU: the eager composition of PyTorch ops that the CPU's compiled graphs
are exported from (AOTInductor fuses the row-local ones), around our C++ kernels — `ygg::attention`
and, for quantized weights, `ygg::qlinear` (`backend.native`). Each op spells exactly the ops the
decoder ran before the backends were split out, so the CPU's bits and graphs are what they were."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ygg_runtime.backend import native
from ygg_runtime.backend.ops import Ops


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CpuOps(Ops):
    name = "cpu"

    def place(self, weight: Tensor) -> Tensor:
        """In memory backed by huge pages once the process has the native kernels (`native.huge_copy`)."""
        return native.huge_copy(weight) if native.loaded() is not None else weight

    def embed(self, tokens: Tensor, table: nn.Module) -> Tensor:
        return table(tokens)

    def rope(self, positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None].float() * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def rmsnorm(self, x: Tensor, norm: nn.Module) -> Tensor:
        # Normalise in float32 and cast back before the weight, exactly as transformers does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
        return norm.weight * h.to(x.dtype)

    def qkv(self, x: Tensor, layer: nn.Module, rope: tuple[Tensor, Tensor], heads: int, kv_heads: int,
            head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
        b, w, _ = x.shape
        q, k, v = layer(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(b, w, heads, head_dim).transpose(1, 2)
        k = k.view(b, w, kv_heads, head_dim).transpose(1, 2)
        v = v.view(b, w, kv_heads, head_dim).transpose(1, 2)
        cos, sin = rope
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor,
                  hi: Tensor, tree: Tensor) -> Tensor:
        return native.attention(q, k, v, cache, layer, slots, lo, hi, tree)

    def linear(self, x: Tensor, layer: nn.Module, residual: Tensor | None = None) -> Tensor:
        y = layer(x)
        return y if residual is None else residual + y

    def gated(self, x: Tensor, layer: nn.Module) -> Tensor:
        gate, up = layer(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def logits(self, h: Tensor, layer: nn.Module, heads: Tensor | None) -> Tensor:
        return layer(h if heads is None else h[:, heads]).float()
