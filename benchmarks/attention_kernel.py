"""Our attention kernel against PyTorch's CPU attention: is a row's output independent of its layout,
and how fast is each at the shapes decoding uses (the Qwen2.5-Coder-1.5B target's: 12 query heads,
2 KV heads, head dim 128, bfloat16).

    .venv/bin/python benchmarks/attention_kernel.py [--trials N] [--repeats N] [-o FILE.json]
        [--dtype float32] [--shapes W:CONTEXT,...] [--library ARTIFACT/kernels.so]
        [--save-bits FILE.pt | --check-bits FILE.pt]

Layout: one query row whose three newest keys are (a) contiguous after the prefix, as in plain
decoding, or (b) spread over the slots of a tree verify with other keys between them; the two
outputs must be bitwise equal. Width: the same row alone and among 3 or 15 other rows. Speed: one
call at W query rows over a context of L keys (a tree's rows after it), both kernels alternating,
median of the repeats after a warm-up. `--library` times the kernels an artifact was built with
(its `kernels.so`) instead of this checkout's: run once each way, alternately, to compare two
revisions (a process registers one library); `--save-bits` with one library and `--check-bits` with
the other tell whether they give the same bits on random calls (dtypes, head counts and dimensions,
widths, prefixes, trees and cache layouts drawn from a fixed seed). Run it alone on the machine.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from ygg_bench import harness
from ygg_runtime.backend import native

H, KV, D = 12, 2, 128
BIT_CALLS = 400  # --save-bits / --check-bits
DTYPE = torch.bfloat16  # --dtype sets it


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)


def ygg(q, k, v, mask):
    """Our kernel over k, v [1, KV, S, D] with a mask [W, S]: each row's view given as its tree
    window from slot 0 (the kernel's general form); the call's own new rows are written past S."""
    (_, kv, s, d), w = k.shape, q.shape[2]
    cache = torch.zeros(1, 2, kv, s + w, d, dtype=k.dtype)
    cache[0, 0, :, :s], cache[0, 1, :, :s] = k[0], v[0]
    zeros, new = torch.zeros(w, dtype=torch.long), torch.zeros(1, kv, w, d, dtype=k.dtype)
    return native.attention(q, new, new, cache, 0, torch.arange(s, s + w), zeros, zeros, mask)


IMPLS = {"ygg": ygg, "sdpa": sdpa}


def layout_trials(trials: int, context: int = 100) -> dict[str, dict[str, int]]:
    """How often a row's output is bitwise the same (a) with holes among its keys, (b) at another width."""
    g = torch.Generator().manual_seed(0)
    same = {name: {"holes": 0, "width": 0} for name in IMPLS}
    for _ in range(trials):
        k = torch.randn(1, KV, 256, D, generator=g).to(DTYPE)
        v = torch.randn(1, KV, 256, D, generator=g).to(DTYPE)
        q = (torch.randn(1, H, 16, D, generator=g) * 3).to(DTYPE)
        plain = torch.zeros(16, 256, dtype=torch.bool)
        plain[:, : context + 3] = True
        k2, v2 = k.clone(), v.clone()
        for depth, slot in ((1, context + 5), (2, context + 9)):  # ancestors moved apart; others fill the holes
            k2[:, :, slot], v2[:, :, slot] = k[:, :, context + depth], v[:, :, context + depth]
            k2[:, :, context + depth] = torch.randn(KV, D, generator=g).to(DTYPE)
            v2[:, :, context + depth] = torch.randn(KV, D, generator=g).to(DTYPE)
        tree = torch.zeros(16, 256, dtype=torch.bool)
        tree[:, : context + 1] = True
        tree[:, [context + 5, context + 9]] = True
        for name, fn in IMPLS.items():
            a = fn(q[:, :, :4], k, v, plain[:4])[:, :, 0]
            same[name]["holes"] += torch.equal(a, fn(q[:, :, :4], k2, v2, tree[:4])[:, :, 0])
            same[name]["width"] += all(torch.equal(a, fn(q[:, :, :w], k, v, plain[:w])[:, :, 0]) for w in (1, 2, 16))
    return same


def random_calls(n: int) -> list[torch.Tensor]:
    """The kernel's outputs on n random calls drawn from a fixed seed: float32, bfloat16 and float16;
    1-3 KV heads of 1-12 query heads each; head dims 16-128; 1-64 rows, each with its own prefix
    range in a cache of up to ~1 300 slots and its own tree window; the rows' new keys written to
    random slots."""
    rng = random.Random(0)
    outs = []
    for trial in range(n):
        dt = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        kv, groups, d = rng.choice([1, 2, 3]), rng.choice([1, 2, 5, 6, 8, 9, 12]), rng.choice([16, 40, 64, 80, 96, 128])
        w = rng.choice([1, 2, 3, 8, 16, 33, 64])
        t = rng.choice([w, w + 5])
        s = rng.choice([64, 300, 1200]) + w + t + 20
        g = torch.Generator().manual_seed(trial)
        q = (torch.randn(1, kv * groups, w, d, generator=g) * rng.choice([0.5, 3, 10])).to(dt)
        k, v = torch.randn(1, kv, w, d, generator=g).to(dt), torch.randn(1, kv, w, d, generator=g).to(dt)
        cache = torch.randn(2, 2, kv, s, d, generator=g).to(dt)
        lo, hi = torch.zeros(w, dtype=torch.long), torch.zeros(w, dtype=torch.long)
        tree, slots = torch.zeros(w, t, dtype=torch.bool), torch.empty(w, dtype=torch.long)
        for r in range(w):
            lo[r] = rng.randrange(0, s - t - 1)
            hi[r] = lo[r] if rng.random() < 0.15 else rng.randrange(int(lo[r]), s - t)
            tree[r] = torch.tensor([rng.random() < 0.3 for _ in range(t)])
            slots[r] = rng.randrange(0, s)
        outs.append(native.attention(q, k, v, cache, rng.randrange(0, 2), slots, lo, hi, tree))
    return outs


def timings(shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for w, context in shapes:
        span = -(-(context + w) // 256) * 256
        k = torch.randn(1, KV, span, D, generator=g).to(DTYPE)
        v = torch.randn(1, KV, span, D, generator=g).to(DTYPE)
        q = torch.randn(1, w, H, D, generator=g).to(DTYPE).transpose(1, 2)  # the model's layout
        mask = torch.zeros(w, span, dtype=torch.bool)
        mask[:, :context] = True
        mask[:, context : context + w] = torch.ones(w, w, dtype=torch.bool).tril()
        # ours as the model calls it: the new rows written after the prefix, each row seeing the
        # prefix range and its tree window (a chain here)
        cache = torch.stack([k[0], v[0]])[None]
        view = (cache, 0, torch.arange(context, context + w), torch.zeros(w, dtype=torch.long),
                torch.full((w,), context), torch.ones(w, w, dtype=torch.bool).tril())
        calls = {"ygg": lambda: native.attention(q, k[:, :, context : context + w], v[:, :, context : context + w], *view),
                 "sdpa": lambda: sdpa(q, k, v, mask)}
        ms = harness.medians(harness.interleaved(calls, repeats), 4)
        rows.append({"width": w, "context": context, **{f"{n}_ms": t for n, t in ms.items()}})
    return rows


def main() -> None:
    ap = harness.parser(__doc__, repeats=21)
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--shapes", default="2:300,4:300,8:300,16:300,16:1000,64:600,512:512", help="WIDTH:CONTEXT,...")
    ap.add_argument("--library", type=Path, help="a kernels.so to time (an artifact's) instead of this checkout's")
    bits = ap.add_mutually_exclusive_group()
    bits.add_argument("--save-bits", type=Path, help="save the outputs of random calls there, and stop")
    bits.add_argument("--check-bits", type=Path, help="compare the outputs of the same calls with a saved file")
    args = harness.parse(ap)
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    native.load(args.library)
    if args.save_bits or args.check_bits:
        outs = random_calls(BIT_CALLS)
        if args.save_bits:
            torch.save(outs, args.save_bits)
            print(f"{len(outs)} calls' outputs saved to {args.save_bits}")
        else:
            saved = torch.load(args.check_bits)
            def bits(t):  # NaNs compare too
                return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

            same = sum(torch.equal(bits(a), bits(b)) for a, b in zip(outs, saved, strict=True))
            print(f"{same}/{len(outs)} calls bitwise the same as {args.check_bits}'s")
        return
    same = layout_trials(args.trials)
    for name, counts in same.items():
        print(f"{name}: row bitwise the same with holes among its keys in {counts['holes']}/{args.trials} trials, "
              f"at widths 1, 2, 4 and 16 in {counts['width']}/{args.trials}")
    shapes = [tuple(int(x) for x in shape.split(":")) for shape in args.shapes.split(",")]
    rows = timings(shapes, args.repeats)
    print(f"{'W':>4} {'context':>8} {'ygg ms':>8} {'sdpa ms':>8}  (one call; a forward makes one per layer)")
    for r in rows:
        print(f"{r['width']:>4} {r['context']:>8} {r['ygg_ms']:>8.3f} {r['sdpa_ms']:>8.3f}")
    if args.out:
        harness.write_json(args.out, {"dtype": args.dtype, "library": str(native.loaded()), "trials": args.trials,
                                      "layout": same, "timings": rows})


if __name__ == "__main__":
    main()
