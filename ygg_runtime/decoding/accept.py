"""The acceptance rule every method uses (docs/design.md, "The lossless rules"): greedy, coupled
sampling and rejection sampling.

Walk down from the root; at each node try its children in order; the first accepted child becomes
the node; when none is accepted the bonus token comes from the target. Greedy and coupled sampling
accept the child whose token is the target's own choice at the node (its argmax; the argmax of
log p + Gumbel noise keyed by the position, `ygg_runtime.decoding.coupling`), and the bonus is that choice:
the output is plain decoding's, token for token. Rejection sampling accepts a child with
probability min(1, p/q) and draws the bonus from what the rejections left of p. Both sampling rules
keep the output distribution exactly p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from ygg_runtime.decoding.select import first_max
from ygg_runtime.transfer import rows_at_once, to_host
from ygg_runtime.decoding.tree import TokenTree


class CoupledKeys(Protocol):
    """What the coupled rule asks of a generation's noise (`coupling.Noise`, which imports this
    module): the target's choice at every row in one go, or at one row."""

    def choices(self, logits: Tensor, positions: list[int], temperature: float) -> Tensor: ...

    def choose(self, logits: Tensor, position: int, temperature: float, top_p: float) -> int: ...


@dataclass
class Verdict:
    path: list[int]  # accepted nodes from the root (node 0) down
    bonus: int  # the target's own next token after the path
    # what the proposer asked to read with the verdict (`Proposer.with_verdict`), at the path's last
    # node: the row the next step starts from, known only once the verdict is read
    extra: list[float] | None = None

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted (the root is not a draft)."""
        return len(self.path) - 1


def warp(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """Sampling distribution(s) for logits [..., V] at a temperature > 0 with nucleus top_p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        # The nucleus lies among the likeliest tokens: sort only the top k, widening k until the
        # mass above the k-th token reaches top_p (a full sort of 150k tokens costs ~16 ms a row).
        vocab, k = probs.shape[-1], min(probs.shape[-1], 256)
        while True:
            sorted_p, idx = probs.topk(k, dim=-1) if k < vocab else probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
            if k == vocab or bool((before[..., -1] >= top_p).all()):
                break
            k = k * 16 if k * 16 < vocab // 4 else vocab
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _follow(tree: TokenTree, choice: Callable[[int], int]) -> Verdict:
    """Down the children whose token is the target's choice at their parent; the bonus is the
    choice where no child has it."""
    node, path = 0, [0]
    while True:
        best = choice(node)
        nxt = tree.child(node, best)
        if nxt is None:
            return Verdict(path, best)
        node = nxt
        path.append(node)


def accept_greedy(tree: TokenTree, logits: Tensor, extra: Tensor | None = None) -> Verdict:
    """logits [W, V] of the target at every tree node, padded to the forward's width (the tree's
    rows' argmax read in one transfer, with `extra`'s rows [W, m] when given: `Verdict.extra`)."""
    return _read(tree, first_max(logits[: len(tree)]), extra)


def _read(tree: TokenTree, choices: Tensor, extra: Tensor | None) -> Verdict:
    """The verdict from the target's choice at every tree node [n], read in one transfer together
    with the proposer's `extra` rows (the choices travel as float64, which holds them exactly)."""
    if extra is None:
        return _follow(tree, to_host(choices).__getitem__)
    rows = to_host(torch.cat([choices[:, None].double(), extra[: len(tree)].double()], 1))
    verdict = _follow(tree, lambda node: int(rows[node][0]))
    verdict.extra = rows[verdict.path[-1]][1:]
    return verdict


def accept_coupled(tree: TokenTree, logits: Tensor, noise: CoupledKeys, first: int, temperature: float,
                   top_p: float, extra: Tensor | None = None) -> Verdict:
    """logits [n, V] of the target at every tree node; first: the sequence position of the root's
    children. The target's choice at a node of depth d is argmax(log p + g) with g the noise of
    position first + d: on a GPU for every node in one read (without a nucleus the keys are
    elementwise, so each row's choice is the one it has alone); else only on the path walked (a
    row at a time, as `ar` computes it)."""
    if top_p == 1.0 and rows_at_once(logits.device):
        return _read(tree, noise.choices(logits[: len(tree)], [first + d for d in tree.depths], temperature), extra)
    verdict = _follow(tree, lambda node: noise.choose(logits[node], first + tree.depths[node], temperature, top_p))
    if extra is not None:  # no transfer to share: its own
        verdict.extra = to_host(extra[verdict.path[-1]])
    return verdict


def _normalise(p: Tensor) -> Tensor:
    total = p.sum()
    return p / total if total > 0 else p


def discard(p: Tensor, x: int) -> Tensor:
    """p without x, renormalised: what is left of a distribution once x was ruled out."""
    p[x] = 0.0
    return _normalise(p)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """What is left of p after a draft from q was rejected: norm(max(0, p - q))."""
    return _normalise(torch.clamp(p - q, min=0.0))


def accept_sampling(tree: TokenTree, target_probs: Tensor, generator: torch.Generator | None) -> Verdict:
    """target_probs [n, V]: the target's (warped) distribution at every tree node."""
    node, path = 0, [0]
    while True:
        p = target_probs[node].double().clone()
        q = tree.draft_dists[node].double().clone() if tree.child_rule != "deterministic" and tree.children[node] else None
        chosen = None
        for child in tree.children[node]:
            x = tree.tokens[child]
            u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device).item()
            if tree.child_rule == "deterministic":
                if u < p[x].item():
                    chosen = child
                    break
                p = discard(p, x)
                continue
            if u * q[x].item() < p[x].item():  # u < p(x) / q(x), without dividing by q
                chosen = child
                break
            p = residual(p, q)
            if tree.child_rule == "without_replacement":
                q = discard(q, x)
        if chosen is None:
            if p.sum() <= 0:  # p == q up to rounding: every rejection left nothing; p itself is exact
                p = target_probs[node].double()
            bonus = torch.multinomial(p, 1, generator=generator).item()
            return Verdict(path, int(bonus))
        node = chosen
        path.append(node)
