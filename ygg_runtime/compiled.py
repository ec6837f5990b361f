"""Ahead-of-time compiled forwards (DESIGN.md §7, §9): one AOTInductor graph per static width,
bundled in one `model.pt2` per model and written by `ygg_compile.aot`.

The graphs hold no weights: every width loads the eager model's own parameters and KV-cache buffers
as user-managed constants, so all widths share one copy of the weights and one cache, and the eager
path (`Transformer.forward`) stays usable beside them. A graph's attention mask spans the whole cache
(static shape): slots past the tree are simply masked out.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ygg_runtime.errors import YggError
from ygg_runtime.model import Transformer


def graph_name(width: int) -> str:
    return f"w{width}"


def constants(model: Transformer) -> dict[str, Tensor]:
    """Every tensor a compiled graph may read, by the name export gives it (tied weights under
    both names)."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


class CompiledForward:
    """Calls the compiled graph of a forward's width; same arguments and results as the model.
    The graphs hold the cache buffers they were given: build it after `setup_cache`, and again
    if the cache is ever set up anew."""

    def __init__(self, path: Path, model: Transformer, widths: tuple[int, ...]):
        from torch._inductor.package import load_package

        self.max_len = model.max_len
        self.calls: list[int] = []  # width of every compiled forward run, for tests and stats
        shared = constants(model)
        self.graphs = {}
        for w in widths:
            try:
                graph = load_package(str(path), model_name=graph_name(w))
            except Exception as e:  # a corrupt or foreign package: one line, not a C++ trace
                raise YggError(f"cannot load the compiled width {w} from {path}: {str(e).splitlines()[0]}") from None
            names = graph.get_constant_fqns()
            missing = [n for n in names if n not in shared]
            if missing:
                raise YggError(f"{path} was compiled for another model (it expects {missing[0]}): recompile")
            graph.load_constants({n: shared[n] for n in names}, check_full_update=True, user_managed=True)
            self.graphs[w] = graph

    def __call__(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        w, t = mask.shape
        self.calls.append(w)
        full = torch.zeros(w, self.max_len, dtype=torch.bool, device=mask.device)
        full[:, :t] = mask
        logits, hidden = self.graphs[w](tokens, positions, slots, full)
        return logits, hidden
