"""Greedy output of every method is token-for-token the target's own (transformers' generate)."""

import pytest
import torch
import tiny
from helpers import METHODS, decode, hf_greedy, noised_runtime, runner, to_runtime, truncated

N_NEW = 64


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_pair(request):
    """A tiny target and three drafters: itself (always accepts), a noised copy (mixed) and an
    unrelated random model (almost always rejects)."""
    arch = request.param
    hf = tiny.hf_model(arch, seed=10)
    target = to_runtime(hf)
    drafts = {
        "self": to_runtime(hf),
        "noised": noised_runtime(target, 0.05, seed=1),
        "random": to_runtime(tiny.hf_model(arch, seed=11)),
    }
    refs = {tuple(p): hf_greedy(hf, p, N_NEW) for p in prompts(6, seed=12)}
    return runner(target), {k: runner(v) for k, v in drafts.items()}, refs


@pytest.mark.parametrize("method,params", METHODS, ids=lambda x: str(x))
def test_tiny_greedy_equals_hf_generate(tiny_pair, method, params):
    target, drafts, refs = tiny_pair
    accepted = []
    for name, draft in drafts.items():
        for prompt, ref in refs.items():
            out, m = decode(target, draft, method, params, list(prompt), N_NEW)
            assert out == ref, f"{method} with the {name} drafter diverged from generate()"
            accepted.append(m.mean_accepted_length)
    if method != "ar":  # the drafters really exercised full, partial and no acceptance
        assert max(accepted) > 2.5 and min(accepted) < 1.2


@pytest.mark.real
def test_smollm2_greedy_equals_hf_generate(smollm2_hf, smollm2_tokenizer):
    target = to_runtime(smollm2_hf)
    drafts = {
        "self": to_runtime(smollm2_hf),
        "truncated": truncated(target, 3),
        "noised": noised_runtime(target, 0.15, seed=3),
    }
    texts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "The history of the printing press begins"]
    tr = runner(target)
    rates = {}
    for text in texts:
        prompt = smollm2_tokenizer(text).input_ids
        ref = hf_greedy(smollm2_hf, prompt, N_NEW)
        for name, draft in drafts.items():
            dr = runner(draft)
            for method, params in METHODS[:3]:
                out, m = decode(tr, dr, method, params, prompt, N_NEW)
                assert out == ref, f"{method} with the {name} drafter diverged on {text[:20]!r}"
                rates.setdefault(name, []).append(m.acceptance_rate)
    assert min(rates["self"]) > 0.2 and max(rates["truncated"]) < 0.3
    assert 0.05 < sum(rates["noised"]) / len(rates["noised"]) < 0.95
