"""A forward's inputs in one buffer, and the CUDA graphs that replay forwards over static copies of it.

Every forward takes tokens, positions, slots, lo, hi [W], the rows whose logits are wanted [H] and
a tree window [W, T] (`model.Transformer.forward`). Built on the host as one byte buffer
(`ForwardInputs`), they reach a GPU in one copy from pinned memory, which does not wait for the
GPU; on a CPU the buffer's views are the inputs themselves.

On a GPU a forward is hundreds of kernel launches (the 1.5B target's: 8 a layer × 28 layers and
the head), each microseconds of host time, where its weights stream in under a millisecond on an
H200 (launched one by one, its T(1) was 38.2 ms against a 0.88 ms floor:
docs/notes/2026-11-27-the-gpu-path-on-a-gpu-for.md), so `CapturedForwards` records each forward width once as a
CUDA graph over a static device copy of the buffer and the model's cache, and replays it: one
copy in, one replay (gpt-fast's captured decode step, SGLang's verify graphs, Sequoia's graph per
tree width). A captured forward computes the output head for all W rows (H = W) and sees a tree
window of a fixed T (the widest asked for so far, rounded up to a power of two: a wider one
re-captures); neither changes a row's bits (the attention kernel blocks a row's keys by their
position order, not by the window). The graph of a width is captured on its first forward: two
warm-up runs of that very forward on a side stream (they write the same cache rows it writes),
then the capture, then the replay that answers it. The graphs hold the address of the cache they
were captured over: a forward over another cache (`ygg serve` sets the caches up anew, sized by
memory) drops them all, so the graphs held stay one per (kind, width) whatever a process's life.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ygg_runtime.errors import first_line

MIN_WINDOW = 64  # the narrowest tree window a captured forward takes
WARMUP = 2  # runs of a forward before its capture (kernels compiled, workspaces allocated)


class ForwardInputs:
    """tokens, positions, slots, lo, hi [width] and heads [heads] as int64, then tree [width,
    window] as bool, in one byte buffer on the host (pinned for a GPU). Each input starts on a
    16-byte boundary (ALIGN): a GPU graph compiled ahead of time was built from separate, aligned
    example tensors, and its kernels may load an input as if it were (Inductor copies a misaligned
    input before its own kernels run, an AOTInductor graph does not)."""

    ALIGN = 16

    def __init__(self, width: int, heads: int, window: int, pin: bool = False):
        self.width, self.heads, self.window = width, heads, window
        step = self.ALIGN // 8  # int64s to a boundary
        padded = lambda n: -(-n // step) * step  # noqa: E731  (n int64s, rounded up to a boundary)
        self._at = [i * padded(width) for i in range(6)]  # int64 offsets of the five [W] inputs and heads
        self._tree_at = 8 * (self._at[5] + padded(heads))
        self.host = torch.zeros(self._tree_at + width * window, dtype=torch.uint8, pin_memory=pin)
        self.tree = self.host[self._tree_at :].view(torch.bool).view(width, window)
        # (input, row, values on the device): inputs a drafter's last forward chose — tokens, and for
        # a round that also chose which nodes to feed, their positions, slots and mask rows — written
        # into the device's copy of the inputs (`write_late`) instead of read back to fill `host`
        self.late: list[tuple[int, int, Tensor]] = []

    def set_ints(self, tokens: list[int], positions: list[int], slots: list[int], lo: list[int], hi: list[int],
                 heads: list[int]) -> None:
        """Write the integer inputs (each of its length: the width, or the heads)."""
        flat: list[int] = []  # one copy into the buffer, zeros in the gaps
        for at, values in zip(self._at, (tokens, positions, slots, lo, hi, heads)):
            flat += [0] * (at - len(flat)) + values
        self.host[: 8 * len(flat)].view(torch.int64).copy_(torch.tensor(flat, dtype=torch.int64))

    def args(self, buffer: Tensor | None = None) -> tuple[Tensor, ...]:
        """The forward's inputs (tokens [1, W], positions, slots, lo, hi, tree, heads) as views of
        `buffer`: a device copy of `host` (the host buffer itself by default)."""
        buffer = self.host if buffer is None else buffer
        w = self.width
        ints = buffer[: self._tree_at].view(torch.int64)
        tree = buffer[self._tree_at :].view(torch.bool).view(w, self.window)
        tokens, positions, slots, lo, hi = (ints[at : at + w] for at in self._at[:5])
        return tokens.view(1, w), positions, slots, lo, hi, tree, ints[self._at[5] : self._at[5] + self.heads]

    def write_late(self, args: tuple[Tensor, ...]) -> None:
        """Write the inputs that are on the device already (`late`: tokens, positions, slots, mask
        rows) into the forward's inputs `args` (on the device: a copy there, no read)."""
        for i, row, values in self.late:
            if values.dim() == 2:  # mask rows
                args[i][row : row + len(values), : values.shape[1]].copy_(values)
            else:
                args[i].view(-1)[row : row + len(values)].copy_(values)

    def on(self, device: torch.device) -> tuple[Tensor, ...]:
        """The inputs on `device`, in one copy that does not wait (the host buffer is pinned off the
        CPU, and its memory is not handed out again until the copy is done)."""
        if device.type == "cpu":
            return self.args()
        return self.args(self.host.to(device, non_blocking=True))


Forward = Callable[..., tuple[Tensor, Tensor]]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: Tensor  # the static device buffer the graph reads
    logits: Tensor
    hidden: Tensor


class CapturedForwards:
    """One CUDA graph per (kind of forward, width) over one model's cache, captured on first use."""

    def __init__(self, device: torch.device):
        self.device = device
        self.window = MIN_WINDOW  # the tree window every graph takes
        self.failed: str | None = None  # why capture was given up (then every forward runs uncaptured)
        self.captures = 0  # graphs captured (re-captures included)
        self._graphs: dict[tuple, _Graph] = {}
        self._cache: tuple | None = None  # (address, shape) of the cache the graphs were captured over
        self._pool = None

    def window_for(self, window: int) -> int:
        """The window a forward seeing `window` tree slots is built with: the graphs', widened (and
        the graphs dropped) when it is not enough."""
        if window > self.window:
            self.window = max(MIN_WINDOW, 1 << (window - 1).bit_length())
            self._graphs.clear()
        return self.window

    def run(self, kind: str, forward: Forward, inputs: ForwardInputs, cache: Tensor) -> tuple[Tensor, Tensor] | None:
        """The forward's (logits, hidden) by replaying its graph (captured now if new), as views of
        the graph's static outputs that its next replay overwrites; None when capture failed (the
        caller runs the forward itself)."""
        if self._cache != (cache.data_ptr(), tuple(cache.shape)):  # a new cache: the old one's graphs go
            self._graphs.clear()
            self._cache = (cache.data_ptr(), tuple(cache.shape))
        key = (kind, inputs.width, inputs.heads)
        g = self._graphs.get(key)
        if g is None:
            if self.failed is not None:
                return None
            try:
                g = self._graphs[key] = self._capture(forward, inputs, cache)
            except Exception as e:  # a forward that cannot be captured runs as it is, and says why once
                self.failed = f"CUDA graph capture failed ({first_line(e)}): forwards run uncaptured"
                return None
        g.inputs.copy_(inputs.host, non_blocking=True)
        inputs.write_late(inputs.args(g.inputs))
        g.graph.replay()
        return g.logits, g.hidden

    def _capture(self, forward: Forward, inputs: ForwardInputs, cache: Tensor) -> _Graph:
        static = inputs.host.to(self.device)
        args = inputs.args(static)
        args = (*args[:6], cache, args[6])
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                forward(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = forward(*args)
        self.captures += 1
        return _Graph(graph, static, logits, hidden)
