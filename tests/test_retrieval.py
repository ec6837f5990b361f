"""Retrieval (ygg_runtime.decoding.retrieval): prompt lookup against a linear scan, the adjacency table's
guarantee, and grafting into a tree."""

import random

import pytest

from ygg_runtime.schema.params import GraftParams
from ygg_runtime.decoding.retrieval import AdjacencyTable, ContextIndex, Retriever, prior_context
from ygg_runtime.decoding.tree import CONTEXT, DRAFT, TokenTree


def scan(tokens, max_n, min_n, keep, length, limit, path=()):
    """The reference: for the longest suffix of tokens + path seen before in tokens, every earlier
    occurrence (the latest `keep`), what followed it, merged and ranked as the index documents."""
    full, end = list(tokens) + list(path), len(tokens)
    for n in range(min(max_n, len(full)), min_n - 1, -1):
        suffix = full[len(full) - n :]
        ends = [e for e in range(n, end) if tokens[e - n : e] == suffix][-keep:]
        if not ends:
            continue
        found = {}
        for e in ends:
            cont = tuple(tokens[e : e + length])
            c, last = found.get(cont, (0, -1))
            found[cont] = (c + 1, max(last, e))
        first = {}
        for cont, (c, _) in found.items():
            first[cont[0]] = first.get(cont[0], 0) + c
        ranked = sorted(found.items(), key=lambda kv: (-first[kv[0][0]], -kv[1][0], -kv[1][1]))
        return [(list(cont), first[cont[0]], n) for cont, _ in ranked[:limit]]
    return []


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_lookup_equals_a_linear_scan_as_tokens_arrive(vocab):
    rng = random.Random(vocab)
    for trial in range(30):
        max_n, min_n, keep = rng.randint(1, 5), 1, rng.randint(1, 6)
        min_n = rng.randint(1, max_n)
        index = ContextIndex(max_n, min_n, keep)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        index.reset(tokens)
        for _ in range(20):
            length, limit = rng.randint(1, 6), rng.randint(1, 4)
            got = [(c.tokens, c.count, c.match) for c in index.lookup(length, limit)]
            assert got == scan(tokens, max_n, min_n, keep, length, limit), (tokens, max_n, min_n, keep)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            tokens += new
            index.extend(new)


def test_a_repeated_span_is_copied_from_its_longest_match():
    prompt = "the cat sat on the mat . the cat sat".split()
    ids = {w: i for i, w in enumerate(dict.fromkeys(prompt))}
    index = ContextIndex(max_n=3)
    index.reset([ids[w] for w in prompt])
    (best, *_) = index.lookup(length=3)
    assert best.match == 3 and best.tokens == [ids["on"], ids["the"], ids["mat"]]


def test_nothing_is_proposed_without_an_earlier_match():
    index = ContextIndex(max_n=2, min_n=2)
    index.reset([1, 2, 3, 4])
    assert index.lookup(4) == []
    index.extend([2, 3])  # "2 3" ended at 3 before
    assert [c.tokens for c in index.lookup(4)] == [[4, 2, 3]]
    with pytest.raises(ValueError):
        ContextIndex(max_n=1, min_n=2)


def test_adjacency_keeps_every_successor_more_frequent_than_one_in_k():
    """Space-Saving's guarantee, on streams where a few successors dominate and many are noise."""
    from collections import Counter

    from ygg_runtime.decoding.retrieval import AdjacencyTable

    rng = random.Random(7)
    for trial in range(20):
        k = rng.randint(1, 6)
        table = AdjacencyTable(k)
        heavy = rng.sample(range(1000), k=rng.randint(1, k))
        stream = [rng.choice(heavy) if rng.random() < 0.6 else rng.randrange(1000) for _ in range(400)]
        for s in stream:
            table.observe(5, s)
        truth = Counter(stream)
        kept = dict(table.successors(5))
        assert len(kept) <= k and sum(kept.values()) == len(stream)
        for s, c in truth.items():
            if c > len(stream) / k:
                assert s in kept and kept[s] >= c  # counts never under-estimate a kept successor


def test_adjacency_ranks_by_count_and_round_trips_through_lists():
    from ygg_runtime.decoding.retrieval import AdjacencyTable

    table = AdjacencyTable(k=3)
    table.observe_sequence([1, 2, 1, 2, 1, 3, 4, 5])
    assert table.successors(1) == [(2, 2), (3, 1)] and table.successors(9) == []
    again = AdjacencyTable.from_lists(3, *table.to_lists())
    assert again.rows == table.rows
    with pytest.raises(ValueError):
        AdjacencyTable(0)


@pytest.mark.parametrize("vocab", [3, 8])
def test_lookup_after_a_tree_path_equals_a_scan_of_the_extended_sequence(vocab):
    """A lookup under a tree node matches the sequence followed by the node's path, and copies
    only from the accepted sequence."""
    rng = random.Random(100 + vocab)
    for _ in range(200):
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 20))]
        path = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        index = ContextIndex(3, 1, 8)
        index.reset(tokens)
        got = [(c.tokens, c.count, c.match) for c in index.lookup(4, 3, path)]
        assert got == scan(tokens, 3, 1, 8, 4, 3, path), (tokens, path)


def test_graft_merges_retrieved_tokens_into_drafted_nodes_and_values_them_by_the_table():
    r = Retriever(GraftParams(length=3, limit=2, adjacency_depth=0))
    r.reset([4, 5, 6, 7, 9, 4, 5])  # the sequence ends "... 4 5" + root 6: "6" was followed by 7
    r.sync([4, 5, 6, 7, 9, 4, 5, 6])
    tree = TokenTree(6)
    drafted = tree.add(0, 7, 0.5, 0.4)  # the drafter also proposes 7
    added = r.graft(tree)
    assert tree.tokens[1:] == [7, 9, 4] and added == 2  # 7 merged, 9 and 4 added below it
    assert tree.sources == [DRAFT, DRAFT, CONTEXT, CONTEXT]
    # "4 5 6" matched (n = 3): 7 at position 0, seen once; the higher of its and the drafter's values
    table = r.context
    assert tree.path_values[drafted] == pytest.approx(max(0.4, table[2][0][0]))
    assert tree.path_values[2] == pytest.approx(tree.path_values[1] * table[2][1][0])
    assert tree.path_values[3] == pytest.approx(tree.path_values[2] * table[2][2][0])


def test_graft_never_adds_more_than_its_budget_and_adjacency_learns_only_the_targets_tokens():
    r = Retriever(GraftParams(length=8, limit=3, budget=5))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    r.reset(prompt[:-1])
    r.sync(prompt)
    assert r.table.rows == {}  # the prompt is the user's text: not the target's choices
    tree = TokenTree(1)
    assert r.graft(tree) == 5 and len(tree) == 6
    r.sync(prompt + [8, 9])
    assert r.table.successors(1) == [(8, 1)] and r.table.successors(8) == [(9, 1)]
    r.reset(prompt[:-1])
    assert r.table.rows == {}  # online learning stays within its generation


def test_adjacency_table_round_trips_through_its_file(tmp_path):
    table = AdjacencyTable(3)
    table.observe_sequence([1, 2, 1, 3, 1, 2, 5, 5, 5])
    table.save(tmp_path / "adjacency.safetensors")
    loaded = AdjacencyTable.load(tmp_path / "adjacency.safetensors")
    assert loaded.k == 3 and {t: loaded.successors(t) for t in (1, 2, 3, 5)} == {t: table.successors(t) for t in (1, 2, 3, 5)}


def test_graft_settings_are_checked_in_one_line():
    from ygg_runtime.errors import YggError

    for bad in ({"length": 0}, {"max_n": 9}, {"k": 0}, {"context": [[0.5]]}, {"colour": 1}):
        with pytest.raises(YggError):
            GraftParams.from_dict(bad)


def test_retrieval_values_are_measured_on_the_targets_continuations():
    """graft_values labels what retrieval would have proposed along each continuation: text that
    copies its prompt makes long matches valuable, text that never repeats leaves the prior, and the
    shipped adjacency table holds the continuations' successors only."""
    from ygg_compile.calibrate import Calibration, graft_values

    rng = random.Random(5)
    copying, fresh = {}, {}  # prompt -> its tokens and the continuation
    for i in range(6):
        prompt = rng.sample(range(1000), 40)
        copying[i] = prompt + prompt[10:40]  # the answer copies a span of its prompt
        fresh[i] = prompt + [1000 + 40 * i + j for j in range(30)]  # tokens seen nowhere before
    lengths = {i: 40 for i in range(6)}
    copied = graft_values(Calibration([], 6, 180, 0.0, copying, lengths))
    unseen = graft_values(Calibration([], 6, 180, 0.0, fresh, lengths))
    long_match = copied.values["context"][3]  # n = 4
    assert all(pos[0] > 0.9 for pos in long_match[1:])  # deep in a copied span: nearly certain
    assert copied.hits > 0.8 * copied.tries
    prior = [p for row in prior_context() for pos in row for p in pos]
    assert unseen.hits == 0 and all(v <= p for v, p in zip([p for row in unseen.values["context"] for pos in row for p in pos], prior))
    assert set(unseen.table.rows) == {t for text in fresh.values() for t in text[39:-1]}
