"""Gumbel-max coupled sampling (Daliri, Musco and Suresh, "Coupling without Communication and
Drafter-Invariant Speculative Decoding", 2024): the token at sequence position t is

    argmax_x  log p_t(x) + g_t(x),   g_t = Gumbel noise over the vocabulary keyed by (seed, t),

an exact sample of p_t (the Gumbel-max trick) that depends on nothing but p_t and the noise. Plain
decoding computes it once per position; speculation computes it at every node it verifies and
accepts a child exactly when its token is that choice. So every method, with any tree, alone or in
any batch, prints the tokens `ar` prints with the same seed. The drafter proposes with the same
noise (its candidates are the top of log q + g_t), which is what makes its guesses agree.

The noise comes from Philox, a counter-based generator, keyed by the 128-bit (seed, position): no
state is carried from one position to the next, so a position's noise is the same whichever step,
tree or batch first needs it.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
from torch import Tensor

from ygg_runtime.accept import warp


class Noise:
    """One generation's Gumbel noise, by sequence position (cached until the position is decided)."""

    def __init__(self, seed: int | None):
        self.seed = secrets.randbits(63) if seed is None else seed
        self._cache: dict[int, Tensor] = {}  # by position, float64 (the target's choice)
        self._cache32: dict[int, Tensor] = {}  # ... and float32 (a drafter's guesses)

    def at(self, position: int, vocab: int) -> Tensor:
        """g_t [vocab] float64: -log E, E ~ Exp(1) from Philox keyed by (seed, position)."""
        g = self._cache.get(position)
        if g is None or g.shape[0] != vocab:
            rng = np.random.Generator(np.random.Philox(key=(self.seed << 64) | position))
            e = rng.standard_exponential(vocab)
            # E == 0 (probability ~2^-64 per token) would give g = inf, and inf + (-inf) is NaN
            g = -torch.from_numpy(np.maximum(e, np.finfo(np.float64).tiny)).log()
            self._cache[position] = g
        return g

    def at32(self, position: int, vocab: int) -> Tensor:
        """g_t in float32, for a drafter's guesses (kept beside the float64 noise)."""
        g = self._cache32.get(position)
        if g is None or g.shape[0] != vocab:
            g = self._cache32[position] = self.at(position, vocab).float()
        return g

    def choose(self, logits: Tensor, position: int, temperature: float, top_p: float) -> int:
        """The target's token at `position` from its logits row [V]: argmax of log p + g, an exact
        sample of p."""
        return int(keys(logits, temperature, top_p, self.at(position, logits.shape[-1])).argmax().item())

    def candidates(self, logits: Tensor, position: int, k: int, temperature: float,
                   top_p: float) -> tuple[list[float], list[int]]:
        """A drafter's k guesses at the target's choice at `position`, from its logits row [V]: the
        top k of log q + g (the first is the drafter's own Gumbel-max sample). Each is valued as
        its rank's draft probability (q sorted), the chance a greedy drafter's rank-r child has:
        the noise reorders the tokens, and the q of the token it lifted to the top says little about
        whether the target agrees."""
        k = min(k, logits.shape[-1])  # past q's support, the ruled-out tokens follow, valued 0
        g = self.at32(position, logits.shape[-1]).to(logits.device)
        # in float32: a guess needs no exactness (the target's choice decides), and it is cheaper
        if top_p == 1.0:
            log_q = torch.log_softmax(logits.float() / temperature, -1)  # -inf where q is 0
        else:
            q = warp(logits, temperature, top_p).float()
            log_q = torch.where(q > 0, q.log(), float("-inf"))
        tokens = (log_q + g).topk(k).indices.tolist()
        return log_q.topk(k).values.exp().tolist(), tokens

    def forget(self, before: int) -> None:
        """Drop the noise of positions before `before`: the sequence holds their tokens now."""
        for cache in (self._cache, self._cache32):
            for t in [t for t in cache if t < before]:
                del cache[t]


def keys(logits: Tensor, temperature: float, top_p: float, gumbel: Tensor) -> Tensor:
    """log p(x) + g(x) up to a constant, p = logits at the temperature within the top_p nucleus;
    -inf where p is 0. One row [V]; computed the same way for the target's choice in every method,
    so a row with the same bits gives the same token."""
    if top_p < 1.0:
        p = warp(logits, temperature, top_p)
        return torch.where(p > 0, p.log() + gumbel.to(p.device), float("-inf"))
    # log softmax minus its constant, so the argmax is the same; -inf (a row a cut head lacks)
    # stays -inf, the noise being finite
    return logits.double() / temperature + gumbel.to(logits.device)

