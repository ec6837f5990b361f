"""This machine's roofline and an artifact's forwards against it: for the target and the drafter,
each forward width's time (one forward over W new tokens after C committed ones, compiled and
eager, interleaved, median of the repeats) beside the two floors no forward can beat,
max(bytes read / read bandwidth, W x multiply-adds / int8 peak), both roofs measured here by the
kernel library on the torch threads (ygg_compile.roofline).

    .venv/bin/python benchmarks/roofline.py [ARTIFACT] [--widths 1,2,4,8,16] [--context 100]
        [--repeats 7] [-o DIR] [--label before]

Writes DIR/roofline[-LABEL].json and .md, and DIR/roofline.png (every labelled run in DIR, one
panel per model); DIR defaults to benchmarks/results/<device>-roofline/. Run it alone on the machine.

Where a forward's time above its floor goes (--ops, width 1 by default; --ops "" skips it): a few
forwards of that width under torch.profiler, each of our ops' ms per forward and, for every weight
shape, the rate `ygg::qlinear` read it at against the read bandwidth measured around it (1.00: that
linear at its own floor), and what is left of an unprofiled forward's time: the compiled graph's
fused kernels, its wrapper and the runner, which the profiler does not see one by one.

Which kernels it times: measuring the roofs registers this checkout's library first, and the
artifact loaded after it runs on that one, not on the kernels.so the artifact carries (which
`ygg_runtime.load` alone, or a run with --roofs, would use). To time another revision's kernels,
register its library (`native.load(path)`) before running this file.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import torch

import ygg_runtime
from ygg_bench import harness
from ygg_compile import hardware
from ygg_compile.plots import figure, png
from ygg_compile.roofline import Roofs, model_costs, table
from ygg_runtime.files import write_atomic


SAME = 0.1  # two reads of the bandwidth "agree" within this fraction (this VM's two states differ by ~1.8x)


def forward_ms(runner, widths: list[int], context: int, repeats: int) -> dict[str, list[float]]:
    """Median ms per width of the compiled forward (when the artifact has one) and the eager one."""
    compiled, floor, runner.widths, runner.min_width = runner.compiled, runner.min_width, (), 0  # every width as it is
    modes = ["compiled", "eager"] if compiled is not None else ["eager"]
    tokens = torch.randint(0, runner.vocab_size, (max(widths),), generator=torch.Generator().manual_seed(0)).tolist()

    def setup(case: tuple[str, int]) -> None:
        runner.compiled = compiled if case[0] == "compiled" else None
        runner.reset(context)

    calls = {(m, w): (lambda w=w: runner.forward_chain(tokens[:w])) for w in widths for m in modes}
    samples = harness.interleaved(calls, repeats, setup=setup)
    runner.compiled, runner.min_width = compiled, floor
    runner.reset()
    return {m: [statistics.median(samples[(m, w)]) for w in widths] for m in modes}


def weight_names(model) -> dict[int, str]:
    """Each quantized weight's byte count -> what it is ("feed_forward.w13 17920x1536 4+4-bit"):
    how a profiled `ygg::qlinear` call, known by its inputs' shapes, is named."""
    from ygg_runtime.model.quant import QLinear

    found: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, QLinear):
            bits = "+".join(str(int(b)) for b in m.layout[:, 2])
            where = re.sub(r"^layers\.[0-9]+\.", "", name)  # one name for every layer's
            what = f"{where} {m.out_features}x{m.in_features} {bits}-bit"
            found.setdefault(m.data.numel(), []).append(what)
    return {n: " / ".join(dict.fromkeys(names)) for n, names in found.items()}


def where_time_goes(runner, width: int, context: int, repeats: int) -> dict:
    """One width's forward (compiled where the artifact has it) taken apart: `repeats` times, between
    two short reads of the bandwidth (this VM's moves between ~45 and ~80 GB/s within seconds), a
    forward to warm the caches again, one timed and one under torch.profiler. Of the repeats whose
    two reads agree (all, when none do), the medians: the timed forward, each of our ops' ms in the
    profiled one (a qlinear's by the weight it read, with that read's rate over the repeat's
    bandwidth), and the rest of the time."""
    from torch.profiler import ProfilerActivity, profile

    from ygg_runtime.backend import native

    floor, runner.widths, runner.min_width = runner.min_width, (), 0
    tokens = list(range(100, 100 + width))
    names = weight_names(runner.model)
    for _ in range(2):
        runner.reset(context)
        runner.forward_chain(tokens)
    forwards = []
    for _ in range(repeats):
        before = native.read_bandwidth(1 << 28, 1)
        runner.reset(context)
        runner.forward_chain(tokens)  # the caches the read swept, warmed again as a decode keeps them
        runner.reset(context)
        wall = harness.time_ms(lambda: runner.forward_chain(tokens))  # unprofiled: the profiler's ~1 us an op kept out
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            runner.reset(context)
            runner.forward_chain(tokens)
        after = native.read_bandwidth(1 << 28, 1)
        ops = {}
        for e in prof.key_averages(group_by_input_shape=True):
            if e.key.startswith("ygg::"):
                nbytes = math.prod(e.input_shapes[1]) if e.key == "ygg::qlinear" else 0
                ops[(e.key.removeprefix("ygg::"), nbytes)] = (e.count, e.self_cpu_time_total / 1000)
        forwards.append({"bandwidth": (before + after) / 2, "steady": abs(after / before - 1) <= SAME, "wall": wall,
                         "ops": ops})
    runner.min_width = floor
    runner.reset()
    kept = [f for f in forwards if f["steady"]] or forwards
    rows = []
    for (op, nbytes), (calls, _) in kept[0]["ops"].items():
        seen = [(f["ops"][(op, nbytes)][1], f["bandwidth"]) for f in kept if (op, nbytes) in f["ops"]]  # (ms, B/s)
        row = {"op": op, "calls": calls, "ms": round(statistics.median(ms for ms, _ in seen), 3)}
        if op == "qlinear":
            row["weight"] = names.get(nbytes, f"{nbytes} bytes")
            row["of_bandwidth"] = round(statistics.median(nbytes * calls / (ms / 1000) / bw for ms, bw in seen), 3)
        rows.append(row)
    rows.sort(key=lambda r: -r["ms"])
    forward = statistics.median(f["wall"] for f in kept)
    bandwidths = [f["bandwidth"] for f in kept]
    return {"width": width, "compiled": runner.compiled is not None and runner.compiled.holds(width),
            "forward_ms": round(forward, 2), "forwards": len(forwards), "steady": sum(f["steady"] for f in forwards),
            "bandwidth": [min(bandwidths), max(bandwidths)], "ops": rows,
            "rest_ms": round(forward - sum(r["ms"] for r in rows), 2)}


def ops_lines(b: dict) -> list[str]:
    """The breakdown as text lines (the console's and the markdown's)."""
    lo, hi = (x / 1e9 for x in b["bandwidth"])
    which = (f"{b['steady']} of {b['forwards']}, those with the same read bandwidth before and after them: {lo:.1f}-{hi:.1f} GB/s"
             if b["steady"] else f"all {b['forwards']}: the read bandwidth moved across every one, {lo:.1f}-{hi:.1f} GB/s")
    lines = [f"W = {b['width']} ({'compiled' if b['compiled'] else 'eager'}): {b['forward_ms']:.1f} ms a forward "
             f"(median of {which})"]
    for r in b["ops"]:
        what = f"qlinear {r['weight']}" if r["op"] == "qlinear" else r["op"]
        rate = f", {r['of_bandwidth']:.2f} of the read bandwidth" if "of_bandwidth" in r else ""
        lines.append(f"  {r['ms']:7.2f} ms  {r['calls']:3d} x {what}{rate}")
    lines.append(f"  {b['rest_ms']:7.2f} ms  everything else (fused kernels, wrapper, runner)")
    return lines


def moved(result: dict) -> str | None:
    """A warning when the read bandwidth after the forwards is not the one the floors were drawn from
    (this VM's moves between states, even within a process: then a width's 'x of floor' is not its own)."""
    before, after = result["roofs"]["bandwidth"], result.get("bandwidth_after")
    if after is None or abs(after / before - 1) <= SAME:
        return None
    return (f"the read bandwidth moved during the run: {before / 1e9:.1f} GB/s when the floors were measured, "
            f"{after / 1e9:.1f} after the forwards: the floors, and each time over its floor, assume the first")


def markdown(result: dict) -> str:
    r = result["roofs"]
    lines = [f"### Roofline{' (' + result['label'] + ')' if result['label'] else ''}: {result['cpu']}", "",
             f"Read bandwidth {r['bandwidth'] / 1e9:.1f} GB/s, int8 peak {r['int8_peak'] / 1e9:.0f} G multiply-adds/s "
             f"({r['threads']} threads, `ygg::read_bandwidth` / `ygg::int8_peak`); artifact {result['artifact']}, "
             f"context {result['context']}, median of {result['repeats']} interleaved repeats; qlinear path "
             f"{result['qlinear_path']}.", ""]
    if warning := moved(result):
        lines += [f"**Note**: {warning}.", ""]
    for role, m in result["models"].items():
        c = m["costs"]
        lines += [f"**{role}**: {c['weight_bytes'] / 1e9:.3f} GB read per forward, {c['macs_per_row'] / 1e9:.2f} G "
                  f"multiply-adds per row", "",
                  "| W | compiled ms | eager ms | memory floor | compute floor | compiled / floor | T(W) / T(1) |",
                  "|---|---|---|---|---|---|---|"]
        for i, row in enumerate(m["rows"]):
            eager = m["eager_ms"][i]
            compute = f"{row['compute_ms']:.1f}" if row["compute_ms"] is not None else "–"
            lines.append(f"| {row['width']} | {row['ms']:.1f} | {eager:.1f} | {row['memory_ms']:.1f} | {compute} | "
                         f"{row['of_floor']:.2f} ({row['bound']}) | {row['of_t1']:.2f} |")
        lines.append("")
        for b in m.get("ops", []):
            lines += ["Where the time goes (torch.profiler, ms per forward):", "", "```", *ops_lines(b), "```", ""]
    return "\n".join(lines)


def plot(directory: Path) -> Path:
    """Every labelled run in `directory`: T(W) against the floor, one panel per model."""
    runs = [r for r in (json.loads(p.read_text()) for p in sorted(directory.glob("roofline*.json"))) if r.get("models")]
    roles = list(dict.fromkeys(role for run in runs for role in run["models"]))
    fig, axes = figure(ncols=len(roles), figsize=(6 * len(roles), 4.2), squeeze=False)
    for ax, role in zip(axes[0], roles):
        for run in runs:
            m = run["models"].get(role)
            if not m:
                continue
            widths = [row["width"] for row in m["rows"]]
            line, = ax.plot(widths, [row["ms"] for row in m["rows"]], "o-", label=f"{run['label'] or 'measured'} (compiled)")
            ax.plot(widths, [row["floor_ms"] for row in m["rows"]], "--", color=line.get_color(),
                    label=f"its floor: max({m['costs']['weight_bytes'] / 1e9:.2f} GB / BW, W·MACs / peak)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("forward width W (rows)")
        ax.set_ylabel("ms per forward")
        ax.set_title(f"{role}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{runs[0]['cpu']}: {runs[0]['roofs']['bandwidth'] / 1e9:.1f} GB/s, "
                 f"{runs[0]['roofs']['int8_peak'] / 1e9:.0f} G int8 MAC/s", fontsize=10)
    fig.tight_layout()
    out = directory / "roofline.png"
    write_atomic(out, png(fig))
    return out


def main() -> None:
    ap = harness.parser(__doc__, artifact="artifacts/default", repeats=7, widths="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--label", default="")
    ap.add_argument("--roofs", type=Path, help="reuse the roofs of an earlier run's JSON (same machine): for an "
                    "artifact whose kernel library predates the roof measurements")
    ap.add_argument("--roofs-only", action="store_true", help="measure the roofs, write DIR/roofs.json, stop")
    ap.add_argument("--ops", default="1", help="widths whose forward is taken apart op by op (\"\": none)")
    args = harness.parse(ap)
    widths = args.widths
    out = harness.output(args.out, "-roofline")
    roofs = Roofs(**json.loads(args.roofs.read_text())["roofs"]) if args.roofs else harness.roofs()
    print(f"read bandwidth {roofs.bandwidth / 1e9:.1f} GB/s, int8 peak {roofs.int8_peak / 1e9:.0f} G MAC/s, "
          f"{roofs.threads} threads", flush=True)
    if args.roofs_only:
        harness.write_json(out / "roofs.json", {"cpu": hardware.cpu_info().model, "roofs": roofs.as_dict()}, measured=roofs)
        return
    dec = ygg_runtime.load(args.artifact)
    from ygg_runtime.backend import native

    result = {"label": args.label, "cpu": hardware.cpu_info().model, "artifact": str(args.artifact), "context": args.context,
              "repeats": args.repeats, "roofs": roofs.as_dict(), "torch": torch.__version__,
              "qlinear_path": native.qlinear_path(), "models": {}}
    for role, runner in dec.runners.items():
        costs = model_costs(runner.model)
        times = forward_ms(runner, widths, args.context, args.repeats)
        main_ms = times.get("compiled", times["eager"])
        rows = table(costs, roofs, widths, main_ms, args.context)
        result["models"][role] = {"costs": costs.__dict__, "rows": rows, "eager_ms": [round(t, 2) for t in times["eager"]]}
        for row in rows:
            print(f"{role:6s} W {row['width']:3d}  {row['ms']:7.1f} ms  floor {row['floor_ms']:6.1f} ({row['bound']})  "
                  f"x{row['of_floor']:.2f} of floor  T(W)/T(1) {row['of_t1']:.2f}", flush=True)
        ops = [where_time_goes(runner, int(w), args.context, args.repeats) for w in args.ops.split(",") if w]
        result["models"][role]["ops"] = ops
        for b in ops:
            print("\n".join(f"{role:6s} {line}" for line in ops_lines(b)), flush=True)
    result["bandwidth_after"] = native.read_bandwidth()
    if warning := moved(result):
        print(warning)
    stem = "roofline" + (f"-{args.label}" if args.label else "")
    harness.write_json(out / f"{stem}.json", result, measured=roofs, markdown=markdown(result))
    print(f"wrote {out / stem}.json, .md and {plot(out)}")


if __name__ == "__main__":
    main()
