"""Gumbel-max coupled sampling (Daliri, Musco and Suresh, "Coupling without Communication and
Drafter-Invariant Speculative Decoding", 2024): the token at sequence position t is

    argmax_x  log p_t(x) + g_t(x),   g_t = Gumbel noise over the vocabulary keyed by (seed, t),

an exact sample of p_t (the Gumbel-max trick) that depends on nothing but p_t and the noise. Plain
decoding computes it once per position; speculation computes it at every node it verifies and
accepts a child exactly when its token is that choice. So every method, with any tree, alone or in
any batch, prints the tokens `ar` prints with the same seed. The drafter proposes with the same
noise (its candidates are the top of log q + g_t), which is what makes its guesses agree.

The noise comes from Philox, a counter-based generator, keyed by (seed, position): no state is
carried from one position to the next, so a position's noise is the same whichever step, tree or
batch first needs it. It is made where the logits are: on a CPU by numpy's Philox keyed by the
128-bit (seed, position); on a GPU by torch's Philox on the device, seeded with a 64-bit mix of the
two, so no noise crosses to the device (a GPU's noise is its own: the same seed gives the same
tokens for every method and batch on that machine, not the CPU's tokens).
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
from torch import Tensor

from ygg_runtime.decoding.accept import warp
from ygg_runtime.decoding.select import first_max
from ygg_runtime.transfer import read_top, to_host


class Noise:
    """One generation's Gumbel noise, by sequence position (cached until the position is decided)."""

    def __init__(self, seed: int | None):
        self.seed = secrets.randbits(63) if seed is None else seed
        self._cache: dict[int, Tensor] = {}  # by position, float64 (the target's choice)
        self._cache32: dict[int, Tensor] = {}  # ... and float32 (a drafter's guesses)

    def at(self, position: int, vocab: int, device: torch.device | str = "cpu") -> Tensor:
        """g_t [vocab] float64 on `device`: -log E, E ~ Exp(1) from Philox keyed by (seed, position)."""
        device = torch.device(device)
        g = self._cache.get(position)
        if g is None or g.shape[0] != vocab or g.device != device:
            if device.type == "cpu":
                rng = np.random.Generator(np.random.Philox(key=(self.seed << 64) | position))
                e = torch.from_numpy(rng.standard_exponential(vocab))
            else:
                gen = torch.Generator(device=device)
                gen.manual_seed(_mix(self.seed, position))
                e = torch.empty(vocab, dtype=torch.float64, device=device).exponential_(generator=gen)
            # E == 0 (probability ~2^-64 per token) would give g = inf, and inf + (-inf) is NaN
            g = -e.clamp_min(np.finfo(np.float64).tiny).log()
            self._cache[position] = g
        return g

    def at32(self, position: int, vocab: int, device: torch.device | str = "cpu") -> Tensor:
        """g_t in float32, for a drafter's guesses (kept beside the float64 noise)."""
        g = self._cache32.get(position)
        if g is None or g.shape[0] != vocab or g.device != torch.device(device):
            g = self._cache32[position] = self.at(position, vocab, device).float()
        return g

    def choose(self, logits: Tensor, position: int, temperature: float, top_p: float) -> int:
        """The target's token at `position` from its logits row [V]: argmax of log p + g, an exact
        sample of p."""
        g = self.at(position, logits.shape[-1], logits.device)
        return int(to_host(first_max(keys(logits, temperature, top_p, g)[None])[0]))

    def choices(self, logits: Tensor, positions: list[int], temperature: float) -> Tensor:
        """`choose` for every row of logits [n, V] (row i at positions[i]), on the device for one
        read, without a nucleus: log p + g is then elementwise, so a row's choice has the bits it
        has alone."""
        g = torch.stack([self.at(p, logits.shape[-1], logits.device) for p in positions])
        return first_max(keys(logits, temperature, 1.0, g))

    def candidates(self, logits: Tensor, positions: list[int], k: int, temperature: float,
                   top_p: float) -> list[tuple[list[float], list[int]]]:
        """A drafter's k guesses at the target's choice at each of `positions`, from its logits rows
        [n, V] (read in one transfer): the top k of log q + g (the first is the drafter's own
        Gumbel-max sample). Each is valued as its rank's draft probability (q sorted), the chance a
        greedy drafter's rank-r child has: the noise reorders the tokens, and the q of the token it
        lifted to the top says little about whether the target agrees."""
        k = min(k, logits.shape[-1])  # past q's support, the ruled-out tokens follow, valued 0
        g = torch.stack([self.at32(p, logits.shape[-1], logits.device) for p in positions])
        # in float32: a guess needs no exactness (the target's choice decides), and it is cheaper
        if top_p == 1.0:
            log_q = torch.log_softmax(logits.float() / temperature, -1)  # -inf where q is 0
        else:
            q = warp(logits, temperature, top_p).float()
            log_q = torch.where(q > 0, q.log(), float("-inf"))
        return read_top(log_q.topk(k).values.exp(), (log_q + g).topk(k).indices)

    def forget(self, before: int) -> None:
        """Drop the noise of positions before `before`: the sequence holds their tokens now."""
        for cache in (self._cache, self._cache32):
            for t in [t for t in cache if t < before]:
                del cache[t]


def _mix(seed: int, position: int) -> int:
    """A 64-bit seed for (seed, position): splitmix64's finaliser over the two, so nearby seeds and
    positions give unrelated streams."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def keys(logits: Tensor, temperature: float, top_p: float, gumbel: Tensor) -> Tensor:
    """log p(x) + g(x) up to a constant, p = logits at the temperature within the top_p nucleus;
    -inf where p is 0. One row [V]; computed the same way for the target's choice in every method,
    so a row with the same bits gives the same token."""
    if top_p < 1.0:
        p = warp(logits, temperature, top_p)
        return torch.where(p > 0, p.log() + gumbel, float("-inf"))
    # log softmax minus its constant, so the argmax is the same; -inf (a row a cut head lacks)
    # stays -inf, the noise being finite
    return logits.double() / temperature + gumbel

