"""What the machine is: used to pick the dtype and recorded in the plan."""

from __future__ import annotations

import re

import torch

from ygg_compile.options import check_dtype
from ygg_runtime.backend import gpu
from ygg_runtime.errors import YggError
from ygg_runtime.integrity import cpu_info

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


def device_slug(device: str) -> str:
    """A directory name for results measured here, e.g. cpu-amd-epyc-2t, cpu-amd-epyc-avx2-2t or
    cuda-nvidia-a100-sxm4-80gb."""
    if device.startswith("cuda") and torch.cuda.is_available():
        kind, name, suffix = "cuda", torch.cuda.get_device_name(), ""
    else:  # an AVX2-only CPU files apart from AVX-512 ones of its name (Zen 3 and Zen 4 EPYCs): other
        # kernels, another `--dtype auto`, other timings
        cpu = cpu_info()
        width = "-avx2" if "avx2" in cpu.isa and "avx512f" not in cpu.isa else ""
        kind, name, suffix = "cpu", cpu.model, f"{width}-{torch.get_num_threads()}t"
    name = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|\d+-core", "", name.lower())
    return f"{kind}-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-") + suffix
