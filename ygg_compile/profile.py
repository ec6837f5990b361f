"""Measured forward latency T(W): one forward over W new tokens after a context of C tokens.

These curves are what every latency-aware choice reads (DESIGN.md §2). Widths are interleaved
within each repeat, so a slow drift of a shared machine hits every width alike, and the median of
the repeats is kept.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ygg_compile.build import Reporter
from ygg_runtime.runner import ModelRunner

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def fitting_widths(context: int, max_len: int, widths: tuple[int, ...] = DEFAULT_WIDTHS) -> tuple[int, ...]:
    """The widths whose forward still fits a cache of max_len after `context` tokens."""
    return tuple(w for w in widths if context + w <= max_len)


def forward_times(
    runner: ModelRunner,
    widths: tuple[int, ...] = DEFAULT_WIDTHS,
    context: int = 256,
    repeats: int = 3,
    warmup: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, float]:
    """Median ms of one causal forward over W new tokens at `context` committed tokens, per width.
    The runner is left reset (nothing committed)."""
    context = max(0, min(context, runner.max_len - max(widths)))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (max(widths),), generator=gen).tolist()
    samples: dict[int, list[float]] = {w: [] for w in widths}
    rounds = warmup + repeats
    try:
        for r in range(rounds):
            order = widths[r % len(widths) :] + widths[: r % len(widths)]
            for w in order:
                runner.reset(context)
                runner.synchronize()
                start = time.perf_counter()
                runner.forward_chain(tokens[:w])
                runner.synchronize()
                if r >= warmup:
                    samples[w].append(1000.0 * (time.perf_counter() - start))
            if progress:
                progress(r + 1, rounds)
    finally:
        runner.reset()
    return {w: statistics.median(v) for w, v in samples.items()}


def profile_models(
    runners: dict[str, ModelRunner],
    widths: tuple[int, ...] = DEFAULT_WIDTHS,
    context: int = 256,
    repeats: int = 3,
    ui: Reporter | None = None,
) -> dict:
    """T(W) of each model (e.g. {"target": ..., "draft": ...}) as a plan/result section."""
    out = {"context": context, "threads": torch.get_num_threads(), "repeats": repeats, "widths": list(widths)}
    for role, runner in runners.items():
        label = f"timing {role} forwards (W = {widths[0]}..{widths[-1]})"
        report = (lambda done, total: ui.progress(label, done, total, unit="rounds")) if ui else None
        times = forward_times(runner, widths, context, repeats, progress=report)
        out[f"{role}_ms"] = [round(times[w], 3) for w in widths]
    return out
