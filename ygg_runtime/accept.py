"""The acceptance rule every method uses (docs/design.md, "The lossless rules"), greedy and lossless sampling.

Walk down from the root; at each node try its children in order; the first accepted child becomes
the node; when none is accepted the bonus token comes from the target (its argmax, or a sample from
what the rejections left of p). The sampling rules keep the output distribution exactly p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ygg_runtime.tree import TokenTree


@dataclass
class Verdict:
    path: list[int]  # accepted nodes from the root (node 0) down
    bonus: int  # the target's own next token after the path

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted (the root is not a draft)."""
        return len(self.path) - 1


def warp(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """Sampling distribution(s) for logits [..., V] at a temperature > 0 with nucleus top_p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept_greedy(tree: TokenTree, logits: Tensor) -> Verdict:
    """logits [n, V] of the target at every tree node."""
    best = logits.argmax(-1).tolist()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == best[node]), None)
        if nxt is None:
            return Verdict(path, best[node])
        node = nxt
        path.append(node)


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
