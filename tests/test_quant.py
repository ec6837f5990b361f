"""Quantized weights (ygg_runtime/quant.py, csrc/qlinear.cpp, ygg_compile/quantize.py): the kernel's
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
from ygg_runtime import kernels
from ygg_runtime.quant import Codes, QEmbedding, QLinear, cat, pack, pack_rows, unpack


def random_codes(n: int, k: int, bits: int, group: int, superblock: int, seed: int = 0) -> Codes:
    g = torch.Generator().manual_seed(seed)
    return Codes(torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g),
                 torch.rand(n, k // superblock, generator=g) * 0.01, -torch.rand(n, k // superblock, generator=g) * 0.01,
                 torch.randint(-60, 63, (n, k // group), dtype=torch.int8, generator=g),
                 torch.randint(0, 63, (n, k // group), dtype=torch.int8, generator=g), bits, f"test{bits}")


FORMATS = [(4, 32, 256), (4, 32, 32), (6, 16, 256), (6, 32, 32), (8, 16, 256), (8, 32, 32), (8, 32, 256)]


def call(c: Codes, x: torch.Tensor, bias=None, reference=False) -> torch.Tensor:
    p = pack(c)
    return kernels.qlinear(x, p["codes"], p["D"], p["M"], p["sc"], p["mn"], bias, c.shape[0], reference=reference)


@pytest.mark.parametrize("bits,group,superblock", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_path_equals_the_scalar_definition_bit_for_bit(bits, group, superblock, dtype):
    """Every row count a step uses, in and past the 8-row blocks, with a bias and a padded last tile."""
    c = random_codes(72, 512, bits, group, superblock)
    bias = torch.randn(72).to(dtype)
    x = (torch.randn(67, 512) * 3).to(dtype)
    x[5] = 0  # an all-zero row: a zero activation scale
    for m in (1, 2, 3, 8, 9, 16, 17, 64, 67):
        fast, ref = call(c, x[:m], bias), call(c, x[:m], bias, reference=True)
        assert fast.dtype == dtype and fast.shape == (m, 72)
        assert torch.equal(fast, ref), m


def test_an_offset_multiplier_equal_to_the_scale_is_stored_once():
    """Q6_K's layout: mn is sc, so the packed weight keeps one of them; same results."""
    c = random_codes(32, 512, 6, 16, 256, seed=11)
    c.mn = c.sc.clone()
    p = pack(c)
    assert p["mn"].numel() == 0
    x = torch.randn(5, 512).to(torch.bfloat16)
    assert torch.equal(call(c, x), call(c, x, reference=True))
    assert torch.equal(unpack(p).dequantize(), c.dequantize())
    exact = F.linear(x.double(), c.dequantize().double())
    assert (call(c, x).double() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("bits,group,superblock", FORMATS[:3])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(bits, group, superblock):
    c = random_codes(64, 1024, bits, group, superblock, seed=1)
    x = torch.randn(64, 1024).to(torch.bfloat16)
    alone = torch.cat([call(c, x[i:i + 1]) for i in range(64)])
    for m in (2, 4, 7, 16, 33, 64):
        assert torch.equal(call(c, x[:m]), alone[:m]), m
    assert torch.equal(call(c, x.flip(0)), alone.flip(0))
    assert torch.equal(call(c, x[None, :16]), alone[None, :16])  # [1, W, K], as the model calls it


@pytest.mark.parametrize("bits,group,superblock", FORMATS)
def test_result_is_the_dequantized_matmul_up_to_the_int8_activations(bits, group, superblock):
    c = random_codes(48, 256, bits, group, superblock, seed=2)
    x = torch.randn(5, 256)
    exact = F.linear(x.double(), c.dequantize().double())
    got = call(c, x).double()
    # activations are int8 per 32 columns: ~0.4 % of each block's largest value, summed over k
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()
    # and exactly the integer arithmetic the header states, computed here in float64
    q, da = [], []
    for b in x.reshape(5, -1, 32):
        amax = b.abs().amax(-1)
        d = (amax / 127).float()
        qq = torch.where(amax[:, None] > 0, torch.round(b * (127 / amax.float())[:, None]), torch.zeros_like(b))
        q.append(qq.reshape(-1))
        da.append(d.repeat_interleave(32))
    xq = torch.stack(q).double() * torch.stack(da).double()
    assert (got - F.linear(xq, c.dequantize().double())).abs().max() <= 1e-4 * exact.abs().max()


def test_portable_build_equals_the_vnni_path(tmp_path):
    """The plain C++ path (what a CPU without AVX-512 VNNI runs) gives the same bits: run in a
    process that asks for it, on the same inputs."""
    c = random_codes(40, 512, 4, 32, 256, seed=3)
    x = torch.randn(11, 512).to(torch.bfloat16)
    p = pack(c)
    torch.save({"x": x, **p}, tmp_path / "in.pt")
    script = ("import torch, json; from ygg_runtime import kernels; d = torch.load(r'%s');"
              "y = kernels.qlinear(d['x'], d['codes'], d['D'], d['M'], d['sc'], d['mn'], None, 40);"
              "torch.save(y, r'%s'); print(json.dumps(kernels.qlinear_path()))") % (tmp_path / "in.pt", tmp_path / "out.pt")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "YGG_QLINEAR": "portable"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == "portable"
    assert torch.equal(torch.load(tmp_path / "out.pt"), call(c, x))


def test_an_avx2_build_runs_its_own_path_and_agrees(tmp_path):
    """The library built without AVX-512, as for an AVX2 CPU, runs its AVX2 path: the same bits for
    every code width and group, rows in and past its 4-row blocks."""
    lib = kernels.build(tmp_path, isa=["-mavx2", "-mfma", "-mf16c"])
    cases = [random_codes(40, 512, bits, group, superblock, seed=4) for bits, group, superblock in FORMATS]
    x = torch.randn(6, 512).to(torch.bfloat16)
    torch.save({"x": x, "packed": [pack(c) for c in cases]}, tmp_path / "in.pt")
    script = ("import torch, json; from ygg_runtime import kernels; kernels.load(r'%s'); d = torch.load(r'%s');"
              "ys = [kernels.qlinear(d['x'][:m], p['codes'], p['D'], p['M'], p['sc'], p['mn'], None, 40)"
              " for p in d['packed'] for m in (1, 3, 6)];"
              "torch.save(ys, r'%s'); print(json.dumps(kernels.qlinear_path()))") % (lib, tmp_path / "in.pt", tmp_path / "out.pt")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == "avx2"
    want = [call(c, x[:m]) for c in cases for m in (1, 3, 6)]
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "out.pt"), want))


@pytest.mark.parametrize("bits,group,superblock", FORMATS)
def test_packing_round_trips(bits, group, superblock):
    c = random_codes(40, 256, bits, group, superblock, seed=5)
    back = unpack(pack(c))
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


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_float_weights_bounds_the_error(bits):
    g = torch.Generator().manual_seed(10)
    w = torch.randn(64, 512, generator=g) * 0.05
    c = quantize.quantize(w, bits)
    err = (c.dequantize() - w).abs()
    step = w.reshape(64, -1, 32).abs().amax(-1) * (2 / 15 if bits == 4 else 1 / 127)
    assert (err.reshape(64, -1, 32).amax(-1) <= step * 0.75 + 1e-6).all()  # half a step, plus 6-bit scales' slack
    assert quantize.quantize(torch.zeros(16, 64), bits).dequantize().abs().max() == 0
