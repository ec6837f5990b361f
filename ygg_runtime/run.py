"""What `ygg run` does once `ygg_runtime.cli` has checked its arguments: load the artifact, generate,
stream the text (or print one JSON object), and the statistics when asked."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from ygg_runtime.artifact.load import load
from ygg_runtime.options import RunOptions
from ygg_runtime.ui import err, stats_table


def run(prompt: str, artifact: Path, options: RunOptions, *, as_json: bool, stats: bool, device: str | None,
        dtype: str | None, expect_plan: str | None) -> None:
    """Generate from the prompt, streaming the text (or one JSON object at the end)."""
    decoder = load(artifact, device=device, predictor=options.ablation.predictor, eager=options.ablation.eager,
                   dtype=dtype, expect_plan=expect_plan)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        result = decoder.generate(prompt, options, on_text=None if as_json else stream)
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
