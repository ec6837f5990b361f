"""Quantized weights: integer codes with group scales, their two layouts, and the layers that use them.

One format holds every quantization the native kernel takes (csrc/qlinear.cpp):

    w[n, k] = D[n, s] * sc[n, j] * c[n, k] + M[n, s] * mn[n, j]

codes c in [0, 2**bits) (bits 4, 6 or 8), groups j of G = 16 or 32 input columns with int8 multipliers
(sc, mn), super-blocks s of S = G or 256 columns with float32 factors (D, M). A GGUF file's blocks
are exactly this: Q4_K and Q5_K (S = 256, G = 32, 6-bit scales and mins), Q6_K (G = 16, signed
scales, the -32 of its codes in M), and the legacy Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (a super-block of one
group, sc = mn = 1). So an artifact keeps the file's own numbers (`ygg_compile.quantize` reads them),
and a tensor whose parts differ (q, k and v fused into one matrix) is promoted to the finer format
of its parts without changing a single weight.

`QLinear` computes with the tiled layout the kernel reads; `QEmbedding` looks rows up in a row-major
copy and dequantizes only the rows it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ygg_runtime.kernels import qlinear

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
    """Row blocks stacked into one matrix (fused q/k/v, gate/up), each promoted to the finest
    format among them; kind lists the parts' kinds when they differ."""
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


def bits_for(top: int) -> int:
    """The narrowest code width the kernel takes for codes up to `top`."""
    return next(b for b in (4, 6, 8) if top < 2 ** b)


def pack(c: Codes) -> dict[str, Tensor]:
    """The tensors `QLinear` holds (its state dict entries): codes [N/16, K/32, 512, 384 or 256]
    bytes, each block 8 quads of 4 k x 16 columns (4-bit: quads 2i and 2i+1 in the low and high
    nibbles of one 64-byte vector; 6-bit: those 4 low bits, then the top 2 bits of quads 4i..4i+3 in
    one 64-byte vector each); D, M [N/16, K/S, 16]; sc, mn [N/16, K/G, 16] (mn empty when it equals
    sc, as Q6_K's does: one load less per group); shape [N, K] (N before the last tile's padding
    rows, which are zeros)."""
    rows, k = c.shape
    if not fits_kernel((rows, k)):
        raise ValueError(f"a [{rows}, {k}] weight does not come in blocks of {BLOCK} inputs")
    n = -(-rows // TILE) * TILE
    if n != rows:
        c = Codes(*(torch.cat([t, t.new_zeros(n - rows, t.shape[1])]) for t in (c.codes, c.D, c.M, c.sc, c.mn)), c.bits, c.kind)
    # [n, k] -> [tile, column, block, quad, 4] -> [tile, block, quad, column, 4]
    q = c.codes.reshape(n // TILE, TILE, k // BLOCK, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    if c.bits in (4, 6):
        low = q & 15
        parts = [low[:, :, 0::2] | (low[:, :, 1::2] << 4)]
        if c.bits == 6:
            top = q >> 4
            parts.append(top[:, :, 0::4] | (top[:, :, 1::4] << 2) | (top[:, :, 2::4] << 4) | (top[:, :, 3::4] << 6))
        q = torch.cat([p.reshape(n // TILE, k // BLOCK, -1) for p in parts], dim=-1)
    codes = q.reshape(n // TILE, k // BLOCK, -1).contiguous()

    def tiled(t: Tensor) -> Tensor:
        return t.reshape(n // TILE, TILE, -1).transpose(1, 2).contiguous()

    mn = tiled(c.mn) if not torch.equal(c.mn, c.sc) else torch.empty(n // TILE, 0, TILE, dtype=torch.int8)
    return {"codes": codes, "D": tiled(c.D.float()), "M": tiled(c.M.float()), "sc": tiled(c.sc), "mn": mn,
            "shape": torch.tensor([rows, k])}


def unpack(state: dict[str, Tensor]) -> Codes:
    """`pack`'s inverse (tests)."""
    codes = state["codes"]
    tiles, blocks, nbytes = codes.shape
    bits = nbytes * 8 // (TILE * BLOCK)
    if bits == 8:
        q = codes.reshape(tiles, blocks, BLOCK // 4, TILE, 4)
    else:
        p = codes[..., : TILE * BLOCK // 2].reshape(tiles, blocks, -1, TILE, 4)
        q = torch.stack((p & 15, p >> 4), dim=3).reshape(tiles, blocks, BLOCK // 4, TILE, 4)
        if bits == 6:
            h = codes[..., TILE * BLOCK // 2:].reshape(tiles, blocks, -1, TILE, 4)
            top = torch.stack([(h >> (2 * j)) & 3 for j in range(4)], dim=3).reshape(tiles, blocks, BLOCK // 4, TILE, 4)
            q = q | (top << 4)
    flat = q.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks * BLOCK)

    def rows(t: Tensor) -> Tensor:
        return t.transpose(1, 2).reshape(tiles * TILE, -1)

    n = int(state["shape"][0])
    sc = rows(state["sc"])[:n]
    mn = rows(state["mn"])[:n] if state["mn"].numel() else sc
    return Codes(flat[:n], rows(state["D"])[:n], rows(state["M"])[:n], sc, mn, bits, kind="")


class QLinear(nn.Module):
    """y = x W^T + b with W in the tiled layout, through `ygg::qlinear` (row-invariant: a row's
    result never depends on the rows beside it)."""

    def __init__(self, n: int, tiles: int, blocks: int, bits: int, groups: int, superblocks: int, bias: bool,
                 bias_dtype: torch.dtype = torch.float32, own_mn: bool = True):
        super().__init__()
        self.register_buffer("codes", torch.empty(tiles, blocks, TILE * BLOCK * bits // 8, dtype=torch.uint8))
        self.register_buffer("shape", torch.empty(2, dtype=torch.long))
        self.register_buffer("D", torch.empty(tiles, superblocks, TILE))
        self.register_buffer("M", torch.empty(tiles, superblocks, TILE))
        self.register_buffer("sc", torch.empty(tiles, groups, TILE, dtype=torch.int8))
        self.register_buffer("mn", torch.empty(tiles, groups if own_mn else 0, TILE, dtype=torch.int8))
        self.bias = nn.Parameter(torch.empty(n, dtype=bias_dtype)) if bias else None
        self.out_features, self.in_features, self.bits = n, blocks * BLOCK, bits

    @classmethod
    def like(cls, state: dict[str, Tensor], prefix: str) -> "QLinear":
        """An empty layer shaped for the state dict's entries under `prefix` ("layers.0.attention.wqkv.")."""
        codes, D, sc = state[prefix + "codes"], state[prefix + "D"], state[prefix + "sc"]
        bias = state.get(prefix + "bias")
        return cls(int(state[prefix + "shape"][0]), codes.shape[0], codes.shape[1], codes.shape[2] * 8 // (TILE * BLOCK),
                   sc.shape[1], D.shape[1], bias is not None, bias.dtype if bias is not None else torch.float32,
                   own_mn=state[prefix + "mn"].numel() > 0)

    def forward(self, x: Tensor) -> Tensor:
        return qlinear(x, self.codes, self.D, self.M, self.sc, self.mn, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


# ---------------------------------------------------------------- row-major, for embeddings


def pack_rows(c: Codes) -> dict[str, Tensor]:
    """What `QEmbedding` holds: codes [V, K] (8-bit, and 6-bit ones: a lookup reads a few rows, so
    their size is all that counts) or [V, K/2] (4-bit: k = 2i in the low and 2i + 1 in the high
    nibble of byte i), D, M [V, K/S], sc, mn [V, K/G]."""
    codes = c.codes if c.bits > 4 else c.codes[:, 0::2] | (c.codes[:, 1::2] << 4)
    return {"codes": codes.contiguous(), "D": c.D.float().contiguous(), "M": c.M.float().contiguous(),
            "sc": c.sc.contiguous(), "mn": c.mn.contiguous()}


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
