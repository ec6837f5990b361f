"""Ahead-of-time compiled forwards: one dynamic width-and-span graph per model in model.pt2,
sharing the eager model's weights and KV cache."""

import pytest
import tiny
import torch
from helpers import decode, hf_greedy, noised_runtime, runner, to_runtime

from ygg_compile.aot import compile_model
from ygg_runtime.compiled import CompiledForward
from ygg_runtime.errors import YggError
from ygg_runtime.tree import TokenTree

WIDTHS = (1, 2, 5, 16, 64)
CACHE = 80


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    model = to_runtime(tiny.hf_model("qwen2", seed=40))  # qkv bias and tied embeddings: both traps
    model.setup_cache(CACHE)
    path = tmp_path_factory.mktemp("aot") / "model.pt2"
    assert compile_model(model, path) > 0
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
    mask = torch.ones(width, prefix + width, dtype=torch.bool)
    mask[:, prefix:] = tree.ancestor_mask()
    for cache in model.caches():
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
    want_logits, want_hidden = model(tokens, positions, slots, mask)
    want_cache = [(c.k[:, :, : prefix + width].clone(), c.v[:, :, : prefix + width].clone()) for c in model.caches()]
    for cache in model.caches():  # forget the rows the forward wrote: the compiled one must write them again
        cache.k[:, :, prefix:] = 0
        cache.v[:, :, prefix:] = 0
    assert fwd.holds(width, mask.shape[1])
    logits, hidden = fwd(tokens, positions, slots, mask, torch.arange(width))
    assert (logits - want_logits).abs().max() < 1e-4 and (hidden - want_hidden).abs().max() < 1e-4
    some = torch.arange(width - 1, -1, -2)  # a few rows' logits only (a prompt's rows need none)
    part, _ = fwd(tokens, positions, slots, mask, some)
    assert torch.allclose(part[0], logits[0, some], atol=1e-5)  # a float head at another row count: close
    for cache, (k, v) in zip(model.caches(), want_cache):
        assert torch.allclose(cache.k[:, :, : prefix + width], k, atol=1e-5)
        assert torch.allclose(cache.v[:, :, : prefix + width], v, atol=1e-5)


def test_a_package_refuses_another_models_weights_in_one_line(compiled):
    _, path, _ = compiled
    other = to_runtime(tiny.hf_model("llama", seed=41))  # no qkv bias: constants the graph expects are missing
    other.setup_cache(CACHE)
    with pytest.raises(YggError, match="compiled for another model"):
        CompiledForward(path, other)


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
