"""The cache on demand, measured: what a region move costs against a decoding step, and whether a
forward's cost depends on the size of the cache it runs over (it must not: `ygg serve` sizes the
cache by memory, tens of thousands of slots).

    .venv/bin/python benchmarks/kv_cache.py [ARTIFACT] [--repeats 7] [--out FILE.json]

Moves: a sequence of n tokens moved to another place of the cache (`kv.move`, both models' rows,
what `Batch` does when a region cannot grow in place), n = 512, 1024, 2048, 4096; medians. A step:
the target's verify forward of 8 rows at a context of 1000 and the drafter's of 1 row, as a
`ygg serve` step of one `egt` request runs them (medians). Cache size: the same target forward
(8 rows, context 1000) over the artifact's own cache and over one of 65 536 slots, alternating,
the order flipped every repeat. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import ygg_runtime
from ygg_runtime.integrity import cpu_info
from ygg_runtime.kv import move

POOL = 65536


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def forward(runner, context: int, width: int) -> float:
    """ms of one forward of `width` chain rows after `context` committed (garbage) rows."""
    runner.reset(context)
    return timed(lambda: runner.forward_chain(list(range(100, 100 + width))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?", default="artifacts/default")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dec = ygg_runtime.load(args.artifact)
    runners = dec.runners
    target, draft = runners["target"], runners.get("draft")
    own = target.model.max_len
    torch.set_grad_enabled(False)

    # a forward over the artifact's own cache and over a 64k-slot one, alternating
    sizes = {own: [], POOL: []}
    for r in range(args.repeats + 1):
        for slots in (sizes if r % 2 else list(sizes)[::-1]):
            target.model.setup_cache(slots)
            forward(target, 1000, 8)  # the first call after a new cache touches its pages
            ms = forward(target, 1000, 8)
            if r:
                sizes[slots].append(ms)
    cache_ms = {str(s): round(statistics.median(v), 2) for s, v in sizes.items()}
    print(f"target forward, 8 rows at context 1000: {cache_ms[str(own)]} ms over a {own}-slot cache, "
          f"{cache_ms[str(POOL)]} ms over {POOL}")

    # a step of one request, and moves of n tokens (both models' rows), on a 64k-slot cache
    for r in runners.values():
        r.model.setup_cache(POOL)
    verify = statistics.median(forward(target, 1000, 8) for _ in range(args.repeats))
    drafting = statistics.median(forward(draft, 1000, 1) for _ in range(args.repeats)) if draft else 0.0
    moves = {}
    for n in (512, 1024, 2048, 4096):
        samples = []
        for i in range(args.repeats + 1):
            src, dst = (100, 30000) if i % 2 else (30000, 100)
            ms = sum(timed(lambda r=r: move(r.model.kv, src, n, dst)) for r in runners.values())
            if i:
                samples.append(ms)
        moves[str(n)] = round(statistics.median(samples), 2)
        print(f"move of {n} tokens (both models): {moves[str(n)]} ms")
    per_token = dec.kv_bytes_per_token()
    print(f"a step of one request: verify {verify:.1f} ms + a drafter forward {drafting:.1f} ms; "
          f"{per_token / 1024:.0f} KiB a token")
    if args.out:
        args.out.write_text(json.dumps({
            "machine": cpu_info().model, "threads": torch.get_num_threads(), "artifact": args.artifact,
            "kv_bytes_per_token": per_token, "forward_ms_by_cache_slots": cache_ms,
            "verify_ms_w8_ctx1000": round(verify, 2), "draft_ms_w1_ctx1000": round(drafting, 2),
            "move_ms_by_tokens": moves}, indent=1) + "\n")


if __name__ == "__main__":
    main()
