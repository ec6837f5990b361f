"""Compile a model's forward ahead of time, once per static width (DESIGN.md §9 recipe):
`torch.export` (strict=False) of the slot-cache forward with a whole-cache attention mask, then
AOTInductor with the weights left out of the shared object (`package_constants_in_so=False`), every
width bundled into one `model.pt2`. The runtime (`ygg_runtime.compiled`) loads the eager model's
weights and KV cache into every width as user-managed constants.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from ygg_runtime.compiled import graph_name
from ygg_runtime.model import Transformer


def example_args(width: int, max_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Inputs of a width-`width` forward: tokens [1, W], positions [W], slots [W], mask [W, max_len]."""
    idx = torch.arange(width, device=device)
    mask = torch.ones(width, max_len, dtype=torch.bool, device=device).tril()
    return torch.zeros(1, width, dtype=torch.long, device=device), idx, idx, mask


def compile_widths(model: Transformer, widths: tuple[int, ...], path: Path,
                   progress: Callable[[int, int], None] | None = None) -> dict[int, float]:
    """Write `path` (model.pt2) with one compiled forward per width; returns seconds per width."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    if not model.max_len:
        raise ValueError("set up the model's KV cache (setup_cache) before compiling it")
    device = model.tok_embeddings.weight.device
    files, seconds = {}, {}
    for i, w in enumerate(widths):
        start = time.time()
        args = example_args(w, model.max_len, device)
        with torch.no_grad():
            program = torch.export.export(model, args, strict=False)
            files[graph_name(w)] = aot_compile(program.module(), args, options={
                "aot_inductor.package": True, "aot_inductor.package_constants_in_so": False})
        seconds[w] = time.time() - start
        if progress:
            progress(i + 1, len(widths))
    package_aoti(str(path), files)
    return seconds
