"""The static, slot-addressed KV cache and the one place where its rows move: compaction after a
step, a sequence's region moving to another place in the cache, and the prefix cache's copies.

Every layer's keys and values live in one tensor [layers, 2, kv_heads, slots, head_dim], which
the forward takes as an input (so a compiled graph fits a cache of any size: `ygg serve` sizes
it by memory). A step writes the tree's nodes to the slots right after the committed prefix.
After acceptance the accepted path's rows are gathered into contiguous slots (compaction) and the
rest are simply left to be overwritten: nothing is recomputed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ygg_runtime.transfer import to_device


class LayerKV(NamedTuple):
    """One layer's keys and values, views [1, kv_heads, slots, head_dim] of the cache."""

    k: Tensor
    v: Tensor


class KVCache:
    def __init__(self, n_layers: int, slots: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (n_layers, 2, n_kv_heads, slots, head_dim)
        self.data = lazy_zeros(shape, dtype) if torch.device(device).type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        """What one token costs the cache (every layer's key and value)."""
        n_layers, two, heads, _, dim = self.data.shape
        return n_layers * two * heads * dim * self.data.element_size()

    def layers(self) -> list[LayerKV]:
        return [LayerKV(self.data[i, 0][None], self.data[i, 1][None]) for i in range(self.data.shape[0])]


ALIGN = 64


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Zeros in memory the system hands out zeroed and untouched (calloc: fresh pages are mapped on
    first write). torch.zeros writes every byte, so a cache sized for the model's whole context
    (32 768 tokens: 2.7 GB for the float32 Qwen pair) would be resident from the start; this one
    costs what the sequences write."""
    count = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(count + ALIGN, dtype=np.uint8))
    skip = -raw.data_ptr() % ALIGN  # as torch's own allocator aligns (compiled code may assume it)
    return raw[skip : skip + count].view(dtype).view(shape)


def compact(cache: KVCache, src_slots: list[int], dst_start: int) -> None:
    """Move the rows at `src_slots` to dst_start, dst_start+1, ... in every layer."""
    n = len(src_slots)
    if n == 0 or src_slots == list(range(dst_start, dst_start + n)):
        return
    device = cache.data.device
    src = to_device(src_slots, device)
    dst = torch.arange(dst_start, dst_start + n, device=device)
    # Advanced indexing on the right copies first, so overlapping src/dst ranges are safe.
    cache.data[:, :, :, dst] = cache.data[:, :, :, src]


def move(cache: KVCache, src_start: int, n: int, dst_start: int) -> None:
    """Move slots [src_start, src_start + n) to [dst_start, dst_start + n) (a region moving)."""
    if not n or src_start == dst_start:
        return
    src = cache.data[:, :, :, src_start : src_start + n]
    overlap = abs(src_start - dst_start) < n  # then copy through a temporary, else straight across
    cache.data[:, :, :, dst_start : dst_start + n] = src.clone() if overlap else src


def snapshot(cache: KVCache, start: int, n: int) -> Tensor:
    """A copy of every layer's K and V rows at slots [start, start + n)."""
    return cache.data[:, :, :, start : start + n].clone()


def restore(cache: KVCache, rows: Tensor, start: int) -> None:
    """Write rows taken by `snapshot` back at slots [start, start + n)."""
    cache.data[:, :, :, start : start + rows.shape[3]] = rows
