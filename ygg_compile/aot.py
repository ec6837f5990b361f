"""Compile a model's forward ahead of time (DESIGN.md §9 recipe): `torch.export` (strict=False) of
the slot-cache forward, then AOTInductor with the weights left out of the shared object
(`package_constants_in_so=False`), every graph of a model bundled into one `model.pt2`. The runtime
(`ygg_runtime.compiled`) loads the eager model's weights and KV cache into every graph as
user-managed constants.

Two graphs per model, decided by measurement (1.5B target, bf16, 2 threads, interleaved medians;
numbers in the README): one graph whose width (2..MAX_WIDTH) and attention span are dynamic ran as
fast as one static graph per width (W = 4: 197 vs 204 ms, W = 16: 312 vs 322, W = 64: 770 vs 730 at
context 64; within 2 % at context 1000) and compiles once instead of once per width, and covers the
prompt's prefill chunks too. Width 1 is its own static graph, because export specialises a size
of 1. The span is dynamic because a mask over the whole cache made every forward attend to every
slot (slower than eager at a 2 k-slot cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from ygg_runtime.compiled import DYNAMIC, MAX_WIDTH, SINGLE
from ygg_runtime.model import Transformer


def example_args(width: int, span: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Inputs of a forward: tokens [1, W], positions [W], slots [W], mask [W, span]."""
    idx = torch.arange(width, device=device)
    mask = torch.ones(width, span, dtype=torch.bool, device=device).tril()
    return torch.zeros(1, width, dtype=torch.long, device=device), idx, idx, mask


def graphs_for(widths: tuple[int, ...] | list[int]) -> list[str]:
    """The graphs a model needs: the dynamic one always (prefill chunks), width 1 when used."""
    return ([SINGLE] if 1 in widths else []) + [DYNAMIC]


def compile_model(model: Transformer, graphs: list[str], path: Path,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Write `path` (model.pt2) holding the named graphs; returns the seconds each took."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti
    from torch.export import Dim

    if not model.max_len:
        raise ValueError("set up the model's KV cache (setup_cache) before compiling it")
    device = model.tok_embeddings.weight.device
    span = Dim("span", min=2, max=model.max_len)
    files, seconds = {}, {}
    for i, name in enumerate(graphs):
        start = time.time()
        if name == SINGLE:
            args, shapes = example_args(1, min(8, model.max_len), device), ({}, {}, {}, {1: span})
        else:
            width = Dim("width", min=2, max=min(MAX_WIDTH, model.max_len))
            args = example_args(min(8, model.max_len), min(16, model.max_len), device)
            shapes = ({1: width}, {0: width}, {0: width}, {0: width, 1: span})
        with torch.no_grad():
            program = torch.export.export(model, args, dynamic_shapes=shapes, strict=False)
            files[name] = aot_compile(program.module(), args, options={
                "aot_inductor.package": True, "aot_inductor.package_constants_in_so": False})
        seconds[name] = round(time.time() - start, 1)
        if progress:
            progress(i + 1, len(graphs))
    package_aoti(str(path), files)
    return seconds
