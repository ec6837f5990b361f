"""What `ygg bench` and `ygg bench-serve` do once `ygg_bench.cli` has parsed and checked their
arguments, and how they render what they measured. This module imports torch and the toolchain: the
command line imports it only when a command runs, so a refused call never pays for them."""

from __future__ import annotations

from dataclasses import replace

from ygg_bench.bench import default_output, run_bench
from ygg_bench.bench_serve import run_bench_serve
from ygg_bench.options import BenchOptions, ServeBenchOptions
from ygg_bench.report import render_table
from ygg_bench.serve_report import summary_markdown
from ygg_runtime.ui import RichReporter, console, err


def bench(opts: BenchOptions) -> None:
    opts = replace(opts, output=opts.output or default_output(opts.artifact))
    with RichReporter() as ui:
        results = run_bench(opts, ui)
    console().print(render_table(results))
    err.print(f"[green]wrote[/] {opts.output}/summary.md, results.json, results.csv, speedup.png, tpot_vs_accepted.png, tw_curves.png")


def bench_serve(opts: ServeBenchOptions) -> None:
    with RichReporter() as ui:
        report = run_bench_serve(opts, ui)
    print(summary_markdown(report))
