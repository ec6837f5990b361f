"""How far ahead `ygg::qlinear` should ask for weight bytes, by forward width, on this machine: the
1.5B target's linears (28 layers of wqkv, wo, w13, w2, 4-bit codes in Q4_K's format) in huge pages as
a loaded model holds them, timed at each width with each YGG_PREFETCH distance (0: each line asked
for only where it is about to be read, so only the hardware prefetchers run ahead) and with the
kernel's own choice ("default", YGG_PREFETCH unset: a few lines ahead where a call reads each tile
in one pass, a tile ahead where it takes several; csrc/qlinear.cpp, prefetch_ahead), beside the read
bandwidth measured in the same process between the timings (this VM's bandwidth moves between runs,
so each time is set against its own). The distance is fixed per process: each setting runs in a
child of its own, settings alternating round by round, medians kept, ratios paired per round.

    .venv/bin/python benchmarks/qlinear_prefetch.py [--distances 0,16384,65536,262144] [--widths 1,2,4,8,16]
        [--rounds 4] [--repeats 7] [-o DIR]

Writes DIR/qlinear_prefetch.json and .md (DIR defaults to benchmarks/results/<device>-prefetch/).
Run it alone on the machine: item 2 of issue 46 (T(1) at its floor) asks where a one-row forward
loses time against the weight stream, and the answer differs by CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qlinear_kernels import LAYERS, SHAPES, forward, inputs, random_codes

from ygg_bench import harness
from ygg_runtime.backend import native
from ygg_runtime.model.quant import pack

DEFAULT = "default"  # the setting that leaves YGG_PREFETCH unset: the kernel's own distance by width


def child(widths: list[int], repeats: int, bits: int = 4, shapes: tuple = SHAPES, layers: int = LAYERS) -> dict:
    """This process's kernel (its distance, or its library: qlinear_ab.py): ms per forward (LAYERS
    layers of `shapes`, taken round-robin from `layers` distinct ones: 1 keeps a small one in cache)
    at each width, and the read bandwidth between them."""
    g = torch.Generator().manual_seed(0)
    held = [[{k: native.huge_copy(v) if k == "data" else v for k, v in pack(random_codes(n, k, bits, g)).items()}
             for n, k in shapes] for _ in range(layers)]
    nbytes = sum(p["data"].numel() for layer in held for p in layer) * LAYERS // layers  # read per forward
    x = torch.randn(max(widths), max(k for _, k in SHAPES), generator=g).to(torch.bfloat16)
    xs = {w: inputs(x[:w]) for w in widths}

    def layer(x: dict, i: int) -> list:
        return [native.qlinear(x[k], p["data"], p["layout"], None) for p, (_, k) in zip(held[i % layers], shapes)]

    bandwidth = []  # read between the timings: each round's own
    fns = {w: forward(layer, xs[w]) for w in widths} | {"bandwidth": lambda: bandwidth.append(native.read_bandwidth(1 << 29, 3))}
    samples = harness.interleaved(fns, repeats)
    return {"ms": {w: statistics.median(samples[w]) for w in widths}, "bandwidth": statistics.median(bandwidth),
            "bytes": nbytes, "path": native.qlinear_path()}


def markdown(r: dict) -> str:
    widths, dists = r["widths"], r["distances"]
    lines = [f"### qlinear's prefetch distance by width: {r['cpu']}", "",
             (f"ms per forward of the 1.5B target's linears at 4 bits ({r['bytes'] / 1e6:.0f} MB in huge pages, "
             f"{LAYERS} layers), {r['threads']} threads, path {r['path']}, torch {r['torch']}; median of {r['rounds']} rounds "
             f"(each a child process per distance, settings alternating) of {r['repeats']} repeats. In brackets: the "
             f"time over the kernel's own distance's (YGG_PREFETCH unset), paired per round, median. Read bandwidth measured "
             f"beside the timings: median {r['bandwidth_gbs']:.1f} GB/s (rounds {min(r['bandwidth_each']):.1f}–"
             f"{max(r['bandwidth_each']):.1f}); 'x floor' = time / (bytes / that round's bandwidth), median."), "",
             "| YGG_PREFETCH | " + " | ".join(f"M={w}" for w in widths) + f" | M={widths[0]} x floor |",
             "|---|" + "---|" * (len(widths) + 1)]
    for d in dists:
        cells = [f"{r['ms'][str(d)][str(w)]:.1f} ({r['vs_default'][str(d)][str(w)]:.2f})" for w in widths]
        lines.append(f"| {d} | " + " | ".join(cells) + f" | {r['of_floor_m1'][str(d)]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__, repeats=7, widths="1,2,4,8,16")
    ap.add_argument("--distances", default="0,16384,65536,262144")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = harness.parse(ap)
    widths = args.widths
    if args.child:
        print(json.dumps(child(widths, args.repeats)))
        return
    from ygg_compile import hardware

    dists = [d.strip() for d in args.distances.split(",")]
    if bad := [d for d in dists if not d.isdigit() and d != DEFAULT]:  # the kernel would read a word as 0
        ap.error(f"--distances must be byte counts (or {DEFAULT!r}), not {', '.join(bad)}")
    if DEFAULT not in dists:
        dists.append(DEFAULT)
    runs: dict[str, list[dict]] = {d: [] for d in dists}
    for rnd in range(args.rounds):
        for d in dists if rnd % 2 == 0 else dists[::-1]:
            env = {k: v for k, v in os.environ.items() if k != "YGG_PREFETCH"}
            if d != DEFAULT:
                env["YGG_PREFETCH"] = d
            runs[d].append(harness.child_json([sys.executable, __file__, "--child", "--widths", ",".join(map(str, widths)),
                                               "--repeats", str(args.repeats)], env, f"for YGG_PREFETCH={d}"))
            print(f"round {rnd + 1} YGG_PREFETCH={d}: " + " ".join(f"M={w} {runs[d][-1]['ms'][str(w)]:.1f}" for w in widths)
                  + f" ms, {runs[d][-1]['bandwidth'] / 1e9:.1f} GB/s", flush=True)
    bw = [run["bandwidth"] for d in dists for run in runs[d]]
    nbytes = runs[dists[0]][0]["bytes"]
    result = {
        "cpu": hardware.cpu_info().model, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "path": runs[dists[0]][0]["path"], "rounds": args.rounds, "repeats": args.repeats, "widths": widths,
        "distances": dists, "bytes": nbytes, "bandwidth_gbs": statistics.median(bw) / 1e9,
        "bandwidth_each": [round(b / 1e9, 1) for b in bw],
        "ms": {str(d): {str(w): statistics.median(run["ms"][str(w)] for run in runs[d]) for w in widths} for d in dists},
        "vs_default": {str(d): {str(w): statistics.median(a["ms"][str(w)] / b["ms"][str(w)] for a, b in zip(runs[d], runs[DEFAULT]))
                                for w in widths} for d in dists},
        "of_floor_m1": {str(d): statistics.median(run["ms"][str(widths[0])] / (1000 * nbytes / run["bandwidth"]) for run in runs[d])
                        for d in dists},
        "runs": {str(d): runs[d] for d in dists},
    }
    out = harness.output(args.out, "-prefetch")
    harness.write_json(out / "qlinear_prefetch.json", result, markdown=markdown(result))
    print(markdown(result))
    print(f"wrote {out}/qlinear_prefetch.json and .md")


if __name__ == "__main__":
    main()
