"""What each `ygg` command does once `ygg_compile.cli` has parsed and checked its arguments, and how
it renders what it made. This module imports torch and the toolchain: the command line imports it
only when a command runs, so a refused call never pays for them."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import typer
from rich.table import Table

import ygg_runtime
from ygg_compile import cache, quantize, roofline
from ygg_compile.bench import default_output, run_bench
from ygg_compile.bench_serve import run_bench_serve, summary_markdown
from ygg_compile.build import compile_artifact
from ygg_compile.inspection import inspect_artifact
from ygg_compile.options import BenchOptions, CompileOptions, ServeBenchOptions
from ygg_compile.report import fmt, render_table
from ygg_compile.roofline import Costs, Roofs
from ygg_compile.serve import serve as serve_http
from ygg_compile.ui import RichReporter, console, err, stats_table
from ygg_runtime.artifact import plan_sha256
from ygg_runtime.exactness import verdict
from ygg_runtime.files import size
from ygg_runtime.integrity import cache_dir
from ygg_runtime.options import ServeOptions
from ygg_runtime.plan import Plan


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



def roofline_table(plan: Plan):
    """Each measured forward (the profile's first context) beside the floor this machine allows it,
    max(bytes / read bandwidth, rows x multiply-adds / int8 peak), both roofs measured at compile."""
    section = plan.profile.get("roofline")
    if not section:
        return "roofline: not measured (an artifact compiled before it was, or off the CPU)"
    roofs = Roofs(**section["roofs"])
    prof, context = plan.profile, plan.profile["contexts"][0]
    t = Table(title=f"roofline: {roofs.bandwidth / 1e9:.1f} GB/s read, {roofs.int8_peak / 1e9:.0f} G int8 multiply-adds/s "
              f"({roofs.threads} threads, measured at compile); forwards at context {context}", title_justify="left")
    for col in ("model", "W", "measured ms", "memory floor", "compute floor", "× floor", "T(W)/T(1)"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for role in ("target", "draft"):
        if role not in section or not prof.get(f"{role}_ms"):
            continue
        costs = Costs(**section[role])
        for i, r in enumerate(roofline.table(costs, roofs, prof["widths"], prof[f"{role}_ms"][0], context)):
            compute = f"{r['compute_ms']:.2f}" if r["compute_ms"] is not None else "–"
            t.add_row(f"{role} ({costs.weight_bytes / 1e9:.2f} GB, {costs.macs_per_row / 1e9:.2f} G MAC/row)" if i == 0 else "",
                      str(r["width"]), f"{r['ms']:.2f}", f"{r['memory_ms']:.2f}", compute, f"{r['of_floor']:.1f} ({r['bound']})",
                      f"{r['of_t1']:.2f}")
    return t


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
    egt, seq = plan.methods["egt"], plan.methods["sequoia"]
    best = max(plan.planning["egt"], key=lambda r: r["speedup"]) if plan.planning["egt"] else None
    sbest = max(plan.planning["sequoia"], key=lambda r: r["speedup"])
    cal = plan.calibration
    egt_text = ("egt: depth 0 (no tree pays for itself: plain decoding)" if not egt["depth"] else
                f"egt: depth {egt['depth']} × {egt['draft_width']} nodes/round, verify ≈{egt['verify_width']} "
                f"({best['tokens_per_step']:.2f} tokens/step replayed, modelled {best['speedup']:.2f}×)")
    seq_text = (f"sequoia: {len(seq['parents'])}-node tree, depth {sbest['depth']} (E[A] {sbest['expected_accepted']:.2f}, "
                f"modelled {sbest['speedup']:.2f}×)")
    return (f"plan — {egt_text}; {seq_text}; calibrated on {cal.prompts} prompts, {cal.steps} probe steps "
            f"in {cal.seconds:.0f} s\n{predictor_summary(plan.planning.get('predictor') or {})}\n"
            f"{stages_summary(plan.planning['stages'])}\n{exactness_summary(plan)}\n"
            + "\n".join(f"{role} weights: {weights_summary(plan.models[role], plan.dtype)}" for role in ("target", "draft")))


def weights_summary(m, dtype: str) -> str:
    """How one model's weights are held, in a line: float, or codes and where their numbers came from."""
    w = m.weights
    if w.kind == "float":
        return f"{dtype} (F.linear)"
    numbers = ("the GGUF file's own quantization" if w.numbers == "gguf" and not w.fallbacks else
               "the GGUF file's numbers where the kind holds them" if w.numbers == "gguf" else
               "quantized by ygg compile from the float checkpoint: lossy against it")
    formats = ", ".join(f"{k} ×{n}" for k, n in w.formats.items())
    line = f"{w.kind} codes, {numbers} — {formats}; {w.bytes / 1e9:.2f} GB"
    if w.numbers == "gguf":
        line += f"; decoded = converted checkpoint within {w.max_rel_error:.1e} of max |w|"
    if w.fallbacks:
        line += f"; {quantize.fallbacks_line(w.fallbacks)}"
    return line


def exactness_summary(plan: Plan) -> str:
    """One line on whether greedy output is plain decoding's, for each forward kind checked."""
    lines = []
    for kind, record in plan.exactness.items():
        _, why = verdict(record, kind=kind)
        checked = f"checked in {record.seconds:.0f} s"
        lines.append(f"exactness ({kind} forwards, {checked}): {why}")
    return "\n".join(lines)


def stages_summary(r: dict) -> str:
    """One line on egt's stage order and the alternatives' modelled times per token."""
    alts = "; ".join(f"tail {a['tail']}/head {a['head']} {a['ms_per_token']:.3g} ms/token (head hits {a['head_hit_rate']:.0%})"
                     for a in r["alternatives"])
    return f"stages: {r['why']}" + (f" — modelled {alts}" if alts else "")


def predictor_summary(r: dict) -> str:
    """One line on egt's depth predictor: its validation figures and whether the plan uses it."""
    if "heads" not in r:
        return f"depth predictor: none ({r.get('why', 'not trained')})"
    aucs = " ".join("–" if h["auc"] is None else f"{h['auc']:.2f}" for h in r["heads"])
    briers = " ".join(f"{h['brier']:.3f}" for h in r["heads"])
    verdict = (f"used: × {r['draft_width']} nodes/round, depth per step, {r['validation_speedup']:.2f}× "
               f"vs fixed depth {r['fixed_validation_speedup']:.2f}× on held-out probe steps"
               + (f" ({r['why']})" if r.get("why") else "") if r["used"] else
               f"not used ({r['why']}: {r['validation_speedup']:.2f}× vs {r['fixed_validation_speedup']:.2f}×)")
    return (f"depth predictor: {verdict}; {r['folds']}-fold over {r['prompts']} prompts ({r['rows']} positions): "
            f"AUC per depth {aucs}, Brier {briers}, accepted-length MAE {r['depth_mae']:.2f} "
            f"(always-the-mean {r['baseline_depth_mae']:.2f})")



def run(prompt: str, artifact: Path, *, method: str | None, max_new_tokens: int, temperature: float, top_p: float,
        seed: int | None, as_json: bool, stats: bool, raw: bool, ignore_eos: bool, no_predictor: bool, no_graft: bool,
        eager: bool, device: str | None, dtype: str | None, expect_plan: str | None) -> None:
    """Generate from the prompt, streaming the text (or one JSON object at the end)."""
    decoder = ygg_runtime.load(artifact, device=device, predictor=not no_predictor, eager=eager, dtype=dtype,
                               expect_plan=expect_plan)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        result = decoder.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            method=method,
            graft=not no_graft,
            raw=raw,
            ignore_eos=ignore_eos,
            on_text=None if as_json else stream,
        )
        if as_json:
            print(json.dumps(result.to_json(), ensure_ascii=False))
        else:
            sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `ygg run ... | head -1`: the reader has what it wanted; stop, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        raise typer.Exit(0) from None
    if stats:
        err.print(stats_table(result.metrics, f"{result.method} · {artifact}", decoder.forwards))
        err.print(f"exactness: {result.exactness}")


def serve(opts: ServeOptions, artifact: Path, model_name: str | None, eager: bool, expect_plan: str | None) -> None:
    """Load the artifact and serve it until SIGINT or SIGTERM."""
    decoder = ygg_runtime.load(artifact, eager=eager, expect_plan=expect_plan)
    target = decoder.plan.models["target"].spec if decoder.plan else "model"
    name = model_name or (Path(target).name if "/" in target or Path(target).exists() else target)
    err.print(f"serving {name} ({decoder.default_method}, {decoder.forwards}) on http://{opts.host}:{opts.port}/v1 · batch "
              f"≤ {opts.max_batch}, queue ≤ {opts.max_queue} · Ctrl-C or SIGTERM stops it once running requests finish")
    serve_http(decoder, name, opts)
    err.print("ygg serve: stopped")



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
    rep = inspect_artifact(artifact, out, text, method, step, max_new_tokens)
    plan, con = rep.plan, console()
    models = plan.models
    info = Table(show_header=False, title=f"artifact {artifact}", title_justify="left")
    info.add_column(style="bold")
    info.add_column()
    for role in ("target", "draft"):
        if role in models:
            m = models[role]
            info.add_row(role, f"{m.spec} ({m.parameters / 1e6:.0f}M parameters, {m.layers} layers, {m.source})")
            info.add_row(f"{role} weights", weights_summary(m, plan.dtype))
    cpu = plan.cpu
    info.add_row("device / dtype", f"{plan.device} / {plan.dtype}  (torch {plan.torch_version}, {cpu.model}, {cpu.threads} threads)")
    info.add_row("context", f"{plan.max_context} tokens")
    info.add_row("default method", f"{plan.method}  (ygg run --method picks another)")
    info.add_row("compiled", f"{plan.created} in {plan.compile_seconds} s")
    info.add_row("plan sha256", f"{plan_sha256(artifact)}  (ygg run --expect-plan pins it)")
    aot = plan.aot
    info.add_row("forwards", "eager (compiled with --no-aot)" if not aot else
                 f"AOTInductor {aot.package} per model, widths 1..{aot.max_width}, built for {aot.isa or plan.device} "
                 f"(needs {', '.join(aot.cpu_flags) or 'nothing special'}) in "
                 + ", ".join(f"{role} {sec:.0f} s" for role, sec in aot.seconds.items()))
    kernel = plan.kernel
    info.add_row("kernels", f"{kernel.file}: row-invariant attention, quantized linear (needs {', '.join(kernel.cpu_flags) or 'nothing special'})"
                 if kernel else "PyTorch's scaled_dot_product_attention")
    info.add_row("exactness", exactness_summary(plan))
    prof = plan.profile
    for role in ("target", "draft"):
        for ctx, row in zip(prof["contexts"], prof.get(f"{role}_ms") or []):
            info.add_row(f"T(W) {role} @ {ctx}, ms", "  ".join(f"{w}:{t:.1f}" for w, t in zip(prof["widths"], row)))
    info.add_row("T_other(W), ms", "  ".join(f"{w}:{t:.1f}" for w, t in zip(prof["widths"], prof["other_ms"])))
    cal = plan.calibration
    info.add_row("calibration", f"{cal.prompts} prompts ({cal.source}), {cal.tokens} target tokens, "
                 f"{cal.steps} probe steps, {cal.probe_tokens_per_step:.2f} tokens/step, {cal.seconds:.0f} s")
    info.add_row("rank acceptance", "  ".join(f"{p:.3f}" for p in plan.planning["rank_acceptance"]))
    graft = plan.planning.get("graft")
    values = (plan.methods["egt"].get("graft") or {}).get("context")
    if graft and values:
        first = "  ".join(f"n={n + 1}:{row[0][0]:.2f}/{row[0][1]:.2f}" for n, row in enumerate(values))
        info.add_row("retrieval", f"{graft['target_tokens']} of {graft['labelled_tokens']} retrieved tokens were the target's "
                     f"on the calibration continuations; P(first copied token accepted) by match length, seen once/twice: "
                     f"{first}; adjacency table: {graft['adjacency_rows']} tokens")
    con.print(info)
    con.print(roofline_table(plan))

    egt = Table(title=f"egt candidates, replayed on the calibration steps (context ≈{plan.planning['context']})",
                title_justify="left")
    for col in ("depth", "draft width", "tokens/step", "modelled step ms", "usual verify W", "modelled speed-up"):
        egt.add_column(col, justify="right")
    chosen = plan.methods["egt"]
    for r in sorted(plan.planning["egt"], key=lambda r: -r["speedup"]):
        mark = r["depth"] == chosen["depth"] and (r["depth"] == 0 or r["draft_width"] == chosen["draft_width"])
        cells = [str(r["depth"]), str(r["draft_width"]), f"{r['tokens_per_step']:.2f}", f"{r['step_ms']:.1f}",
                 str(r["verify_width"]), f"{r['speedup']:.2f}×"]
        egt.add_row(*[f"[bold green]{c}[/]" if mark else c for c in cells])
    con.print(egt)
    report = plan.planning.get("predictor") or {}
    con.print(predictor_summary(report))
    stages = plan.planning.get("stages") or {}
    if stages.get("alternatives"):
        st = Table(title=f"egt stage orders, timed on {stages['prompts']} calibration prompts × {stages['tokens']} tokens "
                   "(ms per step; stages run one after the other)", title_justify="left")
        for col in ("tail draft", "head draft", "begin", "rounds", "ahead", "verify", "other", "step", "tokens/step",
                    "head hits", "modelled ms/token"):
            st.add_column(col, justify="left" if "draft" in col else "right")
        for a in stages["alternatives"]:
            mark = {"tail": a["tail"], "head": a["head"]} == stages["chosen"]
            cells = [a["tail"], a["head"], *(f"{a['stage_ms'][k]:.1f}" for k in ("begin", "rounds", "ahead", "verify", "other")),
                     f"{a['step_ms']:.1f}", f"{a['tokens_per_step']:.2f}", f"{a['head_hit_rate']:.0%}", f"{a['ms_per_token']:.1f}"]
            st.add_row(*[f"[bold green]{c}[/]" if mark else c for c in cells])
        con.print(st)
    con.print(f"stages: {stages.get('why', 'not searched')}")
    if "heads" in report:
        heads = Table(title="depth predictor, cross-validated over the calibration prompts, and its depth policy", title_justify="left")
        for col in ("depth d", "P(A ≥ d) observed", "AUC", "Brier", "tokens factor", "verify W"):
            heads.add_column(col, justify="right")
        policy = chosen.get("depth_policy") or {}
        for h in report["heads"]:
            d = h["depth"]
            extra = [f"{policy['factors'][d]:.2f}", str(policy["verify_widths"][d])] if policy else ["–", "–"]
            heads.add_row(str(d), f"{h['positives']:.2f}", fmt(h["auc"]), f"{h['brier']:.3f}", *extra)
        con.print(heads)

    t = Table(title="methods: one step's forwards and what the objective makes of them", title_justify="left")
    for col in ("method", "params", "draft forwards (W)", "verify W", "modelled step ms", "break-even E[A]"):
        t.add_column(col, justify="left" if col in ("method", "params") else "right")
    measured = any(r.measured_accepted is not None for r in rep.methods)
    if measured:
        for col in ("E[A] on prompt", "predicted speed-up", "measured speed-up"):
            t.add_column(col, justify="right")
    for r in rep.methods:
        name = f"[bold]{r.name}[/] (default)" if r.name == plan.method else r.name
        row = [name, _short_params(r.name, r.params),
               " + ".join(map(str, r.shape.draft_widths)) or "–", str(r.shape.verify_width),
               fmt(r.step_ms, ".1f"), fmt(r.break_even)]
        if measured:
            row += [fmt(r.measured_accepted), fmt(r.predicted_speedup, ".2f", "×"), fmt(r.measured_speedup, ".2f", "×")]
        t.add_row(*row)
    con.print(t)
    con.print("break-even E[A]: the tokens per step a method must average to match plain decoding "
              "(modelled step time / plain step time, at the calibration context); predicted speed-up = E[A] · plain step / modelled step.")
    if rep.tree_caption:
        con.print(f"tree: {rep.tree_caption}")
    for f in rep.files:
        con.print(f"[green]wrote[/] {f}")


def _short_params(name: str, params: dict) -> str:
    """A method's parameters in a table cell (sequoia's tree and egt's map summarised)."""
    if name == "sequoia":
        return f"{len(params['parents'])}-node tree"
    if name == "egt":
        if params.get("depth_policy"):
            return f"depth 0–{len(params['depth_policy']['factors']) - 1} by predictor, draft_width={params['depth_policy']['draft_width']}, top_k={params.get('top_k')}"
        return f"depth={params['depth']}, draft_width={params.get('draft_width')}, top_k={params.get('top_k')}"
    if name == "pld":
        g = params.get("graft") or {}
        return f"up to {g.get('limit', 3)} continuations of {g.get('length', 8)} tokens" + (", calibrated" if g.get("context") else "")
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "–"

