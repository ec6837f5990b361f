"""The latency-aware objective (docs/design.md, "The objective"), the one place every plan choice asks:

    speedup = E[A] · T_verify(1) / (Σ_rounds T_draft(W_draft) + T_verify(W_verify) + T_other)

E[A] is tokens per step (bonus included); the T's are measured forwards (`ygg_compile.latency`)
read off the plan's profile. Plain decoding is E[A] = 1 with one W = 1 verify: speed-up 1.

Over a whole request (`request_ms`): the prompt's prefill — the target's, and the drafter's where
the method drafts — in forwards of MAX_ROWS tokens at their contexts, then the new tokens at the
step's modelled time per token: what the runtime weighs when it picks a request's method.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from ygg_runtime.options import MAX_ROWS
from ygg_runtime.transfer import to_device
# a step's forwards: its method's parameters' (`Params.step_shape`)
from ygg_runtime.schema.params import StepShape, fit_width
from ygg_runtime.schema.plan import OutputLength, Profile


class Curves:
    """Measured T_verify(W), T_draft(W) and T_other(W) in ms (`ygg_compile.latency`): linear between
    measured widths (beyond the last one extrapolated from the last two: wide forwards grow linearly
    once compute-bound) and between measured context lengths (clamped at both ends). `context` is
    the length used when a call does not name one."""

    def __init__(self, profile: Profile | dict, context: int | None = None):
        if isinstance(profile, dict):  # as `ygg_compile.latency.combine` makes it
            profile = Profile.from_dict(profile)
        self.widths = list(profile.widths)
        self.contexts = list(profile.contexts)
        self.target_ms = [list(row) for row in profile.target_ms]
        self.draft_ms = [list(row) for row in profile.draft_ms]
        self.other = list(profile.other_ms or [0.0] * len(self.widths))  # per verify width
        self.context = context if context is not None else self.contexts[0]
        # The widths each model's forwards are padded to (all measured ones until compile picks).
        self.target_widths = tuple(profile.compiled_widths("target"))
        self.draft_widths = tuple(profile.compiled_widths("draft"))
        # f(B, c, n) / T(n) of a forward over B sequences (`ygg_compile.latency.batch_times`);
        # absent from profiles measured before batching: then taken as 1.
        self.batch = {role: profile.batch(role) for role in ("target", "draft")}
        self.share = 1  # see shared()
        self._costs: dict[tuple[int, tuple[StepShape, ...]], StepCosts] = {}  # see costs(); views share it
        self._memo: dict[tuple, float] = {}  # _at's answers (shared with the `shared` views: the same curves)

    def shared(self, sequences: int) -> "Curves":
        """These curves as one sequence's share of a batch of `sequences` that all run the same
        step shape: a forward of w tokens costs f(B, B·w) / B. What CAST's rule amounts to for a
        symmetric batch — the batch's tokens per ms is B·E[A] / f(B, B·w), so each sequence weighs
        its depth and width against its share — and as B grows the share of a wide tree grows
        faster than plain decoding's, so the same objective code picks smaller trees under load."""
        if sequences <= 1:
            return self
        view = copy.copy(self)
        view.share = sequences
        return view

    def costs(self, shapes: tuple[StepShape, ...]) -> "StepCosts":
        """The shapes' times at any context (`StepCosts`), made once per shapes and share: a step
        weighs the same few shapes every time (egt's depths, its verify widths)."""
        key = (self.share, shapes)
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = StepCosts(list(shapes), self)
        return costs

    def t_verify(self, w: int, context: int | None = None) -> float:
        if self.share > 1:
            return self.t_batch("target", self.share, self.share * w, context) / self.share
        return self._at(self.target_ms, fit_width(w, self.target_widths), context)

    def t_draft(self, w: int, context: int | None = None) -> float:
        if not self.draft_ms:
            raise ValueError("the profile has no draft model curve")
        if self.share > 1:
            return self.t_batch("draft", self.share, self.share * w, context) / self.share
        return self._at(self.draft_ms, fit_width(w, self.draft_widths), context)

    def t_batch(self, role: str, sequences: int, w: int, context: int | None = None) -> float:
        """One forward of `role` ("target" or "draft") carrying w new tokens of `sequences`
        sequences at about `context` tokens each: T(w) scaled by the measured batch factor
        (interpolated between the measured batch sizes and widths; 1 for one sequence)."""
        rows, widths = (self.target_ms, self.target_widths) if role == "target" else (self.draft_ms, self.draft_widths)
        one = self._at(rows, fit_width(w, widths), context)
        table = self.batch[role]
        if sequences <= 1 or table is None:
            return one
        measured = [(b, [(x, f) for x, f in zip(table.widths, row) if f is not None])
                    for b, row in zip(table.sequences, table.factors)]
        per_b = [(b, _interp([x for x, _ in pts], [f for _, f in pts], w)) for b, pts in measured if pts]
        if not per_b:
            return one
        factor = _interp([b for b, _ in per_b], [f for _, f in per_b], min(max(sequences, per_b[0][0]), per_b[-1][0]))
        return one * factor

    def t_other(self, w: int) -> float:
        """CPU work of a step around a verify of w nodes: tree, masks, acceptance, compaction."""
        return _interp(self.widths, self.other, w)

    def _at(self, rows: list[list[float]], w: int, context: int | None) -> float:
        """Past the longest measured context, extrapolated from the last two (a forward's attention
        reads every key before it: it grows with the context), never below the longest's time.
        Remembered per (curve, width, context): a step's choices ask for the same forwards at the
        same context many times (egt's depth choice, every step: issue 73's 50 µs)."""
        ctx = self.context if context is None else context
        key = (id(rows), w, ctx)
        got = self._memo.get(key)
        if got is not None:
            return got
        contexts = self.contexts
        if len(rows) == 1 or ctx <= contexts[0]:
            got = _interp(self.widths, rows[0], w)
        else:  # between the two measured contexts around ctx (the last two past the longest)
            i = min(max(bisect.bisect_left(contexts, ctx), 1), len(contexts) - 1)
            pair = [_interp(self.widths, rows[i - 1], w), _interp(self.widths, rows[i], w)]
            got = _interp(contexts[i - 1 : i + 1], pair, ctx)
            if ctx >= contexts[-1]:
                got = max(pair[1], got)
        if len(self._memo) > 4096:
            self._memo.clear()
        self._memo[key] = got
        return got


def undominated(widths: list[int], rows: list[list[float]]) -> list[int]:
    """The widths worth compiling: drop a width when a wider one is no slower (averaged over the
    measured contexts), so that its forwards are padded to the wider, faster one instead. On
    CPUs whose one-token matmul path is slower than the two-token one, W = 1 goes."""
    mean = [sum(col) / len(col) for col in zip(*rows)]
    return [w for i, w in enumerate(widths) if all(mean[j] > mean[i] for j in range(i + 1, len(widths)))]


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def step_ms(shape: StepShape, curves: Curves, context: int | None = None, draft_context: int | None = None) -> float:
    """Modelled wall time of one step at a context length (draft_context: the drafter's, when its
    window leaves it shorter than the target's)."""
    drafting = sum(curves.t_draft(w, context if draft_context is None else draft_context) for w in shape.draft_widths)
    return drafting + curves.t_verify(shape.verify_width, context) + curves.t_other(shape.verify_width)


def plain_ms(curves: Curves, context: int | None = None) -> float:
    """One step of plain decoding: the denominator of every speed-up."""
    return step_ms(StepShape((), 1), curves, context)


def speedup(expected_accepted: float, shape: StepShape, curves: Curves, context: int | None = None) -> float:
    """Modelled speed-up over plain decoding of a step shape that yields E[A] tokens per step."""
    return expected_accepted * plain_ms(curves, context) / step_ms(shape, curves, context)


class StepCosts:
    """Modelled ms of a fixed list of step shapes at any context (`step_ms`), read off their drafting
    and verifying times at each measured context: each is linear in the context between two measured
    ones (`Curves._at`), so a line a shape, kept per pair of segments, replaces a sum over its
    forwards — egt's depth choice runs every step, and its host time counts (issue 73: 50 µs). Past
    the longest measured context (where `Curves` clamps each forward) it sums the forwards as
    `step_ms` does."""

    def __init__(self, shapes: list[StepShape], curves: Curves):
        self.shapes, self.curves = shapes, curves
        at = curves.contexts
        self.drafting = [[sum(curves.t_draft(w, c) for w in s.draft_widths) for c in at] for s in shapes]
        self.verifying = [[curves.t_verify(s.verify_width, c) + curves.t_other(s.verify_width) for c in at]
                          for s in shapes]
        # per pair of segments (the drafter's context's, the target's): each shape's time as
        # a + b·drafter context + c + d·context, so a step costs two bisections and a line a shape
        self._lines: dict[tuple[int, int], list[tuple[float, float, float, float]]] = {}

    def at(self, context: int, draft_context: int | None = None) -> list[float]:
        """Each shape's `step_ms` at `context` (the drafter's at `draft_context`)."""
        dc = context if draft_context is None else draft_context
        at = self.curves.contexts
        if max(context, dc) > at[-1]:
            return [step_ms(s, self.curves, context, draft_context) for s in self.shapes]
        key = (_segment(at, dc), _segment(at, context))
        lines = self._lines.get(key)
        if lines is None:
            lines = self._lines[key] = [_line(at, d, key[0]) + _line(at, v, key[1])
                                        for d, v in zip(self.drafting, self.verifying)]
        return [a + b * dc + c + d * context for a, b, c, d in lines]


def _segment(xs: list[int], x: int) -> int:
    """Which piece of the measured times' line (`Curves._at`) x falls on: 0 before the first
    measured x (its value there), else the index of the measured x that ends its span."""
    return 0 if len(xs) == 1 or x <= xs[0] else min(bisect.bisect_left(xs, x), len(xs) - 1)


def _line(xs: list[int], ys: list[float], i: int) -> tuple[float, float]:
    """(intercept, slope) of the measured times ys on segment i (`_segment`)."""
    if i == 0:
        return ys[0], 0.0
    slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] - slope * xs[i - 1], slope


def spread(once_ms: float, tokens_per_step: float, remaining: int | None) -> float:
    """A one-time cost as a share of one step yielding `tokens_per_step`, spread over the `remaining`
    tokens a request may still make: switching to a way of stepping pays off over the rest of the
    request, not within one step (None: the whole cost on this step)."""
    if not once_ms:
        return 0.0
    return once_ms * tokens_per_step / remaining if remaining else once_ms


def best_depth(reach: list[float], factors: list[float], shapes: list[StepShape], curves: Curves,
               context: int | None = None, retrieved: tuple[float, int] | None = None,
               draft_context: int | None = None, costs: StepCosts | None = None, catch_up_ms: float = 0.0,
               remaining: int | None = None) -> int:
    """The depth D in 0..len(shapes) - 1 with the most tokens per modelled ms, given the depth
    predictor's reach[d - 1] = P(accepted length >= d). A step of depth D yields
    1 + factors[D] · Σ_{d ≤ D} reach[d - 1] tokens: a deep tree accepted to length A yields min(A, D)
    from a depth-D tree, and factors[D] (measured on calibration, `ygg_compile.calibrate`) scales
    that for the narrower tree the runtime grows. shapes[D] is a depth-D step (shapes[0] plain).
    retrieved: (E[A], verify width) of a retrieval-only step, which then is depth 0's option (no
    drafter forward) in place of plain decoding. draft_context: the drafter's, when a window leaves
    it shorter than the target's. costs: `StepCosts` of these shapes, to read their times from.
    catch_up_ms: what drafting costs once more before its first step (a drafter behind after steps
    that skipped it), spread over the `remaining` tokens the request may make (`spread`)."""
    zero = shapes[0] if retrieved is None else StepShape((), retrieved[1])
    best, rate = 0, (1.0 if retrieved is None else retrieved[0]) / step_ms(zero, curves, context)
    ms = costs.at(context if context is not None else curves.context, draft_context) if costs is not None else None
    reached = 0.0
    for d in range(1, len(shapes)):
        reached += reach[d - 1]
        tokens = 1.0 + factors[d] * reached
        t = ms[d] if ms is not None else step_ms(shapes[d], curves, context, draft_context)
        r = tokens / (t + spread(catch_up_ms, tokens, remaining))
        if r > rate:
            best, rate = d, r
    return best


def prefill_ms(curves: Curves, role: str, tokens: int, start: int = 0) -> float:
    """Modelled time of feeding `tokens` prompt tokens to `role` ("target" or "draft") after
    `start` committed, in the runner's forwards of at most MAX_ROWS tokens (`runner.PREFILL_CHUNK`),
    each at its own context."""
    forward = curves.t_verify if role == "target" else curves.t_draft
    total, at, end = 0.0, start, start + tokens
    while at < end:
        w = min(MAX_ROWS, end - at)
        total += forward(w, at)
        at += w
    return total


@dataclass(frozen=True)
class RequestCost:
    """A request's modelled wall time, in ms: its prompt's prefill, then its new tokens."""

    prefill_ms: float
    decode_ms: float

    @property
    def ms(self) -> float:
        return self.prefill_ms + self.decode_ms


def request_ms(shape: StepShape, tokens_per_step: float, prompt: int, new: int, curves: Curves,
               window: int | None = None) -> RequestCost:
    """A request of `prompt` tokens and `new` new ones decoded in steps of `shape` yielding
    `tokens_per_step`: the target's prefill, the drafter's when the shape drafts (of the last
    `window` prompt tokens when it has one), and new / tokens_per_step steps at the context halfway
    through the output (the drafter's own, shorter with a window)."""
    seen = min(prompt, window) if window else prompt
    prefill = prefill_ms(curves, "target", prompt) + (prefill_ms(curves, "draft", seen) if shape.draft_widths else 0.0)
    return RequestCost(prefill, new / tokens_per_step * step_ms(shape, curves, prompt + new // 2, seen + new // 2))


def expected_tokens(length: OutputLength | None, budget: int) -> int:
    """The tokens a request with `budget` new tokens is expected to make: E[min(L, budget)] for an
    answer length L with a constant chance h a token to be the last, h fitted to calibration's
    answers (`Plan.output_length`) by maximum likelihood with the answers still running at
    calibration's budget counted as censored there: h = answers that ended / answer tokens seen.
    E[min(L, B)] = (1 - (1 - h)^B) / h. No answer ended (or nothing measured): the whole budget."""
    if length is None or length.ended <= 0 or length.tokens <= 0 or budget <= 0:
        return budget
    h = min(1.0, length.ended / length.tokens)
    return max(1, min(budget, round((1.0 - (1.0 - h) ** budget) / h)))


def windowed_tokens_per_step(tokens_per_step: float, kept: float) -> float:
    """Tokens per step of a drafter that reads a window keeping `kept` of the whole prompt's
    per-token acceptance (`Plan.draft_window`): the drafted part of a step (all but the bonus token)
    scaled by it — first order in 1 − kept, which is small wherever a window is worth choosing."""
    return 1.0 + (tokens_per_step - 1.0) * min(1.0, max(0.0, kept))


def break_even(shape: StepShape, curves: Curves, context: int | None = None) -> float:
    """The E[A] a step shape needs to match plain decoding (speed-up 1)."""
    return step_ms(shape, curves, context) / plain_ms(curves, context)


class AcceptanceMap:
    """P(a drafted child is accepted | its parent was) as a function of its draft probability,
    learnt on calibration text (`ygg_compile.calibrate`); the identity q ↦ q until calibrated.
    Monotone and within [0, 1], so path values only decrease along a path."""

    def __init__(self, points: list[list[float]] | None = None):
        pts = sorted(points or [[0.0, 0.0], [1.0, 1.0]])
        self.qs = [float(q) for q, _ in pts]
        self.accept = [min(1.0, max(0.0, float(a))) for _, a in pts]
        self._on: tuple[Tensor, Tensor] | None = None  # qs and accept on the device `on` last ran on

    def __call__(self, q: float) -> float:
        if q <= self.qs[0]:
            return self.accept[0]
        if q >= self.qs[-1]:
            return self.accept[-1]
        return _interp(self.qs, self.accept, q)

    def on(self, q: Tensor) -> Tensor:
        """The map of float64 draft probabilities on their device, bit for bit the host's: the same
        segment (`bisect_left`) and the same operations in the same order, each rounded as Python
        rounds it."""
        if self._on is None or self._on[0].device != q.device:
            self._on = tuple(to_device(v, q.device, torch.float64) for v in (self.qs, self.accept))
        xs, ys = self._on
        if len(xs) == 1:
            return ys[0].expand_as(q).clone()
        i = torch.searchsorted(xs, q, side="left").clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        inside = (y0 + (y1 - y0) * (q - x0) / (x1 - x0)).clamp(min=0.0)
        return torch.where(q <= xs[0], ys[0], torch.where(q >= xs[-1], ys[-1], inside))
