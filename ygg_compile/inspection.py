"""`ygg inspect`: what an artifact's plan is and why.

For every compiled method: the forwards of one step (drafter widths, verify width), the step time
the objective models from the artifact's measured T(W) curves, and the accepted length it needs
to beat plain decoding. Given a prompt, each method also runs on it, so the table shows the
objective's predicted speed-up next to the measured one, and one drafted tree is drawn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import ygg_runtime
from rich.console import Console
from rich.table import Table

from ygg_compile import plots, quantize, roofline
from ygg_runtime.decoding import objective
from ygg_runtime.artifact.load import plan_sha256, read_plan
from ygg_runtime.errors import YggError
from ygg_runtime.checks.exactness import Machine, verdict
from ygg_runtime.files import output_dir, write_atomic
from ygg_runtime.options import MAX_NEW_TOKENS, check_max_new_tokens
from ygg_runtime.schema.params import Params, Stages, StepShape
from ygg_runtime.schema.plan import AdaptReport, Plan, PredictorReport, StagesReport
from ygg_runtime.decoding.tree import DRAFT
from ygg_runtime.ui import adapt_line, fmt


@dataclass
class MethodReport:
    name: str
    params: Params
    shape: StepShape
    step_ms: float | None = None  # modelled
    break_even: float | None = None  # E[A] needed to match ar
    measured_accepted: float | None = None  # on the prompt
    predicted_speedup: float | None = None  # objective at the measured E[A]
    measured_speedup: float | None = None  # ar's TPOT / this TPOT on the prompt
    tpot_ms: float | None = None
    adapt: dict | None = None  # the request's acceptance estimate at its end (`Metrics.adapt`)
    shapes: dict[str, int] = field(default_factory=dict)  # steps by depth×width on the prompt


@dataclass
class Inspection:
    plan: Plan
    methods: list[MethodReport]
    files: list[Path] = field(default_factory=list)
    tree_caption: str | None = None


def inspect_artifact(directory: Path, out: Path, prompt: str | None = None, method: str | None = None,
                     step: int = 1, max_new_tokens: int = 64) -> Inspection:
    """Everything `ygg inspect` shows; its figures are written into `out` only once all of them are
    made (a refused --step or --method leaves `out` as it was)."""
    plan = read_plan(directory)
    method = method or plan.method
    if prompt is not None and method not in plan.methods:
        raise YggError(f"method '{method}' is not in this artifact (it has: {', '.join(plan.methods)})")
    check_max_new_tokens(max_new_tokens)
    curves = objective.Curves(plan.profile, context=plan.planning.context)
    reports = []
    for name, params in plan.methods.items():
        r = MethodReport(name, params, params.step_shape())
        r.step_ms = objective.step_ms(r.shape, curves)
        r.break_even = objective.break_even(r.shape, curves)
        reports.append(r)
    result = Inspection(plan, reports)

    created = not out.exists()
    output_dir(out, "inspect's figures")  # writable, before the minutes of work below
    figures = {"tw_curves.png": plots.tw_curves(plan.profile, "T(W) measured at compile time")}
    if prompt is not None:
        try:
            figures["tree.png"] = _run_prompt(directory, plan, prompt, method, step, max_new_tokens, curves, result)
        except BaseException:
            if created:
                out.rmdir()  # made for figures that will not come
            raise
    for name, png in figures.items():
        _write(out / name, png, result)
    return result


def _run_prompt(directory: Path, plan: Plan, prompt: str, method: str, step: int, max_new_tokens: int,
                curves, result: Inspection) -> bytes:
    """Run every method on the prompt (measured accepted lengths and speed-ups into `result`); the
    figure of `method`'s tree at `step`."""
    decoder = ygg_runtime.load(directory)
    ids = decoder.encode(prompt)
    decoder.generate(ids, max_new_tokens=4, method=method)  # warm-up
    captured: list = []

    def capture(tree, verdict) -> None:
        if len(captured) < step:
            captured.append((tree, verdict))

    tpot = {}
    for r in result.methods:
        res = decoder.generate(ids, max_new_tokens=max_new_tokens, method=r.name,
                               on_step=capture if r.name == method else None)
        r.measured_accepted, r.tpot_ms = res.metrics.mean_accepted_length, res.tpot_ms
        r.adapt, r.shapes = res.metrics.adapt, res.metrics.shapes
        tpot[r.name] = res.tpot_ms
        r.predicted_speedup = objective.speedup(r.measured_accepted, r.shape, curves, len(ids))
    for r in result.methods:
        if "ar" in tpot and r.tpot_ms:
            r.measured_speedup = tpot["ar"] / r.tpot_ms
    if len(captured) < step:
        raise YggError(f"the generation took only {len(captured)} step(s): ask for an earlier --step or more tokens")
    tree, verdict = captured[step - 1]
    label = lambda t: _visible(decoder.codec.decode([t]))  # noqa: E731
    retrieved = sum(s != DRAFT for s in tree.sources)
    caption = (f"{method} · step {step}: {len(tree) - 1 - retrieved} drafted and {retrieved} retrieved nodes, "
               f"{verdict.accepted} accepted + bonus '{label(verdict.bonus)}'")
    result.tree_caption = caption
    return plots.token_tree([label(t) for t in tree.tokens], tree.parents, tree.draft_probs, verdict.path,
                            label(verdict.bonus), caption, tree.sources)


def _visible(text: str) -> str:
    """A token as a short readable label: whitespace made visible, long tokens cut."""
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "␣")
    return text if len(text) <= 14 else text[:13] + "…"


def _write(path: Path, data: bytes, result: Inspection) -> None:
    try:
        write_atomic(path, data)
    except OSError as e:
        raise YggError(f"cannot write {path}: {e.strerror or e}") from e
    result.files.append(path)


# ---------------------------------------------------------------- rendering (ygg inspect; ygg compile's summary)


def roofline_table(plan: Plan):
    """Each measured forward (the profile's first context) beside the floor this machine allows it,
    max(bytes / read bandwidth, rows x multiply-adds / compute peak), both roofs measured at compile."""
    section = plan.profile.roofline
    if section is None:
        return "roofline: not measured (an artifact compiled before it was)"
    roofs = section.roofs
    prof, context = plan.profile, plan.profile.contexts[0]
    peak = (f"{roofs.int8_peak / 1e12:.0f} T bf16 multiply-adds/s on {plan.gpu.name}" if plan.gpu is not None else
            f"{roofs.int8_peak / 1e9:.0f} G int8 multiply-adds/s ({roofs.threads} threads")
    t = Table(title=f"roofline: {roofs.bandwidth / 1e9:.1f} GB/s read, {peak}{'' if plan.gpu else ')'}, measured at "
              f"compile; forwards at context {context}", title_justify="left")
    for col in ("model", "W", "measured ms", "memory floor", "compute floor", "× floor", "T(W)/T(1)"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for role in ("target", "draft"):
        costs = getattr(section, role)
        if costs is None or not prof.ms(role):
            continue
        for i, r in enumerate(roofline.table(costs, roofs, prof.widths, prof.ms(role)[0], context, plan.gpu is not None)):
            compute = f"{r['compute_ms']:.2f}" if r["compute_ms"] is not None else "–"
            t.add_row(f"{role} ({costs.weight_bytes / 1e9:.2f} GB, {costs.macs_per_row / 1e9:.2f} G MAC/row)" if i == 0 else "",
                      str(r["width"]), f"{r['ms']:.2f}", f"{r['memory_ms']:.2f}", compute, f"{r['of_floor']:.1f} ({r['bound']})",
                      f"{r['of_t1']:.2f}")
    return t


def weights_summary(m, dtype: str) -> str:
    """How one model's weights are held, in a line: float, or codes and where their numbers came from."""
    w = m.weights
    if w.kind == "float":
        return f"{dtype} (F.linear)"
    numbers = ("the GGUF file's own quantization" if w.numbers == "gguf" and not w.fallbacks else
               "the GGUF file's numbers where the kind holds them" if w.numbers == "gguf" else
               "quantized by ygg compile from the float checkpoint: lossy against it")
    formats = ", ".join(f"{k} ×{n}" for k, n in w.formats.items())
    # a GGUF file's codes keep their own widths (Q4_K and Q6_K: 4 and 6 bits), `kind` is only their cap
    bits = sorted({int(b) for b in re.findall(r"(\d+)-bit", " ".join(w.formats))})
    held = f"{'/'.join(map(str, bits))}-bit codes (at most {w.kind})" if w.numbers == "gguf" and bits else f"{w.kind} codes"
    line = f"{held}, {numbers} — {formats}; {w.bytes / 1e9:.2f} GB"
    if w.numbers == "gguf":
        line += f"; decoded = converted checkpoint within {w.max_rel_error:.1e} of max |w|"
    if w.fallbacks:
        line += f"; {quantize.fallbacks_line(w.fallbacks)}"
    return line


def exactness_summary(plan: Plan) -> str:
    """One line on whether greedy output is plain decoding's on this machine, for each forward kind
    checked (a check made on another machine is "not checked on this machine")."""
    lines = []
    for kind, record in plan.exactness.items():
        _, why = verdict(record, Machine.checked(plan, record), kind=kind)
        checked = f"checked in {record.seconds:.0f} s"
        lines.append(f"exactness ({kind} forwards, {checked}): {why}")
    return "\n".join(lines)


def stages_summary(r: StagesReport | None) -> str:
    """One line on egt's stage order and the alternatives' modelled times per token."""
    if r is None:
        return "stages: not searched"
    alts = "; ".join(f"tail {a.tail}/head {a.head} {a.ms_per_token:.3g} ms/token (head hits {a.head_hit_rate:.0%})"
                     for a in r.alternatives)
    return f"stages: {r.why}" + (f" — modelled {alts}" if alts else "")


def adapt_summary(r: AdaptReport | None) -> str:
    """One line on the request's acceptance estimate: the prior strengths and robust weights compile
    fitted, and how much better they predict held-out calibration prompts than calibration's prices
    alone."""
    if r is None or r.strength is None:
        return f"acceptance estimate: none ({r.why if r is not None and r.why else 'not fitted: recompile'}): every step as planned"
    robust = lambda w: f" at weight {w:g}" if w < 1.0 else ""  # noqa: E731
    reach = (f"; egt's reach {r.reach_strength:g}{robust(r.reach_weight)} ({r.reach_tries} tries: "
             f"{r.reach_loglik_per_try[str(r.reach_strength)]:.3f} vs {r.prior_reach_loglik_per_try:.3f})"
             if r.reach_strength is not None else "")
    return (f"acceptance estimate: prior strength, fitted {r.folds}-fold on held-out calibration prompts (log-likelihood "
            f"a try, against calibration's alone): nodes' prices {r.strength:g} expected acceptances{robust(r.weight)} "
            f"({r.tries} tries: {r.loglik_per_try[str(r.strength)]:.3f} vs {r.prior_loglik_per_try:.3f}){reach}; "
            f"evidence half-life {r.half_life:g} steps")


def predictor_summary(r: PredictorReport) -> str:
    """One line on egt's depth predictor: its validation figures and whether the plan uses it."""
    if not r.heads:
        return f"depth predictor: none ({r.why or 'not trained'})"
    aucs = " ".join("–" if h.auc is None else f"{h.auc:.2f}" for h in r.heads)
    briers = " ".join(f"{h.brier:.3f}" for h in r.heads)
    verdict = (f"used: × {r.draft_width} nodes/round, depth per step, {r.validation_speedup:.2f}× "
               f"vs fixed depth {r.fixed_validation_speedup:.2f}× on held-out probe steps"
               + (f" ({r.why})" if r.why else "") if r.used else
               f"not used ({r.why}: {r.validation_speedup:.2f}× vs {r.fixed_validation_speedup:.2f}×)")
    return (f"depth predictor: {verdict}; {r.folds}-fold over {r.prompts} prompts ({r.rows} positions): "
            f"AUC per depth {aucs}, Brier {briers}, accepted-length MAE {r.depth_mae:.2f} "
            f"(always-the-mean {r.baseline_depth_mae:.2f})")


def render(rep: Inspection, artifact: Path, con: Console) -> None:
    """`ygg inspect`'s output: the artifact, its roofline, the plan's candidates, stages, depth
    predictor and methods, then the figures written."""
    plan = rep.plan
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
                 f"AOTInductor {aot.package} per model, widths {max(aot.min_width.values(), default=1)}..{aot.max_width}, "
                 f"built for {aot.isa or plan.device} "
                 f"(needs {', '.join(aot.cpu_flags) or 'nothing special'}) in "
                 + ", ".join(f"{role} {sec:.0f} s" for role, sec in aot.seconds.items()))
    kernel = plan.kernel
    info.add_row("kernels", f"{kernel.file}: row-invariant attention, quantized linear (needs {', '.join(kernel.cpu_flags) or 'nothing special'})"
                 if kernel else "ygg_runtime.backend.cuda: Triton kernels, row-invariant, 8 a layer, one CUDA graph a width"
                 + (f"; compiled for this GPU kind by Triton {plan.triton.triton_version} in {plan.triton.directory}/"
                    if plan.triton else ""))
    if plan.gpu is not None:
        g = plan.gpu
        info.add_row("GPU", f"{g.label()}, {g.memory / 2**30:.0f} GiB; CUDA {g.cuda}, cuBLAS {g.cublas}, driver {g.driver}")
    info.add_row("exactness", exactness_summary(plan))
    prof = plan.profile
    for role in ("target", "draft"):
        for ctx, row in zip(prof.contexts, prof.ms(role)):
            info.add_row(f"T(W) {role} @ {ctx}, ms", "  ".join(f"{w}:{t:.1f}" for w, t in zip(prof.widths, row)))
    info.add_row("T_other(W), ms", "  ".join(f"{w}:{t:.1f}" for w, t in zip(prof.widths, prof.other_ms)))
    cal = plan.calibration
    info.add_row("calibration", f"{cal.prompts} prompts ({cal.source}), {cal.tokens} target tokens, "
                 f"{cal.steps} probe steps, {cal.probe_tokens_per_step:.2f} tokens/step, {cal.seconds:.0f} s")
    info.add_row("rank acceptance", "  ".join(f"{p:.3f}" for p in plan.planning.rank_acceptance))
    graft, chosen = plan.planning.graft, plan.methods["egt"]
    values = chosen.graft.context if chosen.graft is not None else None
    if graft is not None and values:
        first = "  ".join(f"n={n + 1}:{row[0][0]:.2f}/{row[0][1]:.2f}" for n, row in enumerate(values))
        info.add_row("retrieval", f"{graft.target_tokens} of {graft.labelled_tokens} retrieved tokens were the target's "
                     f"on the calibration continuations; P(first copied token accepted) by match length, seen once/twice: "
                     f"{first}; adjacency table: {graft.adjacency_rows} tokens")
    win = plan.draft_window
    info.add_row("drafter's window", "not measured: the drafter reads every prompt whole" if win is None else
                 f"top-1 agreement {win.acceptance:.1%} reading {win.text_tokens} tokens whole; kept reading only the "
                 "last " + ", ".join(f"{w}: {k:.0%}" for w, k in zip(win.windows, win.kept)) + f" ({win.source})")
    length = plan.output_length
    info.add_row("answers' length", "not measured: a request is priced at its whole budget" if length is None else
                 f"{length.ended} of {length.answers} calibration answers ended within {length.budget} tokens "
                 f"({length.tokens} answer tokens); the default budget of {MAX_NEW_TOKENS} is priced at "
                 f"{objective.expected_tokens(length, MAX_NEW_TOKENS)}")
    con.print(info)
    con.print(roofline_table(plan))

    egt = Table(title=f"egt candidates, replayed on the calibration steps (context ≈{plan.planning.context})",
                title_justify="left")
    for col in ("depth", "draft width", "tokens/step", "modelled step ms", "usual verify W", "modelled speed-up"):
        egt.add_column(col, justify="right")
    for r in sorted(plan.planning.egt, key=lambda r: -r.speedup):
        mark = r.depth == chosen.depth and (r.depth == 0 or r.draft_width == chosen.draft_width)
        cells = [str(r.depth), str(r.draft_width), f"{r.tokens_per_step:.2f}", f"{r.step_ms:.1f}",
                 str(r.verify_width), f"{r.speedup:.2f}×"]
        egt.add_row(*[f"[bold green]{c}[/]" if mark else c for c in cells])
    con.print(egt)
    report = plan.planning.predictor
    con.print(predictor_summary(report))
    con.print(adapt_summary(plan.planning.adapt))
    stages = plan.planning.stages
    if stages is not None and stages.alternatives:
        st = Table(title=f"egt stage orders, timed on {stages.prompts} calibration prompts × {stages.tokens} tokens "
                   "(ms per step; stages run one after the other)", title_justify="left")
        for col in ("tail draft", "head draft", "begin", "rounds", "ahead", "verify", "other", "step", "tokens/step",
                    "head hits", "modelled ms/token"):
            st.add_column(col, justify="left" if "draft" in col else "right")
        for a in stages.alternatives:
            mark = Stages(a.tail, a.head) == stages.chosen
            cells = [a.tail, a.head, *(f"{a.stage_ms[k]:.1f}" for k in ("begin", "rounds", "ahead", "verify", "other")),
                     f"{a.step_ms:.1f}", f"{a.tokens_per_step:.2f}", f"{a.head_hit_rate:.0%}", f"{a.ms_per_token:.1f}"]
            st.add_row(*[f"[bold green]{c}[/]" if mark else c for c in cells])
        con.print(st)
    con.print(f"stages: {stages.why if stages is not None else 'not searched'}")
    if report.heads:
        heads = Table(title="depth predictor, cross-validated over the calibration prompts, and its depth policy", title_justify="left")
        for col in ("depth d", "P(A ≥ d) observed", "AUC", "Brier", "tokens factor", "verify W"):
            heads.add_column(col, justify="right")
        policy = chosen.depth_policy
        for h in report.heads:
            d = h.depth
            extra = [f"{policy.factors[d]:.2f}", str(policy.verify_widths[d])] if policy is not None else ["–", "–"]
            heads.add_row(str(d), f"{h.positives:.2f}", fmt(h.auc), f"{h.brier:.3f}", *extra)
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
        row = [name, r.params.summary(),
               " + ".join(map(str, r.shape.draft_widths)) or "–", str(r.shape.verify_width),
               fmt(r.step_ms, ".1f"), fmt(r.break_even)]
        if measured:
            row += [fmt(r.measured_accepted), fmt(r.predicted_speedup, ".2f", "×"), fmt(r.measured_speedup, ".2f", "×")]
        t.add_row(*row)
    con.print(t)
    con.print("break-even E[A]: the tokens per step a method must average to match plain decoding "
              "(modelled step time / plain step time, at the calibration context); predicted speed-up = E[A] · plain step / modelled step.")
    for r in rep.methods:
        if r.adapt is not None:
            shapes = "  ".join(f"{k}:{n}" for k, n in sorted(r.shapes.items(), key=lambda kv: -kv[1]))
            con.print(f"{r.name} on the prompt — acceptance estimate against the prior: {adapt_line(r.adapt)}; "
                      f"steps by depth×width: {shapes}")
    if rep.tree_caption:
        con.print(f"tree: {rep.tree_caption}")
    for f in rep.files:
        con.print(f"[green]wrote[/] {f}")
