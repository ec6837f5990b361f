"""Quantized weights for an artifact (`--weights int8|int4|int3|int2`): a GGUF file's own blocks read
as codes (`ygg_runtime.model.quant.Codes`), or float weights quantized here.

`int8` means at most 8 bits per weight: from a GGUF file nothing is requantized, every block type
below is decoded into codes and scales that give back exactly the values llama.cpp (and
transformers' dequantizer) compute from it (4-bit types stay 4-bit, 5- and 6-bit ones 6-bit), and
the compile checks that against the dequantized checkpoint it converted. `int4` (`int3`, `int2`)
means at most that many bits: the file's narrower tensors are kept as they are, wider ones
requantized from their exact values (lossy: a drafter's weights may be, since the drafter only
proposes). A tensor the kernel cannot hold as it is
(another block type, a float tensor) is quantized here from its dequantized values, a shape whose
inputs are not a multiple of 32 stays in the float dtype; the plan lists every such tensor. From a
float checkpoint every linear weight is quantized here: lossy against that checkpoint, which the
plan and `ygg inspect` say.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ygg_runtime.errors import YggError, first_line
from ygg_runtime.model.transformer import ModelArgs
from ygg_runtime.schema.plan import WeightsInfo
from ygg_runtime.model.quant import BITS, Codes, fits_kernel, pack, pack_rows, segment_kind

QK = 256  # values per K-quant super-block


# ---------------------------------------------------------------- GGUF blocks -> codes


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (a little-endian float16)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are values 0..15, the high 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, value j from bit j."""
    bits = np.ascontiguousarray(qh).view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _legacy(d: np.ndarray, codes: np.ndarray, offset: np.ndarray, bits: int, kind: str) -> tuple:
    """A super-block of one 32-value group: w = d * c + offset."""
    ones = np.ones(d.shape, np.int8)
    return codes, d, offset, ones, ones, bits, kind


def decode(kind: str, blocks: np.ndarray) -> tuple | None:
    """One tensor's raw blocks [N, bytes per row] -> (codes [N, K], D, M, sc, mn, bits, kind) as
    numpy arrays, or None for a block type the kernel cannot hold as it is."""
    n = blocks.shape[0]
    if kind == "Q8_0":
        b = blocks.reshape(n, -1, 34)
        d = _f16(b[..., 0:2])
        x = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16)
        return _legacy(d, (x + 128).astype(np.uint8).reshape(n, -1), -128.0 * d, 8, kind)
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = blocks.reshape(n, -1, size)
        d = _f16(b[..., 0:2])
        off = -8.0 * d if kind == "Q4_0" else _f16(b[..., 2:4])
        codes = _nibbles(b[..., size - 16:])
        return _legacy(d, codes.reshape(n, -1), off, 4, kind)
    if kind in ("Q5_0", "Q5_1"):
        size = 22 if kind == "Q5_0" else 24
        b = blocks.reshape(n, -1, size)
        d = _f16(b[..., 0:2])
        off = -16.0 * d if kind == "Q5_0" else _f16(b[..., 2:4])
        qh = b[..., size - 20:size - 16]
        codes = _nibbles(b[..., size - 16:]) | (_high_bits(qh) << 4)
        return _legacy(d, codes.reshape(n, -1), off, 6, kind)
    if kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        b = blocks.reshape(n, -1, size)
        d = _f16(b[..., 0:2])
        dmin = _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., size - 128:].reshape(n, -1, 4, 32)  # 4 chunks of 64 values: low nibbles first
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1, 8, 32)  # group j = chunk j//2, half j%2
        if kind == "Q5_K":
            qh = b[..., 16:48]  # bit j of byte l is the fifth bit of group j's value l
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            codes = codes | (high << 4)
        bits = 4 if kind == "Q4_K" else 6
        return codes.reshape(n, -1), d, -dmin, sc.astype(np.int8).reshape(n, -1), mn.astype(np.int8).reshape(n, -1), bits, kind
    if kind == "Q6_K":
        b = blocks.reshape(n, -1, 210)
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
        d = _f16(b[..., 208:210])
        low = np.concatenate([ql & 15, ql >> 4], axis=-1).reshape(n, -1, 2, 4, 32)  # per half: 4 runs of 32
        high = (qh[..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        codes = (low | (high << 4)).reshape(n, -1)
        sc = scales.reshape(n, -1)
        return codes, d, -32.0 * d, sc, sc, 6, kind
    return None


def _codes(parts: tuple) -> Codes:
    codes, D, M, sc, mn, bits, kind = parts
    n = codes.shape[0]
    return Codes(torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
                 torch.from_numpy(np.ascontiguousarray(D.reshape(n, -1), dtype=np.float32)),
                 torch.from_numpy(np.ascontiguousarray(M.reshape(n, -1), dtype=np.float32)),
                 torch.from_numpy(np.ascontiguousarray(sc.reshape(n, -1), dtype=np.int8)),
                 torch.from_numpy(np.ascontiguousarray(mn.reshape(n, -1), dtype=np.int8)), bits, kind)


def _unpermute(c: Codes, heads: int) -> Codes:
    """Undo llama.cpp's reordering of q/k rows for Llama models (what transformers undoes too)."""
    n = c.shape[0]
    order = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return c.rows(order)


@dataclass
class GGUFWeights:
    """A GGUF file's quantized tensors as codes, by their GGUF names (None: a type kept as floats)."""
    tensors: dict[str, Codes | None]
    types: dict[str, str]
    arch: str


def read_gguf(path: Path) -> GGUFWeights:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise YggError(f"could not read GGUF file {path}: {first_line(e)}") from e
    field_ = reader.fields.get("general.architecture")
    arch = bytes(field_.parts[field_.data[0]]).decode() if field_ else ""
    tensors, types = {}, {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        types[t.name] = kind
        parts = decode(kind, np.asarray(t.data)) if t.data.dtype == np.uint8 else None
        tensors[t.name] = _codes(parts) if parts is not None else None
    return GGUFWeights(tensors, types, arch)


# ---------------------------------------------------------------- float weights -> codes


def _half(t: Tensor) -> Tensor:
    """Factors as float16 numbers (what the kernel stores), in float32."""
    return t.half().float()


def quantize(w: Tensor, bits: int) -> Codes:
    """Float weights [N, K] (K a multiple of 32) -> codes (lossy). 8 bits: symmetric per 32
    (llama.cpp's Q8_0). 4, 3 or 2 bits: per group (32 columns at 4 bits, 16 below) an affine range
    (searched: `_fit_ranges`), its scale and minimum quantized to 6 bits per super-block of 256
    (Q4_K's format), or of 128 or 64 where the rows hold no whole 256 (a 0.5B Qwen's 896); rows of
    an odd number of 32s get blocks of 32 with float16 factors (Q4_1's). The codes are chosen
    against the quantized range."""
    w = w.float()
    n, k = w.shape
    if bits == 8:
        g = w.reshape(n, k // 32, 32)
        d = _half(g.abs().amax(-1) / 127)
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (g * inv[..., None]).round().clamp(-127, 127)
        ones = torch.ones(n, k // 32, dtype=torch.int8)
        return Codes((q + 128).to(torch.uint8).reshape(n, k), d, -128 * d, ones, ones, 8, "int8")
    top = 2 ** bits - 1
    superblock = next((s for s in (QK, 128, 64) if k % s == 0), None)
    if superblock is None:  # blocks of 32 with their own float16 scale and minimum
        g = w.reshape(n, k // 32, 32)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        d, m = _half((hi - lo) / top), _half(lo)
        q = torch.where(d[..., None] > 0, ((g - m[..., None]) / d.clamp(min=1e-30)[..., None]).round(), torch.zeros_like(g))
        ones = torch.ones(n, k // 32, dtype=torch.int8)
        return Codes(q.clamp(0, top).to(torch.uint8).reshape(n, k), d, m, ones, ones, bits, f"int{bits}")
    group = 32 if bits == 4 else 16
    g = w.reshape(n, k // superblock, superblock // group, group)
    scale, low = _fit_ranges(g, top)  # per group: w ~= scale * q - low
    d = _half(scale.amax(-1) / 63)
    dmin = _half(low.amax(-1) / 63)
    sc = torch.where(d[..., None] > 0, (scale / d.clamp(min=1e-30)[..., None]).round(), torch.zeros_like(scale)).clamp(0, 63)
    mn = torch.where(dmin[..., None] > 0, (low / dmin.clamp(min=1e-30)[..., None]).round(), torch.zeros_like(low)).clamp(0, 63)
    step = d[..., None] * sc
    q = torch.where(step[..., None] > 0, ((g + (dmin[..., None] * mn)[..., None]) / step.clamp(min=1e-30)[..., None]).round(),
                    torch.zeros_like(g)).clamp(0, top)
    return Codes(q.to(torch.uint8).reshape(n, k), d, -dmin, sc.to(torch.int8).reshape(n, -1), mn.to(torch.int8).reshape(n, -1),
                 bits, f"int{bits}")


SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # fractions of a group's range tried (fewer bits: outliers cost more)


def _fit_ranges(g: Tensor, top: int, rows: int = 1024) -> tuple[Tensor, Tensor]:
    """Per group of the last axis, the affine range (scale, low: w ~= scale * q - low, low >= 0)
    with the least squared error among the group's own [min(w, 0), max(w, 0)] shrunk towards its
    middle by each of SHRINK: at 2-4 bits, clipping a group's extremes usually serves the rest
    better (llama.cpp's quantizers search likewise). In chunks of rows, to bound memory."""
    scales, lows = [], []
    for r in range(0, g.shape[0], rows):
        x = g[r:r + rows]
        lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        best = best_scale = best_low = None
        for f in SHRINK:
            a = (lo + hi) / 2 - (hi - lo) * f / 2
            b = (lo + hi) / 2 + (hi - lo) * f / 2
            a = a.clamp(max=0)
            scale = (b - a) / top
            q = torch.where(scale[..., None] > 0, ((x - a[..., None]) / scale.clamp(min=1e-30)[..., None]).round().clamp(0, top), 0)
            err = ((q * scale[..., None] + a[..., None] - x) ** 2).sum(-1)
            if best is None:
                best, best_scale, best_low = err, scale, -a
            else:
                better = err < best
                best = torch.where(better, err, best)
                best_scale, best_low = torch.where(better, scale, best_scale), torch.where(better, -a, best_low)
        scales.append(best_scale)
        lows.append(best_low)
    return torch.cat(scales), torch.cat(lows)


def holdable(c: Codes) -> bool:
    """Whether the kernel holds these codes exactly as they are (`ygg_runtime.model.quant.segment_kind`)."""
    try:
        segment_kind(c)
    except ValueError:
        return False
    return c.bits in BITS


# ---------------------------------------------------------------- a model's state, quantized

# Our tensor names from GGUF's (per layer i); fused tensors list their parts in order.
_LINEARS = {
    "attention.wqkv": ("attn_q", "attn_k", "attn_v"),
    "attention.wo": ("attn_output",),
    "feed_forward.w13": ("ffn_gate", "ffn_up"),
    "feed_forward.w2": ("ffn_down",),
}


def fallbacks_line(fallbacks: list[str]) -> str:
    """The tensors not held as the file has them, in one line grouped by what happened to them
    ("86 not as in the file: Q5_0 -> int4 (requantized, lossy) ×56, …"): the plan lists each."""
    counts = Counter(f.split(": ", 1)[-1] for f in fallbacks)
    return f"{len(fallbacks)} not as in the file: " + ", ".join(f"{why} ×{n}" for why, n in counts.most_common())


def quantize_state(state: dict[str, Tensor], args: ModelArgs, weights: str, gguf: Path | None,
                   progress=None) -> tuple[ModelArgs, dict[str, Tensor], WeightsInfo]:
    """Replace the state's linear and embedding weights by codes (`ygg_runtime.model.quant` layouts).
    `state` holds the float weights the checkpoint was converted to: they are the reference every
    decoded GGUF tensor is checked against, and what a fallback quantizes. The parts of a fused
    layer (q/k/v, gate/up) keep their own formats. The head becomes a tensor of its own (a
    quantized model never ties it to the embeddings)."""
    bits = int(weights.removeprefix("int"))
    source = read_gguf(gguf) if gguf is not None else None
    report = WeightsInfo(weights, "gguf" if source else "quantized")
    out = dict(state)
    head = "output.weight" if not source or "output.weight" in source.tensors else "token_embd.weight"
    jobs = [("tok_embeddings", ["token_embd.weight"], True), ("output", [head], False)]
    jobs += [(f"layers.{i}.{ours}", [f"blk.{i}.{g}.weight" for g in parts], False)
             for i in range(args.n_layers) for ours, parts in _LINEARS.items()]
    for n, (ours, names, rows) in enumerate(jobs):
        if progress:
            progress(n, len(jobs))
        reference = state.get(f"{ours}.weight")
        if reference is None:  # a tied head: the embeddings
            reference = out[f"{ours}.weight"] = state["tok_embeddings.weight"]
        parts = _from_file(source, names, args) if source else None
        if parts is not None:
            report.max_rel_error = max(report.max_rel_error, _check(parts, reference, ours))
            for i, part in enumerate(parts):
                if part.bits > bits or not (rows or holdable(part)):  # requantized from its exact values
                    which = f"{ours} ({names[i]})" if len(parts) > 1 else ours  # which part of a fused layer
                    report.fallbacks.append(f"{which}: {part.kind} -> int{bits} (requantized, lossy)")
                    parts[i] = quantize(part.dequantize(), bits)
        elif not fits_kernel(tuple(reference.shape)):
            why = "+".join(source.types.get(n, "missing") for n in names) if source else "float"
            report.fallbacks.append(f"{ours}: {why}, {reference.shape[1]} inputs (not a multiple of 32) -> kept in {reference.dtype}")
            continue
        else:
            if source:
                why = "+".join(source.types.get(n, "missing") for n in names)
                report.fallbacks.append(f"{ours}: {why} -> int{bits} (requantized, lossy)")
            parts = [quantize(reference, bits)]
        packed = pack_rows(parts[0]) if rows else pack(parts)
        del out[f"{ours}.weight"]
        out.update({f"{ours}.{k}": v for k, v in packed.items()})
        for part in parts:
            ours_too = part.kind.startswith("int")  # quantized here, not a file's own block type
            kind = ("requantized" if source else "quantized") if ours_too else part.kind
            label = f"{kind} {part.bits}-bit" + (f" g{part.group}" if part.group != 32 else "")
            report.formats[label] = report.formats.get(label, 0) + 1
        report.bytes += sum(v.numel() * v.element_size() for v in packed.values())
    if progress:
        progress(len(jobs), len(jobs))
    return replace(args, tie_embeddings=False), out, report


def _from_file(source: GGUFWeights, names: list[str], args: ModelArgs) -> list[Codes] | None:
    """The named GGUF tensors as codes, one per part, or None when some part is not held as it is."""
    heads = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads}
    parts = []
    for name in names:
        c = source.tensors.get(name)
        if c is None or not fits_kernel(c.shape):
            return None
        role = name.split(".")[-2]
        if source.arch == "llama" and role in heads:
            c = _unpermute(c, heads[role])
        parts.append(c)
    return parts


def _check(parts: list[Codes], reference: Tensor, name: str, rows: int = 4096) -> float:
    """The decoded weights (the parts stacked) against the checkpoint's (in chunks of rows, to
    bound memory): the largest difference relative to the largest weight. A decoding that does not
    give the file's numbers is a bug, and never a silent one."""
    top = max(reference.float().abs().max().item(), 1e-30)
    worst, at = 0.0, 0
    for c in parts:
        for r in range(0, c.shape[0], rows):
            part = c.rows(slice(r, r + rows))
            ref = reference[at + r:at + r + part.shape[0]].float()
            worst = max(worst, (part.dequantize() - ref).abs().max().item() / top)
        at += c.shape[0]
    if worst > 1e-2:
        raise YggError(f"{name}: the GGUF codes decode to other weights than the checkpoint's (relative error "
                       f"{worst:.2g}): report this with the file")
    return worst
