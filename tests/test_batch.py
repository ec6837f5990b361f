"""Several sequences decoding together (`ygg_runtime.decoding.batch`): each one's output is what it gets
alone, whatever else is in the batch, and the batch's bookkeeping (regions, joins, leaves) holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import METHODS, SEQUOIA_TREE, decode, linear_curves, noised_runtime, runner
from ygg_compile import invariance, quantize
from ygg_compile.convert import convert_state, to_runtime
from ygg_runtime.artifact import load as artifacts
from ygg_runtime.decoding import proposers
from ygg_runtime.decoding.batch import Batch, Regions
from ygg_runtime.options import MAX_ROWS
from ygg_runtime.model.transformer import from_state
from ygg_runtime.model.runner import Call, forward_many

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "Once upon a time, in a land far away,",
           "import numpy as np\n", "SELECT name FROM users WHERE"]


@pytest.fixture(scope="module")
def int8_pair():
    """A tiny Qwen2-shaped target in 8-bit codes (rows invariant at every width, as the kernel
    is) and a noised float drafter, in memory."""
    import tiny

    hf = tiny.hf_model("qwen2", seed=40)
    args, state = convert_state(hf, torch.float32)
    args, state, _ = quantize.quantize_state(state, args, "int8", None)
    target = runner(from_state(args, state), 2048)
    assert invariance.check(target, [1, 2, 4, 8, 16]).min_width == 1
    draft = runner(noised_runtime(to_runtime(hf), 0.05, seed=41), 2048)
    return target, draft, tiny.byte_tokenizer()


def run_batch(batch: Batch, requests: list[tuple[list[int], str, dict]], joins_at: list[int] | None = None,
              max_steps: int = 500) -> list[list[int]]:
    """Step a batch until every request is done; request i joins at step joins_at[i]."""
    joins_at = joins_at or [0] * len(requests)
    outs: list[list[int]] = [[] for _ in requests]
    members: dict[int, object] = {}
    for step in range(max_steps):
        for i, (prompt, method, kw) in enumerate(requests):
            if i not in members and joins_at[i] <= step:
                m = batch.join(prompt, method, on_tokens=outs[i].extend, **kw)
                if m is not None:
                    members[i] = m
        if len(members) == len(requests) and not batch.members:
            return outs
        for m in batch.step():
            assert m.error is None, m.error
    raise AssertionError("the batch did not finish")


def test_forward_many_scores_each_region_as_the_sequence_alone(int8_pair):
    """Three sequences in regions at unaligned bases, one forward: each row's logits are the
    bits its sequence gets in a forward of its own at base 0."""
    target, _, _ = int8_pair
    seqs = [list(range(5, 40)), list(range(50, 61)), list(range(100, 170))]
    alone = []
    for s in seqs:
        target.reset()
        target.prefill(s[:-3])
        alone.append(target.forward_chain(s[-3:]).clone())
    regions = [target.region(base, 200) for base in (0, 333, 700)]
    for r, s in zip(regions, seqs):
        r.prefill(s[:-3])
    causal = torch.ones(3, 3, dtype=torch.bool).tril_()
    calls = [Call(r, s[-3:], [0, 1, 2], [0, 1, 2], causal) for r, s in zip(regions, seqs)]
    for got, want in zip(forward_many(calls, 16), alone):
        assert torch.equal(got, want)


def test_a_region_refuses_a_tree_past_its_end_and_a_region_past_the_cache(int8_pair):
    target, _, _ = int8_pair
    r = target.region(100, 8)
    with pytest.raises(ValueError, match="exceeds the cache of 8"):
        r.forward_chain(list(range(9)))
    with pytest.raises(ValueError, match="outside the cache"):
        target.region(target.max_len - 4, 8)


def test_regions_are_first_fit_and_reused_after_a_free():
    regions = Regions(100)
    assert [regions.alloc(30), regions.alloc(30), regions.alloc(30)] == [0, 30, 60]
    assert regions.alloc(20) is None
    regions.free(30)
    assert regions.alloc(20) == 30 and regions.alloc(10) == 50 and regions.alloc(1) == 90
    assert regions.used == 30 + 20 + 10 + 30 + 1


def test_every_method_batched_gives_each_request_its_own_greedy_output(int8_pair):
    """Five prompts, every method of the test table, joining at different steps (continuous
    batching): each request's tokens are what it gets decoded alone, and alone is plain decoding."""
    target, draft, tok = int8_pair
    prompts = [tok(p).input_ids for p in PROMPTS]
    alone = [decode(target, None, "ar", {}, p, 24)[0] for p in prompts]
    for method, params in METHODS:
        def make(name, drafter, params=params):
            return proposers.build(name, params, drafter)

        batch = Batch(target, draft, make, max_batch=4, cost_aware=False)
        outs = run_batch(batch, [(p, method, {"max_new_tokens": 24}) for p in prompts], joins_at=[0, 0, 1, 3, 4])
        assert outs == alone, (method, params)


def test_a_members_drafter_follows_its_prompt_chunks_and_one_that_never_drafts_never_runs(int8_pair):
    """Lazy drafters: a member that never drafts (egt at depth 0) never runs its drafter; one that
    drafts is fed its prompt a chunk behind its target (chunked prefill), has all of it by its
    first drafting step, and decodes exactly as alone."""
    target, draft, tok = int8_pair
    prompt = tok(PROMPTS[2]).input_ids
    params = {"chain": {"k": 3}, "egt": {"depth": 0}}
    batch = Batch(target, draft, lambda name, d: proposers.build(name, params[name], d), max_batch=2)
    plain = batch.join(prompt, "egt", max_new_tokens=8)
    drafting = batch.join(prompt, "chain", max_new_tokens=8)
    d = drafting.generation.proposer.drafter.runner
    fed = []
    while not drafting.prefilled:
        batch.step()
        fed.append((drafting.generation.target.committed, d.committed))
    assert all(theirs <= ours for ours, theirs in fed)  # the drafter follows, never leads
    batch.step()  # its first drafting step
    assert d.committed >= len(prompt) - 1
    assert plain.generation.proposer.drafter.runner.forwards == 0
    while batch.members:
        batch.step()
    alone = decode(target, None, "ar", {}, prompt, 8)[0]
    assert plain.generation.out == drafting.generation.out == alone
    assert plain.generation.proposer.drafter.runner.forwards == 0


def test_requests_sharing_a_prompt_prefix_reuse_its_rows_and_decode_as_alone(int8_pair):
    """A chat template's system turn is computed once: every member whose prompt starts with it
    gets its rows copied into its region (target and drafter), and decodes as the request alone
    without any prefix cache."""
    from ygg_runtime.model.runner import PrefixCache

    target, draft, tok = int8_pair
    head = tok("<|system|>You are a careful assistant.<|end|>\n<|user|>").input_ids
    prompts = [head + tok(p).input_ids for p in PROMPTS[:4]]
    alone = [decode(target, None, "ar", {}, p, 16)[0] for p in prompts]
    target.prefix, draft.prefix = PrefixCache(head), PrefixCache(head)
    try:
        batch = Batch(target, draft, lambda name, d: proposers.build(name, {"k": 3}, d), max_batch=4)
        outs = run_batch(batch, [(p, "chain", {"max_new_tokens": 16}) for p in prompts], joins_at=[0, 0, 2, 3])
    finally:
        hits = target.prefix.hits, draft.prefix.hits
        target.prefix = draft.prefix = None
    assert outs == alone
    # the first member computed the target's rows and the other three copied them; the two members
    # whose drafters first drafted together both computed the drafter's
    assert hits == (3, 2)


def test_a_members_drafter_with_a_window_reads_the_system_turn_and_the_prompts_last_tokens_and_decodes_as_alone(int8_pair):
    """A request whose drafter reads a window (`Decoder.choose`, `ygg serve`): its lazy drafter
    takes the prefix cache's rows and then only the prompt's last `draft_window` tokens, behind
    the target's chunks, and the output is the request's alone."""
    from ygg_runtime.model.runner import PrefixCache

    target, draft, tok = int8_pair
    head = tok("<|system|>You are a careful assistant.<|end|>\n<|user|>").input_ids
    long = head + tok(" ".join(PROMPTS) * 2).input_ids
    alone = decode(target, None, "ar", {}, long, 24)[0]
    target.prefix, draft.prefix = PrefixCache(head), PrefixCache(head)
    try:
        batch = Batch(target, draft, lambda name, d: proposers.build(name, {"k": 3}, d), max_batch=2)
        outs: list[int] = []
        member = batch.join(long, "chain", max_new_tokens=24, on_tokens=outs.extend, draft_window=20)
        d = member.generation.proposer.drafter
        while batch.members:
            batch.step()
    finally:
        target.prefix = draft.prefix = None
    assert outs == alone
    assert d.head == len(head) and d.cut == len(long) - 1 - len(head) - 20
    assert d.runner.committed <= len(head) + 20 + 24 < len(long)


def test_a_full_batch_admits_a_request_when_a_member_leaves(int8_pair):
    target, draft, tok = int8_pair
    batch = Batch(target, draft, lambda name, d: proposers.build(name, {"k": 3}, d), max_batch=2)
    prompts = [tok(p).input_ids for p in PROMPTS[:3]]
    a = batch.join(prompts[0], "chain", max_new_tokens=4)
    b = batch.join(prompts[1], "chain", max_new_tokens=40)
    assert a is not None and b is not None and batch.join(prompts[2], "chain", max_new_tokens=4) is None
    finished = []
    for _ in range(10):
        finished += batch.step()
        if a in finished:
            break
    assert a in finished and b not in finished
    assert batch.join(prompts[2], "chain", max_new_tokens=4) is not None
    batch.cancel(b)
    assert len(batch.members) == 1 and batch.regions.used == batch.members[0].length


def test_a_request_larger_than_the_cache_is_refused_and_requests_hold_what_they_wrote_not_their_max_tokens(int8_pair):
    """The cache on demand: four requests whose max_tokens add up to three times the cache all
    join, each holding its prompt and a step's room (and some to grow), and grow as they decode."""
    from ygg_runtime.decoding.batch import GROW
    from ygg_runtime.errors import YggError

    target, draft, tok = int8_pair
    batch = Batch(target, draft, lambda name, d: proposers.build(name, {}, d), max_batch=4)
    with pytest.raises(YggError, match="does not fit the context"):
        batch.join(list(range(1, 100)), "ar", max_new_tokens=target.max_len)
    members = [batch.join(list(range(1 + i, 100)), "ar", max_new_tokens=1500) for i in range(4)]
    assert all(m is not None for m in members)
    assert [m.length for m in members] == [len(m.generation.prompt) + m.room + GROW for m in members]
    for _ in range(3):
        batch.step()
    held, written, upfront = batch.held()
    assert held == sum(m.length for m in members) and written == sum(len(m.generation.seq) for m in members)
    assert upfront == sum(len(m.generation.prompt) + 1500 + m.room for m in members) > 3 * batch.regions.capacity
    for m in members:
        batch.cancel(m)
    assert batch.regions.used == 0


def small_cache(int8_pair, slots: int):
    """The pair's models (copies) over a cache of `slots` slots."""
    import copy

    target, draft, _ = int8_pair
    t, d = runner(copy.deepcopy(target.model), slots), runner(copy.deepcopy(draft.model), slots)
    t.min_width, t.widths = target.min_width, target.widths
    return t, d


@pytest.mark.parametrize("method,params", [("chain", {"k": 3}), ("ar", {})])
def test_a_full_cache_preempts_the_newest_and_every_output_is_still_its_own(int8_pair, method, params):
    """Four requests in a cache that holds about a third of what they write: regions move to grow,
    the newest is preempted when no room is left and recomputed later, and every output (greedy,
    and coupled sampling with a seed) is what the request gets alone."""
    target, draft, tok = int8_pair
    t, d = small_cache(int8_pair, MAX_ROWS + 600)
    prompts = [tok(p).input_ids for p in PROMPTS[:4]]
    kws = [{"max_new_tokens": 400}, {"max_new_tokens": 400, "temperature": 0.8, "seed": 7},
           {"max_new_tokens": 400}, {"max_new_tokens": 400}]
    alone = [decode(target, draft, "ar", {}, p, kw.pop("max_new_tokens"), **kw)[0] for p, kw in
             zip(prompts, [dict(k) for k in kws])]
    batch = Batch(t, d, lambda name, dr: proposers.build(name, params, dr), max_batch=4, cost_aware=False)
    outs = run_batch(batch, [(p, method, kw) for p, kw in zip(prompts, kws)], max_steps=3000)
    assert outs == alone
    assert batch.preemptions > 0 and batch.moves > 0 and batch.regions.used == 0


def test_a_member_that_fails_leaves_and_the_others_finish(int8_pair):
    target, draft, tok = int8_pair
    batch = Batch(target, draft, lambda name, d: proposers.build(name, {"k": 3}, d), max_batch=3)
    prompts = [tok(p).input_ids for p in PROMPTS[:3]]
    outs = [[], [], []]
    members = [batch.join(p, "chain", max_new_tokens=12, on_tokens=o.extend) for p, o in zip(prompts, outs)]

    def boom(new):
        raise RuntimeError("client went away")

    members[1].on_tokens = boom
    finished = []
    for _ in range(40):
        finished += batch.step()
        if not batch.members:
            break
    assert isinstance(members[1].error, RuntimeError)
    assert outs[0] == decode(target, None, "ar", {}, prompts[0], 12)[0]
    assert outs[2] == decode(target, None, "ar", {}, prompts[2], 12)[0]


def test_the_batched_verify_never_exceeds_the_checked_width(int8_pair, monkeypatch):
    """Eight members with 16-node trees: the verify is split into forwards of MAX_ROWS rows."""
    import ygg_runtime.decoding.batch

    target, draft, tok = int8_pair
    widths = []

    def recorded(calls, width=0):
        widths.append(sum(len(c.tokens) for c in calls))
        return forward_many(calls, width)

    monkeypatch.setattr(ygg_runtime.decoding.batch, "forward_many", recorded)
    params = {"depth": 3, "draft_width": 4, "top_k": 4, "verify_widths": [16]}
    batch = Batch(target, draft, lambda name, d: proposers.build(name, params, d), max_batch=8, cost_aware=False)
    prompts = [tok(p).input_ids for p in PROMPTS] + [tok(p + " again").input_ids for p in PROMPTS[:3]]
    outs = run_batch(batch, [(p, "egt", {"max_new_tokens": 8}) for p in prompts])
    assert max(widths) <= MAX_ROWS and MAX_ROWS in widths
    assert outs == [decode(target, None, "ar", {}, p, 8)[0] for p in prompts]


def test_cost_aware_trees_shrink_as_the_batch_grows_and_stay_exact(artifact):
    """The compiled tiny artifact, its batch's CAST allocation priced by planted costs (a verify
    forward of n rows takes 2 + 10·n ms, whatever the batch; drafting and the step's CPU work take
    nothing), so that a node must be nearly certain to pay for its rows on any machine (how this
    machine's measured T(B, n) weighs a node is the objective's business, pinned in test_planning):
    the verified nodes per member fall as more members share the verify, and every output is
    still the request's own. (How many of the four fit the tiny artifact's cache at once depends on
    the plan's step room: the test reads the largest batch that formed.)"""
    decoder = artifacts.load(artifact)
    prompts = [decoder.encode(p) for p in PROMPTS[:4]]
    alone = [decoder.generate(p, method="egt", max_new_tokens=16).token_ids for p in prompts]
    sizes = {}
    for size in (1, 4):
        batch = decoder.batch(max_batch=size)
        batch.curves = linear_curves(2.0, 10.0)  # the batch's allocation only: the proposers keep the measured curves
        outs = run_batch(batch, [(p, "egt", {"max_new_tokens": 16}) for p in prompts[:size]])
        assert outs == alone[:size]
        sizes[size] = batch.nodes_per_sequence()
    together = max(sizes[4])
    assert together >= 2 and sizes[4][together] < sizes[1][1], sizes


@pytest.mark.parametrize("method", ["specinfer", "sequoia", "egt"])
def test_a_proposer_learns_its_accepted_path_in_its_own_tree_when_the_batch_cut_it(artifact, method):
    """CAST keeps part of each member's tree and renumbers its nodes; the engine maps the verdict
    back, so every proposer's update names the nodes of the tree it proposed (before, a specinfer or
    sequoia member's drafter committed the K/V of a sibling: [0,1,2] was really [0,1,4])."""
    decoder = artifacts.load(artifact)
    if method == "sequoia":  # a static tree wide enough for the allocation to cut (the plan's is small here)
        decoder.methods["sequoia"] = dataclasses.replace(decoder.methods["sequoia"], **SEQUOIA_TREE)
    batch = decoder.batch(max_batch=4)
    seen = {"cut": 0, "steps": 0}
    checks = []
    members = [batch.join(decoder.encode(p), method, max_new_tokens=24) for p in PROMPTS[:4]]

    def spy(gen):
        update = gen.proposer.update

        def checked(verdict):
            seen["cut"] += gen.tree is not gen.proposed
            seen["steps"] += 1
            said = [gen.proposed.tokens[v] for v in verdict.path[1:]] + [verdict.bonus]
            checks.append((gen, len(gen.seq), said))
            return update(verdict)
        gen.proposer.update = checked

    joined = [m for m in members if m is not None]
    assert len(joined) >= 2
    for m in joined:
        spy(m.generation)
    while batch.members:
        batch.step()
        for gen, before, said in checks:
            got = gen.seq[before:]
            assert got == said[: len(got)], (got, said)
        checks.clear()
    assert seen["cut"] > 0, seen  # the allocation did cut trees, so the mapping was exercised


def test_compile_measures_batched_forwards_and_the_cost_model_reads_them(int8_pair):
    """f(B, c, n): a forward of n tokens over B regions is timed for every width n >= B, and the
    curves scale one sequence's T(n) by the measured factor (1 for a single sequence)."""
    from ygg_compile import latency as prof
    from ygg_runtime.decoding.objective import Curves

    target, _, _ = int8_pair
    measured = prof.measure(target, (1, 2, 4, 8), (16, 64), repeats=1)
    batch = measured["batch_ms"]
    assert batch["sequences"] == [2, 4, 8] and batch["widths"] == [1, 2, 4, 8]
    assert [[ms is not None for ms in row] for row in batch["ms"]] == [[False, True, True, True],
                                                                       [False, False, True, True],
                                                                       [False, False, False, True]]
    curves = Curves(prof.combine(measured, None, (1, 2, 4, 8), (16, 64)))
    assert curves.t_batch("target", 1, 8, 40) == curves.t_verify(8, 40)
    factors = curves.batch["target"].factors
    assert curves.t_batch("target", 2, 4, 40) == pytest.approx(curves.t_verify(4, 40) * factors[0][2])
    assert curves.t_batch("target", 8, 8, 40) == pytest.approx(curves.t_verify(8, 40) * factors[2][3])


def test_as_the_batch_grows_the_objective_picks_shallower_trees_down_to_plain_decoding():
    """Curves.shared(B): one sequence's share of a batched step. A forward's fixed cost is shared
    by B sequences while every tree node still costs its own row, so the depth the objective picks
    falls with B, and a big enough batch decodes plainly."""
    from ygg_runtime.decoding.objective import Curves, best_depth
    from ygg_runtime.schema.params import StepShape

    widths = [1, 2, 4, 8, 16, 32, 64]
    profile = {"widths": widths, "contexts": [64], "target_ms": [[30 + 0.5 * w for w in widths]],
               "draft_ms": [[8 + 0.1 * w for w in widths]], "other_ms": [0.5] * len(widths)}
    curves = Curves(profile)
    shapes = [StepShape((), 1)] + [StepShape((2,) + (4,) * (d - 1), min(64, 4 * d)) for d in range(1, 7)]
    reach = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    depths = [best_depth(reach, [1.0] * 7, shapes, curves.shared(b), 64) for b in (1, 2, 4, 8, 16, 64)]
    assert depths[0] == 4 and depths[-1] == 0
    assert all(a >= b for a, b in zip(depths, depths[1:])), depths
    assert curves.shared(1) is curves and curves.shared(4).t_verify(8) == pytest.approx((30 + 0.5 * 32) / 4)


def test_every_batched_target_forward_runs_at_a_width_the_row_check_covers(int8_pair, monkeypatch):
    """Four chain k = 4 members ending together: 20 tree rows, and near the end no member's region
    has room for the 12 padding rows past its tree. The forward must still run at a checked
    width (the batch keeps slots for padding), never at the raw 20, which the compile-time row
    check never measured (it covers the compiled widths, as the decoder's target has them)."""
    import ygg_runtime.decoding.batch
    from ygg_runtime.model.transformer import Transformer
    from ygg_runtime.model.runner import ModelRunner

    checked = (1, 2, 4, 8, 16, 32, 64)
    target, draft, tok = int8_pair
    target = ModelRunner(target.model, 2048)
    target.widths = checked
    widths = []
    real = Transformer.forward

    def recorded(self, x, *args, **kw):
        if self is target.model:
            widths.append(x.shape[1])
        return real(self, x, *args, **kw)

    monkeypatch.setattr(Transformer, "forward", recorded)
    rows = []

    def counted(calls, width=0):
        if calls[0].runner.model is target.model:
            rows.append(sum(len(c.tokens) for c in calls))
        return forward_many(calls, width)

    monkeypatch.setattr(ygg_runtime.decoding.batch, "forward_many", counted)
    batch = Batch(target, draft, lambda name, d: proposers.build(name, {"k": 4}, d), max_batch=4, cost_aware=False)
    prompt = tok(PROMPTS[0]).input_ids
    prompts = [prompt, prompt[:-1] + [prompt[-1] + 1], prompt[:-1] + [prompt[-1] + 2], prompt[:-1] + [prompt[-1] + 3]]
    outs = run_batch(batch, [(p, "chain", {"max_new_tokens": 13}) for p in prompts])
    assert rows.count(20) > 1  # the four trees verified together
    assert set(widths) <= set(checked), sorted(set(widths) - set(checked))
    assert outs == [decode(target, None, "ar", {}, p, 13)[0] for p in prompts]


def test_a_long_prompt_prefills_in_chunks_beside_the_decoding_members_and_every_output_is_its_own(int8_pair):
    """Chunked prefill: a prompt of several chunks joins two decoding members. Every step until it
    is in carries one chunk of it in the same target forward as the others' trees (at most
    MAX_ROWS rows), the decoding members get tokens at every one of those steps (no stall), and
    every request's output is what it gets alone."""
    target, draft, tok = int8_pair
    long = tok(" ".join(PROMPTS) * 2).input_ids
    short = [tok(p).input_ids for p in PROMPTS[:2]]
    alone = [decode(target, None, "ar", {}, p, n)[0] for p, n in [(short[0], 200), (short[1], 200), (long, 40)]]
    batch = Batch(target, draft, lambda name, d: proposers.build(name, dict(METHODS)[name], d), max_batch=4,
                  cost_aware=False)
    outs = [[], [], []]
    members = [batch.join(p, "chain", max_new_tokens=200, on_tokens=o.extend) for p, o in zip(short, outs)]
    for _ in range(2):
        batch.step()
    joiner = batch.join(long, "chain", max_new_tokens=40, on_tokens=outs[2].extend)
    steps, seen = 0, [0]
    while not joiner.prefilled:
        before = [len(o) for o in outs[:2]]
        with joiner.generation.target.recording() as widths:
            batch.step()
        steps += 1
        seen.append(joiner.generation.target.committed)
        assert len(widths) == 1 and seen[-1] - seen[-2] < widths[0] <= MAX_ROWS  # one forward, shared
        assert not any(m.done for m in members)
        assert all(len(o) > b for o, b in zip(outs[:2], before))
    assert steps >= (len(long) - 1) // MAX_ROWS + 1 and steps > 2, steps  # in chunks, over several steps
    assert seen == sorted(seen) and seen[-1] == len(long) - 1
    while batch.members:
        batch.step()
    assert outs == alone


def test_a_chunk_is_as_large_as_the_step_budget_allows_and_fills_an_idle_forward(int8_pair):
    """The chunk size comes from the measured T(B, n): a step carrying a chunk costs at most
    PREFILL_STRETCH times the step without it (at least MIN_CHUNK tokens, then up to the compiled
    width the forward is padded to); with nobody decoding, the forward is filled to MAX_ROWS."""
    from ygg_runtime.decoding.batch import MIN_CHUNK, PREFILL_STRETCH
    from ygg_runtime.decoding.objective import Curves

    target, draft, tok = int8_pair
    widths = [1, 2, 4, 8, 16, 32, 64]  # memory-bound up to 8 rows, then compute-bound
    curves = Curves({"widths": widths, "contexts": [16], "threads": 2, "target_ms": [[10, 10, 11, 12, 20, 36, 68]]})
    batch = Batch(target, None, lambda name, d: proposers.build(name, {}, d), curves=curves, max_batch=3)
    long = tok(" ".join(PROMPTS) * 4).input_ids
    decoding = batch.join(tok(PROMPTS[0]).input_ids, "ar", max_new_tokens=30)
    batch.step()  # its prompt is short: one chunk
    assert decoding.prefilled
    filling = batch.join(long, "ar", max_new_tokens=4)
    filling.started = True
    filling.generation.begin_prefill()
    ((m, n),) = batch._chunks([decoding], [filling], 1)
    plain = curves.t_batch("target", 1, 1)
    assert m is filling and MIN_CHUNK <= n < MAX_ROWS
    assert curves.t_batch("target", 2, 1 + n) - plain <= (PREFILL_STRETCH - 1) * plain
    assert curves.t_batch("target", 2, 2 + n) - plain > (PREFILL_STRETCH - 1) * plain
    assert batch._chunks([], [filling], 0) == [(filling, MAX_ROWS)]
    # a budget narrower than MIN_CHUNK: the chunk still goes, and fills the width the forward is padded to
    steep = Curves({"widths": widths, "contexts": [16], "threads": 2, "target_ms": [[10, 12, 30, 50, 90, 170, 330]]})
    batch.curves, target.widths = steep, tuple(widths)
    try:
        ((_, n),) = batch._chunks([decoding], [filling], 1)
    finally:
        target.widths = ()
    assert n == 7  # 1 verify row + MIN_CHUNK = 5 rows run at width 8: 7 prompt rows for the price of 4


def test_a_prompts_rows_skip_the_output_head_and_write_the_same_cache_rows(int8_pair):
    """Prefill asks for no logits (the head is a sixth of a 1.5B model's work per row): the rows it
    commits are the bits a forward that computes every row's logits writes."""
    target, _, _ = int8_pair
    tokens = list(range(3, 150))
    target.reset()
    target.prefill(tokens)
    assert target.logits is None
    skipped = [(c.k[:, :, : len(tokens)].clone(), c.v[:, :, : len(tokens)].clone()) for c in target.model.caches()]
    target.reset()
    for i in range(0, len(tokens), MAX_ROWS):
        part = tokens[i : i + MAX_ROWS]
        assert target.forward_chain(part).shape[0] == len(part)
        target.commit(list(range(len(part))))
    for c, (k, v) in zip(target.model.caches(), skipped):
        assert torch.equal(c.k[:, :, : len(tokens)], k) and torch.equal(c.v[:, :, : len(tokens)], v)


def test_a_mixed_forward_computes_logits_on_a_checked_number_of_rows():
    """Beside a prompt chunk, the head runs on the wanted rows filled up to a compiled width of at
    least the exactness floor (a float head's rows are invariant only from there), padding rows
    and the chunk's last rows filling it."""
    from types import SimpleNamespace

    from ygg_runtime.model.runner import head_rows

    first = SimpleNamespace(min_width=4, widths=(1, 2, 4, 8, 16))
    verify = Call(None, [1], [0], [0], torch.ones(1, 1, dtype=torch.bool))
    chunk = Call(None, list(range(10)), list(range(10)), list(range(10)), torch.ones(10, 10, dtype=torch.bool), False)
    heads, at = head_rows([verify, chunk], 16, first)
    assert heads[:1] == [0] and len(heads) == 4 and at == [0, None]
    assert heads[1:] == [11, 12, 13, 14, 15][:3]  # the padding rows first
    heads, at = head_rows([chunk, verify, verify], 12, first)
    assert heads[:2] == [10, 11] and len(heads) == 4 and at == [None, 0, 1]
    assert head_rows([verify, verify], 2, first) == ([0, 1], [0, 1])  # all wanted: every row, as before


@pytest.mark.parametrize("max_context", [1, 100, 1024])
def test_every_measured_forward_fits_the_cache_a_compile_makes_whatever_the_exactness_floor(max_context):
    """A compile's latency profile — T(W) at each context of its grid, CAST's batched forwards, a
    step's CPU work — is measured in the cache `ygg compile --max-context N` makes (N plus a probe
    tree's room), every target forward padded to the exactness floor the row check found, which
    is a machine's: 1 or 2 on the EPYCs, up to the widest compiled width where only it agrees (the
    AMX Xeon's bf16). Every forward fits, padding rows included, down to the smallest cache: a
    floor of 64 crashed the batched forwards ("no region has room for 62 padding rows past its
    tree") and a compile with --max-context 1, whose widths hold no two sequences, divided by zero."""
    import tiny
    from helpers import to_runtime

    from ygg_compile import calibrate
    from ygg_compile import latency as profile
    from ygg_runtime.schema.params import WIDTHS

    small = runner(to_runtime(tiny.hf_model("llama", seed=3)), max_context + calibrate.PROBE_ROOM)
    widths, contexts = profile.plan_grid(max_context)
    for floor in (0, *WIDTHS):
        small.min_width = floor
        with small.recording() as seen:
            got = profile.measure(small, widths, contexts, repeats=1)
        assert seen and min(seen) >= max(floor, 1), (floor, seen)  # T(W) as the model runs: padded to the floor
        assert len(got["forward_ms"]) == len(contexts) and len(got["other_ms"]) == len(widths)
        batch = got["batch_ms"]
        assert batch["sequences"] == list(profile.BATCH_SEQUENCES) and (batch["context"] >= 1 or widths == (1,))
        assert all((ms is None) == (w < b) for b, row in zip(batch["sequences"], batch["ms"])
                   for w, ms in zip(widths, row)), (floor, batch)
        assert small.committed == 0 and small.widths == ()
