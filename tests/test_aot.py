"""Ahead-of-time compiled forwards: one graph per model in model.pt2, dynamic in width, tree window
and cache size, sharing the eager model's weights; the cache is an input of every call."""

import pytest
import tiny
import torch
from helpers import decode, hf_greedy, noised_runtime, runner, to_runtime

from ygg_compile.aot import compile_model
from ygg_runtime.model.compiled import CompiledForward
from ygg_runtime.errors import YggError
from ygg_runtime.decoding.tree import TokenTree

WIDTHS = (1, 2, 5, 16, 64)
CACHE = 80


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    model = to_runtime(tiny.hf_model("qwen2", seed=40))  # qkv bias and tied embeddings: both traps
    model.setup_cache(CACHE)
    path = tmp_path_factory.mktemp("aot") / "model.pt2"
    result = compile_model(model, path)
    assert result.seconds > 0 and result.narrowest == 1  # one-row forwards are in the graph on the CPU
    return model, path, CompiledForward(path, model)


@pytest.mark.parametrize("at_end", [False, True])
@pytest.mark.parametrize("width", WIDTHS)
def test_compiled_forward_matches_eager_and_writes_the_same_cache_rows(compiled, width, at_end):
    """Every width, as a binary token tree (siblings share a position, so positions are not the
    slots), after a short prefix and filling the cache to its last slot."""
    model, _, fwd = compiled
    prefix = CACHE - width if at_end else 5
    g = torch.Generator().manual_seed(width)
    tokens = torch.randint(0, 256, (1, width), generator=g)
    tree = TokenTree(0)
    for i in range(1, width):
        tree.add((i - 1) // 2, i, 0.5)
    positions, slots = torch.tensor(tree.depths) + prefix, torch.arange(width) + prefix
    lo, hi = torch.zeros(width, dtype=torch.long), torch.full((width,), prefix)
    view = (slots, lo, hi, tree.ancestor_mask())
    kv = model.kv.data
    kv.normal_(generator=g)
    want_logits, want_hidden = model(tokens, positions, *view, kv)
    want_cache = kv[:, :, :, : prefix + width].clone()
    kv[:, :, :, prefix:] = 0  # forget the rows the forward wrote: the compiled one must write them again
    assert fwd.holds(width)
    logits, hidden = fwd(tokens, positions, *view, kv, torch.arange(width))
    assert (logits - want_logits).abs().max() < 1e-4 and (hidden - want_hidden).abs().max() < 1e-4
    some = torch.arange(width - 1, -1, -2)  # a few rows' logits only (a prompt's rows need none)
    part, _ = fwd(tokens, positions, *view, kv, some)
    assert torch.allclose(part[0], logits[0, some], atol=1e-5)  # a float head at another row count: close
    assert torch.allclose(kv[:, :, :, : prefix + width], want_cache, atol=1e-5)


def test_one_compiled_graph_serves_a_cache_of_any_size(compiled):
    """The cache is an input, not a constant of the graph: the graph compiled beside an 80-slot
    cache runs over one of 5000 (a sequence far into it), with the eager forward's results."""
    model, _, fwd = compiled
    big = torch.randn(*model.kv.data.shape[:3], 5000, model.kv.data.shape[4], generator=torch.Generator().manual_seed(7))
    tokens = torch.tensor([[3, 4, 5, 6]])
    slots, positions = torch.arange(4321, 4325), torch.arange(20, 24)
    view = (slots, torch.full((4,), 4301), torch.full((4,), 4321), torch.ones(4, 4, dtype=torch.bool).tril())
    want, _ = model(tokens, positions, *view, big.clone())
    got, _ = fwd(tokens, positions, *view, big, torch.arange(4))
    assert (got - want).abs().max() < 1e-4


def test_a_second_compile_of_the_same_graph_reuses_the_cached_package_and_another_graph_does_not(compiled, tmp_path,
                                                                                                 monkeypatch):
    """The package holds no weights: another model of the same architecture exports the same graph,
    takes the package the fixture's compile left in the cache (Inductor not called) and gives its
    own eager logits through it; a model one layer deeper is another graph, and is compiled."""
    import torch._inductor

    from ygg_compile import aot
    from ygg_runtime.files import cache_dir

    model, path, _ = compiled

    def refused(*a, **k):
        raise RuntimeError("Inductor was called")

    monkeypatch.setattr(torch._inductor, "aot_compile", refused)
    other = to_runtime(tiny.hf_model("qwen2", seed=41))
    other.setup_cache(CACHE)
    # as an earlier aot_compile of this process leaves it (the fixture's may have been the cache's)
    with torch._inductor.config.patch({"aot_inductor.metadata": {"AOTI_DEVICE_KEY": "cpu", "AOTI_CPU_ISA": "X"}}):
        got = compile_model(other, tmp_path / "model.pt2")
    assert got.reused and got.narrowest == 1
    assert any(cache_dir().joinpath(aot.GRAPHS).glob("qwen2-*.pt2"))
    tokens, positions = torch.tensor([[3, 4, 5]]), torch.arange(3)
    view = (torch.arange(3), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long),
            torch.ones(3, 3, dtype=torch.bool).tril())
    want, _ = other(tokens, positions, *view, other.kv.data.zero_().clone())
    logits, _ = CompiledForward(tmp_path / "model.pt2", other)(tokens, positions, *view, other.kv.data.zero_(),
                                                                torch.arange(3))
    assert (logits - want).abs().max() < 1e-4
    deeper = to_runtime(tiny.hf_model("qwen2", seed=41, num_hidden_layers=3))
    deeper.setup_cache(CACHE)
    with pytest.raises(RuntimeError, match="Inductor was called"):
        compile_model(deeper, tmp_path / "deeper.pt2")


def test_a_package_refuses_another_models_weights_in_one_line(compiled):
    _, path, _ = compiled
    other = to_runtime(tiny.hf_model("llama", seed=41))  # no qkv bias: constants the graph expects are missing
    other.setup_cache(CACHE)
    with pytest.raises(YggError, match="compiled for another model"):
        CompiledForward(path, other)


@pytest.mark.parametrize("keep", [False, True], ids=["cpu", "gpu-like"])
def test_a_killed_process_leaves_no_unpacked_package_behind(compiled, tmp_path, keep):
    """Loading unpacks model.pt2 into a directory of ours: on a CPU it is gone once loaded, so a
    process killed later leaves nothing; one kept until exit (a GPU graph reads its kernels on first
    use) and orphaned by a kill is removed by the next load on the machine. torch's own
    `aotinductor_*` directories never appear."""
    import os
    import signal
    import subprocess
    import sys

    _, path, _ = compiled
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = ("import os, signal, sys; from pathlib import Path; from ygg_runtime.backend import native; native.load(); "
            "from ygg_runtime.model.compiled import load_graph; "
            f"g = load_graph(Path(sys.argv[1]), keep_unpacked={keep}); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, stderr=subprocess.PIPE, text=True)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read()
    assert not list(tmp_path.glob("aotinductor_*"))
    left = [d.name for d in (tmp_path / "ygg-aoti").iterdir()]
    assert len(left) == keep and all(d.startswith(f"{proc.pid}-") for d in left)
    again = subprocess.run([sys.executable, "-c", code.replace("keep_unpacked=True", "keep_unpacked=False"), str(path)],
                           env=env, capture_output=True, text=True)
    assert again.returncode == -signal.SIGKILL, again.stderr
    assert not list((tmp_path / "ygg-aoti").iterdir()) and not list(tmp_path.glob("aotinductor_*"))


def test_greedy_output_through_the_compiled_forwards_is_the_targets_own(tmp_path):
    """A runner holding compiled graphs runs every forward through them (the prompt's prefill too)
    and decodes exactly transformers' greedy output."""
    hf = tiny.hf_model("llama", seed=42)
    target = runner(to_runtime(hf), 96)
    draft = runner(noised_runtime(to_runtime(hf), 0.05, seed=43), 96)
    compile_model(target.model, tmp_path / "model.pt2")
    target.compiled = CompiledForward(tmp_path / "model.pt2", target.model)
    target.widths = (2, 4)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(44)).tolist()
    for method, params in (("ar", {}), ("chain", {"k": 3})):
        compiled = target.compiled_forwards
        with target.recording() as calls:
            out, _ = decode(target, draft, method, params, prompt, 32)
        assert out == hf_greedy(hf, prompt, 32), method
        assert calls[0] == len(prompt) - 1 and set(calls[1:]) <= {2, 4}
        assert target.compiled_forwards - compiled == len(calls)  # every forward ran compiled


def test_a_compile_that_leaves_the_compiled_forwards_out_runs_eager_and_says_why(tmp_path, monkeypatch):
    """Where a device's forwards are not compiled ahead of time (CUDA's: our Triton kernels, replayed
    as CUDA graphs), the compile goes on without them: no package in the artifact, the plan and the
    decoder say why, and every method still gives `ar`'s tokens."""
    import ygg_runtime
    from ygg_compile import aot, build
    from ygg_compile.build import compile_artifact
    from ygg_compile.options import CompileOptions

    compiled_roles = []
    monkeypatch.setattr(aot, "compile_model", lambda model, path, progress=None: compiled_roles.append(path))
    monkeypatch.setattr(build, "aot_left_out", lambda device: "a reason of this device's")
    target = tiny.hf_model("llama", seed=40)
    tok = tiny.byte_tokenizer()
    dirs = {role: tiny.save_pair_dir(tmp_path / role, model, tok)
            for role, model in (("target", target), ("draft", tiny.noised(target, 0.05, seed=41)))}
    out = tmp_path / "artifact"
    plan = compile_artifact(CompileOptions(draft=str(dirs["draft"]), target=str(dirs["target"]), output=out, device="cpu",
                                           dtype="float32", profiles=tmp_path / "profiles", max_context=256, quick=True))
    assert compiled_roles == [] and plan.aot is None and plan.aot_skipped == "a reason of this device's"
    assert not list(out.rglob(aot.PACKAGE))
    dec = ygg_runtime.load(out)
    assert dec.plan.aot_skipped == plan.aot_skipped and "the compile left its compiled forwards out" in dec.forwards
    prompt = list(b"def quicksort(xs):\n")
    ar = dec.generate(prompt, max_new_tokens=24, method="ar").token_ids
    assert all(dec.generate(prompt, max_new_tokens=24, method=m).token_ids == ar for m in ("chain", "egt", "pld"))
