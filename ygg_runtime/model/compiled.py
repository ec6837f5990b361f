"""Ahead-of-time compiled forwards (docs/design.md, "The artifact"), written by `ygg_compile.aot` into one
`model.pt2` per model: one graph whose width (1..MAX_WIDTH) and attention span are dynamic (why
not one per width: see ygg_compile.aot).

The graph holds no weights: it loads the eager model's own parameters as user-managed constants,
so it shares one copy of the weights, and the eager path (`Transformer.forward`) stays usable
beside it. The KV cache is an input of every call (`kv.KVCache.data`): one graph fits a cache of
any size, set up anew at any time.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from ygg_runtime.backend import native
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.model.transformer import Transformer

GRAPH = "forward"  # its name inside the package
# The widest forward the graph takes (its width is dynamic up to it): the widest tree a plan may
# verify alone (`ygg_compile.build` refuses wider ones). Prompts run in narrower chunks (runner.PREFILL_CHUNK).
MAX_WIDTH = 512


def unpack_root() -> Path:
    """Where packages are unpacked to load: one directory per load, named by the loading process."""
    return Path(tempfile.gettempdir()) / "ygg-aoti"


def _sweep(root: Path) -> None:
    """Remove what loads by processes that are gone left behind (killed before they cleaned up)."""
    for d in root.iterdir() if root.is_dir() else ():
        pid = d.name.partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # another user's process: alive
            pass


def load_graph(path: Path, keep_unpacked: bool) -> torch._C._aoti.AOTIModelPackageLoader:
    """torch's C++ package loader, unpacking into a directory of ours rather than its own
    `$TMPDIR/aotinductor_*` (which a killed process leaves behind, a few MB to hundreds a load).
    On a CPU the shared library is mapped once loaded, so the directory goes at once; a GPU
    graph loads its kernels' binaries on first use, so there it goes when the process exits, or,
    if it is killed, at the next load on this machine. Not `torch._inductor.package.load_package`,
    its Python wrapper: importing it imports Inductor and Dynamo (~3 s of every `ygg` start on a
    2-core EPYC, besides ~0.6 s probing the compiler's vector ISAs for a device check that only
    warns), and its call re-parses the graph's call spec on every forward."""
    root = unpack_root()
    root.mkdir(parents=True, exist_ok=True)
    _sweep(root)
    unpacked = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = unpacked  # the C++ loader unpacks under temp_directory_path(), read now
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), GRAPH, False, 1, -1)  # one runner, current device
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
        if keep_unpacked:
            atexit.register(shutil.rmtree, unpacked, True)
        else:
            shutil.rmtree(unpacked, ignore_errors=True)


def constants(model: Transformer) -> dict[str, Tensor]:
    """Every tensor a compiled graph may read, by the name export gives it (tied weights under
    both names)."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


class CompiledForward:
    """Runs a forward through the compiled graph; same arguments and results as the model."""

    def __init__(self, path: Path, model: Transformer, min_width: int = 1):
        if model.device.type == "cpu":
            native.load()  # the ops the graph calls (`ygg::attention`, `ygg::qlinear`), before it is loaded
        self.min_width, self.max_width = min_width, MAX_WIDTH
        shared = constants(model)
        try:
            self.graph = load_graph(path, keep_unpacked=model.device.type != "cpu")
        except Exception as e:  # a corrupt or foreign package: one line, not a C++ trace
            raise YggError(f"cannot load the compiled forward {path}: {first_line(e)}") from None
        names = self.graph.get_constant_fqns()
        missing = [n for n in names if n not in shared]
        if missing:
            raise YggError(f"{path} was compiled for another model (it expects {missing[0]}): recompile")
        try:
            self.graph.load_constants({n: shared[n] for n in names}, False, True, user_managed=True)  # active set, all of them
        except Exception as e:  # same names, other shapes (another model size)
            raise YggError(f"{path} does not fit this model or cache: {first_line(e)}: recompile") from None

    def holds(self, width: int) -> bool:
        """Whether a forward of this width is within the graph's range."""
        return self.min_width <= width <= self.max_width

    def __call__(self, tokens: Tensor, positions: Tensor, slots: Tensor, lo: Tensor, hi: Tensor, tree: Tensor,
                 cache: Tensor, heads: Tensor) -> tuple[Tensor, Tensor]:
        logits, hidden = self.graph.run([tokens, positions, slots, lo, hi, tree, cache, heads])
        return logits, hidden
