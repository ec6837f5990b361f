"""What `ygg run` does once `ygg_runtime.cli` has checked its arguments: load the artifact, generate,
stream the text (or print one JSON object), and the statistics when asked."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from ygg_runtime.artifact.load import load
from ygg_runtime.ui import err, stats_table


def run(prompt: str, artifact: Path, *, method: str | None, max_new_tokens: int, temperature: float, top_p: float,
        seed: int | None, sampling: str | None, as_json: bool, stats: bool, raw: bool, ignore_eos: bool, no_predictor: bool, no_graft: bool,
        eager: bool, device: str | None, dtype: str | None, expect_plan: str | None,
        draft_window: int | None = None, no_adapt: bool = False) -> None:
    """Generate from the prompt, streaming the text (or one JSON object at the end)."""
    decoder = load(artifact, device=device, predictor=not no_predictor, eager=eager, dtype=dtype,
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
            sampling=sampling,
            method=method,
            graft=not no_graft,
            raw=raw,
            ignore_eos=ignore_eos,
            draft_window=draft_window,
            adapt=not no_adapt,
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
