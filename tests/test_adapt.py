"""A request's acceptance estimate (ygg_runtime.decoding.estimate): a request whose drafter accepts
nothing moves to plain steps within a few steps and stays within a few percent of plain decoding's
modelled time; one that accepts everything grows its tree; every switch of shape keeps greedy output
and coupled samples `ar`'s; compile fits the prior's strength on held-out prompts."""

import random

import pytest
import torch
import tiny
from helpers import COMPILED, PROFILE, hf_greedy, runner, to_runtime

from ygg_compile import calibrate
from ygg_runtime.decoding import objective
from ygg_runtime.decoding.engine import generate
from ygg_runtime.decoding.estimate import Estimate
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.params import egt_shape
from ygg_runtime.decoding.proposers import Drafter, build
from ygg_runtime.decoding.tree import CONTEXT, DRAFT, TokenTree

N_NEW = 64
CURVES = Curves(PROFILE | {"target_widths": list(COMPILED), "draft_widths": list(COMPILED)})
DEPTHS = 4


def egt_params(reach: list[float], strength: float = 1.0) -> dict:
    """egt as compile plans it with an estimate: calibration's reach as the depth policy's prior."""
    policy = {"file": None, "draft_width": 2, "factors": [1.0] * (DEPTHS + 1), "verify_widths": [1, 4, 8, 8, 16],
              "reach": reach}
    return {"depth": 2, "draft_width": 2, "top_k": 2, "verify_widths": list(COMPILED),
            "adapt": {"strength": strength, "half_life": 32.0, "policy": policy}}


@pytest.fixture(scope="module")
def pair():
    """A tiny target, a drafter that is the target itself (it accepts everything) and one with
    other weights (it accepts next to nothing), and greedy references."""
    hf = tiny.hf_model("llama", seed=20)
    target = runner(to_runtime(hf))
    drafts = {"self": runner(to_runtime(hf)), "other": runner(to_runtime(tiny.hf_model("llama", seed=21)))}
    g = torch.Generator().manual_seed(22)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 14)]
    return target, drafts, {tuple(p): hf_greedy(hf, p, N_NEW) for p in prompts}


def run(target, draft, params, prompt, adapt=True, n=N_NEW, **kw):
    egt = build("egt", params, Drafter(draft, target.vocab_size), CURVES)
    return generate(target, egt, list(prompt), max_new_tokens=n, adapt=adapt, **kw)


def modelled_ms(m, draft_forwards: int) -> float:
    """The steps' modelled time: each verify at its width, each drafter forward at two tokens."""
    verify = sum(n * CURVES.t_verify(int(shape.split("×")[1])) for shape, n in m.shapes.items())
    return verify + draft_forwards * CURVES.t_draft(2)


def test_a_request_that_accepts_nothing_moves_to_plain_steps_within_a_few_steps(pair):
    """Calibration promised a drafter this request's is not: within a few steps it runs plain steps,
    and its modelled time stays within 3 % of plain decoding's; as planned, every step drafts."""
    target, drafts, refs = pair
    draft = drafts["other"]
    params = egt_params([0.9, 0.8, 0.7, 0.6])
    n = 96  # a request's own length: its few drafting steps are spent once
    ar_ms = n * CURVES.t_verify(1)  # plain decoding: one verify of one token a token
    for prompt, ref in refs.items():
        before = draft.forwards
        out, m = run(target, draft, params, prompt, n=n)
        forwards = draft.forwards - before
        assert out[:N_NEW] == ref
        first_plain = m.tree_depths.index(0)
        assert first_plain <= 3, m.tree_depths
        assert sum(d > 0 for d in m.tree_depths[first_plain:]) <= len(m.tree_depths) // 10, m.tree_depths
        assert modelled_ms(m, forwards) <= 1.03 * ar_ms, (m.shapes, forwards)
        assert m.adapt["reach"]["odds"] < 0.3 and m.adapt["reach"]["accepted"] == 0
        before = draft.forwards
        fixed, mf = run(target, draft, params, prompt, adapt=False, n=n)
        assert fixed == out and all(d > 0 for d in mf.tree_depths) and mf.adapt is None
        assert modelled_ms(mf, draft.forwards - before) > 1.2 * ar_ms


def test_a_request_that_accepts_everything_grows_its_tree(pair):
    """Calibration's drafter was a poor one (the prior's best depth is 1); this request's drafter is
    the target itself: its depth grows, and so do its tokens a step."""
    target, drafts, refs = pair
    params = egt_params([0.7, 0.3, 0.1, 0.03])
    for prompt, ref in refs.items():
        out, m = run(target, drafts["self"], params, prompt)
        assert out == ref
        depths, lengths = m.tree_depths, m.accepted_lengths
        half = len(depths) // 2
        assert depths[0] == 1 and min(depths[half:-1]) > 1, depths  # the last step may be cut by the budget
        assert sum(lengths[half:-1]) / len(lengths[half:-1]) > lengths[0]
        assert m.adapt["reach"]["odds"] > 3 and m.adapt["reach"]["accepted"] == m.adapt["reach"]["tries"]


@pytest.mark.parametrize("drafter", ["self", "other"])
def test_every_switch_of_shape_keeps_coupled_samples_plain_decodings(pair, drafter):
    target, drafts, refs = pair
    params = egt_params([0.7, 0.5, 0.3, 0.2])
    for prompt in refs:
        for seed in (1, 2):
            ar, _ = generate(target, build("ar", {}), list(prompt), max_new_tokens=N_NEW, temperature=0.9, seed=seed,
                             sampling="coupled")
            out, m = run(target, drafts[drafter], params, prompt, temperature=0.9, seed=seed, sampling="coupled")
            assert out == ar
            assert m.adapt is not None


def test_the_estimate_learns_each_source_and_depth_and_forgets_with_its_half_life():
    est = Estimate(strength=2.0, half_life=8.0)
    assert est.scale(DRAFT, 1) == 1.0 and est.reach([0.8, 0.4]) == [0.8, 0.4]
    for _ in range(10):  # drafted children priced 0.5 and 0.3, never accepted; a context node always is
        tree = TokenTree(0)
        a = tree.add(0, 1, 0.5, 0.5)
        tree.add(0, 2, 0.3, 0.3)
        tree.add(a, 3, 0.5, 0.5)
        tree.add(0, 4, 0.0, 0.4, CONTEXT)
        c = len(tree) - 1
        tree.add(c, 5, 0.0, 0.4, CONTEXT)
        est.reach([0.8, 0.4])  # the step's prior: it drafted, and the drafter's nodes all failed
        est.observe(tree, [0, c, c + 1])
    assert est.scale(DRAFT, 1) < 0.5 < 1.5 < est.scale(CONTEXT, 1)
    assert est.scale(DRAFT, 2) < 1.0  # a depth with little evidence of its own leans on its row's others
    low = est.reach([0.8, 0.4])  # two accepted of two tried at depths 1 and 2 each step: the reach rises
    assert 0.8 < low[0] and 0.4 < low[1] <= low[0] < 1.0
    for _ in range(64):  # plain steps: nothing tried, old evidence fades back towards the prior
        est.observe(TokenTree(0), [0])
    assert 0.9 < est.scale(DRAFT, 1) < 1.0 and 1.0 < est.scale(CONTEXT, 1) < 1.1


def test_fading_the_evidence_in_growing_units_loses_nothing_when_they_are_brought_back():
    """The evidence fades by one division a step (`Estimate.unit`); bringing it back to plain units
    (before a float would overflow) changes no figure."""
    a, b = (Estimate(512.0, 1.0, 16.0, weight=0.75, reach_weight=0.9) for _ in range(2))
    for step in range(60):
        for est in (a, b):
            _tries(est, [0.88, 0.6], [step % 3 == 0])
        if step % 7 == 0:
            b._rescale()
    assert b.unit < a.unit
    assert a.reach([0.88, 0.6]) == pytest.approx(b.reach([0.88, 0.6]), rel=1e-9)
    assert a.scale(DRAFT, 1) == pytest.approx(b.scale(DRAFT, 1), rel=1e-9)
    assert a.to_dict() == b.to_dict()


def _synthetic(rates: list[float], steps: int, seed: int) -> tuple[calibrate.Calibration, calibrate.Replays]:
    """Probe steps of prompts whose drafters agree with the target at `rates` (one per prompt): a
    chain of two children per node, priced alike in every prompt; and the replays of egt's deepest
    tree on them (the accepted run, for the reach)."""
    rng = random.Random(seed)
    out, runs = [], []
    for prompt, rate in enumerate(rates):
        for _ in range(steps):
            parents, tokens, probs, children, argmax = [-1], [0], [1.0], {}, {}
            node, accepted = 0, 1
            for depth in range(calibrate.PROBE_DEPTH):
                a, b = len(tokens), len(tokens) + 1
                parents += [node, node]
                tokens += [10 + depth, 20 + depth]
                probs += [0.6, 0.2]
                children[node] = [a, b]
                hit = rng.random() < rate
                argmax[node] = tokens[a] if hit else 99
                if not hit:
                    break
                node, accepted = a, accepted + 1
            out.append(calibrate.ProbeStep(parents, tokens, probs, children, argmax, accepted, 100, prompt, None))
            runs.append((accepted, 4, 1.0))
    replays = calibrate.Replays({(calibrate.PROBE_DEPTH, 2): runs}, [1.0] * len(runs), [2])
    return calibrate.Calibration(out, len(rates), 0, 0.0), replays


def test_compile_fits_the_priors_strengths_on_held_out_prompts():
    """Prompts that differ (a drafter that suits some and not others) want a weak prior the request
    overrules soon; prompts alike want a strong one. Each scored on prompts its map never saw."""
    unlike = calibrate.fit_strength(*_synthetic([0.95, 0.1, 0.9, 0.15, 0.85, 0.05, 0.9, 0.1], 40, seed=1), 2)
    alike = calibrate.fit_strength(*_synthetic([0.5] * 8, 40, seed=1), 2)
    for key in ("strength", "reach_strength"):
        assert unlike[key] < alike[key], key
    assert unlike["loglik_per_try"][str(unlike["strength"])] > unlike["prior_loglik_per_try"]
    assert unlike["reach_loglik_per_try"][str(unlike["reach_strength"])] > unlike["prior_reach_loglik_per_try"]
    assert calibrate.fit_strength(*_synthetic([0.5], 10, seed=1), 2)["strength"] is None


def test_compile_fits_a_robust_prior_where_one_prompt_is_far_from_the_others():
    """Prompts alike but one (a language the drafter never saw) want a strong prior with a part
    that lets such a request leave it (weight < 1); prompts all alike want next to none."""
    outlier = calibrate.fit_strength(*_synthetic([0.9, 0.9, 0.85, 0.9, 0.9, 0.2, 0.9, 0.88], 40, seed=1), 2)
    alike = calibrate.fit_strength(*_synthetic([0.5] * 8, 40, seed=1), 2)
    assert outlier["weight"] < 0.9 and outlier["reach_weight"] < 0.9
    assert alike["weight"] >= 0.9 and alike["reach_weight"] >= 0.9
    for fit in (outlier, alike):  # each weight scored beside the others at the fitted strength
        best = fit["weight_loglik_per_try"][str(fit["weight"])]
        assert best == max(fit["weight_loglik_per_try"].values()) == fit["loglik_per_try"][str(fit["strength"])]


def _tries(est: Estimate, prior: list[float], accepted: list[bool]) -> None:
    """Drafted steps of one child priced prior[0] under the root, accepted or not."""
    for hit in accepted:
        tree = TokenTree(0)
        child = tree.add(0, 1, prior[0], prior[0])
        est.reach(prior)
        est.observe(tree, [0, child] if hit else [0])


def test_a_robust_prior_leaves_calibration_for_a_request_unlike_it_and_keeps_it_for_one_alike():
    prior = [0.88, 0.6]
    unlike = [i % 10 < 3 for i in range(20)]  # 30% where calibration expects 88%
    strong, robust = Estimate(512.0, 32.0, 16.0), Estimate(512.0, 32.0, 16.0, weight=0.75, reach_weight=0.9)
    for est in (strong, robust):
        _tries(est, prior, unlike)
    assert strong.reach(prior)[0] > 0.5 and robust.reach(prior)[0] < 0.45  # the request's own 0.3 wins
    assert strong.scale(DRAFT, 1) > 0.9 and robust.scale(DRAFT, 1) < 0.5  # its prices too
    assert robust.to_dict()["reach"]["like"] < 0.2 and robust.to_dict()["draft"]["like"] < 0.2
    alike = [i % 25 < 22 for i in range(50)]  # 88%: calibration's kind
    strong, robust = Estimate(512.0, 32.0, 16.0), Estimate(512.0, 32.0, 16.0, weight=0.75, reach_weight=0.9)
    for est in (strong, robust):
        _tries(est, prior, alike)
    assert robust.reach(prior)[0] == pytest.approx(strong.reach(prior)[0], abs=0.03)
    assert robust.scale(DRAFT, 1) == pytest.approx(strong.scale(DRAFT, 1), abs=0.03)
    assert robust.to_dict()["reach"]["like"] > 0.75


def test_the_reach_policy_reproduces_each_depths_replayed_tokens_at_the_prior():
    calib, replays = _synthetic([0.9, 0.3, 0.6], 30, seed=2)
    for depth in range(1, calibrate.PROBE_DEPTH + 1):  # replays of every depth: the deepest run cut at the depth
        replays.runs[(depth, 2)] = [(min(n - 1, depth) + 1, 4, 1.0) for n, _, _ in replays.runs[(calibrate.PROBE_DEPTH, 2)]]
    policy = calibrate.reach_policy(calib, replays, 2)
    for depth in range(1, calibrate.PROBE_DEPTH + 1):
        runs = replays.at(depth, 2)
        replayed = sum(n for n, _, _ in runs) / len(runs)
        assert 1 + policy["factors"][depth] * sum(policy["reach"][:depth]) == pytest.approx(replayed, abs=2e-3)


def test_step_costs_read_the_objectives_step_times_at_every_context():
    shapes = [egt_shape(d, 2, w) for d, w in enumerate((1, 4, 8, 8, 16))]
    costs = objective.StepCosts(shapes, CURVES)
    for context in (1, 16, 17, 100, 255, 256, 300, 5000):
        for draft_context in (None, 8, context):
            want = [objective.step_ms(s, CURVES, context, draft_context) for s in shapes]
            assert costs.at(context, draft_context) == pytest.approx(want, rel=1e-9)


def test_a_request_priced_out_of_drafting_tries_again_once_its_evidence_fades():
    """Failures price the drafter out; plain steps bring no news of it, and as the evidence fades the
    prior returns and a drafting step is chosen again (the estimate recovers when the request does)."""
    prior, factors = [0.8, 0.6, 0.4, 0.3], [1.0] * (DEPTHS + 1)
    shapes = [egt_shape(d, 2, w) for d, w in enumerate((1, 4, 8, 8, 16))]
    est = Estimate(128.0, 8.0, 2.0)
    assert objective.best_depth(est.reach(prior), factors, shapes, CURVES, 100) > 0
    for _ in range(6):  # drafted steps the target took nothing of
        tree = TokenTree(0)
        tree.add(0, 1, 0.8, 0.8)
        est.reach(prior)
        est.observe(tree, [0])
    assert objective.best_depth(est.reach(prior), factors, shapes, CURVES, 100) == 0
    est.plain()
    steps = 0
    while objective.best_depth(est.reach(prior), factors, shapes, CURVES, 100) == 0:
        est.plain()
        est.observe(TokenTree(0), [0])
        steps += 1
    assert 4 <= steps <= 40


def test_the_drafters_catch_up_is_spread_over_the_tokens_the_request_may_still_make():
    """After plain steps the drafter is behind: charged to one step, its catch-up would keep drafting
    out for good (it grows with every plain step); spread over the budget left, it is paid once."""
    prior, factors = [0.9, 0.8, 0.7, 0.6], [1.0] * (DEPTHS + 1)
    shapes = [egt_shape(d, 2, w) for d, w in enumerate((1, 4, 8, 8, 16))]
    catch_up = CURVES.t_draft(16) * 3  # a drafter 48 tokens behind
    assert objective.best_depth(prior, factors, shapes, CURVES, 100) > 0
    assert objective.best_depth(prior, factors, shapes, CURVES, 100, catch_up_ms=catch_up) == 0
    assert objective.best_depth(prior, factors, shapes, CURVES, 100, catch_up_ms=catch_up, remaining=200) > 0
    assert objective.best_depth(prior, factors, shapes, CURVES, 100, catch_up_ms=catch_up, remaining=4) == 0
