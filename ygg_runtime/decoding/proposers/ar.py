"""`ar`: plain target decoding, the baseline of every speed-up (a tree that is only its root)."""

from ygg_runtime.schema.params import Params
from ygg_runtime.decoding.proposers.base import Proposer, StepState
from ygg_runtime.decoding.tree import TokenTree


class AR(Proposer):
    name = "ar"
    Params = Params  # none

    def propose(self, state: StepState) -> TokenTree:
        return TokenTree(state.seq[-1])
