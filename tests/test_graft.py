"""Retrieval grafting (egt) and retrieval alone (pld) keep greedy output the target's own, on
prompts built to make retrieval hit and to make it miss; retrieval-only steps run no drafter."""

import pytest
import torch
import tiny
from helpers import COMPILED, PROFILE, decode, depth_policy, hf_greedy, noised_runtime, random_predictor, runner, to_runtime

from ygg_runtime.decoding.engine import generate
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.proposers import Drafter, build

N_NEW = 48
EGT = {"depth": 3, "draft_width": 2, "top_k": 2, "verify_widths": [1, 2, 4, 8, 16]}
GRAFTING = [("pld", {}), ("egt", EGT | {"graft": {}}), ("egt", EGT | {"graft": {"limit": 1, "under": 0, "adjacency_depth": 0}}),
            ("egt", EGT | {"graft": {}, "stages": {"tail": "ahead", "head": "ahead"}})]


def repetitive(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a span: a lookup after them finds the earlier copy."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        span = torch.randint(0, vocab, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
        out.append(span + torch.randint(0, vocab, (3,), generator=g).tolist() + span[: len(span) // 2])
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pairs(request):
    """Two targets with their drafters and references: one whose greedy text repeats itself (a
    16-token vocabulary: retrieval hits) and one over 256 tokens (retrieval mostly misses)."""
    out = {}
    for name, over, vocab in (("hits", {"vocab_size": 16, "initializer_range": 0.02}, 16), ("misses", {}, 256)):
        hf = tiny.hf_model(request.param, seed=10, **over)
        target = to_runtime(hf)
        drafts = {"self": runner(to_runtime(hf)), "noised": runner(noised_runtime(target, 0.3, seed=1)),
                  "random": runner(to_runtime(tiny.hf_model(request.param, seed=11, **over)))}
        refs = {tuple(p): hf_greedy(hf, p, N_NEW) for p in repetitive(4, vocab, seed=12)}
        out[name] = runner(target), drafts, refs
    return out


@pytest.mark.parametrize("method,params", GRAFTING, ids=str)
def test_grafted_and_retrieved_trees_keep_greedy_output_the_targets(pairs, method, params):
    retrieved = {}
    for kind, (target, drafts, refs) in pairs.items():
        retrieved[kind] = 0
        for name, draft in drafts.items():
            for prompt, ref in refs.items():
                out, m = decode(target, draft if method == "egt" else None, method, params, list(prompt), N_NEW)
                assert out == ref, f"{method} ({kind}, {name} drafter) diverged from generate()"
                retrieved[kind] += m.accepted_context + m.accepted_adjacency
                assert sum(m.tokens_per_step_by_source.values()) == pytest.approx(m.mean_accepted_length)
    assert retrieved["hits"] > 100  # retrieval really supplied tokens where the text repeats


def test_without_grafting_egt_verifies_only_drafted_tokens(pairs):
    target, drafts, refs = pairs["hits"]
    prompt, ref = next(iter(refs.items()))
    out, m = decode(target, drafts["noised"], "egt", EGT, list(prompt), N_NEW)
    assert out == ref and m.retrieved_tokens == 0 and m.retrieval_s == 0.0


@pytest.mark.parametrize("with_predictor", [False, True])
def test_a_strong_match_makes_a_retrieval_only_step_that_runs_no_drafter(pairs, with_predictor):
    """Where retrieval alone beats drafting per modelled ms, egt verifies it without a drafter forward."""
    target, drafts, refs = pairs["hits"]
    draft = drafts["random"]  # a useless drafter: retrieval is worth more
    params = EGT | {"graft": {}, "tokens_per_step": 1.2}
    predictor = None
    if with_predictor:
        params |= {"depth_policy": depth_policy(), "verify_widths": list(COMPILED)}
        predictor = DepthPredictor(random_predictor(target.model.args.dim))
    steps = 0
    for prompt, ref in refs.items():
        egt = build("egt", params, Drafter(draft, target.vocab_size), Curves(PROFILE), predictor)
        before = draft.forwards
        out, m = generate(target, egt, list(prompt), max_new_tokens=N_NEW)
        assert out == ref
        steps += m.retrieval_steps
        assert draft.forwards - before < m.steps  # some steps never ran the drafter
    assert steps > 0


def test_a_drafting_step_after_retrieval_only_steps_is_priced_with_the_drafters_catch_up():
    """The drafter feeds the tokens it missed in chunks of its widest compiled width (Drafter.begin):
    the objective counts those forwards, so drafting looks as dear as it will be."""
    from ygg_runtime.schema.params import EGTParams
    from ygg_runtime.decoding.proposers.egt import Planner

    planner = Planner(EGTParams(depth=3, draft_width=4), Curves(PROFILE | {"draft_widths": list(COMPILED)}))
    assert planner.shape(3).draft_widths == (2, 4, 4)
    assert planner.shape(3, behind=2).draft_widths == (2, 4, 4)
    assert planner.shape(3, behind=9).draft_widths == (9, 4, 4)
    assert planner.shape(3, behind=40).draft_widths == (16, 16, 8, 4, 4)  # 16 + 16 + the last 8
    assert planner.shape(0, behind=40).draft_widths == ()
