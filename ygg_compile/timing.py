"""The one timer every measurement uses: the latency profiles a compile plans from
(`ygg_compile.latency`) and every benchmark (`ygg_bench.harness` hands it on). Every candidate once
per round, in an order rotated from round to round, so a slow drift of a shared machine (another
tenant, a VM changing state) hits all alike, after untimed warm-up rounds, with untimed set-up
before each call; medians over the rounds. On a GPU a call is timed by CUDA events on its stream
(`cuda_ms`), or by the caller's synchronisation inside the call where the host's time counts too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping

import torch


def cuda_ms(fn, repeats: int = 20, warmup: int = 1) -> float:
    """Median ms of `fn` on the current CUDA stream (events; after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def time_ms(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """Milliseconds of one call of `fn`: wall time on a CPU, CUDA events around it on a GPU."""
    if torch.device(device).type == "cuda":
        return cuda_ms(fn, repeats=1, warmup=0)
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def median_ms(fn: Callable[[], object], repeats: int = 20, device: str | torch.device = "cpu") -> float:
    """The median milliseconds of `repeats` calls of `fn` after one untimed call (one candidate of
    `interleaved`: where nothing is compared beside it)."""
    return statistics.median(interleaved({0: fn}, repeats, device=device)[0])


def rotated(items: list, k: int) -> list:
    """`items` starting at the k-th (modulo their number): round k's order, so that over as many
    rounds as there are items each runs once in each position."""
    k %= len(items)
    return items[k:] + items[:k]


def interleaved(fns: Mapping[Hashable, Callable[[], object]], repeats: int, *, warmup: int = 1,
                setup: Callable[[Hashable], None] | None = None, device: str | torch.device = "cpu",
                progress: Callable[[int, int], None] | None = None) -> dict[Hashable, list[float]]:
    """Each candidate's milliseconds, `repeats` samples each: round r calls every candidate once, in
    the order rotated by r, after `warmup` untimed rounds. `setup(name)`, untimed, runs before each
    call (a cache reset, a mode switch); `progress(done, rounds)` after each round."""
    names = list(fns)
    samples: dict[Hashable, list[float]] = {n: [] for n in names}
    rounds = warmup + repeats
    for r in range(rounds):
        for n in rotated(names, r):
            if setup is not None:
                setup(n)
            ms = time_ms(fns[n], device)
            if r >= warmup:
                samples[n].append(ms)
        if progress is not None:
            progress(r + 1, rounds)
    return samples


def medians(samples: Mapping[Hashable, list[float]], digits: int = 3) -> dict[Hashable, float]:
    return {n: round(statistics.median(s), digits) for n, s in samples.items()}


def ratio_median(a: list[float], b: list[float]) -> float:
    """The median of paired ratios a[i] / b[i] (samples taken back to back in one round)."""
    return statistics.median(x / y for x, y in zip(a, b))
