"""Quantized weights: integer codes with group scales, their two layouts, and the layers that use them.

One format holds every quantization the native kernel takes (csrc/qlinear.cpp):

    w[n, k] = D[n, s] * sc[n, j] * c[n, k] + M[n, s] * mn[n, j]

codes c in [0, 2**bits) (bits 2, 3, 4, 6 or 8), groups j of G = 16 or 32 input columns with int8
multipliers (sc, mn), super-blocks s of S = 256 columns (or 128 or 64, for rows without whole
256s) with float16 factors (D, M), or S = G = 32 with sc = mn = 1. A GGUF file's blocks are exactly
this: Q4_K and Q5_K (G = 32, 6-bit scales and mins), Q6_K (G = 16, signed scales, the -32 of its
codes in M), and the legacy Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32). So an artifact keeps the file's own numbers (`ygg_compile.quantize` reads
them), and the parts of a fused tensor (q, k and v in one matrix) keep their own formats, as row
segments of one layer.

`QLinear` computes with the tiled layout the kernel reads; `QEmbedding` looks rows up in a row-major
copy and dequantizes only the rows it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ygg_runtime.backend.native import qlinear

TILE = 16  # output columns per kernel tile (one vector of float32 lanes)
BLOCK = 32  # input columns per code block (and per block of the activations' int8 scale)


@dataclass
class Codes:
    """A weight matrix [N, K] in the format above, row-major. `kind` says where the codes came from
    (a GGUF type such as "Q4_K", or "int4"/"int8" for weights quantized here)."""
    codes: Tensor  # uint8 [N, K], values < 2**bits
    D: Tensor  # float32 [N, K/S]
    M: Tensor  # float32 [N, K/S]
    sc: Tensor  # int8 [N, K/G]
    mn: Tensor  # int8 [N, K/G]
    bits: int
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.sc.shape[1]

    @property
    def superblock(self) -> int:
        return self.codes.shape[1] // self.D.shape[1]

    def rows(self, index: Tensor | slice) -> "Codes":
        """The weight matrix's rows `index` (a slice or an index tensor), in the same format."""
        return replace(self, codes=self.codes[index], D=self.D[index], M=self.M[index], sc=self.sc[index], mn=self.mn[index])

    def dequantize(self) -> Tensor:
        """The weights as float32 [N, K] (what a test or a check compares with the source's)."""
        scale = self.D.repeat_interleave(self.superblock, 1) * self.sc.float().repeat_interleave(self.group, 1)
        offset = self.M.repeat_interleave(self.superblock, 1) * self.mn.float().repeat_interleave(self.group, 1)
        return scale * self.codes.float() + offset

    def promote(self, bits: int, group: int, superblock: int) -> "Codes":
        """The same weights with wider codes, smaller groups or smaller super-blocks (exact)."""
        if bits < self.bits or group > self.group or superblock > self.superblock or self.group % group or self.superblock % superblock:
            raise ValueError(f"cannot express {self.bits}-bit codes in groups of {self.group}/{self.superblock} "
                             f"as {bits}-bit in groups of {group}/{superblock}")
        g, s = self.group // group, self.superblock // superblock
        return replace(self, bits=bits, D=self.D.repeat_interleave(s, 1), M=self.M.repeat_interleave(s, 1),
                       sc=self.sc.repeat_interleave(g, 1), mn=self.mn.repeat_interleave(g, 1))



def cat(parts: list[Codes]) -> Codes:
    """Row blocks stacked into one matrix, each promoted to the finest format among them; kind
    lists the parts' kinds when they differ. (A fused layer keeps its parts apart instead: `pack`
    takes the list.)"""
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    superblock = min(p.superblock for p in parts)
    parts = [p.promote(bits, group, superblock) for p in parts]
    kinds = list(dict.fromkeys(p.kind for p in parts))
    return Codes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "D", "M", "sc", "mn")),
                 bits=bits, kind="+".join(kinds))


def fits_kernel(shape: tuple[int, int]) -> bool:
    """Whether the kernel takes a [N, K] weight: K in whole blocks (N is padded to whole tiles)."""
    return shape[1] % BLOCK == 0


# ---------------------------------------------------------------- the kernel's tiled layout

BITS = (2, 3, 4, 6, 8)  # the code widths the kernel reads (5-bit codes are held in 6)
HAS_SC, GENERAL = 1, 2  # a segment's flags (csrc/qlinear.cpp)
# Each code width's bit planes, (shift, width): the low 4 (or 2) bits of the codes, then the bits above.
PLANES = {6: [(0, 4), (4, 2)], 4: [(0, 4)], 3: [(0, 2), (2, 1)], 2: [(0, 2)]}


def bits_for(top: int) -> int:
    """The narrowest code width the kernel takes for codes up to `top`."""
    return next(b for b in BITS if top < 2 ** b)


def _exact_half(t: Tensor) -> bool:
    return bool(torch.equal(t.float().half().float(), t.float()))


def segment_kind(c: Codes) -> tuple[int, int]:
    """(flags, off) of a segment holding `c`: with group multipliers (super-blocks of 256) or unit
    ones (blocks of 32, a GGUF legacy block); "folded" (flags without GENERAL) when mn = sc and M =
    -off * D for one integer off, as in Q6_K, Q8_0, Q4_0 and Q5_0. Raises ValueError for what the
    kernel cannot hold exactly: factors that are not float16 numbers, multipliers in blocks of 32."""
    if c.superblock in (64, 128, 256) and c.group in (16, 32):
        flags = HAS_SC
    elif c.superblock == c.group == BLOCK and bool((c.sc == 1).all()) and bool((c.mn == 1).all()):
        flags = 0
    else:
        raise ValueError(f"groups of {c.group} in super-blocks of {c.superblock} "
                         "(the kernel takes groups of 16 or 32 in super-blocks of 64, 128 or 256, or blocks of 32 with unit multipliers)")
    if not _exact_half(c.D) or not _exact_half(c.M):
        raise ValueError("the super-blocks' factors are not float16 numbers")
    if torch.equal(c.mn, c.sc):
        nonzero = c.D != 0
        ratio = torch.where(nonzero, -c.M / torch.where(nonzero, c.D, 1), 0)
        off = int(ratio[nonzero][0].round()) if bool(nonzero.any()) else 0
        if 0 <= off < 256 and torch.equal(c.M.float(), -off * c.D.float()):
            return flags, off
    return flags | GENERAL, 0


def _tiled(t: Tensor, tiles: int, supers: int) -> Tensor:
    """[n, X] (X per-row values, X / supers per super-block) -> [tiles, supers, bytes]: each
    super-block's values of a tile, columns innermost, as bytes."""
    per = t.reshape(tiles, TILE, supers, -1).permute(0, 2, 3, 1)  # [tile, super, value, column]
    return per.contiguous().view(torch.uint8).reshape(tiles, supers, -1)


def _planes(q: Tensor, bits: int) -> Tensor:
    """Quad-vectors [tiles, K/32, 8, TILE, 4] -> their bit planes [tiles, K/32, 64 * bits] (csrc/qlinear.cpp)."""
    tiles, blocks = q.shape[:2]
    if bits == 8:
        return q.reshape(tiles, blocks, -1)

    def plane(v: Tensor, width: int) -> Tensor:  # quads i*per + j in bits width*j of vector i
        per = 8 // width
        out = torch.zeros_like(v[:, :, 0::per])
        for j in range(per):
            out |= v[:, :, j::per] << (width * j)
        return out.reshape(tiles, blocks, -1)

    return torch.cat([plane((q >> shift) & ((1 << width) - 1), width) for shift, width in PLANES[bits]], dim=-1)


def _unplanes(p: Tensor, bits: int) -> Tensor:
    """`_planes`' inverse: -> [tiles, K/32, 8, TILE, 4]."""
    tiles, blocks = p.shape[:2]
    if bits == 8:
        return p.reshape(tiles, blocks, 8, TILE, 4)
    out, at = torch.zeros(tiles, blocks, 8, TILE, 4, dtype=torch.uint8), 0
    for shift, width in PLANES[bits]:
        per = 8 // width
        v = p[..., at * 64:(at + width) * 64].reshape(tiles, blocks, 8 // per, TILE, 4)
        for j in range(per):
            out[:, :, j::per] |= ((v >> (width * j)) & ((1 << width) - 1)) << shift
        at += width
    return out


def _segment(c: Codes) -> tuple[Tensor, list[int]]:
    """One segment's tiles as bytes [tiles * tile_bytes], and its layout row: per tile, one record
    per super-block of codes (bit planes), sc, mn (group pairs), D and M (csrc/qlinear.cpp)."""
    flags, off = segment_kind(c)
    rows, k = c.shape
    if not fits_kernel((rows, k)):
        raise ValueError(f"a [{rows}, {k}] weight does not come in blocks of {BLOCK} inputs")
    if c.bits not in BITS:
        raise ValueError(f"{c.bits}-bit codes (the kernel reads {BITS})")
    tiles, supers = -(-rows // TILE), k // c.superblock
    n = tiles * TILE
    if n != rows:
        c = Codes(*(torch.cat([t, t.new_zeros(n - rows, t.shape[1])]) for t in (c.codes, c.D, c.M, c.sc, c.mn)), c.bits, c.kind)
    # [n, k] -> [tile, column, block, quad, 4] -> [tile, block, quad, column, 4]
    q = c.codes.reshape(tiles, TILE, k // BLOCK, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    parts = [_planes(q, c.bits).reshape(tiles, supers, -1)]
    if flags & HAS_SC:
        parts.append(_tiled(c.sc, tiles, supers))
        if flags & GENERAL:  # group pairs [pair][column][2]
            mn = c.mn.reshape(tiles, TILE, supers, -1, 2).permute(0, 2, 3, 1, 4)
            parts.append(mn.contiguous().view(torch.uint8).reshape(tiles, supers, -1))
    parts.append(_tiled(c.D.half(), tiles, supers))
    if flags & GENERAL:
        parts.append(_tiled(c.M.half(), tiles, supers))
    return torch.cat(parts, dim=2).reshape(-1), [rows, k, c.bits, c.group, c.superblock, flags, off]


def pack(parts: Codes | list[Codes]) -> dict[str, Tensor]:
    """What `QLinear` holds (its state dict entries) for a weight, or for the row blocks of a fused
    one (q/k/v, gate/up), each kept in its own format: data, uint8, every tile's super-block records
    (codes in bit planes, then sc, mn, D, M; csrc/qlinear.cpp), and layout, int64 [segments, 7]
    (rows, inputs, bits, group, super-block, flags, off)."""
    parts = [parts] if isinstance(parts, Codes) else list(parts)
    segments = [_segment(p) for p in parts]
    return {"data": torch.cat([d for d, _ in segments]), "layout": torch.tensor([row for _, row in segments])}


def unpack(state: dict[str, Tensor]) -> list[Codes]:
    """`pack`'s inverse (tests): the segments' codes."""
    out, at = [], 0
    for rows, k, bits, group, superblock, flags, off in state["layout"].tolist():
        tiles, supers, per = -(-rows // TILE), k // superblock, superblock // group
        sizes = [superblock // BLOCK * 64 * bits]
        sizes += [per * TILE] * ((1 if flags & HAS_SC else 0) + (1 if flags & HAS_SC and flags & GENERAL else 0))
        sizes += [TILE * 2] * (2 if flags & GENERAL else 1)
        size = tiles * supers * sum(sizes)
        rec = state["data"][at:at + size].reshape(tiles, supers, sum(sizes))
        at += size
        fields, pos = [], 0
        for width in sizes:
            fields.append(rec[..., pos:pos + width].contiguous())
            pos += width
        q = _unplanes(fields.pop(0).reshape(tiles, k // BLOCK, -1), bits)
        codes = q.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)[:rows]

        def rows_of(t: Tensor, dtype: torch.dtype) -> Tensor:  # [tiles, supers, X * TILE] bytes -> [rows, supers * X]
            v = t.view(dtype).reshape(tiles, supers, -1, TILE).permute(0, 3, 1, 2)
            return v.reshape(tiles * TILE, -1)[:rows]

        ones = torch.ones(rows, k // group, dtype=torch.int8)
        sc = rows_of(fields.pop(0), torch.int8) if flags & HAS_SC else ones
        if flags & HAS_SC and flags & GENERAL:
            mn = fields.pop(0).view(torch.int8).reshape(tiles, supers, -1, TILE, 2).permute(0, 3, 1, 2, 4)
            mn = mn.reshape(tiles * TILE, -1)[:rows]
        else:
            mn = sc
        D = rows_of(fields.pop(0), torch.float16).float()
        M = rows_of(fields.pop(0), torch.float16).float() if flags & GENERAL else -off * D
        out.append(Codes(codes.contiguous(), D.contiguous(), M.contiguous(), sc.contiguous(), mn.contiguous(), bits, kind=""))
    return out


class QLinear(nn.Module):
    """y = x W^T + b with W in the tiled layout, through `ygg::qlinear` (row-invariant: a row's
    result never depends on the rows beside it)."""

    def __init__(self, n: int, k: int, nbytes: int, segments: int, bias: bool, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("data", torch.empty(nbytes, dtype=torch.uint8))
        self.register_buffer("layout", torch.empty(segments, 7, dtype=torch.long))
        self.bias = nn.Parameter(torch.empty(n, dtype=bias_dtype)) if bias else None
        self.out_features, self.in_features = n, k

    @classmethod
    def like(cls, state: dict[str, Tensor], prefix: str) -> "QLinear":
        """An empty layer shaped for the state dict's entries under `prefix` ("layers.0.attention.wqkv.")."""
        data, layout = state[prefix + "data"], state[prefix + "layout"]
        bias = state.get(prefix + "bias")
        return cls(int(layout[:, 0].sum()), int(layout[0, 1]), data.numel(), layout.shape[0], bias is not None,
                   bias.dtype if bias is not None else torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        return qlinear(x, self.data, self.layout, self.bias, self.out_features)

    def extra_repr(self) -> str:
        bits = "+".join(str(int(b)) for b in self.layout[:, 2]) if self.layout.device.type != "meta" else "?"
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={bits}"


# ---------------------------------------------------------------- row-major, for embeddings


def pack_rows(c: Codes) -> dict[str, Tensor]:
    """What `QEmbedding` holds: codes [V, K] (8-bit, and 6-bit ones: a lookup reads a few rows, so
    their size is all that counts) or [V, K/2] (4-bit: k = 2i in the low and 2i + 1 in the high
    nibble of byte i), D, M [V, K/S], sc, mn [V, K/G]."""
    codes = c.codes if c.bits > 4 else c.codes[:, 0::2] | (c.codes[:, 1::2] << 4)
    return {"codes": codes.contiguous(), "D": c.D.float().contiguous(), "M": c.M.float().contiguous(),
            "sc": c.sc.clone(), "mn": c.mn.clone()}  # copies: sc and mn may be one tensor, safetensors stores each once


class QEmbedding(nn.Module):
    """An embedding table kept quantized: a lookup dequantizes only the rows it returns, in float32
    (the exact values of the format) rounded once to `dtype`."""

    def __init__(self, rows: int, dim: int, bits: int, groups: int, superblocks: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("codes", torch.empty(rows, dim * bits // 8, dtype=torch.uint8))
        self.register_buffer("D", torch.empty(rows, superblocks))
        self.register_buffer("M", torch.empty(rows, superblocks))
        self.register_buffer("sc", torch.empty(rows, groups, dtype=torch.int8))
        self.register_buffer("mn", torch.empty(rows, groups, dtype=torch.int8))
        self.bits, self.dim, self.dtype = bits, dim, dtype

    @classmethod
    def like(cls, state: dict[str, Tensor], prefix: str, dim: int, dtype: torch.dtype) -> "QEmbedding":
        codes, D, sc = state[prefix + "codes"], state[prefix + "D"], state[prefix + "sc"]
        return cls(codes.shape[0], dim, 8 if codes.shape[1] == dim else 4, sc.shape[1], D.shape[1], dtype)

    @property
    def weight(self) -> Tensor:
        """A stand-in whose device and dtype are the model's (the runtime reads them from here)."""
        return self.D.new_empty(0, dtype=self.dtype)

    def forward(self, tokens: Tensor) -> Tensor:
        flat = tokens.reshape(-1)
        c = self.codes[flat]
        if self.bits == 4:
            c = torch.stack((c & 15, c >> 4), dim=-1).flatten(-2)
        looked_up = Codes(c, self.D[flat], self.M[flat], self.sc[flat], self.mn[flat], self.bits, "")
        return looked_up.dequantize().to(self.dtype).reshape(*tokens.shape, self.dim)
