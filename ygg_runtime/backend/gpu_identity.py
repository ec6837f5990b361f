"""A GPU as the runtime needs to know it: what it is (recorded in the plan: the exactness check and
the profiles hold for that GPU), how torch's own matmuls are set up, and how much memory it has free.

A forward's products are our own kernels (`backend.triton_linear`), row-invariant by construction.
`configure` still sets cuBLAS up so that a row's result does not depend on the rows beside it —
no TF32, no reduced-precision or split-K reductions, cuBLASLt with a fixed workspace (vLLM's
batch-invariant mode does the same) — for whatever torch itself multiplies on the GPU beside them.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ygg_runtime.files import cache_dir

from ygg_runtime.machine import GPUInfo

# A fixed cuBLAS workspace: its size is one of the things cuBLAS picks a kernel by. Read when the
# first cuBLAS handle is made, so set before any matmul runs on the GPU.
WORKSPACE = ":4096:8"


def configure() -> None:
    """Matmuls whose rows do not depend on the rows beside them: no TF32, no reduced-precision or
    split-K reductions, cuBLASLt with a fixed workspace. Called before a model's first forward."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", WORKSPACE)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    split_reductions(False)
    with contextlib.suppress(RuntimeError, AttributeError):
        torch.backends.cuda.preferred_blas_library("cublaslt")


REDUCTIONS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


def split_reductions(allowed: bool) -> None:
    """Whether cuBLAS may split a product's reduction (split-K) and reduce in lower precision:
    off for row invariance (`configure`); on where no row needs it (a drafter timed on cuBLAS)."""
    for name in REDUCTIONS:
        try:  # (reduced precision, split-K) on torch >= 2.10; a bool before
            setattr(torch.backends.cuda.matmul, name, (allowed, allowed))
        except (TypeError, ValueError, RuntimeError):
            setattr(torch.backends.cuda.matmul, name, allowed)


def info(device: torch.device | str = "cuda") -> GPUInfo:
    """This GPU as the plan records it."""
    device = torch.device(device)
    props = torch.cuda.get_device_properties(device)
    return GPUInfo(name=props.name, capability=f"{props.major}.{props.minor}", memory=int(props.total_memory),
                   cuda=str(torch.version.cuda), cublas=_cublas_version(device), driver=_driver_version())


def free_memory(device: torch.device | str) -> int:
    """Bytes the GPU has free now (its own count, not the process's cache)."""
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def _cublas_version(device: torch.device) -> str:
    """The cuBLAS this process loaded (from the library itself: a wheel's file name carries only
    its major version)."""
    try:
        torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)  # loads cuBLAS
        path = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                    if re.search(r"/libcublas\.so", line))
        lib = ctypes.CDLL(path)
        parts = []
        for kind in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.cublasGetProperty(kind, ctypes.byref(value)) != 0:
                return "unknown"
            parts.append(str(value.value))
        return ".".join(parts)
    except (OSError, StopIteration, AttributeError, RuntimeError):
        return "unknown"


def _driver_version() -> str:
    """The NVIDIA driver's version ("580.159.04"), from the kernel module or nvidia-smi."""
    with contextlib.suppress(OSError):
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found.group(1)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        if out:
            return out[0]
    return "unknown"


# Where Triton keeps the kernels it compiles (read when it compiles one, so settable at any time).
TRITON_CACHE = "TRITON_CACHE_DIR"


@contextlib.contextmanager
def compiling_into(directory: Path) -> Iterator[None]:
    """Triton's kernels compiled inside the block are written to `directory` (an artifact's, so that
    `ygg run` on the same GPU kind and Triton finds them compiled: a start compiles nothing)."""
    before = os.environ.get(TRITON_CACHE)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[TRITON_CACHE] = str(directory)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TRITON_CACHE, None)
        else:
            os.environ[TRITON_CACHE] = before


def use_compiled(directory: Path, key: str) -> Path:
    """Point Triton's cache at the kernels an artifact carries (`compiling_into`): a copy of them in
    the user cache, named by `key` (their hashes), since Triton writes beside what it reads and an
    artifact may be read-only. Made once (a temporary copy renamed into place). Triton's own keys
    include its version and the GPU's: kernels compiled by another Triton, or for another GPU, are
    compiled again at first use, as without the cache."""
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = cache_dir() / "triton"
    copy = root / name
    if not copy.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        shutil.copytree(directory, staging, dirs_exist_ok=True)
        try:
            os.rename(staging, copy)
        except OSError:  # another process made it first
            shutil.rmtree(staging, ignore_errors=True)
    os.environ[TRITON_CACHE] = str(copy)
    return copy
