"""The compiled forward against the eager one on an artifact's target, and the bandwidth floor.

    .venv/bin/python benchmarks/aot_forwards.py [ARTIFACT] [--repeats N] [-o FILE.json]

For each context and width: one forward over W new tokens after C committed ones, eager and
compiled alternating (the order flipped every repeat), the median of the repeats after a warm-up.
The floor of a plain decoding step is the target's weight bytes over the machine's read bandwidth,
measured beside the run (`ygg_bench.harness.roofs`). Run it alone on the machine.
"""

from __future__ import annotations

import torch

import ygg_runtime
from ygg_bench import harness
from ygg_compile.roofline import model_costs


def main() -> None:
    ap = harness.parser(__doc__, artifact="artifacts/default", repeats=7, widths="1,2,4,8,16,32")
    ap.add_argument("--contexts", type=harness.ints, default=[64, 512, 2048], help="committed tokens before the forward")
    args = harness.parse(ap)
    dec = ygg_runtime.load(args.artifact)
    runner = dec.target
    compiled, runner.widths = runner.compiled, ()  # every width as it is, unpadded
    if compiled is None:
        raise SystemExit("this artifact has no compiled forwards")
    tokens = torch.randint(0, runner.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for context in args.contexts:
        for w in args.widths:
            def setup(mode: str) -> None:
                runner.compiled = compiled if mode == "compiled" else None
                runner.reset(context)

            def forward() -> None:
                runner.forward_chain(tokens[:w])
            ms = harness.medians(harness.interleaved({"compiled": forward, "eager": forward}, args.repeats, setup=setup), 1)
            e, c = ms["eager"], ms["compiled"]
            rows.append({"context": context, "width": w, "eager_ms": e, "compiled_ms": c, "speedup": round(e / c, 3)})
            print(f"context {context:5d}  W {w:3d}  eager {e:7.1f} ms  compiled {c:7.1f} ms  {e / c:.2f}×", flush=True)
    runner.compiled = compiled
    weight_bytes = model_costs(runner.model).weight_bytes
    roofs = harness.roofs()
    floor_ms = 1000 * weight_bytes / roofs.bandwidth
    print(f"target weights {weight_bytes / 1e9:.2f} GB, read bandwidth {roofs.bandwidth / 1e9:.1f} GB/s, "
          f"floor {floor_ms:.0f} ms per plain step")
    if args.out:
        harness.write_json(args.out, {"artifact": str(args.artifact), "rows": rows, "weight_bytes": weight_bytes,
                                      "floor_ms": floor_ms}, measured=roofs)


if __name__ == "__main__":
    main()
