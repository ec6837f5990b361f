"""The cache on demand, measured: what a region move costs against a decoding step, and whether a
forward's cost depends on the size of the cache it runs over (it must not: `ygg serve` sizes the
cache by memory, tens of thousands of slots).

    .venv/bin/python benchmarks/kv_cache.py [ARTIFACT] [--repeats 7] [-o FILE.json]

Moves: a sequence of n tokens moved to another place of the cache (`kv.move`, both models' rows,
what `Batch` does when a region cannot grow in place), n = 512, 1024, 2048, 4096; medians. A step:
the target's verify forward of 8 rows at a context of 1000 and the drafter's of 1 row, as a
`ygg serve` step of one `egt` request runs them (medians). Cache size: the same target forward
(8 rows, context 1000) over the artifact's own cache and over one of 65 536 slots, alternating,
the order flipped every repeat. Run it alone on the machine.
"""

from __future__ import annotations

import torch

import ygg_runtime
from ygg_bench import harness
from ygg_runtime.model.kv import move

POOL = 65536


def main() -> None:
    args = harness.parse(harness.parser(__doc__, artifact="artifacts/default", repeats=7))
    dec = ygg_runtime.load(args.artifact)
    runners = dec.runners
    target, draft = runners["target"], runners.get("draft")
    own = target.model.max_len
    torch.set_grad_enabled(False)

    def chain(runner, width: int):
        """One forward of `width` chain rows after 1000 committed (garbage) rows."""
        return lambda: runner.forward_chain(list(range(100, 100 + width)))

    def over(slots: int) -> None:  # a new cache, its pages touched by a first forward
        target.model.setup_cache(slots)
        target.reset(1000)
        chain(target, 8)()
        target.reset(1000)

    # a forward over the artifact's own cache and over a 64k-slot one, alternating
    sizes = harness.interleaved({own: chain(target, 8), POOL: chain(target, 8)}, args.repeats, warmup=0, setup=over)
    cache_ms = {str(s): ms for s, ms in harness.medians(sizes, 2).items()}
    print(f"target forward, 8 rows at context 1000: {cache_ms[str(own)]} ms over a {own}-slot cache, "
          f"{cache_ms[str(POOL)]} ms over {POOL}")

    # a step of one request, and moves of n tokens (both models' rows), on a 64k-slot cache
    for r in runners.values():
        r.model.setup_cache(POOL)
    step = {"verify": chain(target, 8)} | ({"draft": chain(draft, 1)} if draft else {})
    step_ms = harness.medians(harness.interleaved(step, args.repeats, setup=lambda n: runners["target" if n == "verify" else "draft"].reset(1000)), 2)
    verify, drafting = step_ms["verify"], step_ms.get("draft", 0.0)
    there = {}  # a move goes back and forth between two places, so each call has a sequence to move

    def mover(n: int):
        def call() -> None:
            src, dst = there.get(n, (100, 30000))
            for r in runners.values():
                move(r.model.kv, src, n, dst)
            there[n] = (dst, src)
        return call

    moves = {str(n): ms for n, ms in harness.medians(harness.interleaved({n: mover(n) for n in (512, 1024, 2048, 4096)},
                                                                       args.repeats), 2).items()}
    for n, ms in moves.items():
        print(f"move of {n} tokens (both models): {ms} ms")
    per_token = dec.kv_bytes_per_token()
    print(f"a step of one request: verify {verify:.1f} ms + a drafter forward {drafting:.1f} ms; "
          f"{per_token / 1024:.0f} KiB a token")
    if args.out:
        harness.write_json(args.out, {
            "artifact": str(args.artifact), "kv_bytes_per_token": per_token, "forward_ms_by_cache_slots": cache_ms,
            "verify_ms_w8_ctx1000": verify, "draft_ms_w1_ctx1000": drafting, "move_ms_by_tokens": moves})


if __name__ == "__main__":
    main()
