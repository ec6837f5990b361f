"""Our native kernels (csrc/*.cpp, one library): `ygg::attention` and `ygg::qlinear`, both computing
every row of a forward independently of the rows beside it.

`ygg::attention`: attention in which a row's result depends only on its query and on the keys and
values it may see, in cache-slot order; it writes the forward's new keys and values to the cache
first (the cache is an input of the forward, not a constant of its graph, so one compiled graph fits
a cache of any size), and takes what each row sees as its sequence's prefix range and tree window,
so a call costs what its rows see, not what the cache holds.

Why not PyTorch's: measured on the 2-core AVX-512 CPU (torch 2.13, Qwen2.5-Coder-1.5B in bfloat16),
the forward of a token gave bitwise-different logits depending on the verify around it, and every
op whose kernel changes was found by running one row at several widths and layouts:
- `scaled_dot_product_attention` sums over cache *slots* in SIMD lanes and blocks. In a tree verify
  a node's ancestors sit at scattered slots with siblings between them; in plain decoding they are
  contiguous. The same keys summed in another association changed the bfloat16 output in 4 of 400
  random trials, and a row's output changed with the number of query rows beside it in 91 of 400
  (it takes another path below 4 rows: why padding plain decoding to width 2 used to disagree with
  every verify of 4+; `benchmarks/attention_kernel.py` reproduces both). Over 28 layers that is
  most rows: with every forward padded to width 4, 57 of one prompt's 64 accepted rows in an `egt`
  run differed from `ar`'s in some bit, and `egt` left `ar`'s text on 1 of 8 held-out prompts.
- bf16 `F.linear` (oneDNN) gives row 0 the same bits for every M >= 2 but not M = 1 (a gemv path):
  why a one-token forward is never used (the compile-time check, `ygg_compile.invariance`, finds
  the narrowest width from which whole forwards agree and every target forward is padded to it).
Everything else in the eager forward (norms, RoPE, SiLU, the KV writes) is row by row; the compiled
graph's fused kernels are for the check to judge.

`ygg::qlinear` (csrc/qlinear.cpp): the linear layers of quantized weights (`ygg_runtime.model.quant`),
int8 dot products summed exactly in int32 per super-block, over weight tiles streamed once and
unpacked once per 8 rows while the next tile is prefetched; row-invariant by construction, so a
quantized model needs no padding at all, plain decoding included. On a CPU with AMX the same sums
can run on AMX tiles (YGG_QLINEAR=amx: 16 rows x 16 columns x a group per instruction), the same bits;
not the default until a Xeon measures from which width it pays. csrc/roofline.cpp measures the
machine's two roofs (int8 peak, read bandwidth) on the same threads.

The library is built with the system C++ compiler against the installed torch (about a minute, its
sources side by side; cached under the user cache keyed by sources, torch version and instruction
set), for the same vector ISA Inductor compiles for, so the plan's recorded CPU flags cover it.
`ygg compile` copies the build into the artifact, so `ygg run` needs no compiler. The library
implements `ygg::attention` for CPUs; the operator is defined once in `ygg_runtime.backend.schema`,
and its CUDA implementation is the Triton kernel of `ygg_runtime.backend.triton_attention`.
Quantized weights run on CPUs only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from ygg_runtime.backend import schema  # noqa: F401  (defines ygg::attention, which the library implements)
from ygg_runtime.errors import YggError, out_of_space
from ygg_runtime.files import cache_dir, locked, write_atomic
from ygg_runtime.machine import cpu_flags

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "attention.cpp", CSRC / "qlinear.cpp", CSRC / "roofline.cpp")
LIBRARY = "kernels.so"  # its name inside an artifact
_loaded: Path | None = None


def loaded() -> Path | None:
    """The library this process registered `ygg::attention` from (None: not yet)."""
    return _loaded


def version(device: str = "cpu") -> str:
    """Which attention a forward on `device` runs: its kernel's source hash (latency profiles record
    it: another attention is another timing)."""
    source = SOURCES[0] if device.startswith("cpu") else Path(__file__).parent / "triton_attention.py"
    return hashlib.sha256(source.read_bytes()).hexdigest()[:12]


def qlinear_version() -> str:
    """The quantized linear kernel's source hash (profiles of quantized weights record it)."""
    return hashlib.sha256(SOURCES[1].read_bytes()).hexdigest()[:12]


def isa_flags(cxx: str | None = None) -> list[str]:
    """The compiler's instruction-set flags: those Inductor builds this machine's code with."""
    return vector_isa(cxx)[1]


def vector_isa(cxx: str | None = None) -> tuple[str | None, list[str]]:
    """The vector instruction set Inductor builds this machine's code for (None: none) and its
    compiler flags. Asking Inductor imports it (and Dynamo) and compiles a probe program per
    instruction set: ~5 s of every process that builds or finds the kernels, on the 2-core EPYC. So
    the answer is kept in the cache, keyed by all it depends on: the CPU's flags, torch, the
    compiler and ATEN_CPU_CAPABILITY (which caps Inductor's pick)."""
    cxx = cxx or _compiler()
    asked = (sorted(cpu_flags()), torch.__version__, _compiler_version(cxx), os.environ.get("ATEN_CPU_CAPABILITY"))
    key = hashlib.sha256(repr(asked).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"isa-{key}.json"
    try:
        found = json.loads(path.read_text())
        return found["isa"], found["flags"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    flags = [f for f in isa.build_arch_flags().split() if f.startswith("-m") and not f.startswith("-march")]
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the probe next time, nothing else
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"isa": str(isa) or None, "flags": flags}).encode())
    return str(isa) or None, flags


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise YggError("cannot build the native kernels: no C++ compiler found (install g++, or set CXX)")
    return cxx


def compiler_version() -> list[str]:
    """This machine's C++ compiler and its release: part of the key of whatever it builds."""
    return _compiler_version(_compiler())


@functools.cache
def _compiler_version(cxx: str) -> list[str]:
    """The first line `cxx --version` prints: which compiler, and which release of it (asked once a
    process: the ISA cache's key and the build's both need it)."""
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]


def build(cache: Path | None = None, isa: list[str] | None = None) -> Path:
    """The kernels compiled for this machine (or for the instruction-set flags `isa`, which tests
    use to build the portable paths): reused from `cache` when the same sources, torch, compiler and
    flags built them before, else compiled now (written under a temporary name, then renamed, so an
    interrupted build never leaves a broken library; processes that need the same build take turns
    on a lock, so the second loads what the first built rather than building it again)."""
    cxx = _compiler()
    flags = ["-O3", "-std=c++20", "-fPIC", "-fopenmp", *(isa_flags(cxx) if isa is None else isa),
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    version = _compiler_version(cxx)
    sources = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(sources + repr((torch.__version__, flags, version)).encode()).hexdigest()[:16]
    root = Path(cache) if cache is not None else cache_dir() / "kernels"
    out = root / f"kernels-{key}.so"
    if out.is_file():
        return out
    with locked(out, remove=True):
        if not out.is_file():  # else built by whoever held the lock before us
            _compile(cxx, flags, root, out)
    return out


def _compile(cxx: str, flags: list[str], root: Path, out: Path) -> None:
    """Each source compiled to an object in its own process, all at once, then linked: the build
    takes the longest source's time, not the sum (on the 2-core AVX2 EPYC: 62 s for qlinear.cpp
    against 100 s for the three in one compiler process)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    libs, includes = library_paths(), [f"-I{p}" for p in include_paths()]
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        procs = [subprocess.Popen([cxx, *flags, *includes, "-c", str(src), "-o", str(obj)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for src, obj in zip(SOURCES, objects)]
        errors = [proc.communicate()[1] for proc in procs]
        failed = next((e for proc, e in zip(procs, errors) if proc.returncode != 0), None)
        if failed is None:
            part = Path(tmp) / LIBRARY
            link = subprocess.run([cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(part),
                                   *(f"-L{p}" for p in libs), "-lc10", "-ltorch_cpu", *(f"-Wl,-rpath,{p}" for p in libs)],
                                  capture_output=True, text=True)
            failed = link.stderr if link.returncode != 0 else None
        if failed is not None and (full := out_of_space(failed)):
            raise YggError(f"out of disk space building the native kernels ({full}): {cxx} writes to {root} and "
                           f"{tempfile.gettempdir()}; free space there (or set YGG_CACHE / TMPDIR elsewhere)")
        if failed is not None:
            first = next((line for line in failed.splitlines() if "error" in line), failed.strip()[:200])
            raise YggError(f"cannot build the native kernels with {cxx}: {first}")
        os.replace(part, out)


def load(path: Path | None = None) -> Path:
    """Register `torch.ops.ygg.*` from `path` (an artifact's copy), or from a build for this
    machine. A process registers them once: later calls keep the first library."""
    global _loaded
    if _loaded is None:
        path = Path(path) if path is not None else build()
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise YggError(f"cannot load the native kernels {path}: {str(e).strip() or type(e).__name__}") from None
        torch.library.register_fake("ygg::qlinear")(_qlinear_shape)
        torch.library.register_fake("ygg::qlinear_reference")(_qlinear_shape)
        _loaded = path
    return _loaded


def _qlinear_shape(x: Tensor, data: Tensor, layout: Tensor, bias: Tensor | None, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)


def qlinear(x: Tensor, data: Tensor, layout: Tensor, bias: Tensor | None, n: int | None = None,
            reference: bool = False) -> Tensor:
    """x [..., K] times quantized weights (`ygg_runtime.model.quant.pack`'s data and layout) plus bias ->
    [..., n] in x's dtype (n: the weight's rows; None: read from the layout); reference=True runs
    the kernel's scalar definition (tests)."""
    if x.device.type != "cpu":
        raise YggError("quantized weights run on CPUs only (compile with --weights bf16 for this device)")
    if _loaded is None:
        load()
    op = torch.ops.ygg.qlinear_reference if reference else torch.ops.ygg.qlinear
    return op(x, data, layout, bias, int(layout[:, 0].sum()) if n is None else n)


def qlinear_path() -> str:
    """The instruction set `ygg::qlinear` runs with in this process: "avx512-vnni", "avx2" or
    "portable", or where YGG_QLINEAR asks for the tile path, "amx" (a CPU and build with AMX) or
    "amx-emulated" (its instructions in plain C++: tests)."""
    if _loaded is None:
        load()
    return torch.ops.ygg.qlinear_path()


def int8_peak(seconds: float = 0.2, repeats: int = 5) -> float:
    """Int8 multiply-adds per second of a register-only loop of the instruction `ygg::qlinear`
    multiplies with, on the torch threads: the compute roof of a quantized forward."""
    if _loaded is None:
        load()
    return torch.ops.ygg.int8_peak(seconds, repeats)


def read_bandwidth(nbytes: int = 2 << 30, repeats: int = 5) -> float:
    """Bytes per second of a streaming read of `nbytes` (far larger than the caches) on the torch
    threads, each reading its own share: the memory roof of a forward."""
    if _loaded is None:
        load()
    return torch.ops.ygg.read_bandwidth(nbytes, repeats)


HUGE_PAGE = 2 << 20


def huge_copy(t: Tensor) -> Tensor:
    """`t` itself, or for a CPU tensor of at least a huge page a copy in memory Linux is asked to back
    with 2 MiB pages (`ygg::huge_copy`): a forward streams its weights, and with huge pages the
    stream misses the TLB 512 times less (the target's linears: 1-5 % faster per forward)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE:
        return t
    if _loaded is None:
        load()
    return torch.ops.ygg.huge_copy(t)


def attention(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, layer: int, slots: Tensor, lo: Tensor, hi: Tensor,
              tree: Tensor) -> Tensor:
    """`ygg::attention` on a CPU (the library built and loaded on first use): q [1, H, W, D] and the
    W new rows' k, v [1, KV, W, D], written first to `slots` of the cache's layer `layer` (cache
    [layers, 2, KV, S, D]); row i then attends to slots [lo_i, hi_i) and hi_i + j where tree[i, j]
    ([W, T] bool) -> [1, H, W, D], each row independently of the rows beside it."""
    if _loaded is None:
        load()
    return torch.ops.ygg.attention(q, k, v, cache, layer, slots, lo, hi, tree)
