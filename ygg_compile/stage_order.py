"""Stage scheduling at compile time (docs/design.md, "Stages"): which of egt's stages run ahead of the verify.

Every alternative of the grid (tail draft plain or ahead × head draft plain or ahead) decodes the
same calibration prompts with the planned egt on the real models, interleaved prompt by prompt so a
drifting machine hits all alike. Each stage is timed where it runs (the drafter's first forward,
its later rounds, the forward ahead of the verify, the verify, the rest), and an alternative's
modelled time per token is the sum of its stage times per step over its tokens per step. The
plain order is kept unless an alternative beats it by MIN_GAIN: run-ahead stages cost a forward
every step and only pay back when their guesses hit.

Overlap: on CUDA the stage ahead could run on a second stream beside the verify; this runtime does
not implement streams. On a CPU a Python thread cannot overlap them: AOTInductor's runner holds the
GIL for a whole compiled forward (a busy Python thread got ~1 % of its normal loop rate while one ran),
and the two forwards would split the same cores anyway. Measured on the 2-core machine (Qwen pair,
compiled, target W=8 then drafter W=2, medians of 7, interleaved): one after the other 314 ms, in two
threads 392 ms (both at 2 torch threads), 526 ms (drafter at 1). So every plan runs its stages one
after another.
"""

from __future__ import annotations

from dataclasses import replace

from ygg_runtime.options import MIN_GAIN
from ygg_runtime.ui import Reporter
from ygg_runtime.decoding import engine, proposers
from ygg_runtime.decoding.proposers import Hook
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.params import EGTParams, Stages
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.model.runner import ModelRunner

GRID = [{"tail": tail, "head": head} for tail in ("plain", "ahead") for head in ("plain", "ahead")]
PLAIN = GRID[0]
PROMPTS, TOKENS = 4, 40  # calibration prompts decoded per alternative, tokens each
STAGE_KEYS = ("begin", "rounds", "ahead")  # egt's drafter stages, as it reports them to a timed hook


def name(stages: dict) -> str:
    return f"tail {stages['tail']}, head {stages['head']}"


class _StageTimer(Hook):
    """Sums the seconds egt reports per drafter stage."""

    timed = True

    def __init__(self):
        self.seconds = dict.fromkeys(STAGE_KEYS, 0.0)

    def stage(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds


def search(target: ModelRunner, draft: ModelRunner, prompts: list[list[int]], egt: EGTParams, curves: Curves,
           predictor: DepthPredictor | None, ui: Reporter, tokens: int = TOKENS, count: int = PROMPTS) -> dict:
    """Time every alternative on the first `count` of `prompts` (token ids) that fit the context
    with `tokens` to generate; returns planning["stages"]: the chosen stage order, why, and every
    alternative's measured stage times and modelled time per token."""
    drafter = proposers.Drafter(draft, target.vocab_size)
    timers = {i: _StageTimer() for i in range(len(GRID))}  # each alternative's stage seconds, over every prompt
    built = {i: proposers.build("egt", replace(egt, stages=Stages(**s)), drafter, curves, predictor, hook=timers[i])
             for i, s in enumerate(GRID)}
    room = max(engine.step_room(target, p) for p in built.values())
    prompts = [ids for ids in prompts if len(ids) + tokens + room <= target.max_len][:count]
    if not prompts:
        return {"chosen": dict(PLAIN), "why": f"plain: no calibration prompt leaves room for {tokens} tokens in the context",
                "alternatives": []}
    totals = {i: {"steps": 0, "tokens": 0, "hits": 0, "decode_s": 0.0, "verify_s": 0.0, "other_s": 0.0,
                  **{k: 0.0 for k in STAGE_KEYS}} for i in built}
    label = f"timing egt's stage orders ({len(GRID)} alternatives × {len(prompts)} prompts)"
    for n, ids in enumerate(prompts):
        order = list(built)[n % len(built):] + list(built)[: n % len(built)]
        for i in order:
            _, m = engine.generate(target, built[i], ids, max_new_tokens=tokens)
            t = totals[i]
            t["steps"] += m.steps
            t["tokens"] += m.generated_tokens
            t["hits"] += m.ahead_hits
            t["decode_s"] += m.decode_s
            t["verify_s"] += m.verify_s
            t["other_s"] += m.other_s
        ui.progress(label, n + 1, len(prompts), unit="prompts")
    for i, timer in timers.items():
        totals[i].update(timer.seconds)
    rows = []
    for i, t in totals.items():
        steps = max(1, t["steps"])
        stage_ms = {k: round(1000 * t[k] / steps, 2) for k in STAGE_KEYS}
        stage_ms["verify"] = round(1000 * t["verify_s"] / steps, 2)
        stage_ms["other"] = round(1000 * t["other_s"] / steps, 2)
        step_ms = sum(stage_ms.values())
        per_step = t["tokens"] / steps
        rows.append({**GRID[i], "stage_ms": stage_ms, "step_ms": round(step_ms, 2), "tokens_per_step": round(per_step, 3),
                     "head_hit_rate": round(t["hits"] / steps, 3), "ms_per_token": round(step_ms / max(per_step, 1e-9), 2),
                     "measured_ms_per_token": round(1000 * t["decode_s"] / max(1, t["tokens"]), 2)})
    plain = rows[0]
    best = min(rows, key=lambda r: r["ms_per_token"])
    chosen = best if best["ms_per_token"] * MIN_GAIN <= plain["ms_per_token"] else plain
    why = (f"{name(chosen)}: {plain['ms_per_token'] / chosen['ms_per_token']:.3f}× the plain order per token"
           if chosen is not plain else
           f"plain: the best alternative ({name(best)}) models {plain['ms_per_token'] / best['ms_per_token']:.3f}× "
           f"(needs {MIN_GAIN}×)" if best is not plain else "plain: fastest of all")
    return {"chosen": {"tail": chosen["tail"], "head": chosen["head"]}, "why": why,
            "prompts": len(prompts), "tokens": tokens, "alternatives": rows}
