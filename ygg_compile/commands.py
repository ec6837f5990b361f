"""What each `ygg` command does once `ygg_compile.cli` has parsed and checked its arguments, and how
it renders what it made. This module imports torch and the toolchain: the command line imports it
only when a command runs, so a refused call never pays for them."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from rich.table import Table

from ygg_compile import cache
from ygg_compile.build import compile_artifact
from ygg_compile.inspection import (adapt_summary, exactness_summary, inspect_artifact, predictor_summary, render, stages_summary,
                                    weights_summary)
from ygg_compile.options import CompileOptions
from ygg_runtime.ui import RichReporter, console, err
from ygg_runtime.artifact.load import plan_sha256
from ygg_runtime.files import cache_dir, size
from ygg_runtime.schema.plan import Plan


def compile(opts: CompileOptions) -> None:
    """Write the artifact, then say what it holds and what the plan chose."""
    output = opts.output
    with RichReporter() as ui:
        plan = compile_artifact(opts, ui)
    target, draft = plan.models["target"], plan.models["draft"]
    err.print(
        f"[green]wrote[/] {output}  target {target.spec} ({target.parameters / 1e6:.0f}M), "
        f"draft {draft.spec} ({draft.parameters / 1e6:.0f}M), {plan.dtype} on "
        f"{plan.device}, default method {plan.method} — try: ygg run prompt.txt --artifact {output} --stats"
    )
    err.print(plan_summary(plan))
    err.print(phase_table(plan))
    err.print(f"plan sha256 {plan_sha256(output)} — an artifact is executable code: to run only this one, "
              f"`ygg run --expect-plan {plan_sha256(output)}`")


def phase_table(plan: Plan):
    """Where the compile's time went, one row per phase."""
    names = {"resolve": "resolve models", "convert": "convert weights + tokenizer", "aot": "native kernels + AOT forwards",
             "draft vocab": "drafter's head (--draft-vocab)",
             "exactness": "row-invariance check",
             "profile": "latency profiles", "calibrate": "calibration (probe + agreement)", "stages": "stage timing",
             "plan": "planning + predictor", "hash": "hash files"}
    total = plan.compile_seconds
    t = Table(title=f"compile time: {total:.0f} s", title_justify="left")
    for col in ("phase", "seconds", "share"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for key, seconds in plan.compile_phases.items():
        t.add_row(names.get(key, key), f"{seconds:.1f}", f"{seconds / max(total, 1e-9):.0%}")
    return t


def plan_summary(plan: Plan) -> str:
    """One line on what the objective chose, from the plan's candidate tables."""
    egt, seq, planning = plan.methods["egt"], plan.methods["sequoia"], plan.planning
    best = max(planning.egt, key=lambda r: r.speedup) if planning.egt else None
    sbest = max(planning.sequoia, key=lambda r: r.speedup)
    cal = plan.calibration
    egt_text = ("egt: depth 0 (no tree pays for itself: plain decoding)" if not egt.depth else
                f"egt: depth {egt.depth} × {egt.draft_width} nodes/round, verify ≈{egt.verify_width} "
                f"({best.tokens_per_step:.2f} tokens/step replayed, modelled {best.speedup:.2f}×)")
    seq_text = (f"sequoia: {len(seq.parents)}-node tree, depth {sbest.depth} (E[A] {sbest.expected_accepted:.2f}, "
                f"modelled {sbest.speedup:.2f}×)")
    return (f"plan — {egt_text}; {seq_text}; calibrated on {cal.prompts} prompts, {cal.steps} probe steps "
            f"in {cal.seconds:.0f} s\n{predictor_summary(planning.predictor)}\n{adapt_summary(planning.adapt)}\n"
            f"{stages_summary(planning.stages)}\n{exactness_summary(plan)}\n"
            + "\n".join(f"{role} weights: {weights_summary(plan.models[role], plan.dtype)}" for role in ("target", "draft")))


def cache_ls() -> None:
    found = cache.entries()
    table = Table(title=f"{cache_dir()}", title_justify="left")
    for col in ("kind", "what", "size", "last used"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for e in found:
        table.add_row(e.kind, e.what, size(e.bytes), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used)))
    console().print(table)
    print(f"{len(found)} entries, {size(sum(e.bytes for e in found))} in all"
          f" (kinds: {', '.join(cache.KINDS)}; `ygg cache clear [KIND]...` removes them)")


def cache_clear(kinds: list[str] | None) -> None:
    removed, busy = cache.clear(kinds or None)
    for e in busy:
        err.print(f"left {e.kind} {e.path.name}: a running process is writing it")
    by_kind = Counter(e.kind for e in removed)
    kinds_removed = f" ({', '.join(f'{k} {n}' for k, n in by_kind.items())})" if removed else ""
    print(f"removed {len(removed)} entries{kinds_removed} from {cache_dir()}: {size(sum(e.bytes for e in removed))} freed")


def inspect(artifact: Path, text: str | None, method: str | None, step: int, max_new_tokens: int, output: Path | None) -> None:
    """Render the plan and why: step shapes, modelled costs, T(W) curves, an example tree."""
    out = output or artifact.with_name(artifact.name + "-inspect")
    render(inspect_artifact(artifact, out, text, method, step, max_new_tokens), artifact, console())
