"""Sampling is lossless: the output distribution is exactly the target's (chi-square tests)."""


import pytest
import torch
import tiny
from helpers import decode, noised_runtime, runner, to_runtime
from scipy.stats import chisquare

import ygg_runtime.accept as accept
from ygg_runtime.tree import TokenTree

VOCAB = 8
PROMPT = [1, 5, 2, 7]
N_TOKENS = 2  # the joint distribution of the first two generated tokens: 64 cells
SAMPLES = 3000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def models():
    hf = tiny.hf_model("llama", seed=20, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, initializer_range=0.8)
    target = to_runtime(hf)
    return runner(target, 64), runner(noised_runtime(target, 0.4, seed=21), 64)


def exact_joint(target, temperature: float) -> torch.Tensor:
    """P(x1, x2 | PROMPT) at `temperature`, from the target's own logits."""
    target.reset()
    first = accept.warp(target.forward_chain(PROMPT)[-1], temperature)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for x1 in range(VOCAB):
        target.reset()
        joint[x1] = first[x1] * accept.warp(target.forward_chain(PROMPT + [x1])[-1], temperature)
    return joint.flatten()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pool the cells expected below 5 samples into one, then Pearson's chi-square."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs.sum().item() / exp[keep].sum().item()).pvalue)


def sample_counts(target, draft, method, params, temperature) -> tuple[torch.Tensor, float]:
    counts = torch.zeros(VOCAB * VOCAB)
    accepted = 0.0
    for seed in range(SAMPLES):
        out, m = decode(target, draft, method, params, PROMPT, N_TOKENS, temperature=temperature, seed=seed)
        counts[out[0] * VOCAB + out[1]] += 1
        accepted += m.accepted_tokens
    return counts, accepted / SAMPLES


CASES = [("chain", {"k": 3}, 1.0), ("chain", {"k": 3}, 0.7), ("specinfer", {"width": 2, "depth": 2}, 1.0),
         ("specinfer", {"width": 3, "depth": 2}, 0.7),
         ("egt", {"depth": 2, "draft_width": 2, "top_k": 3, "verify_widths": [2, 4, 8]}, 1.0),
         ("egt", {"depth": 3, "draft_width": 4, "top_k": 2, "verify_widths": [4, 8]}, 0.7),
         ("sequoia", {"parents": [-1, 0, 0, 1], "ranks": [0, 0, 1, 0]}, 1.0)]


@pytest.mark.parametrize("method,params,temperature", CASES, ids=lambda x: str(x))
def test_sampling_matches_target_distribution(models, method, params, temperature):
    target, draft = models
    counts, accepted = sample_counts(target, draft, method, params, temperature)
    assert 0.1 < accepted < N_TOKENS  # drafts were accepted and rejected: both branches ran
    assert chi_square_pvalue(counts, exact_joint(target, temperature)) > ALPHA


def test_chi_square_detects_a_wrong_residual_rule(models, monkeypatch):
    """The test above has the power to catch a lossy rule: sampling the bonus from p itself
    after a rejection (instead of the residual) fails it."""
    target, draft = models
    monkeypatch.setattr(accept, "residual", lambda p, q: p)
    counts, _ = sample_counts(target, draft, "chain", {"k": 3}, 1.0)
    assert chi_square_pvalue(counts, exact_joint(target, 1.0)) < ALPHA


@pytest.mark.parametrize("rule", ["iid", "without_replacement", "deterministic"])
def test_every_child_rule_is_lossless_for_one_step(rule):
    """One node with three children and synthetic p, q: the accepted-or-bonus first token is
    distributed exactly as p under each of the three rules."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 1.5, -1)
    counts = torch.zeros(6)
    for i in range(20000):
        tree = TokenTree(0, child_rule=rule)
        if rule == "deterministic":
            kids = q.topk(3).indices.tolist()
        elif rule == "iid":
            kids = torch.multinomial(q, 3, replacement=True, generator=g).tolist()
        else:
            kids = torch.multinomial(q, 3, replacement=False, generator=g).tolist()
        for k in kids:
            tree.add(0, k, q[k].item())
        tree.draft_dists[0] = q
        probs = torch.stack([p] + [torch.full((6,), 1 / 6, dtype=torch.float64)] * 3)
        v = accept.accept_sampling(tree, probs, g)
        counts[tree.tokens[v.path[1]] if len(v.path) > 1 else v.bonus] += 1
    assert chi_square_pvalue(counts, p) > ALPHA


def test_top_p_keeps_the_smallest_nucleus():
    probs = accept.warp(torch.tensor([0.0, 1.0, 2.0, 3.0]).log(), 1.0, top_p=0.6)  # p = 0, 1/6, 2/6, 3/6
    assert probs[3] > 0 and probs[2] > 0 and probs[1] == 0 and probs[0] == 0
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0, dtype=torch.float64))
