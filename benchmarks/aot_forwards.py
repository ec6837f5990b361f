"""The compiled forward against the eager one on an artifact's target, and the bandwidth floor.

    .venv/bin/python benchmarks/aot_forwards.py [ARTIFACT] [--repeats N] [--out FILE.json]

For each context and width: one forward over W new tokens after C committed ones, eager and
compiled alternating (the order flipped every repeat), the median of the repeats after a warm-up.
The floor of a plain decoding step is the target's weight bytes over the machine's read bandwidth,
measured here by summing a buffer far larger than the caches. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import ygg_runtime


def read_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes per second of streaming reads (a sum over a `gib` GiB buffer), best of `repeats`."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)  # float32: a sum with no conversion
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?", default="artifacts/default")
    ap.add_argument("--widths", default="1,2,4,8,16,32")
    ap.add_argument("--contexts", default="64,512,2048")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dec = ygg_runtime.load(args.artifact)
    runner = dec.target
    compiled, runner.widths = runner.compiled, ()  # every width as it is, unpadded
    if compiled is None:
        raise SystemExit("this artifact has no compiled forwards")
    tokens = torch.randint(0, runner.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for context in map(int, args.contexts.split(",")):
        for w in map(int, args.widths.split(",")):
            times = {"eager": [], "compiled": []}
            for r in range(args.repeats + 1):
                for mode in ("eager", "compiled") if r % 2 else ("compiled", "eager"):
                    runner.compiled = compiled if mode == "compiled" else None
                    runner.reset(context)
                    start = time.perf_counter()
                    runner.forward_chain(tokens[:w])
                    if r:
                        times[mode].append(1000 * (time.perf_counter() - start))
            e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
            rows.append({"context": context, "width": w, "eager_ms": round(e, 1), "compiled_ms": round(c, 1),
                         "speedup": round(e / c, 3)})
            print(f"context {context:5d}  W {w:3d}  eager {e:7.1f} ms  compiled {c:7.1f} ms  {e / c:.2f}×", flush=True)
    runner.compiled = compiled
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
    bandwidth = read_bandwidth()
    floor_ms = 1000 * weight_bytes / bandwidth
    print(f"target weights {weight_bytes / 1e9:.2f} GB, read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"floor {floor_ms:.0f} ms per plain step")
    if args.out:
        args.out.write_text(json.dumps({"artifact": args.artifact, "rows": rows, "weight_bytes": weight_bytes,
                                        "read_bandwidth": bandwidth, "floor_ms": floor_ms}, indent=1) + "\n")


if __name__ == "__main__":
    main()
