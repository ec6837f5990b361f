"""The backends (ygg_runtime/backend/): the CUDA ops' Triton kernels run on the CPU by Triton's
interpreter (TRITON_INTERPRET=1, set by conftest.py where there is no GPU) — each bit for bit
against the numpy model of its blocks, a row's bits independent of the rows beside it — and the
whole decoder on the CUDA ops: the model the CPU ops compute, row-invariant across forward widths,
and at most 8 kernels a layer. Bits on a GPU are the GPU's own business (`make gpu-check`)."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ygg_runtime import backend
from ygg_runtime.backend import cpu, cuda, triton_attention, triton_linear, triton_rowwise
from ygg_runtime.backend.triton_linear import GATED, ROPE, linear, reference, tiling

DTYPES = [torch.float32, torch.bfloat16]


def product(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, **kw):
    """x [1, m, k] and weight [n, k] of a kind a model holds, and the kernel's epilogue arguments."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    if kw.pop("with_bias", False):
        kw["bias"] = torch.randn(n, generator=g).to(dtype)
    if kw.pop("with_residual", False):
        kw["residual"] = torch.randn(1, m, n, generator=g).to(dtype)
    if kw.get("epilogue") == ROPE:  # heads of 32: 3 rotated (q and k), 1 not (v)
        kw["rope"] = (torch.randn(m, 16, generator=g).to(dtype), torch.randn(m, 16, generator=g).to(dtype), 16, 3)
    return x, w, kw


@pytest.fixture
def rowwise_dot(monkeypatch):
    """Triton's interpreter multiplies a tile with one numpy matmul, and numpy's BLAS gives a row
    other bits at another position of the same matrix (measured: row 9 of 64 against the same row
    at 1, 7e-7 apart in float32) — which a GPU's MMA does not (each element's products summed by the
    same unit wherever its row is: the H200's row check passes with cuBLAS at every width). With
    this fixture the interpreter multiplies with einsum's own loop, each element summed the same way
    wherever its row is, so a test can see whether the *kernel* lets a row's arithmetic depend on
    the rows beside it."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # einsum's C loop: no BLAS
        return TensorHandle(np.einsum("ik,kj->ij", a.data.astype(d.data.dtype), b.data.astype(d.data.dtype)) + d.data,
                            d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)


def run(x, w, **kw):
    counters = torch.zeros(4096, dtype=torch.int32)
    out = linear(x, w, counters, **kw)
    assert not counters.any()  # left zero for the next product
    return out


CASES = {  # (m, n, k, options): one row block and two, one split and several, each epilogue
    "plain, split": (5, 96, 1000, {}),
    "bias, one split": (7, 130, 40, {"with_bias": True}),
    "residual, split": (3, 64, 700, {"with_residual": True}),
    "gated, split": (5, 96, 600, {"epilogue": GATED}),
    "rope, bias": (4, 128, 300, {"epilogue": ROPE, "with_bias": True}),
    "two row blocks, split": (70, 48, 520, {"with_residual": True}),
    "head rows gathered, float32": (9, 200, 64, {"rows": torch.tensor([8, 0, 3]), "out_dtype": torch.float32}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_the_linear_kernel_gives_the_bits_of_its_blocks_in_numpy(case, dtype):
    m, n, k, options = CASES[case]
    x, w, kw = product(m, n, k, dtype, **options)
    out = run(x, w, **kw)
    assert out.dtype == kw.get("out_dtype", dtype)
    assert torch.equal(out, reference(x, w, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_linear_kernels_epilogues_compute_what_the_eager_ops_do(dtype):
    """Within the rounding of the dtype (the interpreter truncates to bfloat16 where a GPU rounds)."""
    tol = 1e-4 if dtype == torch.float32 else 0.1
    x, w, kw = product(5, 96, 600, dtype, with_bias=True, with_residual=True)
    y = torch.nn.functional.linear(x.float(), w.float(), kw["bias"].float())
    assert (run(x, w, **kw).float() - (y + kw["residual"].float())).abs().max() < tol
    gate, up = torch.nn.functional.linear(x.float(), w.float()).chunk(2, dim=-1)
    assert (run(x, w, epilogue=GATED).float() - torch.nn.functional.silu(gate) * up).abs().max() < tol
    x, w, kw = product(4, 128, 300, dtype, epilogue=ROPE, with_bias=True)
    cos, sin, half, rotated = kw["rope"]
    heads = torch.nn.functional.linear(x.float(), w.float(), kw["bias"].float()).view(1, 4, 4, 32)
    c, s = torch.cat((cos, cos), -1).float()[None, :, None], torch.cat((sin, sin), -1).float()[None, :, None]
    turned = heads * c + cpu.rotate_half(heads) * s
    expect = torch.cat((turned[:, :, :rotated], heads[:, :, rotated:]), dim=2).view(1, 4, 128)
    assert (run(x, w, **kw).float() - expect).abs().max() < tol * 10


def moved_rows(n: int, k: int, dtype: torch.dtype, multiply=None) -> list[tuple[int, int]]:
    """Every row of a 64-row product, computed again in products of 1 to 64 rows, at another place
    among other rows: the (width, row) pairs whose bits differ."""
    multiply = multiply or run
    x, w, _ = product(64, n, k, dtype, seed=1)
    full = multiply(x, w)
    other = torch.randn(1, 64, k).to(dtype)
    moved = []
    for width in (1, 2, 3, 8, 17, 64):
        rows = other[:, :width].clone()
        for i in range(width):
            rows[0, i] = x[0, (i * 7 + width) % 64]
        out = multiply(rows, w)
        moved += [(width, i) for i in range(width) if not torch.equal(out[0, i], full[0, (i * 7 + width) % 64])]
    return moved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 1000), (48, 64)])
def test_a_rows_bits_under_the_linear_kernel_do_not_depend_on_the_rows_beside_it(n, k, dtype, rowwise_dot):
    """The split is the weight's, never the width's."""
    assert moved_rows(n, k, dtype) == []


def test_the_row_test_sees_a_split_that_follows_the_width(rowwise_dot, monkeypatch):
    """The test above has the power to fail: a kernel whose split count followed the number of
    rows (cuBLAS's way) moves rows' bits."""
    chosen = tiling(96, 1000)

    def by_width(x, w):
        splits = 1 + x.shape[-2] % chosen.splits
        monkeypatch.setattr(triton_linear, "tiling", lambda n, k, width=None: triton_linear.Tiling(chosen.bn, chosen.bk, splits))
        return run(x, w)

    assert moved_rows(96, 1000, torch.float32, by_width) != []


def test_the_reference_tells_another_split_apart(monkeypatch):
    """The bit-for-bit tests have the power to see a split chosen otherwise (a split that moved with
    the width would fail them): the same product cut in another number of splits differs in float32."""
    x, w, _ = product(3, 96, 1000, torch.float32)
    ours = reference(x, w)
    t = tiling(96, 1000)
    monkeypatch.setattr(triton_linear, "tiling", lambda n, k, width=None: triton_linear.Tiling(t.bn, t.bk, t.splits // 2))
    assert not torch.equal(reference(x, w), ours)
    assert torch.allclose(reference(x, w), ours, atol=1e-5)


def test_the_tiling_is_the_weights_and_spreads_a_one_row_product():
    """A one-row product of the 1.5B target's narrow projections still runs on ~PROGRAMS programs."""
    for n, k in ((1536, 1536), (1536, 8960), (1024, 1536)):  # wo, w2, qkv's column pairs
        t = tiling(n, k)
        assert t.splits > 1 and t.programs(n) >= triton_linear.PROGRAMS // 2
    assert tiling(151_936, 1536).splits == 1  # the head has columns enough


def test_a_drafters_splits_follow_its_rows_and_its_forward_is_the_same_model(fast_attention):
    """Free splits (a drafter's: only proposes): as many as the invariant ones at one row, fewer as
    the rows grow (their float32 partial sums kept within a quarter of the weight's bytes); the
    drafter's ops on CUDA compute the same model; on a CPU there is one set of ops."""
    assert tiling(1536, 8960, width=1) == tiling(1536, 8960)
    assert tiling(1536, 8960, width=64).splits < tiling(1536, 8960).splits
    assert tiling(896, 896, width=64).splits == 1
    model = tiny_model(torch.float32, layers=1)
    tokens = list(range(5, 12))
    here = logits_of(model, cuda.OPS, tokens)
    assert (logits_of(model, cuda.FREE, tokens) - here).abs().max() < 1e-4 * here.abs().max()
    assert backend.for_device("cpu", invariant=False) is backend.for_device("cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_row_kernels_give_the_bits_of_their_numpy_models(dtype):
    x = (torch.randn(1, 7, 96) * 3).to(dtype)
    w = torch.randn(96).to(dtype)
    assert torch.equal(triton_rowwise.rmsnorm(x, w, 1e-6), triton_rowwise.rmsnorm_reference(x, w, 1e-6))
    positions, inv_freq = torch.tensor([0, 5, 100, 4000]), 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    got, want = triton_rowwise.rope(positions, inv_freq, 1.0, dtype), triton_rowwise.rope_reference(positions, inv_freq, 1.0, dtype)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- the decoder on the CUDA ops --------------------------------------------------------------


@pytest.fixture
def fast_attention(monkeypatch):
    """One program a row for attention's parts: the interpreter runs programs one by one in Python
    (how many run the parts changes no bit: a test below holds that)."""
    monkeypatch.setattr(triton_attention, "PROGRAMS", 1)


def tiny_model(dtype: torch.dtype, layers: int = 2):
    import tiny

    from ygg_compile.convert import to_runtime

    return to_runtime(tiny.hf_model("qwen2", seed=3, num_hidden_layers=layers), dtype)


def logits_of(model, ops, tokens: list[int], rows=None, max_len: int = 64):
    """The logits of a chain forward of `tokens` on a fresh cache, with `ops`."""
    from helpers import runner

    model.ops = ops
    try:
        r = runner(model, max_len)
        return r.forward_chain(tokens).clone() if rows is None else rows(r)
    finally:
        model.ops = None


def test_the_decoder_on_the_cuda_ops_computes_the_model_the_cpu_ops_do(fast_attention):
    """float32, a Qwen2-architecture model (qkv bias, GQA): the same logits within float32 rounding,
    and what the forward returns on the CPU ops is unchanged by the ops being a backend."""
    model = tiny_model(torch.float32)
    tokens = list(range(5, 17))
    here = logits_of(model, backend.for_device("cpu"), tokens)
    there = logits_of(model, cuda.OPS, tokens)
    assert (here - there).abs().max() < 1e-4 * here.abs().max()
    assert backend.for_device("cpu") is backend.for_device(torch.device("cpu")) and backend.for_device("meta").name == "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_logits_on_the_cuda_ops_are_the_same_bits_alone_and_in_a_tree_verify(fast_attention, rowwise_dot,
                                                                                      dtype):
    """Plain decoding scores token 3 of a chain alone (one row, after the prefix); a tree verify
    scores it at depth 2 of a tree of 7 nodes, its ancestors between siblings: every bit equal."""
    model = tiny_model(dtype)
    prompt, chain = [7, 8, 9, 10, 11], [20, 21, 22]

    def alone(r):
        r.prefill(prompt + chain[:2])
        return r.forward_chain(chain[2:]).clone()[0]

    def in_tree(r):
        r.prefill(prompt)
        tokens = [chain[0], 40, chain[1], 41, 42, chain[2], 43]
        parent = [-1, -1, 0, 0, 2, 2, 3]  # node 5 = chain[2], under node 2 = chain[1], under node 0
        mask = torch.zeros(7, 7, dtype=torch.bool)
        depths = []
        for i, p in enumerate(parent):
            mask[i, i] = True
            if p >= 0:
                mask[i] |= mask[p]
            depths.append(int(mask[i].sum()) - 1)
        return r.forward(tokens, list(range(7)), depths, mask).clone()[5]

    assert torch.equal(logits_of(model, cuda.OPS, [], rows=alone), logits_of(model, cuda.OPS, [], rows=in_tree))


def test_how_many_programs_run_attentions_parts_changes_no_bit(monkeypatch):
    model = tiny_model(torch.bfloat16, layers=1)
    tokens = list(range(3, 9))
    monkeypatch.setattr(triton_attention, "PROGRAMS", 1)
    one = logits_of(model, cuda.OPS, tokens)
    monkeypatch.setattr(triton_attention, "PROGRAMS", 10_000)  # every part its own program
    assert torch.equal(logits_of(model, cuda.OPS, tokens), one)


class Launches(TorchDispatchMode):
    """The kernels a forward launches on the CUDA ops: every Triton launch, and every aten op that
    is neither a view nor an allocation (those launch nothing on a GPU). Ops the interpreter runs
    inside a Triton launch are the launch's own."""

    FREE = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "_unsafe_view", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside and not func.is_view and func.__name__.split(".")[0] not in self.FREE:
            self.kernels["aten." + func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self):
        from triton.runtime.interpreter import InterpretedFunction

        launch = InterpretedFunction.run

        def run(fn, *args, **kwargs):
            self.kernels["triton." + fn.fn.__name__] += 1
            self._inside += 1
            try:
                return launch(fn, *args, **kwargs)
            finally:
                self._inside -= 1

        with pytest.MonkeyPatch.context() as patch, self:
            patch.setattr(InterpretedFunction, "run", run)
            yield self.kernels


def forward_kernels(layers: int) -> Counter:
    """The kernels of a captured forward's shape (every row's logits wanted) of 3 rows."""
    model = tiny_model(torch.bfloat16, layers=layers)
    model.setup_cache(32)
    model.ops = cuda.OPS
    w = 3
    args = (torch.tensor([[3, 4, 5]]), torch.arange(w), torch.arange(w), torch.zeros(w, dtype=torch.long),
            torch.zeros(w, dtype=torch.long), torch.ones(w, w, dtype=torch.bool).tril(), model.kv.data, torch.arange(w))
    model(*args)  # the counters are made once a device: not a forward's kernel
    with Launches().counting() as kernels:
        model(*args)
    return kernels


def test_a_target_layer_on_the_cuda_ops_is_at_most_8_kernels(fast_attention):
    """The budget the CUDA forward is built to (norm, qkv + RoPE, KV write, attention, wo +
    residual, norm, w13 + SiLU·mul, w2 + residual), counted as a forward launches them: one
    layer's more between a model of 1 and of 2 layers; and a few kernels a forward besides
    (embedding, rotary tables, the final norm, the head)."""
    one, two = forward_kernels(1), forward_kernels(2)
    per_layer = sum(two.values()) - sum(one.values())
    assert per_layer <= 8, two - one
    assert sum(one.values()) - per_layer <= 4, one
    assert not [k for k in two - one if k.startswith("aten.")], two - one  # nothing eager inside a layer


def test_every_cuda_kernel_of_the_real_shapes_compiles_for_hopper_without_spilling(tmp_path):
    """The CUDA forward of the 1.5B target's shape at 1 and 64 rows, recorded on meta tensors (no
    GPU) and each distinct kernel compiled for sm_90 by Triton with its own ptxas: a kernel that
    does not compile there, or spills registers, fails here, not in a GPU's 15 minutes."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "model.json"
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "gpu_model.py"), "--models", "qwen2.5-1.5b",
                           "--widths", "1,64", "--compile", "-o", str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["modelled"][0]
    assert result["kernels_per_layer"] == 8
    compiled = result["compiled"]
    assert {c["kernel"] for c in compiled} == {"_linear", "_attend", "_write_kv", "_rmsnorm", "_rope"}
    assert all(c["spill_bytes"] == 0 and c["shared"] <= 227 * 1024 for c in compiled), compiled
    t1, t64 = result["rows"]
    assert t1["kernels"] == t64["kernels"] == 8 * 28 + 4  # the same kernels at every width


def test_an_artifacts_triton_kernels_are_used_from_a_copy_made_once(tmp_path, monkeypatch):
    """`ygg compile` on CUDA writes Triton's kernels into the artifact (`compiling_into`, which puts
    Triton's cache back after); `ygg run` points Triton at a copy of them in the user cache, made
    once (an artifact may be read-only, and Triton writes beside what it reads)."""
    import os

    from ygg_runtime.backend import gpu_identity as gpu

    monkeypatch.setenv("YGG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(gpu.TRITON_CACHE, "before")
    shipped = tmp_path / "artifact" / "triton"
    with gpu.compiling_into(shipped):
        assert os.environ[gpu.TRITON_CACHE] == str(shipped)
        (shipped / "abc").mkdir()
        (shipped / "abc" / "_linear.cubin").write_bytes(b"kernel")
    assert os.environ[gpu.TRITON_CACHE] == "before"
    first = gpu.use_compiled(shipped, "triton/abc/_linear.cubin 1234")
    assert os.environ[gpu.TRITON_CACHE] == str(first) and (first / "abc" / "_linear.cubin").read_bytes() == b"kernel"
    (shipped / "abc" / "_linear.cubin").write_bytes(b"other")  # the same key: the copy is not made again
    assert gpu.use_compiled(shipped, "triton/abc/_linear.cubin 1234") == first
    assert (first / "abc" / "_linear.cubin").read_bytes() == b"kernel"
    assert gpu.use_compiled(shipped, "triton/abc/_linear.cubin 5678") != first


def test_every_method_on_the_cuda_ops_gives_plain_decodings_tokens(artifact, fast_attention, rowwise_dot):
    """The whole runtime on the CUDA backend's kernels (under Triton's interpreter, CPU tensors):
    the tiny pair's artifact loaded eager, its target on the invariant CUDA ops and its drafter on
    the free ones, as `ygg run --device cuda` would run them; every method's greedy tokens are
    `ar`'s on the same ops (egt's: its drafter's rounds, tree verifies, the chain and pld's forwards
    are the same shapes), and seeded sampling gives `ar`'s too."""
    import ygg_runtime

    dec = ygg_runtime.load(artifact, eager=True)
    dec.target.model.ops, dec.runners["draft"].model.ops = cuda.OPS, cuda.FREE
    prompt = list(b"def f(x):")
    ar = dec.generate(prompt, max_new_tokens=6, method="ar")
    assert len(ar.token_ids) == 6
    egt = dec.generate(prompt, max_new_tokens=6, method="egt")
    assert egt.token_ids == ar.token_ids and max(egt.accepted_lengths) > 1  # trees verified, tokens accepted
    sampled = dec.generate(prompt, max_new_tokens=6, method="ar", temperature=0.8, seed=3).token_ids
    assert dec.generate(prompt, max_new_tokens=6, method="egt", temperature=0.8, seed=3).token_ids == sampled
