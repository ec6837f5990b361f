"""Retrieval sources: tokens a step can propose without a drafter forward (issue 19, Graft):
`ContextIndex` (prompt lookup over the generation) and `AdjacencyTable` (Graft's top-k successors
per token).

`ContextIndex` is prompt lookup over one generation's own tokens (prompt and output): for the
longest n-gram (n = max_n down to min_n) that ends the sequence and occurred before, the tokens that
followed its earlier occurrences. transformers' `prompt_lookup_num_tokens` copies after the first
match of a linear scan; this keeps, for every n-gram, the positions where it ended (the latest
`keep` of them), so a lookup is max_n dictionary reads whatever the length of the context, and the
index grows by max_n entries per accepted token. Several matches give several continuations, merged
where they share a prefix and counted, which is what a retrieved subtree needs. On this CPU indexing
a 2 200-token prompt takes ~4 ms and a step (3 accepted tokens, one lookup) ~15 µs.

Not yet used by a method: grafting into `egt` and the `pld` method come next (issue 19).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Continuation:
    tokens: list[int]  # what followed an earlier occurrence of the matched suffix
    count: int  # how many earlier occurrences (of those kept) it continued, at least its first token
    match: int  # the length of the matched suffix (n)


class ContextIndex:
    def __init__(self, max_n: int = 4, min_n: int = 1, keep: int = 8):
        if not 1 <= min_n <= max_n or keep < 1:
            raise ValueError("ContextIndex needs 1 <= min_n <= max_n and keep >= 1")
        self.max_n, self.min_n, self.keep = max_n, min_n, keep
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after it (latest last)

    def reset(self, tokens: list[int] = ()) -> None:
        self.tokens, self.ends = [], {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append accepted tokens; every n-gram they complete is indexed by the position after it."""
        seq, ends, cap = self.tokens, self.ends, self.keep + 1  # + the sequence's own end
        for t in tokens:
            seq.append(t)
            end = len(seq)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                slot = ends.setdefault(tuple(seq[end - n : end]), [])
                slot.append(end)
                if len(slot) > cap:
                    del slot[0]

    def lookup(self, length: int, limit: int = 4) -> list[Continuation]:
        """Up to `limit` distinct continuations of at most `length` tokens after the longest
        suffix of the sequence seen before, most frequent first (then the most recent); [] when
        no suffix of min_n or more tokens occurred earlier."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            starts = [p for p in self.ends.get(tuple(self.tokens[end - n :]), ()) if p < end]
            if not starts:
                continue
            found: dict[tuple[int, ...], list[int]] = {}  # continuation -> [count, latest start]
            for p in starts:
                cont = tuple(self.tokens[p : min(p + length, end)])
                if cont:
                    entry = found.setdefault(cont, [0, p])
                    entry[0] += 1
                    entry[1] = max(entry[1], p)
            if not found:
                continue
            first = {}  # continuations sharing a first token share its count
            for cont, (c, _) in found.items():
                first[cont[0]] = first.get(cont[0], 0) + c
            ranked = sorted(found.items(), key=lambda kv: (-first[kv[0][0]], -kv[1][0], -kv[1][1]))
            return [Continuation(list(cont), first[cont[0]], n) for cont, _ in ranked[:limit]]
        return []


class AdjacencyTable:
    """Graft's token adjacency: for every token, up to k successors the target chose after it,
    ranked by count. Counted with Space-Saving (Metwally et al.): a row keeps k counters; a new
    successor takes the smallest counter's place at that count + 1, so every successor that followed
    a token more than 1/k of the time is kept, whatever the stream. Seeded at compile time from the
    target's own continuations of the calibration text, updated online from every verify (each
    verified node tells which token the target wants after it); a row is a dict, so memory grows
    with the tokens seen, not the vocabulary."""

    def __init__(self, k: int = 4):
        if k < 1:
            raise ValueError("AdjacencyTable needs k >= 1")
        self.k = k
        self.rows: dict[int, dict[int, int]] = {}  # token -> {successor: count}

    def observe(self, token: int, successor: int) -> None:
        row = self.rows.setdefault(token, {})
        if successor in row:
            row[successor] += 1
        elif len(row) < self.k:
            row[successor] = 1
        else:
            least = min(row, key=row.__getitem__)
            row[successor] = row.pop(least) + 1

    def observe_sequence(self, tokens: list[int]) -> None:
        for a, b in zip(tokens, tokens[1:]):
            self.observe(a, b)

    def successors(self, token: int) -> list[tuple[int, int]]:
        """(successor, count), the most counted first (ties: the smaller token id, for determinism)."""
        return sorted(self.rows.get(token, {}).items(), key=lambda kv: (-kv[1], kv[0]))

    def to_lists(self) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """(tokens, successors, counts) with rows padded by -1 / 0: what the artifact stores."""
        tokens = sorted(self.rows)
        succ = [[s for s, _ in self.successors(t)] + [-1] * (self.k - len(self.rows[t])) for t in tokens]
        counts = [[c for _, c in self.successors(t)] + [0] * (self.k - len(self.rows[t])) for t in tokens]
        return tokens, succ, counts

    @classmethod
    def from_lists(cls, k: int, tokens: list[int], succ: list[list[int]], counts: list[list[int]]) -> "AdjacencyTable":
        table = cls(k)
        for t, ss, cs in zip(tokens, succ, counts):
            table.rows[t] = {s: c for s, c in zip(ss, cs) if s >= 0}
        return table
