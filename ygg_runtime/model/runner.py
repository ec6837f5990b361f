"""A model together with its cache and the length of the sequence committed to it.

Both the target and every drafter go through this class, so tree forwards, masks and compaction
are built the same way for both. Layout: a sequence owns a region of the cache, slots [base,
base + max_len); slots [base, base + committed) hold its accepted tokens; a forward writes a node
with tree offset i to slot base + committed + i and lets it see the whole committed prefix plus the
tree slots its mask row allows. A runner made by `region()` shares its model and cache with the one
it came from: several sequences, each in its own region, decode together, and `forward_many` runs
their trees in one forward whose mask keeps every row inside its own sequence (`ygg_runtime.decoding.batch`).
Regions need no alignment: the attention kernel reads a row's visible slots in slot order, so a
row's result does not depend on where its region starts (`ygg_runtime.backend`), and a region can
move (`move_to`): its rows are copied, never recomputed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ygg_runtime.model.graphs import CapturedForwards, ForwardInputs
from ygg_runtime.model.kv import compact, move, restore, snapshot
from ygg_runtime.model.transformer import Transformer
from ygg_runtime.options import MAX_ROWS
from ygg_runtime.schema.params import fit_width

# A prompt is run in forwards of at most this many tokens: the widest the compile-time row check
# covers, so a prompt's rows come out the same bits alone and in a batch, where its chunks share
# forwards with other sequences' rows (`ygg_runtime.decoding.batch`). Wider forwards are no faster per token:
# 6.96 ms per prompt token at 64 against 7.04 at 512 on the 1.5B target (docs/measured.md).
PREFILL_CHUNK = MAX_ROWS


class PrefixCache:
    """The KV rows of a prompt prefix most prompts share — the chat template's system turn, frozen
    at compile time — computed once per process and copied into every later prompt's cache.

    Every prompt that starts with the prefix is prefilled on one schedule, alone or in a batch,
    first use or not: the prefix in a forward of its own at positions 0..n-1, then the rest. The
    copied rows are therefore the bits that forward gives, whatever the kernels' row invariance,
    and greedy output stays that of plain decoding. Rows are kept per kind of forward (compiled or
    eager), which can differ in their last bits."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.rows: dict[bool, Tensor] = {}  # compiled? -> every layer's K and V (`kv.snapshot`)
        self.hits = 0  # prompts that reused the rows (tests and stats read it)

    def covers(self, tokens: list[int]) -> bool:
        n = len(self.tokens)
        return n > 0 and len(tokens) >= n and tokens[:n] == self.tokens


@dataclass
class Call:
    """One sequence's share of a forward: ModelRunner.forward's arguments, for `forward_many`."""

    runner: "ModelRunner"
    # the tokens [W]: on the host, or a device tensor a drafter's last forward chose (its next
    # forward's input never comes back to the host: `ForwardInputs.late`); offsets and depths too
    # when a drafting round chose which nodes to feed on the device (then the mask rows are the
    # device's, and the window their width)
    tokens: list[int] | Tensor
    offsets: list[int] | Tensor
    depths: list[int] | Tensor
    tree_mask: Tensor
    logits: bool = True  # False: a prompt's rows, which only write the cache (no output head)


class ModelRunner:
    def __init__(self, model: Transformer, max_len: int, base: int = 0, setup: bool = True):
        """A runner over slots [base, base + max_len) of the model's cache; setup=False shares a
        cache already set up (what `region()` does)."""
        self.model = model
        self.device = model.device
        if setup:
            model.setup_cache(base + max_len)
        elif base + max_len > model.max_len:
            raise ValueError(f"region [{base}, {base + max_len}) is outside the cache of {model.max_len}")
        self.base = base
        self.max_len = max_len
        self.committed = 0
        # Another generation's thread routes this runner's forwards through the batch it belongs to
        # (`ygg_runtime.decoding.batch`), which runs them together with the other sequences' forwards.
        self.gate = None
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
        # Ahead-of-time compiled forwards (ygg_runtime.model.compiled.CompiledForward), used for every
        # forward they hold; any other (wider than their widest) runs eager.
        self.compiled = None
        # The shared prompt prefix whose KV rows a prefill copies instead of computing (None: none).
        self.prefix: PrefixCache | None = None
        # Cache slots no sequence owns, where a forward's padding rows may write when no region
        # has room past its tree (a batch's regions share them: `ygg_runtime.decoding.batch`). Empty alone.
        self.scratch: range = range(0)
        # On a GPU, every forward replays a CUDA graph captured for its width (`ygg_runtime.model.graphs`);
        # None: forwards run as they are (a CPU; or set to None to time a GPU's uncaptured forwards).
        self.graphs = CapturedForwards(self.device) if self.device.type == "cuda" else None

    def region(self, base: int, length: int) -> "ModelRunner":
        """A runner for slots [base, base + length) of this model's cache, with this runner's
        widths, exactness floor, compiled forwards and prefix cache (the cache is shared, so they fit it)."""
        r = ModelRunner(self.model, length, base, setup=False)
        r.widths, r.min_width, r.compiled, r.prefix = self.widths, self.min_width, self.compiled, self.prefix
        r.graphs = self.graphs
        return r

    def view(self, *, eager: bool = False, min_width: int | None = None) -> "ModelRunner":
        """This runner's slots as one generation runs them — eager forwards (`eager`), another
        exactness floor (`min_width`) — with this runner left as it is: what `Decoder.generate`
        runs on, so that a generation's ablations change nothing another generation reads."""
        r = self.region(self.base, self.max_len)
        if eager:
            r.compiled = None
        if min_width is not None:
            r.min_width = min_width
        return r

    def move_to(self, base: int, length: int, rows: int | None = None) -> None:
        """Take slots [base, base + length) of the cache instead of its region (which a batch
        frees): its first `rows` rows (default: the committed ones) are copied there, and the
        sequence goes on as before."""
        if base + length > self.model.max_len:
            raise ValueError(f"region [{base}, {base + length}) is outside the cache of {self.model.max_len}")
        move(self.model.kv, self.base, self.committed if rows is None else rows, base)
        self.base, self.max_len = base, length

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

    def padded(self, n: int) -> int:
        """The width a forward of n rows runs at: at least the exactness floor (`min_width`), then
        up to a compiled width (`forward_many`; it drops the second padding, never the first,
        where the cache has no room). What every caller sizing cache room for a forward reads."""
        return fit_width(max(n, self.min_width), self.widths)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def reset(self, committed: int = 0) -> None:
        """Forget the sequence. committed > 0 pretends that many tokens are in the cache (whatever
        its contents): a forward costs the same, which is all latency profiling needs."""
        self.committed = committed
        self.hidden = self.logits = None

    def synchronize(self) -> None:
        """Wait for queued device work, so a wall-clock timer around a forward measures it (a
        compile-time measurement; a decode step reads its timings off `transfer.Stopwatch`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(
        self, tokens: list[int], offsets: list[int], depths: list[int], tree_mask: Tensor, width: int = 0,
        logits: bool = True,
    ) -> Tensor | None:
        """Run W new tokens. offsets[i]: tree slot of token i (cache slot committed + offsets[i]);
        depths[i]: its depth below the committed prefix (position committed + depths[i]);
        tree_mask [W, T] bool: which of the T tree slots token i sees. Returns logits [W, vocab]
        (None with logits=False: the rows only write the cache, as a prompt's do).
        width > W pads the forward to that many tokens (a compiled width) with masked slots placed
        after the tree, which see only themselves and whose outputs are dropped."""
        return self.run(Call(self, tokens, offsets, depths, tree_mask, logits), width)

    def run(self, call: Call, width: int = 0) -> Tensor | None:
        """Run one call of this runner: through its batch's gate when it has one, else alone."""
        if self.gate is not None:
            return self.gate.run(call, width)
        return forward_many([call], width)[0]

    def chain_call(self, tokens: list[int], logits: bool = True) -> Call:
        """The forward of tokens as a plain causal continuation of the committed prefix."""
        n = len(tokens)
        return Call(self, tokens, list(range(n)), list(range(n)), torch.ones(n, n, dtype=torch.bool).tril_(), logits)

    def forward_chain(self, tokens: list[int], logits: bool = True) -> Tensor | None:
        """Run tokens as a plain causal continuation of the committed prefix (not committed)."""
        return self.run(self.chain_call(tokens, logits))

    def commit(self, offsets: list[int]) -> None:
        """Keep the tree slots `offsets` (a root path, in order) as the next committed tokens."""
        start = self.base + self.committed
        compact(self.model.kv, [start + o for o in offsets], start)
        self.committed += len(offsets)

    def take_prefix(self, tokens: list[int]) -> int:
        """Before anything is committed: when `tokens` (a whole prompt) starts with the prefix
        cache's tokens, commit their rows (copied, or computed in a forward of their own on first
        use: `PrefixCache`). Returns the tokens committed."""
        p = self.prefix
        if p is None or self.committed != 0 or not p.covers(tokens):
            return 0
        n, kind = len(p.tokens), self.compiled is not None
        if kind in p.rows:
            restore(self.model.kv, p.rows[kind], self.base)
            self.committed = n
            p.hits += 1
        else:
            self.forward_chain(p.tokens, logits=False)
            self.commit(list(range(n)))
            p.rows[kind] = snapshot(self.model.kv, self.base, n)
        return n

    def prefill(self, tokens: list[int], chunk: int = PREFILL_CHUNK) -> None:
        """Commit `tokens` after the committed prefix, in forwards of at most `chunk` tokens; a
        prompt that starts with the prefix cache's tokens gets those rows copied (`take_prefix`)."""
        start = self.take_prefix(tokens)
        for i in range(start, len(tokens), chunk):
            part = tokens[i : i + chunk]
            self.forward_chain(part, logits=False)
            self.commit(list(range(len(part))))


@torch.inference_mode()
def forward_many(calls: list[Call], width: int = 0) -> list[Tensor]:
    """One forward of one model over several sequences' trees (each call's runner a region of the
    same cache, or one runner alone): row i of a call sees its region's committed prefix and the
    tree slots its mask row allows, nothing of the other calls. The forward is padded to `width`,
    to a compiled width and to at least the exactness floor (`min_width`), with dummy rows in fresh
    slots past the tree of the call whose region has the most room, or else in the slots a batch
    keeps for padding (`ModelRunner.scratch`), each seeing only itself. Alone, padding to a
    compiled width is dropped when the cache has no room for it (the engine keeps room for the
    floor and for the widest tree padded); in a batch, the scratch slots always hold it, so every
    forward runs at a width the compile-time row check measured. Returns each call's logits [W_i, vocab]."""
    first = calls[0].runner
    n = sum(len(c.tokens) for c in calls)
    need = max(n, first.min_width)  # padding to min_width is the exactness rule, not a choice
    width = max(width, first.padded(n))

    def extent(c: Call) -> int:  # tree slots a call's rows reach (chosen on the device: within its window)
        return c.tree_mask.shape[1] if isinstance(c.offsets, Tensor) else max(c.tree_mask.shape[1], max(c.offsets) + 1)

    def room(c: Call) -> int:
        return c.runner.max_len - c.runner.committed - extent(c)

    host = max(calls, key=room)
    scratch = first.scratch  # slots a batch keeps for padding: a checked width whatever the regions hold
    if width > need and room(host) < width - n and len(scratch) < width - n:
        width = need
    slots, positions, spans, late = [], [], [], []
    for c in calls:
        r, t = c.runner, c.tree_mask.shape[1]
        if r.committed + t > r.max_len:
            raise ValueError(f"sequence of {r.committed + t} tokens exceeds the cache of {r.max_len}")
        start = r.base + r.committed
        if isinstance(c.offsets, Tensor):  # chosen on the device: written there (`ForwardInputs.late`)
            late += [(1, len(positions), r.committed + c.depths), (2, len(slots), start + c.offsets)]
            slots += [0] * len(c.offsets)
            positions += [0] * len(c.offsets)
        else:
            slots += [start + o for o in c.offsets]
            positions += [r.committed + d for d in c.depths]
        spans.append((r.base, start, c.tree_mask))
    extra = width - n
    pad_slots = []
    if extra and room(host) >= extra:
        r = host.runner
        first_free = r.base + r.committed + extent(host)
        pad_slots = list(range(first_free, first_free + extra))
    elif extra:
        if len(scratch) < extra:
            raise ValueError(f"no region has room for {extra} padding rows past its tree")
        pad_slots = list(scratch[:extra])
    window = max([m.shape[1] for _, _, m in spans] + [1 if pad_slots else 0])
    graphs = first.graphs if first.graphs is not None and first.graphs.failed is None else None
    if graphs is not None:  # a captured forward takes the graphs' window and computes every row's logits
        window = graphs.window_for(window)
    heads, at = head_rows(calls, width, first, every=graphs is not None)
    inputs = ForwardInputs(width, len(heads), window, pin=first.device.type != "cpu")
    tree = inputs.tree
    inputs.late = late
    lo, hi, row = [], [], 0
    for (base, start, tree_mask), c in zip(spans, calls):
        w, t = tree_mask.shape
        if isinstance(c.offsets, Tensor):
            inputs.late.append((5, row, tree_mask))
        else:
            tree[row : row + w, :t] = tree_mask
        lo += [base] * w
        hi += [start] * w
        row += w
    for i, s in enumerate(pad_slots):  # a padding row sees only itself
        tree[n + i, 0] = True
        lo.append(s)
        hi.append(s)
    tokens, row = [], 0
    for c in calls:
        if isinstance(c.tokens, Tensor):  # written on the device, after the host's inputs arrive there
            inputs.late.append((0, row, c.tokens))
            tokens += [0] * len(c.tokens)
        else:
            tokens += c.tokens
        row += len(c.tokens)
    inputs.set_ints(tokens + [0] * extra, positions + [0] * extra, slots + pad_slots, lo, hi, heads)
    compiled = first.compiled is not None and first.compiled.holds(width)
    forward = first.compiled if compiled else first.model
    cache = first.model.kv.data
    replayed = graphs.run("compiled" if compiled else "eager", forward, inputs, cache) if graphs is not None else None
    if replayed is None:
        args = inputs.on(first.device)
        inputs.write_late(args)
        logits, hidden = forward(*args[:6], cache, args[6])
    else:  # the graph's static outputs, which its next replay overwrites: each call keeps a copy of its rows
        logits, hidden = replayed
    out, row = [], 0
    for c, j in zip(calls, at):
        w = len(c.tokens)
        r = c.runner
        r.forwards += 1
        r.compiled_forwards += compiled
        if r._recorded is not None:
            r._recorded.append(width)
        r.hidden, r.logits = hidden[0, row : row + w], (logits[0, j : j + w] if j is not None else None)
        if replayed is not None:
            r.hidden, r.logits = r.hidden.clone(), (r.logits.clone() if r.logits is not None else None)
        out.append(r.logits)
        row += w
    return out


def head_rows(calls: list[Call], width: int, first: "ModelRunner", every: bool = False
              ) -> tuple[list[int], list[int | None]]:
    """The rows of a forward whose logits are computed, and where each call's logits start among
    them (None: a prompt's rows, which need none). Every row when every call wants logits, as
    before; otherwise the wanted rows, filled with others up to a compiled width of at least the
    exactness floor: the output head then runs on as many rows as a whole forward of that width
    did when the row check measured it (the quantized head's rows are invariant at any count).
    every=True: filled up to every row (a captured forward's head takes all of them)."""
    heads, at, spare, row = [], [], [], 0
    for c in calls:
        rows = list(range(row, row + len(c.tokens)))
        at.append(len(heads) if c.logits else None)
        (heads if c.logits else spare).extend(rows)
        row += len(c.tokens)
    if not spare:  # every call wants logits: every row, padding included
        return list(range(width)), at
    spare = list(range(row, width)) + spare[::-1]  # padding rows first, then the prompt's last rows
    need = max(len(heads), first.min_width, 1)
    want = width if every else min(width, fit_width(need, first.widths) if first.widths else need)
    return heads + spare[: want - len(heads)], at
