"""A model together with its cache and the length of the sequence committed to it.

Both the target and every drafter go through this class, so tree forwards, masks and compaction
are built the same way for both. Layout: slots [0, committed) hold the accepted sequence; a
forward writes a node with tree offset i to slot committed + i and lets it see the whole committed
prefix plus the tree slots its mask row allows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from ygg_runtime.kv import compact
from ygg_runtime.model import Transformer

# The attention span is rounded up to a multiple of this, so that most steps reuse one shape.
SPAN_BUCKET = 256
# A prompt is run in chunks of at most this many tokens (the widest compiled forward).
PREFILL_CHUNK = 512
# The forward widths compile measures and plans with: the latency profile's grid, the verify and
# draft widths a plan may pick, and the widths a method's tree is padded to.
WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def fit_width(n: int, widths: tuple[int, ...] | list[int]) -> int:
    """The smallest compiled width that holds n tokens (n itself when none is wide enough)."""
    return next((w for w in sorted(widths) if w >= n), n)


class ModelRunner:
    def __init__(self, model: Transformer, max_len: int):
        self.model = model
        self.device = model.device
        model.setup_cache(max_len)
        self.max_len = max_len
        self.committed = 0
        # Forwards run in this runner's life, and how many of them compiled (a decoder reports the
        # difference around a generation). Counters, so a long-lived process does not grow.
        self.forwards = 0
        self.compiled_forwards = 0
        self._recorded: list[int] | None = None
        # The plan's compiled widths for this model: every forward is padded up to one of them
        # (a narrower one that is slower than a wider one on this machine is left out). Empty:
        # forwards run at their own width.
        self.widths: tuple[int, ...] = ()
        # The narrowest width from which this model's rows come out bitwise the same whatever the
        # forward around them (measured at compile time, `ygg_compile.invariance`): every forward
        # is padded to at least it, so a tree verify scores a token exactly as plain decoding does.
        self.min_width = 0
        self.hidden: Tensor | None = None  # final hidden states [W, dim] of the last forward
        self.logits: Tensor | None = None  # its logits [W, vocab] (what forward returned)
        # Ahead-of-time compiled forwards (ygg_runtime.compiled.CompiledForward), used for every
        # forward they hold; any other (wider than their widest) runs eager.
        self.compiled = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[int]]:
        """The width of every forward run inside the block, in order: what tests and compile-time
        measurements read to see the shapes a method really runs (nothing is kept outside one)."""
        outer, self._recorded = self._recorded, []
        try:
            yield self._recorded
        finally:
            if outer is not None:
                outer.extend(self._recorded)
            self._recorded = outer

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def reset(self, committed: int = 0) -> None:
        """Forget the sequence. committed > 0 pretends that many tokens are in the cache (whatever
        its contents): a forward costs the same, which is all latency profiling needs."""
        self.committed = committed
        self.hidden = self.logits = None

    def synchronize(self) -> None:
        """Wait for queued device work, so a wall-clock timer around a forward measures it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(
        self, tokens: list[int], offsets: list[int], depths: list[int], tree_mask: Tensor, width: int = 0
    ) -> Tensor:
        """Run W new tokens. offsets[i]: tree slot of token i (cache slot committed + offsets[i]);
        depths[i]: its depth below the committed prefix (position committed + depths[i]);
        tree_mask [W, T] bool: which of the T tree slots token i sees. Returns logits [W, vocab].
        width > W pads the forward to that many tokens (a compiled width) with masked slots placed
        after the tree, which see only the prefix and themselves and whose outputs are dropped."""
        n = len(tokens)
        need = max(n, self.min_width)  # padding to min_width is the exactness rule, not a choice
        width = max(width, fit_width(need, self.widths) if self.widths else need)
        # Padding to a compiled width is only a speed-up: at the very end of the cache a forward
        # pads just to min_width (the engine keeps room for that).
        if width > need and self.committed + tree_mask.shape[1] + width - n > self.max_len:
            width = need
        if width > n:
            tokens, offsets, depths, tree_mask = _pad(tokens, offsets, depths, tree_mask, width)
        w, t = tree_mask.shape
        base = self.committed
        if base + t > self.max_len:
            raise ValueError(f"sequence of {base + t} tokens exceeds the cache of {self.max_len}")
        span = min(self.max_len, -(-(base + t) // SPAN_BUCKET) * SPAN_BUCKET)
        mask = torch.zeros(w, span, dtype=torch.bool, device=self.device)
        mask[:, :base] = True
        mask[:, base : base + t] = tree_mask.to(self.device)
        dev = self.device
        x = torch.tensor([tokens], device=dev)
        positions = torch.tensor(depths, device=dev) + base
        slots = torch.tensor(offsets, device=dev) + base
        compiled = self.compiled is not None and self.compiled.holds(w, span)
        self.forwards += 1
        self.compiled_forwards += compiled
        if self._recorded is not None:
            self._recorded.append(w)
        logits, hidden = (self.compiled if compiled else self.model)(x, positions, slots, mask)
        self.hidden, self.logits = hidden[0, :n], logits[0, :n]
        return self.logits

    def forward_chain(self, tokens: list[int]) -> Tensor:
        """Run tokens as a plain causal continuation of the committed prefix (not committed)."""
        n = len(tokens)
        causal = torch.ones(n, n, dtype=torch.bool).tril_()
        return self.forward(tokens, list(range(n)), list(range(n)), causal)

    def commit(self, offsets: list[int]) -> None:
        """Keep the tree slots `offsets` (a root path, in order) as the next committed tokens."""
        compact(self.model.caches(), [self.committed + o for o in offsets], self.committed)
        self.committed += len(offsets)

    def prefill(self, tokens: list[int], chunk: int = PREFILL_CHUNK) -> None:
        for i in range(0, len(tokens), chunk):
            part = tokens[i : i + chunk]
            self.forward_chain(part)
            self.commit(list(range(len(part))))


def _pad(tokens: list[int], offsets: list[int], depths: list[int], tree_mask: Tensor, width: int):
    """Extend a forward to `width` tokens with dummies in fresh slots after the tree's."""
    n, t = tree_mask.shape
    extra = width - n
    slots = max(t, max(offsets) + 1)
    mask = torch.zeros(width, slots + extra, dtype=torch.bool)
    mask[:n, :t] = tree_mask
    idx = torch.arange(extra)
    mask[n + idx, slots + idx] = True
    return tokens + [0] * extra, offsets + list(range(slots, slots + extra)), depths + [0] * extra, mask
