"""What the machine is: used to pick the dtype and recorded in the plan."""

from __future__ import annotations

import re

import torch

from ygg_compile.options import check_dtype
from ygg_runtime.backend import gpu_identity as gpu
from ygg_runtime.errors import YggError
from ygg_runtime.checks.integrity import cpu_info

BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def resolve_device(device: str) -> str:
    """The device to compile for, its matmuls set up for row invariance on a GPU (`gpu.configure`)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise YggError("--device cuda was asked for but CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise YggError(f"unknown device '{device}' (use cpu or cuda)")
    if device.startswith("cuda"):
        gpu.configure()
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto`: bfloat16 on CUDA and on CPUs with native bf16 arithmetic, float32 elsewhere
    (bf16 emulated on older CPUs is slower than fp32)."""
    check_dtype(dtype)
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}  # DTYPES' names
    if dtype == "auto":
        if device.startswith("cuda") or BF16_FLAGS & set(cpu_info().isa):
            return torch.bfloat16
        return torch.float32
    return names[dtype]


def isa_class(isa: list[str] | tuple[str, ...] | set[str]) -> str:
    """The instruction-set class a CPU's kernels and timings follow: amx, avx512, avx2, or "" (none
    of them). Machines of one name differ in it (Zen 3 and Zen 4 EPYCs, Xeons with and without AMX)."""
    isa = set(isa)
    if "amx_tile" in isa:
        return "amx"
    return "avx512" if "avx512f" in isa else "avx2" if "avx2" in isa else ""


def device_slug(device: str) -> str:
    """A directory name for profiles and results measured here: the vendor and model with the
    instruction-set class and threads for a CPU (cpu-amd-epyc-avx512-2t, cpu-intel-xeon-amx-2t), the
    GPU's name for a GPU (cuda-nvidia-h200), so one folder never mixes machines of other kernels."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return slug("cuda", torch.cuda.get_device_name())
    cpu = cpu_info()
    return slug("cpu", cpu.model, cpu.isa, torch.get_num_threads())


def slug(kind: str, name: str, isa: list[str] | tuple[str, ...] = (), threads: int = 0) -> str:
    """`device_slug` of a machine described by what a profile's fingerprint records of it: its
    kind ("cpu" or "cuda"), its model name, and for a CPU its flags and torch's threads."""
    suffix = ""
    if kind == "cpu":
        suffix = (f"-{cls}" if (cls := isa_class(isa)) else "") + f"-{threads}t"
    name = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|\d+-core", "", name.lower())
    return f"{kind}-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-") + suffix
