"""Compile a model's forward ahead of time (the recipe measured on these machines): `torch.export` (strict=False) of
the slot-cache forward, then AOTInductor with the weights left out of the shared object
(`package_constants_in_so=False`), packaged as the model's `model.pt2`. The runtime
(`ygg_runtime.model.compiled`) loads the eager model's weights into it as user-managed constants; the
KV cache is an input of every call, of any size.

One graph per model, whose width (1..MAX_WIDTH), tree window and cache size are dynamic, decided by
measurement (1.5B target, bf16, 2 threads, interleaved medians over 6 repeats, alone): it ran as fast
as one static graph per width (W = 4: 197 vs 204 ms, W = 16: 312 vs 322, W = 64: 770 vs 730 at
context 64; within 2 % at context 1000), compiles once (≈50 s) instead of once per width (≈35 s
each), and covers the prompt's prefill chunks too. Width 1 joins the dynamic range because export
is told not to specialise sizes of 1 (`backed_size_oblivious`); it measured 187 vs 225 ms eager.
What a row sees is given as its prefix range and tree window (`ygg::attention`: `ygg_runtime.backend`), not
as a mask over the cache: a mask over the whole cache made every forward attend to every slot (slower
than eager at a 2 k-slot cache), and the cache `ygg serve` sizes by memory holds tens of thousands.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ygg_runtime.backend import native
from ygg_runtime.model.compiled import GRAPH, MAX_WIDTH
from ygg_runtime.files import cache_dir, write_atomic
from ygg_runtime.machine import cpu_flags
from ygg_runtime.model.transformer import Transformer

PACKAGE = "model.pt2"  # per model, beside its weights
GRAPHS = "graphs"  # the cache's subdirectory of compiled forwards (`ygg cache ls`)
OPTIONS = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False}


def example_args(model: Transformer, width: int, window: int) -> tuple[torch.Tensor, ...]:
    """Inputs of a forward: tokens [1, W], positions [W], slots [W], lo and hi [W], tree [W, T],
    the cache, heads [H] (the rows whose logits are wanted; H, T other than W, so that export keeps
    the sizes apart). Every input is its own tensor: export treats one tensor passed twice as one
    input, and the graph would then read the slots as the positions."""
    device = model.device
    positions = torch.arange(width, device=device)
    tree = torch.ones(width, window, dtype=torch.bool, device=device).tril()
    zeros = torch.zeros(width, dtype=torch.long, device=device)
    heads = torch.arange(max(1, width - 3), device=device)
    return (torch.zeros(1, width, dtype=torch.long, device=device), positions, positions.clone(), zeros,
            zeros.clone(), tree, model.kv.data, heads)


class Compiled(NamedTuple):
    seconds: float
    narrowest: int  # 1, or 2 when export cannot keep one row dynamic (see compile_model)
    reused: bool  # the package came from the cache: the same graph was compiled before


def compile_model(model: Transformer, path: Path, progress: Callable[[int, int], None] | None = None) -> Compiled:
    """Write `path` (model.pt2) holding the model's compiled forward; returns the seconds it took,
    the narrowest width it takes: 1, or 2 when export cannot keep one row dynamic (a kernel
    that branches on a size of 1 makes export guard on it, as PyTorch's attention did on CUDA:
    the graph then starts at two rows, and a one-row forward runs eager), and whether the package
    was the cache's: the package holds no weights, so a graph exported before (the same model
    architecture, dtype and weight formats, on a machine of the same kind: `graph_key`) reuses
    the package compiled then (AOTInductor took 26 s of a tiny model's 29, ~50 s of a 1.5B's)."""
    import torch.fx.experimental._config as shape_config
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti
    from torch.export import Dim

    if not model.max_len:
        raise ValueError("set up the model's KV cache (setup_cache) before compiling it")
    start = time.time()
    if model.max_len < 32:
        raise ValueError("compile with a cache of at least 32 slots (the example forward's)")
    window = Dim("window", min=1, max=1 << 20)
    slots = Dim("slots", min=2, max=1 << 30)
    heads = Dim("heads", min=1, max=MAX_WIDTH)
    args = example_args(model, 8, 12)
    with torch.no_grad(), shape_config.patch(backed_size_oblivious=True), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations, printed per graph
        for narrowest in (1, 2):
            width = Dim("width", min=narrowest, max=MAX_WIDTH)
            shapes = ({1: width}, {0: width}, {0: width}, {0: width}, {0: width}, {0: width, 1: window}, {3: slots},
                      {0: heads})
            try:
                program = torch.export.export(model, args, dynamic_shapes=shapes, strict=False)
                break
            except Exception as e:  # torch's UserError: a guard on the width's value (see the docstring)
                if narrowest == 2 or "width" not in str(e):
                    raise
        if progress:
            progress(1, 2)
        cached = cache_dir() / GRAPHS / f"{model.args.arch}-{graph_key(program, model)[:32]}.pt2"
        reused = cached.is_file()
        if reused:
            shutil.copyfile(cached, path)
        else:
            package_aoti(str(path), {GRAPH: aot_compile(program.module(), args, options=OPTIONS)})
            _keep(path, cached)
    if progress:
        progress(2, 2)
    return Compiled(round(time.time() - start, 1), narrowest, reused)


def graph_key(program: torch.export.ExportedProgram, model: Transformer) -> str:
    """What AOTInductor's code depends on: the exported graph (its code, signature and dynamic
    ranges; its inputs' and weights' shapes, dtypes and strides, not the weights' values), this
    module's recipe, torch and Inductor's settings, the threads Inductor plans loops for, and the
    machine it builds for (a CPU's flags, instruction set and compiler; a GPU's capability)."""
    inputs = [(n.name, str(n.meta.get("val")), str(getattr(n.meta.get("val"), "stride", lambda: None)()))
              for n in program.graph.nodes if n.op == "placeholder"]
    tensors = {**program.state_dict, **program.constants}
    weights = [(k, tuple(v.shape), str(v.dtype), tuple(v.stride()), v.device.type) for k, v in sorted(tensors.items())]
    device = model.device
    machine = [device.type, native.compiler_version()]  # the C++ compiler builds the wrapper on any device
    if device.type == "cpu":
        machine += [sorted(cpu_flags()), native.vector_isa()]
    else:
        machine += [torch.version.cuda, torch.cuda.get_device_capability(device)]
    from torch._inductor import config

    # aot_compile writes the machine it built for into aot_inductor.metadata and leaves it there: a
    # process's second compile would see other settings than its first (the machine is keyed above)
    settings = sorted((k, v) for k, v in config.save_config_portable().items() if k != "aot_inductor.metadata")
    parts = (program.graph_module.code, str(program.graph_signature), str(program.range_constraints), inputs, weights,
             Path(__file__).read_bytes(), OPTIONS, torch.__version__, settings, torch.get_num_threads(), machine)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _keep(package: Path, cached: Path) -> None:
    """A copy of the package for the next compile of the same graph (`write_atomic`: a reader never
    sees half of one); a cache that cannot be written costs the next compile its time, nothing else."""
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, package.read_bytes())


# Compiler flags whose /proc/cpuinfo name is not the flag itself without its "-m".
_CPUINFO_NAMES = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
                  "amx-tile": "amx_tile", "amx-bf16": "amx_bf16", "amx-int8": "amx_int8", "amx-fp16": "amx_fp16"}


def cpu_requirements(device: str) -> dict:
    """The vector ISA Inductor builds CPU code for on this machine and the CPU flags (as
    /proc/cpuinfo names them) that code needs: recorded in the plan, checked by `ygg run`."""
    if not device.startswith("cpu"):
        return {"isa": None, "cpu_flags": []}
    isa, flags = native.vector_isa()
    names = (f.removeprefix("-m") for f in flags)
    return {"isa": isa, "cpu_flags": sorted({_CPUINFO_NAMES.get(f, f.replace("-", "_")) for f in names})}
