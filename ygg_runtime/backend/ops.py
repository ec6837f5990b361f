"""The ops a forward is made of: one signature each, in `Ops`; each device's implementation is a
subclass (`backend.cpu.CpuOps`, `backend.cuda.CudaOps`), and `backend.for_device` picks one."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Ops:
    """The ops of a forward: one signature each (this class), an implementation per device (its
    subclasses). Each takes the model's modules (their weights, and quantized layers on a CPU),
    so the decoder reads as the model it is."""

    name = "?"

    def place(self, weight: Tensor) -> Tensor:
        """Where the device keeps a weight that every forward streams (the tensor itself unless it
        knows a better place)."""
        return weight

    def embed(self, tokens: Tensor, table: nn.Module) -> Tensor:
        """tokens [1, W] -> their embeddings [1, W, dim]."""
        raise NotImplementedError

    def rope(self, positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The rotary tables of the positions [W], in the model's dtype, in the layout this
        backend's `qkv` reads."""
        raise NotImplementedError

    def rmsnorm(self, x: Tensor, norm: nn.Module) -> Tensor:
        """x [..., dim] normalised by the RMSNorm module `norm` (float32 norm, cast, weight)."""
        raise NotImplementedError

    def qkv(self, x: Tensor, layer: nn.Module, rope: tuple[Tensor, Tensor], heads: int, kv_heads: int,
            head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
        """The fused q, k, v projection of x [1, W, dim] (bias included), q and k rotated ->
        q [1, heads, W, head_dim], k and v [1, kv_heads, W, head_dim]."""
        raise NotImplementedError

    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor,
                  hi: Tensor, tree: Tensor) -> Tensor:
        """`ygg::attention` (`backend.schema`): k, v written to the cache's slots, then each row
        attends to its prefix and tree window -> [1, heads, W, head_dim]."""
        raise NotImplementedError

    def linear(self, x: Tensor, layer: nn.Module, residual: Tensor | None = None) -> Tensor:
        """layer(x) (its bias included), plus `residual` when given."""
        raise NotImplementedError

    def gated(self, x: Tensor, layer: nn.Module) -> Tensor:
        """silu(gate) · up, where layer(x) = [gate, up] (the feed-forward's fused w13)."""
        raise NotImplementedError

    def logits(self, h: Tensor, layer: nn.Module, heads: Tensor | None) -> Tensor:
        """The output head on the rows `heads` of h [1, W, dim] (every row when None), float32
        [1, rows, head rows]."""
        raise NotImplementedError
