"""The torch operators a forward calls: one schema and one name each, an implementation per device.

`ygg::attention` is defined here, not in the C++ library: its CPU kernel (csrc/attention.cpp) and
its CUDA kernel (`ygg_runtime.backend.cuda`, Triton) register against this one definition, so a
GPU process needs no C++ compiler and a process with both sees one operator. Its schema declares
the cache write (`Tensor(a!) cache`), so tracing (torch.export, AOTInductor) knows the call
mutates its cache input and keeps it in place. `ygg::qlinear` (quantized weights) has a CPU kernel
only and is defined with it (csrc/qlinear.cpp).
"""

from __future__ import annotations

import torch
from torch import Tensor

ATTENTION = ("(Tensor q, Tensor k, Tensor v, Tensor(a!) cache, int layer, Tensor slots, Tensor lo, Tensor hi, "
             "Tensor tree) -> Tensor")



def _attention_shape(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor, hi: Tensor,
                     tree: Tensor) -> Tensor:
    """What the kernel returns, for tracing (torch.export, AOTInductor): a tensor laid out like q,
    exactly as the CPU kernel allocates it (compiled code reads the result with these strides)."""
    return torch.empty_like(q)


def _defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
        return True
    except RuntimeError:
        return False


if not _defined("ygg::attention"):  # once a process (torch.library keeps the definition alive)
    torch.library.define("ygg::attention", ATTENTION)
    torch.library.register_fake("ygg::attention")(_attention_shape)
