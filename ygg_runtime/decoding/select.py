"""Exact choices over a vocabulary-wide row at a reduction's speed.

A step picks a few tokens out of rows of 65 536–151 936 logits: the target's choice at every tree
node (greedy acceptance, coupled sampling's) and the drafter's top children. On a CPU `argmax` and
`topk` over such a row are scalar loops (~0.13 and ~0.11 ms a row here) while `amax` is vectorized
(~0.01 ms), so both first take each block's maximum and then look only inside the blocks that can
hold the answer: the same tokens, exactly (on a GPU the same two small kernels).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCKS = 64  # a row's blocks at most (the row length's largest divisor up to it)


def _blocks(rows: Tensor) -> Tensor:
    n, v = rows.shape
    return rows.reshape(n, math.gcd(v, BLOCKS), -1)


def first_max(rows: Tensor) -> Tensor:
    """Each row's argmax [n] (its first maximum, as `torch.argmax`), bit for bit: the argmax inside
    the first block whose maximum is the row's. That block holds the row's first maximum, so ties
    and NaN (which `argmax` ranks highest, as `amax` keeps it) go where `argmax` sends them."""
    blocks = _blocks(rows)
    block = blocks.amax(-1).argmax(-1)
    return block * blocks.shape[-1] + blocks[torch.arange(rows.shape[0], device=rows.device), block].argmax(-1)


def top_k(rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's k largest values and their indices [n, k], largest first (as `torch.topk`; ties
    in either order). They lie in the k blocks with the largest maxima: a value in any other block
    has k blocks' maxima at or above it."""
    blocks = _blocks(rows)
    n, b, size = blocks.shape
    k = min(k, rows.shape[-1])
    if k >= b:
        top = rows.topk(k)
        return top.values, top.indices
    chosen = blocks.amax(-1).topk(k).indices  # [n, k]
    inside = blocks.gather(1, chosen[:, :, None].expand(n, k, size)).reshape(n, k * size).topk(k)
    return inside.values, chosen.gather(1, inside.indices // size) * size + inside.indices % size
