"""The latency-aware objective of DESIGN.md §2, the one place every plan choice asks:

    speedup = E[A] · T_verify(1) / (Σ_rounds T_draft(W_draft) + T_verify(W_verify) + T_other)

E[A] is tokens per step (bonus included); the T's are measured forwards (`ygg_compile.profile`)
read off the plan's profile. Plain decoding is E[A] = 1 with one W = 1 verify: speed-up 1.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What one step of a method costs in forwards: drafter widths in order, then one verify."""

    draft_widths: tuple[int, ...]
    verify_width: int  # tree nodes scored by the target, root included


class Curves:
    """Measured T_verify(W) and T_draft(W) in ms, linear between measured widths (and beyond the
    last one, extrapolated from the last two: wide forwards grow linearly once compute-bound)."""

    def __init__(self, profile: dict):
        self.widths = list(profile["widths"])
        self.target_ms = list(profile["target_ms"])
        self.draft_ms = list(profile.get("draft_ms") or [])
        self.other_ms = float(profile.get("other_ms", 0.0))  # per-step CPU work, once measured

    def t_verify(self, w: int) -> float:
        return _interp(self.widths, self.target_ms, w)

    def t_draft(self, w: int) -> float:
        if not self.draft_ms:
            raise ValueError("the profile has no draft model curve")
        return _interp(self.widths, self.draft_ms, w)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def step_ms(shape: StepShape, curves: Curves) -> float:
    """Modelled wall time of one step."""
    return sum(curves.t_draft(w) for w in shape.draft_widths) + curves.t_verify(shape.verify_width) + curves.other_ms


def speedup(expected_accepted: float, shape: StepShape, curves: Curves) -> float:
    """Modelled speed-up over plain decoding of a step shape that yields E[A] tokens per step."""
    return expected_accepted * curves.t_verify(1) / step_ms(shape, curves)


def break_even(shape: StepShape, curves: Curves) -> float:
    """The E[A] a step shape needs to match plain decoding (speed-up 1)."""
    return step_ms(shape, curves) / curves.t_verify(1)
