"""Retrieval: tokens a step can propose without a drafter forward (Graft, "Draft Less, Retrieve
More"). Two sources, `ContextIndex` (prompt lookup over the generation) and `AdjacencyTable`
(Graft's top-k successors per token), and `Retriever`, which hangs what they find into a token tree
with calibrated path values, so that verification pruning weighs retrieved and drafted nodes on
equal terms (`egt` grafts into its drafted tree, `pld` verifies retrieval alone).

`ContextIndex` is prompt lookup over one generation's own tokens (prompt and output): for the
longest n-gram (n = max_n down to min_n) that ends the sequence and occurred before, the tokens that
followed its earlier occurrences. transformers' `prompt_lookup_num_tokens` copies after the first
match of a linear scan; this keeps, for every n-gram, the positions where it ended (the latest
`keep` of them), so a lookup is max_n dictionary reads whatever the length of the context, and the
index grows by max_n entries per accepted token. Several matches give several continuations, merged
where they share a prefix and counted, which is what a retrieved subtree needs. On this CPU indexing
a 2 200-token prompt takes ~4 ms and a step (3 accepted tokens, one lookup) ~15 µs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ygg_runtime.decoding import prune
from ygg_runtime.errors import YggError
from ygg_runtime.schema.params import MAX_N, POSITIONS, GraftParams
from ygg_runtime.decoding.estimate import Estimate
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.decoding.tree import ADJACENCY, CONTEXT, TokenTree


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

    def lookup(self, length: int, limit: int = 4, path: list[int] = ()) -> list[Continuation]:
        """Up to `limit` distinct continuations of at most `length` tokens after the longest
        suffix of the sequence (followed by `path`, tokens not accepted yet: a tree node's) seen
        before, most frequent first (then the most recent); [] when no suffix of min_n or more
        tokens occurred earlier."""
        end = len(self.tokens)
        tail = (self.tokens[max(0, end - self.max_n):] + list(path))[-self.max_n:]
        for n in range(len(tail), self.min_n - 1, -1):
            starts = [p for p in self.ends.get(tuple(tail[len(tail) - n:]), ()) if p < end][-self.keep:]
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

    def copy(self) -> "AdjacencyTable":
        table = AdjacencyTable(self.k)
        table.rows = {t: dict(row) for t, row in self.rows.items()}
        return table

    def save(self, path: Path) -> None:
        tokens, succ, counts = self.to_lists()
        save_file({"tokens": torch.tensor(tokens, dtype=torch.int64).reshape(-1),
                   "successors": torch.tensor(succ, dtype=torch.int64).reshape(-1, self.k),
                   "counts": torch.tensor(counts, dtype=torch.int64).reshape(-1, self.k)}, str(path))

    @classmethod
    def load(cls, path: Path) -> "AdjacencyTable":
        try:
            t = load_file(str(path))
            return cls.from_lists(t["successors"].shape[1], t["tokens"].tolist(), t["successors"].tolist(),
                                  t["counts"].tolist())
        except (OSError, SafetensorError, KeyError, IndexError) as e:
            raise YggError(f"cannot read the adjacency table {path}: {e}") from None


# Uncalibrated P(a retrieved token is accepted | its parent was), used until compile measures them on
# the target's own continuations (`ygg_compile.calibrate.graft_values`): a longer match, a later
# position in a copied run and a continuation seen twice each make a copy likelier; an adjacency
# successor is a guess from one token of context.
def prior_context() -> list[list[list[float]]]:
    return [[[round(min(0.9, 0.1 + 0.1 * n + 0.1 * i + 0.1 * c), 2) for c in range(2)] for i in range(POSITIONS)]
            for n in range(1, MAX_N + 1)]


PRIOR_ADJACENCY = [[0.2, 0.4], [0.08, 0.15], [0.04, 0.08], [0.02, 0.04]]  # [rank][later in the chain]


def context_cell(cont: Continuation, position: int) -> tuple[int, int, int]:
    """The value table cell of a continuation's token at `position`: what the runtime reads and
    calibration counts, by one rule."""
    return min(cont.match, MAX_N) - 1, min(position, POSITIONS - 1), int(cont.count > 1)


def adjacency_cell(rank: int, depth: int) -> tuple[int, int]:
    """The adjacency table's cell of a successor of this rank, `depth` steps down the chain."""
    return rank, int(depth > 0)


class Retriever:
    """One generation's retrieval: the context index over its tokens, and the adjacency table
    (the artifact's seed, updated with every token the target chose in this generation)."""

    def __init__(self, params: GraftParams, seed: AdjacencyTable | None = None):
        self.params = params
        self.seed = seed if seed is not None else AdjacencyTable(params.k)
        self.index = ContextIndex(params.max_n, params.min_n)
        self.table = self.seed
        self.context = params.context or prior_context()
        self.adjacency = params.adjacency or PRIOR_ADJACENCY
        self.prompt = 0
        self.seconds = 0.0  # spent indexing and retrieving since the last `take_seconds`
        # the root's continuations at an index length: a step looks them up for its retrieval-only
        # tree and again when it grafts into its drafted one
        self._root: tuple[int, list[Continuation]] | None = None

    def reset(self, tokens: list[int]) -> None:
        """A new generation over a prompt (all but its last token, as proposers see it)."""
        t = time.perf_counter()
        self.index.reset(tokens)
        self._root = None
        self.table = self.seed.copy()  # online updates stay within one generation
        self.prompt = len(tokens) + 1  # the root, the prompt's last token, arrives with the first step
        self.seconds += time.perf_counter() - t

    def sync(self, seq: list[int]) -> None:
        """Index what was accepted since the last step; the target chose every token after the
        prompt, so each of those pairs also updates the adjacency table."""
        t = time.perf_counter()
        have = len(self.index.tokens)
        self.index.extend(seq[have:])
        for i in range(max(have, self.prompt), len(seq)):
            self.table.observe(seq[i - 1], seq[i])
        self.seconds += time.perf_counter() - t

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def graft(self, tree: TokenTree, under: list[int] = (), estimate: Estimate | None = None) -> int:
        """Hang retrieved continuations into `tree`: the context's under the root and under each
        node of `under` (its root path continues the sequence), then the adjacency chain under the
        root. A retrieved token already in the tree at that place is that node (its value raised
        to the retrieved one when higher); new ones get the calibrated path values. Returns the
        nodes added (at most `budget`). estimate: the request's, which scales those values."""
        t = time.perf_counter()
        p, added = self.params, 0
        for node in (0, *under):
            for cont in self._lookup(tree, node):
                parent = node
                for i, token in enumerate(cont.tokens):
                    n, pos, twice = context_cell(cont, i)
                    parent, new = self._place(tree, parent, token, self.context[n][pos][twice], CONTEXT, added, estimate)
                    if parent is None:
                        break
                    added += new
        parent = 0
        for depth in range(p.adjacency_depth):
            successors = self.table.successors(tree.tokens[parent])
            if not successors:
                break
            first = None
            for rank, (token, _) in enumerate(successors):
                r, later = adjacency_cell(rank, depth)
                node, new = self._place(tree, parent, token, self.adjacency[r][later], ADJACENCY, added, estimate)
                added += new
                if rank == 0:
                    first = node
            if first is None:
                break
            parent = first
        self.seconds += time.perf_counter() - t
        return added

    def _lookup(self, tree: TokenTree, node: int) -> list[Continuation]:
        """The context's continuations after `node`'s root path (the root's kept for the step)."""
        p = self.params
        if node:
            return self.index.lookup(p.length, p.limit, [tree.tokens[v] for v in tree.path_to(node)[1:]])
        if self._root is None or self._root[0] != len(self.index.tokens):
            self._root = (len(self.index.tokens), self.index.lookup(p.length, p.limit))
        return self._root[1]

    def alone(self, root: int, verify_widths: tuple[int, ...], curves: Curves | None,
              context: int, estimate: Estimate | None = None) -> tuple[TokenTree, TokenTree]:
        """A retrieval-only step (no drafter forward): the whole retrieved tree under `root`, and
        the part of it worth verifying (`prune.verified` with no drafting to pay for)."""
        tree = TokenTree(root, child_rule="deterministic")
        self.graft(tree, (), estimate)
        return tree, prune.verified(tree, verify_widths, curves, (), context)

    def _place(self, tree: TokenTree, parent: int, token: int, accept: float, source: int, added: int,
               estimate: Estimate | None) -> tuple[int | None, int]:
        """(the node for `token` under `parent`, 1 if it is new); (None, 0) when the budget is spent."""
        scale = estimate.scale(source, tree.depths[parent] + 1) if estimate is not None else 1.0
        node = tree.child(parent, token)
        if node is not None:
            tree.accepts[node] = max(tree.accepts[node], accept)
            tree.path_values[node] = max(tree.path_values[node], tree.path_values[parent] * min(1.0, accept * scale))
            return node, 0
        if added >= self.params.budget:
            return None, 0
        return tree.add(parent, token, 0.0, accept, source, scale), 1
