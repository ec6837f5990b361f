"""Row invariance, measured at compile time: from which forward width on does the target score a
token bitwise the same, whatever else the forward holds?

Greedy speculative decoding is exact only if a tree verify gives every accepted token the very
logits plain decoding gives it: one flipped bit can flip a near-tie. That holds when a row's
result does not depend on the forward around it: its width, the rows beside it, where its
ancestors sit among the tree's slots, where its sequence sits in the cache. Our attention kernels are built that
way, and on CUDA every kernel of the forward (`ygg_runtime.backend`), but on a CPU the matmuls and the compiled
graph's fused kernels are the machine's: bf16 `F.linear` takes a gemv path for one row, for instance. And a
kernel's construction is a claim its bits on this machine must bear out. So this module measures.

For a few contexts (short, middling and long: the kernel's 16-slot blocks fall differently), a probe
chain x → y → z is run (1) as plain decoding runs it, one token per forward padded with dummies to
width W and committed, and (2) as one branch of a tree of width W, z's ancestors at scattered
slots with siblings and copies of x between them. For every width a generation can use, the
logits of x, y, z and the KV rows they write (every layer) must equal, bit for bit, those of plain
decoding at the widest width. The smallest width from which every wider one agrees is the plan's
`min_width`; the runtime pads every target forward to at least it (`ModelRunner.min_width`). When
not even the widest agrees with itself, there is no such width and the plan says so.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ygg_runtime.schema.plan import ExactnessRecord
from ygg_runtime.model.runner import ModelRunner

CONTEXTS = (37, 230, 1000)


def _tree(width: int, x: int, y: int, z: int, fill: list[int]) -> tuple[list[int], list[int], dict[str, list[int]]]:
    """A tree of `width` nodes holding the branch x -> y -> z at scattered offsets; the other
    nodes alternate between copies of x (depth 0, seeing only themselves) and siblings (children
    of x or y). Returns tokens, parents and the offsets of x (and its copies), y and z."""
    if width == 2:
        return [x, y], [-1, 0], {"x": [0], "y": [1], "z": []}
    if width == 3:
        return [x, y, z], [-1, 0, 1], {"x": [0], "y": [1], "z": [2]}
    y_at, z_at = max(2, width // 3), width - 1
    tokens, parents, where = [x], [-1], {"x": [0], "y": [y_at], "z": [z_at]}
    for off in range(1, width):
        if off == y_at:
            tokens.append(y), parents.append(0)
        elif off == z_at:
            tokens.append(z), parents.append(y_at)
        elif len(tokens) % 2:  # a copy of x, a root of its own
            tokens.append(x), parents.append(-1)
            where["x"].append(off)
        else:  # a sibling of y or of z
            tokens.append(fill[off]), parents.append(0 if off < y_at else y_at)
    return tokens, parents, where


def _mask(parents: list[int]) -> tuple[Tensor, list[int]]:
    n = len(parents)
    mask, depths = torch.zeros(n, n, dtype=torch.bool), [0] * n
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depths[i] = depths[p] + 1
    return mask, depths


def _kv(runner: ModelRunner, slot: int) -> Tensor:
    """The K and V rows at `slot` in every layer, as one tensor."""
    return runner.model.kv.data[:, :, :, slot].flatten()


def check(runner: ModelRunner, widths: list[int], contexts: tuple[int, ...] = CONTEXTS, seed: int = 0) -> ExactnessRecord:
    """Measure the runner's forward as it is (compiled or eager) at every width in `widths`;
    returns the record kept in plan.yaml's `exactness`."""
    start = time.time()
    widths = sorted(set(widths))
    widest = widths[-1]
    contexts = tuple(c for c in contexts if c + widest + 3 <= runner.max_len) or (max(1, runner.max_len - widest - 3),)
    saved = runner.widths, runner.min_width
    runner.widths, runner.min_width = (), 0  # every forward at exactly the width asked for
    g = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    agree = {w: True for w in widths}
    worst = {w: 0.0 for w in widths}
    one = torch.ones(1, 1, dtype=torch.bool)
    try:
        for c in contexts:
            ids = torch.randint(0, vocab, (c + 3 + widest,), generator=g).tolist()
            prefix, (x, y, z), fill = ids[:c], ids[c : c + 3], ids[c + 3 :]
            runner.reset()
            runner.prefill(prefix)
            rows: dict[int, dict[str, tuple[Tensor, Tensor]]] = {}
            for w in widths:  # plain decoding: one token per forward, padded to w
                rows[w] = {}
                for name, tok in (("x", x), ("y", y), ("z", z)):
                    logits = runner.forward([tok], [0], [0], one, w)[0].clone()
                    rows[w][name] = (logits, _kv(runner, runner.committed))
                    runner.commit([0])
                runner.committed = c
            ref = rows[widest]
            for w in widths:
                got = [(rows[w][n], ref[n]) for n in ("x", "y", "z")]
                if w >= 2:  # the same tokens in a tree of w nodes
                    tokens, parents, where = _tree(w, x, y, z, fill)
                    mask, depths = _mask(parents)
                    logits = runner.forward(tokens, list(range(w)), depths, mask, w)
                    got += [((logits[o], _kv(runner, c + o)), ref[n]) for n, offs in where.items() for o in offs]
                for (lg, kv), (ref_lg, ref_kv) in got:
                    if not (torch.equal(lg, ref_lg) and torch.equal(kv, ref_kv)):
                        agree[w] = False
                        worst[w] = max(worst[w], (lg - ref_lg).abs().max().item())
    finally:
        runner.reset()
        runner.widths, runner.min_width = saved
    min_width = None
    for w in reversed(widths):
        if not agree[w]:
            break
        min_width = w
    return ExactnessRecord(min_width, widths, agree, {w: round(d, 6) for w, d in worst.items()}, list(contexts),
                           torch.get_num_threads(), round(time.time() - start, 1))
