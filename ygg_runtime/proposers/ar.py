"""`ar`: plain target decoding, the baseline of every speed-up (a tree that is only its root)."""

from ygg_runtime.proposers.base import Proposer, Sampling
from ygg_runtime.tree import TokenTree


class AR(Proposer):
    name = "ar"

    def propose(self, seq: list[int], sampling: Sampling | None) -> TokenTree:
        return TokenTree(seq[-1])
