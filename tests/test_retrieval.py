"""Prompt lookup over a generation's own tokens (ygg_runtime.retrieval) against a linear scan."""

import random

import pytest

from ygg_runtime.retrieval import ContextIndex


def scan(tokens, max_n, min_n, keep, length, limit):
    """The reference: for the longest suffix seen before, every earlier occurrence (the latest
    `keep`), what followed it, merged and ranked as the index documents."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
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

    from ygg_runtime.retrieval import AdjacencyTable

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
    from ygg_runtime.retrieval import AdjacencyTable

    table = AdjacencyTable(k=3)
    table.observe_sequence([1, 2, 1, 2, 1, 3, 4, 5])
    assert table.successors(1) == [(2, 2), (3, 1)] and table.successors(9) == []
    again = AdjacencyTable.from_lists(3, *table.to_lists())
    assert again.rows == table.rows
    with pytest.raises(ValueError):
        AdjacencyTable(0)
