"""`ygg::qlinear` before and after a change: the same forwards timed under two revisions of the
runtime, each built from its own git worktree into its own cache, a child process per revision,
the order alternating round by round, the read bandwidth measured in each child beside its timings
(this VM's bandwidth moves between processes, so a memory-bound width compares only rounds whose two
children saw the same bandwidth). What a kernel change must show before it lands: nothing slower.

    .venv/bin/python benchmarks/qlinear_ab.py BEFORE AFTER [--bits 4,6,8] [--widths 1,2,4,8,16,32,64]
        [--rounds 6] [--repeats 5] [--in-cache] [-o DIR]

BEFORE and AFTER are git revisions of this repository ("." for the working tree as it is). The
forward: the 1.5B target's linears (28 layers of wqkv, wo, w13, w2) in huge pages, random codes in
Q4_K's (4 bits), Q6_K's (6) or 8-bit formats (`qlinear_kernels.random_codes`); --in-cache runs one
wo (1536 x 1536) 28 x 4 times instead, which stays in the caches: the instructions' cost alone.
Writes DIR/qlinear_ab.json and .md (DIR defaults to benchmarks/results/<device>-kernels/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qlinear_kernels import LAYERS, SHAPES
from qlinear_prefetch import child

from ygg_bench import harness

REPO = Path(__file__).resolve().parent.parent
IN_CACHE = ((1536, 1536),) * 4  # wo four times a layer: 1.3-2.4 MB, the two cores' L2 and the L3 hold it
SAME = 0.05  # two children "saw the same bandwidth" within this fraction


def tree(rev: str, root: Path) -> tuple[Path, str]:
    """The revision's source tree (a detached worktree; "." is this one) and its commit."""
    if rev == ".":
        return REPO, "working tree"
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"qlinear_ab: {rev!r} is not a revision of this repository")
    commit = found.stdout.strip()
    path = root / commit
    if not path.exists():  # the same revision on both sides (the run's noise) shares one tree
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), commit], check=True, capture_output=True)
    return path, commit


def revision_child(src: Path, cache: Path, args: argparse.Namespace, bits: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "YGG_CACHE": str(cache)}
    cmd = [sys.executable, __file__, "--child", "--bits", str(bits), "--widths", ",".join(map(str, args.widths)),
           "--repeats", str(args.repeats)]
    return harness.child_json(cmd + (["--in-cache"] if args.in_cache else []), env, f"under {src}")


def ratios(before: list[dict], after: list[dict], w: str, same_only: bool) -> list[float]:
    return [a["ms"][w] / b["ms"][w] for b, a in zip(before, after)
            if not same_only or abs(a["bandwidth"] - b["bandwidth"]) <= SAME * b["bandwidth"]]


def markdown(r: dict) -> str:
    widths = [str(w) for w in r["widths"]]
    what = (f"one wo (1536 x 1536) {LAYERS * len(IN_CACHE)} times, held in the caches" if r["in_cache"] else
            f"the 1.5B target's linears ({LAYERS} layers: wqkv, wo, w13, w2) in huge pages")
    lines = [f"### ygg::qlinear, {r['before']} against {r['after']}: {r['cpu']}", "",
             (f"ms per forward of {what}, {r['threads']} threads, path {r['path']}, torch {r['torch']}; {r['rounds']} rounds, "
             f"each a child process per revision (order alternating) timing {r['repeats']} repeats (median). after/before: "
             f"paired per round, median and range; 'same bw': only the rounds whose two children measured the same read "
             f"bandwidth (within {SAME:.0%}; how many in brackets) — the fair ratio at memory-bound widths. "
             f"Bandwidth in the children {min(r['bandwidth_each']):.0f}–{max(r['bandwidth_each']):.0f} GB/s."), "",
             "| bits | | " + " | ".join(f"M={w}" for w in widths) + " |", "|---|---|" + "---|" * len(widths)]
    for bits, runs in r["runs"].items():
        b, a = runs["before"], runs["after"]
        lines.append(f"| {bits} | before | " + " | ".join(f"{statistics.median(x['ms'][w] for x in b):.2f}" for w in widths) + " |")
        lines.append("| | after | " + " | ".join(f"{statistics.median(x['ms'][w] for x in a):.2f}" for w in widths) + " |")
        cells = []
        for w in widths:
            q = ratios(b, a, w, False)
            cells.append(f"{statistics.median(q):.2f} ({min(q):.2f}–{max(q):.2f})")
        lines.append("| | after/before | " + " | ".join(cells) + " |")
        same = [ratios(b, a, w, True) for w in widths]
        lines.append("| | same bw | " + " | ".join(f"{statistics.median(q):.2f} [{len(q)}]" if q else "–" for q in same) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__, repeats=5, widths="1,2,4,8,16,32,64")
    ap.add_argument("before", nargs="?")
    ap.add_argument("after", nargs="?")
    ap.add_argument("--bits", type=harness.ints, default=[4, 6, 8])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--in-cache", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = harness.parse(ap)
    widths, bits = args.widths, args.bits
    if args.child:
        shapes, layers = (IN_CACHE, 1) if args.in_cache else (SHAPES, LAYERS)
        print(json.dumps(child(widths, args.repeats, bits[0], shapes, layers)))
        return
    if not (args.before and args.after):
        ap.error("name two revisions: BEFORE AFTER (\".\" for the working tree)")
    from ygg_compile import hardware

    with tempfile.TemporaryDirectory(prefix="ygg-qlinear-ab-") as tmp:
        root = Path(tmp)
        trees = {}
        try:
            for side, rev in (("before", args.before), ("after", args.after)):
                trees[side] = tree(rev, root)
            runs = {b: {"before": [], "after": []} for b in bits}
            for rnd in range(args.rounds):
                for b in bits:
                    for side in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
                        run = revision_child(trees[side][0], root / f"cache-{side}", args, b)
                        runs[b][side].append(run)
                        print(f"round {rnd + 1} {b}-bit {side}: " + " ".join(f"M={w} {run['ms'][str(w)]:.2f}" for w in widths)
                              + f" ms, {run['bandwidth'] / 1e9:.1f} GB/s", flush=True)
        finally:
            for path, commit in trees.values():
                if path != REPO:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False, capture_output=True)
    first = runs[bits[0]]["before"][0]
    result = {"cpu": hardware.cpu_info().model, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "path": first["path"], "before": trees["before"][1], "after": trees["after"][1], "in_cache": args.in_cache,
              "rounds": args.rounds, "repeats": args.repeats, "widths": widths,
              "bandwidth_each": [round(x["bandwidth"] / 1e9, 1) for r in runs.values() for s in r.values() for x in s],
              "runs": {str(b): r for b, r in runs.items()}}
    out = harness.output(args.out, "-kernels")
    name = "qlinear_ab_in_cache" if args.in_cache else "qlinear_ab"
    harness.write_json(out / f"{name}.json", result, markdown=markdown(result))
    print(markdown(result))
    print(f"wrote {out}/{name}.json and .md")


if __name__ == "__main__":
    main()
