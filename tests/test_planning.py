"""The tree-shape optimisers against brute force: verification pruning and Sequoia's DP."""

import itertools
import random

import pytest
import torch

from helpers import linear_curves
from ygg_compile.sequoia_tree import optimal_tree
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.decoding.prune import Pruning, allocate, best_subtree, expected_accepted
from ygg_runtime.decoding.tree import TokenTree


def random_tree(rng: random.Random, n: int, decreasing: bool) -> tuple[list[int], list[float]]:
    parents, values = [-1], [1.0]
    for v in range(1, n):
        p = rng.randrange(v)
        parents.append(p)
        values.append(values[p] * rng.random() if decreasing else rng.random())
    return parents, values


def brute_force(parents: list[int], values: list[float], k: int) -> float:
    n, best = len(parents), float("-inf")
    for size in range(1, k + 1):
        for rest in itertools.combinations(range(1, n), size - 1):
            chosen = {0, *rest}
            if all(parents[v] in chosen for v in rest):
                best = max(best, sum(values[v] for v in chosen))
    return best


def test_pruning_finds_the_best_root_connected_subtree_on_random_trees():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 10)
        parents, values = random_tree(rng, n, decreasing=False)
        k = rng.randint(1, n)
        nodes = best_subtree(parents, values, k)
        assert nodes[0] == 0 and len(nodes) <= k
        assert all(parents[v] in nodes for v in nodes[1:]), (parents, nodes)
        assert expected_accepted(values, nodes) == pytest.approx(brute_force(parents, values, k)), trial


def test_pruning_equals_top_k_by_value_when_values_decrease_along_paths():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 60)
        parents, values = random_tree(rng, n, decreasing=True)
        k = rng.randint(1, n)
        top = sorted(range(n), key=lambda v: -values[v])[:k]
        assert expected_accepted(values, best_subtree(parents, values, k)) == pytest.approx(expected_accepted(values, top))


def test_pruning_of_values_decreasing_along_paths_is_the_best_subtree_with_ties_and_zeros():
    """The sort that prunes a step's trees (values never increase along a path) against brute
    force, with children as likely as their parents and nodes worth nothing: the best sum for every
    size, root-connected, and no node worth nothing kept."""
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(1, 10)
        parents, values = [-1], [1.0]
        for v in range(1, n):
            p = rng.randrange(v)
            parents.append(p)
            values.append(values[p] * rng.choice([1.0, 0.0, rng.random(), 0.5]))
        pruning = Pruning(parents, values, n)
        assert pruning.order is not None
        for k in range(1, n + 1):
            nodes = pruning.nodes(k)
            assert nodes[0] == 0 and len(nodes) <= k and all(parents[v] in nodes for v in nodes[1:]), (parents, nodes)
            assert all(values[v] > 0 for v in nodes[1:]) or values[0] == 0
            assert pruning.value(k) == pytest.approx(brute_force(parents, values, k)), trial
            assert expected_accepted(values, nodes) == pytest.approx(pruning.value(k))


def token_tree(parents: list[int], values: list[float]) -> TokenTree:
    tree = TokenTree(0)
    for v in range(1, len(parents)):
        tree.add(parents[v], v, values[v] / values[parents[v]] if values[parents[v]] else 0.0)
    tree.path_values = list(values)
    return tree


def cuts(parents: list[int]) -> list[list[int]]:
    """Every root-connected node set of a tree."""
    n = len(parents)
    return [[0, *rest] for size in range(n) for rest in itertools.combinations(range(1, n), size)
            if all(parents[v] in (0, *rest) for v in rest)]


def step_rate(curves: Curves, values: list[float], nodes: int, sequences: int, draft_ms: float) -> float:
    return sum(values) / (draft_ms + curves.t_batch("target", sequences, nodes, 64) + curves.t_other(nodes))


def test_cast_allocation_gives_the_batch_the_best_modelled_rate_over_every_way_to_cut_its_trees():
    """prune.allocate against brute force: no other choice of root-connected subtrees (one per
    member, every root kept) gives more expected accepted tokens per modelled ms of the step."""
    rng = random.Random(2)
    for trial in range(60):
        trees = [random_tree(rng, rng.randint(1, 5), decreasing=True) for _ in range(rng.randint(1, 3))]
        curves = linear_curves(rng.uniform(0.5, 20), rng.uniform(0.05, 5), rng.uniform(0, 0.5))
        draft_ms = rng.uniform(0, 5)
        out = allocate([token_tree(p, v) for p, v in trees], curves, 64, draft_ms)
        assert all(len(t) >= 1 and t.origin[0] == 0 for t in out)
        got = step_rate(curves, [t.path_values[v] for t in out for v in range(len(t))], sum(map(len, out)),
                        len(trees), draft_ms)
        best = max(step_rate(curves, [v[i] for (_, v), c in zip(trees, combo) for i in c], sum(map(len, combo)),
                             len(trees), draft_ms)
                   for combo in itertools.product(*(cuts(p) for p, _ in trees)))
        assert got == pytest.approx(best), trial


def test_cast_allocation_shrinks_each_tree_as_more_members_share_the_verify():
    """The same tree, alone and as one of four members of a batch whose forward costs what its
    rows do: a node's marginal millisecond buys less in the batch, so each member verifies fewer
    nodes; with four times as many rows costing nothing extra, every tree is verified whole."""
    parents, values = [-1, 0, 0, 1, 1, 2, 3], [1.0, 0.6, 0.3, 0.35, 0.2, 0.1, 0.2]
    steep = linear_curves(10.0, 1.0)
    alone = allocate([token_tree(parents, values)], steep, 64)
    four = allocate([token_tree(parents, values) for _ in range(4)], steep, 64)
    assert max(map(len, four)) < len(alone[0]), (len(alone[0]), [len(t) for t in four])
    flat = allocate([token_tree(parents, values) for _ in range(4)], linear_curves(10.0, 0.0), 64)
    assert [len(t) for t in flat] == [len(parents)] * 4


def complete_tree(p: list[float], depth: int) -> tuple[list[int], list[float], list[int]]:
    """Every rank under every node down to `depth`: the space Sequoia searches."""
    parents, values, depths = [-1], [1.0], [0]
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            for r, pr in enumerate(p):
                parents.append(u)
                values.append(values[u] * pr)
                depths.append(depths[u] + 1)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents, values, depths


def test_sequoia_dp_matches_brute_force_on_small_budgets():
    rng = random.Random(2)
    for _ in range(60):
        ranks, depth = rng.randint(1, 3), rng.randint(1, 3)
        p = sorted((rng.random() * 0.6 for _ in range(ranks)), reverse=rng.random() < 0.7)
        parents, values, _ = complete_tree(p, depth)
        budget = rng.randint(1, min(7, len(parents)))
        tree = optimal_tree(p, budget, depth)
        assert tree.expected_accepted == pytest.approx(brute_force(parents, values, budget))
        assert len(tree.parents) <= budget and tree.depth <= depth
        # the tree it returns is worth what it claims
        worth = [1.0]
        for v in range(1, len(tree.parents)):
            worth.append(worth[tree.parents[v]] * p[tree.ranks[v]])
        assert sum(worth) == pytest.approx(tree.expected_accepted)
        assert len({(tree.parents[v], tree.ranks[v]) for v in range(1, len(tree.parents))}) == len(tree.parents) - 1


def test_sequoia_dp_agrees_with_pruning_the_complete_tree():
    p = [0.55, 0.2, 0.1, 0.05]
    parents, values, _ = complete_tree(p, 3)
    for budget in (1, 2, 4, 8, 16, 32):
        tree = optimal_tree(p, budget, 3)
        assert tree.expected_accepted == pytest.approx(expected_accepted(values, best_subtree(parents, values, budget)))


def test_the_profile_grid_reaches_the_longest_context_a_request_can():
    """An artifact serving the models' 32k context is profiled out to its end, one serving 4k as
    before, and the batch factors stay at the context nearest 512."""
    from ygg_compile import latency as profile

    assert profile.plan_grid(4096)[1] == (64, 512, 2048)
    widths, contexts = profile.plan_grid(32768)
    assert contexts == (64, 512, 2048, 8192, 32768 - widths[-1])
    assert profile.plan_grid(16384)[1] == (64, 512, 2048, 8192)
    assert profile.batch_context(contexts) == 512 and profile.batch_context((64,)) == 64


def test_a_default_compile_serves_the_models_own_context_where_memory_holds_both_caches(tmp_path, monkeypatch):
    """No --max-context: the models' own context (the shorter of the two), unless both caches at
    that length would not fit half the free memory beside the weights; then the longest that does,
    said in one line. --max-context is taken as asked, never past the models'."""
    import json
    from types import SimpleNamespace

    from ygg_compile import build
    from ygg_runtime.schema.plan import WeightsInfo

    args = {"vocab_size": 100, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "norm_eps": 1e-6, "max_position": 32768}
    models = {}
    for role, positions in (("target", 32768), ("draft", 40000)):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text(json.dumps(args | {"max_position": positions}))
        models[role] = SimpleNamespace(max_position=positions, parameters=1_000_000, weights=WeightsInfo("float", "checkpoint"))
    notes = []
    b = SimpleNamespace(models=models, tmp=tmp_path, dtype=torch.float32, ui=SimpleNamespace(note=notes.append),
                        opts=SimpleNamespace(max_context=None, device="cpu"))
    per_token = 2 * (4 * 2 * 2 * 16 * 4)  # both models' K and V, float32
    monkeypatch.setattr(build, "available_memory", lambda device: 8 << 30)
    assert build._max_context(b) == 32768 and not notes
    short = 8_000_000 + int(2 * (10_000 + 300) * per_token)  # the weights, then room for ~10k tokens at half
    monkeypatch.setattr(build, "available_memory", lambda device: short)
    got = build._max_context(b)
    assert got == 9216 and len(notes) == 1 and "not the models' 32768" in notes[0] and "--max-context" in notes[0]
    b.opts.max_context = 100_000
    assert build._max_context(b) == 32768
    b.opts.max_context = 2048
    assert build._max_context(b) == 2048
