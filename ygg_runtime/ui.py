"""What the user sees of long work: the Reporter interface the pipeline talks to, its rich progress
bars, and the tables the CLI prints."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:  # the command line imports this module before torch
    from ygg_runtime.decoding.metrics import Metrics


def fmt(v, spec: str = ".2f", suffix: str = "") -> str:
    """A number for a table cell; "–" where there is none (a peer has no acceptance rate)."""
    return "–" if v is None else f"{v:{spec}}{suffix}"


def console(stderr: bool = False) -> Console:
    """A console for stdout or stderr. A terminal gets rich's own width; a pipe or a CI log gets each
    line whole (rich would wrap it at 80 columns, mid-word and mid-path) and tables up to 200 columns."""
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    return Console(stderr=stderr, width=None if tty else 200, soft_wrap=not tty)


err = console(stderr=True)


class Reporter:
    """What the pipeline (compile, bench, profiles) tells the user, and nothing else: these no-ops
    serve tests and the Python API; the CLI passes a RichReporter that draws progress bars."""

    def step(self, description: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def progress(self, description: str, done: int, total: int, unit: str = "B") -> None:
        pass

    def note(self, text: str) -> None:
        pass


class RichReporter(Reporter):
    def __init__(self, console: Console = err):
        self.console = console
        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[amount]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "RichReporter":
        self.bar.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:  # a failure ends in one error line: take the bars away first
            for task in self.bar.task_ids:
                self.bar.update(task, visible=False)
        self.bar.stop()

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        task = self.bar.add_task(description, total=None, amount="")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.bar.update(task, total=1, completed=1, amount=f"{time.perf_counter() - start:.1f}s")
            for key in [k for k in self.tasks if k != description]:
                self.bar.update(self.tasks.pop(key), visible=False)

    def progress(self, description: str, done: int, total: int, unit: str = "B") -> None:
        if description not in self.tasks:
            self.tasks[description] = self.bar.add_task(f"  {description}", total=total or None, amount="")
        if not total:
            amount = ""
        elif unit == "B":
            amount = f"{done / 2**20:,.0f}/{total / 2**20:,.0f} MiB"
        else:
            amount = f"{done}/{total} {unit}"
        self.bar.update(self.tasks[description], completed=done, total=total or None, amount=amount)

    def note(self, text: str) -> None:
        self.console.print(text)


def adapt_line(adapt: dict | None, lines: bool = False) -> str:
    """The request's acceptance estimate against calibration's, in one line (`Metrics.adapt`), or a
    line each (`lines`: the stats table's cell): each source's price ratio and the reach's odds
    ratio, with how far the request still looks like calibration's kind where the prior is a robust one."""
    if adapt is None:
        return "off (every step as planned)"
    parts = []
    for name, a in adapt.items():
        if not isinstance(a, dict):
            continue
        weight = adapt.get("reach_weight" if name == "reach" else "weight", 1.0)
        like = f", like calibration {a['like']:.0%}" if weight < 1.0 and "like" in a else ""
        parts.append(f"{name} ×{a.get('ratio', a.get('odds')):.2f} ({a['accepted']} accepted of "
                     f"{a['expected']:.1f} calibration expected{like})")
    robust = lambda w: f" at weight {w:g}" if w < 1.0 else ""  # noqa: E731
    prior = (f"prior strengths {adapt['strength']:g}{robust(adapt.get('weight', 1.0))} (nodes), "
             f"{adapt['reach_strength']:g}{robust(adapt.get('reach_weight', 1.0))} (reach)")
    parts = parts or ["nothing tried yet"]
    return "\n".join([*parts, prior]) if lines else "  ".join(parts) + "; " + prior


def stats_table(m: Metrics, title: str, forwards: str = "") -> Table:
    """forwards: how the decoder runs its models (from `ygg_runtime.load`), shown with the counts."""
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()  # left: a long value wraps under itself
    t.add_row("method", m.method)
    if m.choice and m.choice != "asked for":
        t.add_row("method chosen", m.choice)
    if m.draft_window:
        t.add_row("drafter's window", f"the last {m.draft_window} prompt tokens")
    rules = {"greedy": "greedy", "coupled": "coupled (Gumbel-max: the text plain decoding prints with this seed)",
             "rejection": "rejection (speculative sampling: the same distribution, text that depends on the tree)"}
    t.add_row("sampling", rules.get(m.sampling, m.sampling))
    t.add_row("prompt / generated tokens", f"{m.prompt_tokens} / {m.generated_tokens}")
    t.add_row("steps (target forwards)", str(m.steps))
    t.add_row("mean accepted length", f"{m.mean_accepted_length:.2f}")
    t.add_row("acceptance rate", f"{m.acceptance_rate:.1%}" if m.drafted_tokens else "-")
    if m.retrieved_tokens:
        by = m.tokens_per_step_by_source
        t.add_row("tokens per step by source", "  ".join(f"{k} {v:.2f}" for k, v in by.items()))
        t.add_row("retrieval", f"{m.accepted_context + m.accepted_adjacency} of {m.retrieved_tokens} retrieved tokens accepted, "
                  f"{m.retrieval_steps} steps without the drafter, {m.retrieval_ms_per_step:.3f} ms per step")
    if m.depth_acceptance:
        t.add_row("acceptance by depth", "  ".join(f"{d + 1}:{a:.2f}" for d, a in enumerate(m.depth_acceptance)))
    if any(m.tree_depths):
        counts = {d: m.tree_depths.count(d) for d in sorted(set(m.tree_depths))}
        t.add_row("tree depth per step", f"mean {m.mean_tree_depth:.2f}  (" + "  ".join(f"{d}:{n}" for d, n in counts.items()) + " steps)")
    if len(m.shapes) > 1:
        shapes = sorted(m.shapes.items(), key=lambda kv: -kv[1])
        t.add_row("step shapes (depth×width)", "  ".join(f"{k}:{n}" for k, n in shapes[:8]) + ("  …" if len(shapes) > 8 else ""))
    t.add_row("acceptance estimate", adapt_line(m.adapt, lines=True))
    t.add_row("TPOT", f"{m.tpot_ms:.1f} ms  ({1000 / m.tpot_ms if m.tpot_ms else 0:.1f} tok/s)")
    t.add_row("prefill", f"{m.prefill_s * 1000:.0f} ms")
    counts = {"compiled": f"{m.compiled_forwards} compiled", "eager": f"{m.eager_forwards} eager",
              "mixed": f"{m.compiled_forwards} compiled, {m.eager_forwards} eager"}[m.forward]
    t.add_row("forwards", f"{forwards}: {counts}" if forwards else counts)
    total = m.draft_s + m.verify_s + m.other_s or 1.0
    for name, seconds in (("draft", m.draft_s), ("verify", m.verify_s), ("other", m.other_s)):
        t.add_row(f"time: {name}", f"{seconds:.2f} s ({seconds / total:.0%})")
    return t
