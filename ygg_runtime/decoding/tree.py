"""The token tree: what a proposer drafts and the target verifies in one forward.

Node 0 is the root, the last accepted token (its KV is not in the target cache yet). Every other
node is a drafted token whose parent is an earlier node, so node order is a topological order and
a node's tree slot is its index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

# How children were chosen, which decides the lossless acceptance rule (see accept.py):
#   "iid": each child sampled independently from the parent's draft distribution q;
#   "without_replacement": children sampled from q one after another without replacement;
#   "deterministic": children picked by rank (top-k), not sampled.
ChildRule = Literal["iid", "without_replacement", "deterministic"]

# Where a node came from (`TokenTree.sources`): the drafter, or retrieval (`ygg_runtime.decoding.retrieval`)
# from the generation's own context or the adjacency table. A retrieved token the drafter also drafted
# is one node, counted as drafted.
DRAFT, CONTEXT, ADJACENCY = 0, 1, 2
SOURCES = ("draft", "context", "adjacency")


@dataclass
class TokenTree:
    root_token: int
    child_rule: ChildRule = "deterministic"
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    draft_probs: list[float] = field(default_factory=list)  # q(token | parent path)
    path_values: list[float] = field(default_factory=list)  # product of draft probs along the path
    # P(accepted | parent accepted) as calibration prices the node, before the request's estimate
    # scales it (`ygg_runtime.decoding.estimate`): what that estimate compares outcomes with.
    accepts: list[float] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # DRAFT, CONTEXT or ADJACENCY per node (the root: DRAFT)
    # Draft distribution q at a node whose children were sampled from it (sampling rules only).
    draft_dists: dict[int, Tensor] = field(default_factory=dict)
    verify_width: int = 0  # pad the target's forward to this compiled width (0: exactly len(tree))
    origin: list[int] | None = None  # for a pruned tree: each node's index in the tree it came from

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens, self.parents, self.depths = [self.root_token], [-1], [0]
            self.draft_probs, self.path_values, self.children, self.sources = [1.0], [1.0], [[]], [DRAFT]
            self.accepts = [1.0]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, prob: float, accept: float | None = None, source: int = DRAFT,
            scale: float = 1.0) -> int:
        """A child of `parent` drafted with probability `prob` (retrieved: 0); `accept` is its
        estimated chance of being accepted once its parent is (the draft probability itself when
        not given), `scale` what this request's estimate makes of that chance (capped at 1)."""
        node = len(self.tokens)
        accept = prob if accept is None else accept
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.draft_probs.append(prob)
        self.accepts.append(accept)
        self.path_values.append(self.path_values[parent] * min(1.0, accept * scale) if scale != 1.0 else
                                self.path_values[parent] * accept)
        self.children.append([])
        self.children[parent].append(node)
        self.sources.append(source)
        return node

    def child(self, parent: int, token: int) -> int | None:
        """The child of `parent` carrying `token`, if there is one."""
        return next((c for c in self.children[parent] if self.tokens[c] == token), None)

    def subtree(self, nodes: list[int]) -> "TokenTree":
        """The tree made of `nodes` (root-connected, ascending), children kept in their order;
        `origin` maps its nodes back to this tree's."""
        if self.draft_dists:
            raise ValueError("only trees with deterministic children can be pruned")
        new = {old: i for i, old in enumerate(nodes)}
        sub = TokenTree(self.root_token, self.child_rule, origin=list(nodes))
        for old in nodes[1:]:
            parent = self.parents[old]
            node = sub.add(new[parent], self.tokens[old], self.draft_probs[old], self.accepts[old], self.sources[old])
            sub.path_values[node] = self.path_values[old]
        return sub

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> Tensor:
        """[n, n] bool: entry (i, j) is True when j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]
        return mask
