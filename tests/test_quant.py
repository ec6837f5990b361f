"""Quantized weights (ygg_runtime/model/quant.py, csrc/qlinear.cpp, ygg_compile/quantize.py): the kernel's
fast paths equal its scalar definition bit for bit, a row's output never depends on the rows beside
it, the layouts round-trip, and every GGUF block type decodes to the numbers gguf's own dequantizer
gives."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ygg_compile import quantize
from ygg_runtime.backend import native
from ygg_runtime.machine import cpu_flags
from dataclasses import replace

from ygg_runtime.model.quant import GENERAL, HAS_SC, Codes, QEmbedding, QLinear, cat, pack, pack_rows, unpack


def random_codes(n: int, k: int, bits: int, group: int, superblock: int, seed: int = 0, folded: bool = False) -> Codes:
    """Random codes of a format the kernel holds: groups with their own int8 multipliers in
    super-blocks of 64 to 256, or blocks of 32 with unit multipliers (a GGUF legacy block); float16
    factors; folded: mn = sc and M = -off * D (Q6_K's, Q8_0's kind), else independent mins."""
    g = torch.Generator().manual_seed(seed)
    D = (torch.rand(n, k // superblock, generator=g) * 0.01).half().float()
    if superblock > 32:
        sc = torch.randint(-60, 63, (n, k // group), dtype=torch.int8, generator=g)
        mn = torch.randint(0, 63, (n, k // group), dtype=torch.int8, generator=g)
    else:
        sc = mn = torch.ones(n, k // group, dtype=torch.int8)
    if folded:
        mn, M = sc, -(2 ** (bits - 1)) * D
    else:
        M = -(torch.rand(n, k // superblock, generator=g) * 0.01).half().float()
    return Codes(torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g), D, M, sc, mn, bits, f"test{bits}")


# (bits, group, super-block, folded): K-quant-like and legacy-like formats of every code width
FORMATS = [(4, 32, 256, False), (4, 32, 32, False), (4, 32, 32, True), (6, 16, 256, True), (6, 32, 256, False),
           (6, 32, 32, True), (8, 16, 256, True), (8, 32, 32, True), (8, 32, 256, False), (3, 16, 256, False),
           (3, 32, 32, False), (2, 16, 256, False), (2, 32, 256, True), (4, 32, 128, False), (3, 16, 64, False)]


def call(c: Codes | list[Codes], x: torch.Tensor, bias=None, reference=False) -> torch.Tensor:
    p = pack(c)
    return native.qlinear(x, p["data"], p["layout"], bias, reference=reference)


@pytest.mark.parametrize("bits,group,superblock,folded", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_path_equals_the_scalar_definition_bit_for_bit(bits, group, superblock, folded, dtype):
    """Every row count from 1 to 64 and past it (the 8-, 4-, 2- and 1-row blocks and their ragged
    tails), with a bias, a padded last tile, an all-zero row (a zero activation scale)."""
    c = random_codes(72, 512, bits, group, superblock, folded=folded)
    bias = torch.randn(72).to(dtype)
    x = (torch.randn(67, 512) * 3).to(dtype)
    x[5] = 0
    ref = call(c, x, bias, reference=True)
    for m in [*range(1, 18), 31, 33, 64, 67]:
        fast = call(c, x[:m], bias)
        assert fast.dtype == dtype and fast.shape == (m, 72)
        assert torch.equal(fast, ref[:m]), m


def test_a_folded_segment_stores_neither_mins_nor_their_factors():
    """Q6_K's kind (mn = sc, M = -32 D): the codes' offset is subtracted in the integer sums, so
    the packed weight holds only sc and D per super-block; the same numbers as unfolded."""
    c = random_codes(32, 512, 6, 16, 256, seed=11, folded=True)
    p = pack(c)
    flags, off = p["layout"][0, 5:].tolist()
    assert flags == HAS_SC and off == 32
    record = 8 * 64 * 6 + 16 * 16 + 16 * 2  # a super-block: codes, sc, D
    assert p["data"].numel() == 2 * 2 * record  # 2 tiles x 2 super-blocks
    mn = c.sc.clone()
    mn[0, 0] += 1
    unfolded = pack(replace(c, mn=mn))  # one multiplier of the mins apart: general
    assert unfolded["layout"][0, 5] == HAS_SC | GENERAL
    assert unfolded["data"].numel() == 2 * 2 * (record + 16 * 16 + 16 * 2)  # + mn and M
    back = unpack(p)[0]
    assert torch.equal(back.dequantize(), c.dequantize()) and torch.equal(back.mn, back.sc)
    x = torch.randn(5, 512).to(torch.bfloat16)
    assert torch.equal(call(c, x), call(c, x, reference=True))
    exact = F.linear(x.double(), c.dequantize().double())
    assert (call(c, x).double() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("bits,group,superblock,folded", FORMATS[:4] + FORMATS[9:10])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it_or_the_threads(bits, group, superblock, folded, threads):
    c = random_codes(200, 1024, bits, group, superblock, seed=1, folded=folded)
    x = torch.randn(64, 1024).to(torch.bfloat16)
    alone = torch.cat([call(c, x[i:i + 1]) for i in range(64)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for m in (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 64):
            assert torch.equal(call(c, x[:m]), alone[:m]), m
        assert torch.equal(call(c, x.flip(0)), alone.flip(0))
        assert torch.equal(call(c, x[None, :16]), alone[None, :16])  # [1, W, K], as the model calls it
    finally:
        torch.set_num_threads(before)


def test_the_parts_of_a_fused_layer_keep_their_own_formats():
    """q/k/v as Q4_K, Q4_K and Q6_K (and a ragged 40-row part): one layer, three segments, each
    the bits its part has, the output the parts' outputs side by side."""
    parts = [random_codes(96, 512, 4, 32, 256, seed=12), random_codes(40, 512, 4, 32, 256, seed=13),
             random_codes(32, 512, 6, 16, 256, seed=14, folded=True)]
    p = pack(parts)
    assert p["layout"][:, 0].tolist() == [96, 40, 32] and p["layout"][:, 2].tolist() == [4, 4, 6]
    assert p["data"].numel() < pack(cat(parts))["data"].numel()  # promoted whole, all would be 6-bit
    x = torch.randn(9, 512).to(torch.bfloat16)
    bias = torch.randn(168).to(torch.bfloat16)
    whole = call(parts, x, bias)
    assert torch.equal(whole, call(parts, x, bias, reference=True))
    assert torch.equal(whole[:, :96], call(parts[0], x, bias[:96]))
    assert torch.equal(whole[:, 136:], call(parts[2], x, bias[136:]))
    for a, b in zip(unpack(p), parts):
        assert torch.equal(a.dequantize(), b.dequantize())


def test_a_format_the_kernel_cannot_hold_exactly_is_refused():
    c = random_codes(16, 256, 4, 32, 256)
    with pytest.raises(ValueError, match="float16"):
        pack(replace(c, D=c.D + 1e-5))
    with pytest.raises(ValueError, match="unit multipliers"):
        pack(replace(random_codes(16, 256, 4, 32, 32), sc=torch.full((16, 8), 3, dtype=torch.int8)))


@pytest.mark.parametrize("bits,group,superblock,folded", FORMATS)
def test_result_is_the_dequantized_matmul_up_to_the_int8_activations(bits, group, superblock, folded):
    c = random_codes(48, 512, bits, group, superblock, seed=2, folded=folded)
    x = torch.randn(5, 512)
    exact = F.linear(x.double(), c.dequantize().double())
    got = call(c, x).double()
    # activations are int8 per super-block (256 or 32 columns): ~0.4 % of its largest value, summed over k
    assert (got - exact).abs().max() <= 0.03 * exact.abs().max()
    # and exactly the integer arithmetic the header states, computed here in float64
    q, da = [], []
    for b in x.reshape(5, -1, superblock):
        amax = b.abs().amax(-1)
        d = (amax / 127).float()
        inv = torch.full_like(amax, 127.0) / amax  # 127 / amax rounded once, as the kernel does (torch's
        # `127 / t` is 127 * (1 / t), an ulp off at times: a near-tie then rounds the other way)
        qq = torch.where(amax[:, None] > 0, torch.round(b * inv[:, None]), torch.zeros_like(b))
        q.append(qq.reshape(-1))
        da.append(d.repeat_interleave(superblock))
    xq = torch.stack(q).double() * torch.stack(da).double()
    assert (got - F.linear(xq, c.dequantize().double())).abs().max() <= 1e-4 * exact.abs().max()


def _cases():
    return [random_codes(40, 512, bits, group, superblock, seed=4, folded=folded) for bits, group, superblock, folded in FORMATS]


def _run_elsewhere(tmp_path, lib, env) -> tuple[str, list]:
    """Every format at 1, 3, 6 and 13 rows in another process (another library or path)."""
    x = torch.randn(13, 512).to(torch.bfloat16)
    torch.save({"x": x, "packed": [pack(c) for c in _cases()]}, tmp_path / "in.pt")
    load = f"native.load(r'{lib}'); " if lib else ""
    script = (f"import torch, json; from ygg_runtime.backend import native; {load}d = torch.load(r'{tmp_path / 'in.pt'}');"
              "ys = [native.qlinear(d['x'][:m], p['data'], p['layout'], None) for p in d['packed'] for m in (1, 3, 6, 13)];"
              f"torch.save(ys, r'{tmp_path / 'out.pt'}'); print(json.dumps(native.qlinear_path()))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    want = [call(c, x[:m]) for c in _cases() for m in (1, 3, 6, 13)]
    return json.loads(proc.stdout), [torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "out.pt"), want)]


def test_portable_build_equals_the_vnni_path(tmp_path):
    """The plain C++ path (what a CPU without AVX2 runs) gives the same bits: run in a process
    that asks for it, on the same inputs."""
    path, same = _run_elsewhere(tmp_path, None, {"YGG_QLINEAR": "portable"})
    assert path == "portable" and all(same)


def test_an_avx2_build_runs_its_own_path_and_agrees(tmp_path):
    """The library built without AVX-512, as for an AVX2 CPU, runs its AVX2 path: the same bits for
    every code width, group and kind, rows in and past its row blocks. Built into the suite's kernel
    cache: on an AVX2 machine these are its own flags, the library every other test loads."""
    lib = native.build(isa=["-mavx2", "-mfma", "-mf16c"])
    path, same = _run_elsewhere(tmp_path, lib, {})
    assert path == "avx2" and all(same)


def _tile_path_checks(tmp_path, env) -> dict:
    """Every format, float32 and bfloat16 inputs with a bias and an all-zero row, at every width from
    1 to 17 and across the tile path's 16-row tiles and 64-row passes, on 1 and 2 threads, against
    the scalar definition: in a process that runs the path `env` asks for."""
    cases = []
    for i, (bits, group, superblock, folded) in enumerate(FORMATS):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(130, 512) * 3).to(dtype)
            x[5] = 0
            cases.append((pack(random_codes(72, 512, bits, group, superblock, seed=20 + i, folded=folded)), x, torch.randn(72).to(dtype)))
    torch.save(cases, tmp_path / "cases.pt")
    script = f"""
import json, torch
from ygg_runtime.backend import native
bad = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    for i, (p, x, bias) in enumerate(torch.load(r'{tmp_path / "cases.pt"}')):
        ref = native.qlinear(x, p['data'], p['layout'], bias, reference=True)
        for m in [*range(1, 18), 31, 32, 33, 48, 63, 64, 65, 67, 100, 130]:
            if not torch.equal(native.qlinear(x[:m], p['data'], p['layout'], bias), ref[:m]):
                bad.append((threads, i, m))
print(json.dumps({{'path': native.qlinear_path(), 'bad': bad}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_amx_tile_path_equals_the_scalar_definition_bit_for_bit(tmp_path):
    """The AMX path's layout and arithmetic (activations as 16-row tiles, code blocks as B tiles,
    running int32 sums per group, the same float steps), its tile instructions emulated as Intel
    defines them: on every CPU, whether or not it has AMX."""
    got = _tile_path_checks(tmp_path, {"YGG_QLINEAR": "amx-emulated"})
    assert got == {"path": "amx-emulated", "bad": []}


@pytest.mark.skipif(not {"amx_tile", "amx_int8"} <= cpu_flags(), reason="this CPU has no AMX (amx_tile, amx_int8): the emulated path's test stands in")
def test_the_amx_hardware_path_equals_the_scalar_definition_bit_for_bit(tmp_path):
    """On a CPU with AMX the kernels are built with it (Inductor's ISA flags) and YGG_QLINEAR=amx runs
    the tiles themselves: the same bits as the definition, whatever the rows or threads."""
    assert _tile_path_checks(tmp_path, {"YGG_QLINEAR": "amx"}) == {"path": "amx", "bad": []}


def test_the_amx_hardware_path_compiles_on_any_machine(tmp_path):
    """The hardware tiles are compiled only where Inductor's ISA has AMX: built here with those
    flags (to an object, not run), so a change that breaks it shows on every CPU, not first on a Xeon."""
    from torch._inductor.cpu_vec_isa import VecAMX
    from torch.utils.cpp_extension import include_paths

    flags = [f for f in VecAMX._arch_flags.split() if f.startswith("-m")]
    obj = tmp_path / "qlinear.o"
    proc = subprocess.run([native._compiler(), "-O0", "-std=c++20", "-fPIC", "-fopenmp", *flags,
                           *(f"-I{p}" for p in include_paths()), "-c", str(native.SOURCES[1]), "-o", str(obj)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    disassembly = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True).stdout
    assert "tdpbsud" in disassembly and "ldtilecfg" in disassembly


@pytest.mark.parametrize("bits,group,superblock,folded", FORMATS)
def test_packing_round_trips(bits, group, superblock, folded):
    c = random_codes(40, 512, bits, group, superblock, seed=5, folded=folded)
    back = unpack(pack(c))[0]
    for f in ("codes", "D", "M", "sc", "mn"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    assert back.bits == bits


def test_promotion_and_concatenation_keep_every_weight():
    a, b = random_codes(32, 256, 4, 32, 256, seed=6), random_codes(16, 256, 8, 16, 256, seed=7)
    fused = cat([a, b])
    assert (fused.bits, fused.group, fused.superblock) == (8, 16, 256)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    legacy = random_codes(16, 256, 8, 32, 32, seed=8)
    assert cat([a, legacy]).superblock == 32
    assert torch.equal(cat([a, legacy]).dequantize(), torch.cat([a.dequantize(), legacy.dequantize()]))
    with pytest.raises(ValueError):
        b.promote(4, 16, 256)


def test_quantized_layers_compute_what_their_codes_hold():
    c = random_codes(40, 64, 4, 32, 32, seed=9)
    state = {f"l.{k}": v for k, v in pack(c).items()} | {"l.bias": torch.randn(40)}
    lin = QLinear.like(state, "l.")
    lin.load_state_dict({k[2:]: v for k, v in state.items()}, assign=True)
    x = torch.randn(3, 64)
    assert torch.equal(lin(x), call(c, x, state["l.bias"]))
    rows = {f"e.{k}": v for k, v in pack_rows(c).items()}
    emb = QEmbedding.like(rows, "e.", 64, torch.bfloat16)
    emb.load_state_dict({k[2:]: v for k, v in rows.items()}, assign=True)
    ids = torch.tensor([[3, 0, 39, 3]])
    assert torch.equal(emb(ids), c.dequantize()[ids].to(torch.bfloat16))


# ---------------------------------------------------------------- GGUF blocks


def random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of a GGUF type with finite float16 factors."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    size, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, k // size, nbytes), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
    for off in halves[kind]:
        blocks[..., off:off + 2] = (rng.random((rows, k // size, 1)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_every_gguf_block_type_decodes_to_ggufs_own_numbers(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(kind, 24, 512)
    c = quantize._codes(quantize.decode(kind, raw))
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(24, 512))
    got = c.dequantize()
    assert int(c.codes.max()) < 2 ** c.bits
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()
    assert c.bits == {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}.get(kind, 6)


def test_a_block_type_the_kernel_cannot_hold_is_reported_not_guessed():
    assert quantize.decode("Q3_K", random_blocks("Q4_K", 2, 256)) is None


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("k", [512, 384, 96])
def test_quantizing_float_weights_bounds_the_error(bits, k, monkeypatch):
    """Blocks of 32 with float16 factors (8 bits, and rows of an odd number of 32s: K = 96): at most
    half a step of each group's range, plus the factors' slack. Super-blocks (of 256, or 128 for K =
    384) of 4 to 2 bits: the range searched per group errs less, in total, than the whole range."""
    g = torch.Generator().manual_seed(10)
    w = torch.randn(64, k, generator=g) * 0.05
    w[3, 7] = 0.6  # an outlier
    c = quantize.quantize(w, bits)
    assert quantize.holdable(c) and c.bits == bits
    err = (c.dequantize() - w).abs()
    if bits == 8 or k % 64:
        blocks = w.reshape(64, -1, 32)
        span = blocks.abs().amax(-1) * 2 if bits == 8 else blocks.amax(-1).clamp(min=0) - blocks.amin(-1).clamp(max=0)
        step = span / (127 if bits == 8 else 2 ** bits - 1)
        assert (err.reshape(64, -1, 32).amax(-1) <= step * 0.75 + 1e-6).all()
    else:
        monkeypatch.setattr(quantize, "SHRINK", (1.0,))
        whole = (quantize.quantize(w, bits).dequantize() - w).pow(2).sum()
        assert err.pow(2).sum() < whole  # strictly: some group gained from clipping
    assert quantize.quantize(torch.zeros(16, 64), bits).dequantize().abs().max() == 0
