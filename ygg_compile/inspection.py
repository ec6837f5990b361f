"""`ygg inspect`: what an artifact's plan is and why.

For every compiled method: the forwards of one step (drafter widths, verify width), the step time
the objective models from the artifact's measured T(W) curves, and the accepted length it needs
to beat plain decoding. Given a prompt, each method also runs on it, so the table shows the
objective's predicted speed-up next to the measured one, and one drafted tree is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ygg_runtime
from ygg_compile import plots
from ygg_runtime import objective, proposers
from ygg_runtime.artifact import read_plan
from ygg_runtime.errors import YggError
from ygg_runtime.files import output_dir, write_atomic
from ygg_runtime.plan import Plan
from ygg_runtime.tree import DRAFT


@dataclass
class MethodReport:
    name: str
    params: dict
    shape: objective.StepShape
    step_ms: float | None = None  # modelled
    break_even: float | None = None  # E[A] needed to match ar
    measured_accepted: float | None = None  # on the prompt
    predicted_speedup: float | None = None  # objective at the measured E[A]
    measured_speedup: float | None = None  # ar's TPOT / this TPOT on the prompt
    tpot_ms: float | None = None


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
    if max_new_tokens < 1:
        raise YggError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
    curves = objective.Curves(plan.profile, context=plan.planning["context"])
    reports = []
    for name, params in plan.methods.items():
        r = MethodReport(name, params, proposers.params(name, params).step_shape())
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
