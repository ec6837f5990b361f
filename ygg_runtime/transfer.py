"""Where the host and the device meet: every read of device values by the host, counted.

On a GPU a read (`.tolist()`, `.item()`) waits for all the work queued before it, and a decode step
is a chain of small forwards whose results the host must see (the drafter's top children, the
target's choices): each read is a round trip the GPU idles through. So a greedy step reads its
drafted tree once (a static tree's levels feed each other on the device; egt reads once a drafter
round) and its verdict once, with what the next step needs of the verified rows (the depth
predictor's reach) in the same transfer, each read going through `to_host` (a test counts them
per step, and `benchmarks/step_overhead.py` reports them). Host-to-device copies go one per forward, from pinned memory
(`ygg_runtime.model.graphs.ForwardInputs`), and never wait. Device timings are taken with events, read
after a transfer has waited anyway (`Stopwatch`), so timing costs no round trip.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

_reads = 0  # host reads of device values in this process


def to_host(t: Tensor) -> list:
    """t's values as a (nested) Python list: one round trip to the device."""
    global _reads
    _reads += 1
    return t.tolist()


def read_top(values: Tensor, indices: Tensor) -> list[tuple[list[float], list[int]]]:
    """Top-k values and indices [n, k] on the host in one read, a (values, indices) pair per row
    (the indices travel as float64, which holds them exactly)."""
    both = to_host(torch.stack([values.double(), indices.double()]))
    return [(v, [int(i) for i in ix]) for v, ix in zip(*both)]


def host_reads() -> int:
    """Reads of device values so far in this process (a step's count is a difference)."""
    return _reads


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """Values on the device without waiting for it: through pinned memory on a GPU (a copy from
    pageable memory would wait for the work queued before it)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def rows_at_once(device: torch.device) -> bool:
    """Whether a choice over a tree's rows is cheaper computed for every row in one go than for
    the few rows a walk visits: on a GPU one read beats a read per row; on a CPU there is no round
    trip and every row costs its arithmetic."""
    return device.type != "cpu"


class Stopwatch:
    """Seconds of device work between `start` and `stop`: CUDA events on a GPU, read once a
    transfer has waited for the work anyway (no round trip of its own); the host clock on a CPU,
    whose work is done when the call returns."""

    def __init__(self, device: torch.device):
        self.waits = device.type == "cuda"  # the timed work runs on past `stop`, until a read waits for it
        self._t0 = self._t1 = None

    def _mark(self):
        if not self.waits:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> "Stopwatch":
        self._t0 = self._mark()
        return self

    def stop(self) -> "Stopwatch":
        self._t1 = self._mark()
        return self

    @property
    def seconds(self) -> float:
        if self.waits:
            self._t1.synchronize()  # done by now: a read of the work's results has waited for it
            return self._t0.elapsed_time(self._t1) / 1000.0
        return self._t1 - self._t0
