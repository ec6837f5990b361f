"""`ar`: plain target decoding, the baseline of every speed-up (a tree that is only its root)."""

from ygg_runtime.proposers.base import Params, Proposer, Sampling, StepState
from ygg_runtime.tree import TokenTree


class AR(Proposer):
    name = "ar"
    Params = Params  # none

    def propose(self, seq: list[int], state: StepState, sampling: Sampling | None) -> TokenTree:
        return TokenTree(seq[-1])
