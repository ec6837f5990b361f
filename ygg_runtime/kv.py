"""The static, slot-addressed KV cache and its compaction: the one place where cache rows move.

A step writes the tree's nodes to the slots right after the committed prefix. After acceptance the
accepted path's rows are gathered into contiguous slots (compaction) and the rest are simply left
to be overwritten: nothing is recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    def __init__(self, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        super().__init__()
        shape = (1, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, slots: Tensor, k: Tensor, v: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """Store k, v [1, kv_heads, W, head_dim] at `slots`; return the first `length` slots."""
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        return self.k[:, :, :length], self.v[:, :, :length]

    def compact(self, src: Tensor, dst: Tensor) -> None:
        # Advanced indexing on the right copies first, so overlapping src/dst ranges are safe.
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]


def compact(caches: list[KVCache], src_slots: list[int], dst_start: int) -> None:
    """Move the rows at `src_slots` to dst_start, dst_start+1, ... in every layer's cache."""
    n = len(src_slots)
    if n == 0 or src_slots == list(range(dst_start, dst_start + n)):
        return
    device = caches[0].k.device
    src = torch.tensor(src_slots, device=device)
    dst = torch.arange(dst_start, dst_start + n, device=device)
    for cache in caches:
        cache.compact(src, dst)


def snapshot(caches: list[KVCache], start: int, n: int) -> list[tuple[Tensor, Tensor]]:
    """A copy of every layer's K and V rows at slots [start, start + n)."""
    return [(c.k[:, :, start : start + n].clone(), c.v[:, :, start : start + n].clone()) for c in caches]


def restore(caches: list[KVCache], rows: list[tuple[Tensor, Tensor]], start: int) -> None:
    """Write rows taken by `snapshot` back at slots [start, start + n) of every layer's cache."""
    for c, (k, v) in zip(caches, rows):
        n = k.shape[2]
        c.k[:, :, start : start + n] = k
        c.v[:, :, start : start + n] = v
