"""How much memory and disk a compile needs, estimated from the models' file headers before a single
weight is loaded, so a model that cannot fit is refused in one line instead of being killed by the
kernel's OOM killer or filling the disk an hour in."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ygg_compile.sources import ModelSource, gguf_tensors
from ygg_runtime.errors import YggError
from ygg_runtime.files import cache_dir, size
from ygg_runtime.checks.integrity import available_memory

# Bytes an artifact holds per parameter, by how its weights are held: integer codes plus their
# group scales (measured on the default pair: 0.73 for the int8 target, 0.76 for the int4 drafter,
# whose float32 embeddings weigh more; rounded up).
QUANTIZED_BYTES = {"int8": 1.1, "int4": 0.8, "int3": 0.8, "int2": 0.8}  # at most int4's: narrower codes, same embeddings
ARTIFACT_EXTRA = 64 << 20  # tokenizer, compiled packages, kernels, tables
DEQUANTIZE_BYTES = 4  # transformers dequantizes a GGUF tensor to float32 before casting it


def parameters(src: ModelSource) -> int:
    """The model's parameter count from its files' headers (GGUF or safetensors), reading no
    tensor; a tied output embedding counts twice, as the artifact holds it twice."""
    if src.gguf is not None:
        tensors = gguf_tensors(src.gguf)
        return sum(tensors.values()) + (tensors.get("token_embd.weight", 0) if "output.weight" not in tensors else 0)
    tensors = {}
    for f in sorted(src.path.glob("*.safetensors")):
        tensors.update(_safetensors_shapes(f))
    if tensors:
        n = {k: math.prod(shape) for k, shape in tensors.items()}
        tied = "lm_head.weight" not in n and any(k.endswith("embed_tokens.weight") for k in n)
        return sum(n.values()) + (max(v for k, v in n.items() if k.endswith("embed_tokens.weight")) if tied else 0)
    # pickled *.bin checkpoints are not opened here: their size over the config's dtype is the count
    config = json.loads((src.path / "config.json").read_text())
    width = torch.finfo(getattr(torch, str(config.get("torch_dtype") or "float32"), torch.float32)).bits // 8
    return sum(f.stat().st_size for f in src.path.glob("*.bin")) // width


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header: 8 bytes of length, then that much JSON."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError("header larger than 100 MB")
            header = json.loads(f.read(length))
        return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise YggError(f"{path} is not a readable safetensors file ({e})") from None


@dataclass
class Footprint:
    """What a compile of one pair needs, in bytes."""
    parameters: dict[str, int]  # by role
    memory: int  # resident at the peak: see `estimate`
    memory_why: str
    artifact: int  # written under the output's parent directory
    cache: int  # written under the cache directory (conversions of models held as codes, not cached yet)


def estimate(models: dict[str, ModelSource], held: dict[str, str], dtype: torch.dtype) -> Footprint:
    """models: "target"/"draft" sources (not materialized); held: how each role's weights are held
    ("float", "int8", "int4"). Memory is a lower bound of the peak, the most weights held at once:
    dequantizing a GGUF model (float32 plus the dtype copy), converting one (two copies in dtype),
    or both converted models loaded side by side for profiling and calibration."""
    width = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    params = {role: parameters(src) for role, src in models.items()}
    artifact_bytes = {role: int(params[role] * (width if held[role] == "float" else QUANTIZED_BYTES[held[role]]))
                      for role in models}
    cache, peaks = 0, []
    for role, src in models.items():
        cached = src.converted(dtype) if src.sha256 is not None else None  # not identified yet: cache unknown
        if src.gguf is not None and src.path is None and (cached is None or not (cached / "config.json").exists()):
            if held[role] != "float":  # held as codes: its float conversion is cached (build.py)
                cache += params[role] * width
            peaks.append((params[role] * (DEQUANTIZE_BYTES + width), f"dequantizing the {role}"))
        peaks.append((2 * params[role] * width, f"converting the {role}"))
    peaks.append((sum(artifact_bytes.values()), "both models loaded"))
    memory, why = max(peaks)
    return Footprint(params, memory, why, sum(artifact_bytes.values()) + ARTIFACT_EXTRA, cache)


def check_memory(fp: Footprint, dtype: torch.dtype) -> None:
    """Refuse, in one line and before any work, models this machine cannot hold in memory."""
    have = available_memory()
    if have is not None and fp.memory > have:
        sizes = ", ".join(f"{role} {n / 1e9:.1f}B" if n >= 1e9 else f"{role} {n / 1e6:.1f}M"
                          for role, n in fp.parameters.items())
        raise YggError(f"the models do not fit in memory: {fp.memory_why} needs about {size(fp.memory)} "
                       f"({sizes} parameters in {str(dtype).removeprefix('torch.')}), and {size(have)} is "
                       f"available: {'--dtype bfloat16 halves it, or ' if dtype == torch.float32 else ''}use a "
                       "smaller model, or a machine with more memory")


def check_disk(fp: Footprint, out: Path) -> None:
    """Refuse, in one line and before any work, a compile whose files the disk(s) cannot hold."""
    needs: dict[int, list] = {}  # by filesystem: the cache and the output may share one
    for where, bytes_, what in ((out.parent, fp.artifact, "the artifact"), (cache_dir(), fp.cache, "cached conversions")):
        if bytes_:
            root = _existing(where)
            need = needs.setdefault(os.stat(root).st_dev, [root, 0, []])
            need[1] += bytes_
            need[2].append(f"{what} {size(bytes_)}")
    for root, total, parts in needs.values():
        free = shutil.disk_usage(root).free
        if total > free:
            raise YggError(f"not enough disk space: this compile writes about {size(total)} to {root} "
                           f"({' + '.join(parts)}) and {size(free)} is free: free space, compile to another "
                           "-o, or point YGG_CACHE elsewhere (`ygg cache ls` shows what the cache holds)")


def _existing(path: Path) -> Path:
    """The nearest directory that exists on the way to path (where its files will land)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path
