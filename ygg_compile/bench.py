"""Timing every method of an artifact on the same prompts, interleaved, with medians.

Methods run in a rotating order inside each round, so slow drifts of a shared machine (thermal,
other processes) hit every method alike; each (prompt, method) pair reports its median TPOT over
the rounds, and speed-ups are ratios of medians measured in the same run. Greedy outputs are
compared with `ar`'s in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN_PROMPTS = [
    ("code", Path(__file__).resolve().parent.parent / "demo" / "code.txt"),
    ("prose", Path(__file__).resolve().parent.parent / "demo" / "prose.txt"),
]


@dataclass
class Cell:
    tpot_ms: list[float] = field(default_factory=list)
    mean_accepted: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)


def load_prompts(path: Path | None, categories: list[str] | None, limit: int | None) -> list[tuple[str, str]]:
    """(category, prompt) pairs: Spec-Bench JSONL (`category`, `turns`; first turn used), or the
    built-in code and prose prompts."""
    if path is None:
        return [(cat, p.read_text().strip()) for cat, p in BUILTIN_PROMPTS]
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out, per_cat = [], {}
    for row in rows:
        cat = row.get("category", "default")
        if categories and cat not in categories:
            continue
        if limit and per_cat.get(cat, 0) >= limit:
            continue
        per_cat[cat] = per_cat.get(cat, 0) + 1
        out.append((cat, row["turns"][0] if "turns" in row else row["prompt"]))
    return out


def run(decoder, prompts, methods, max_new_tokens: int, rounds: int, progress=None) -> dict:
    cells: dict[tuple[int, str], Cell] = {}
    decoder.generate(prompts[0][1], max_new_tokens=8, method=methods[-1])  # warm-up
    total = rounds * len(prompts) * len(methods)
    done = 0
    for r in range(rounds):
        for i, (_, prompt) in enumerate(prompts):
            order = methods[(r + i) % len(methods) :] + methods[: (r + i) % len(methods)]
            for method in order:
                res = decoder.generate(prompt, max_new_tokens=max_new_tokens, method=method, ignore_eos=True)
                cell = cells.setdefault((i, method), Cell())
                cell.tpot_ms.append(res.tpot_ms)
                cell.mean_accepted.append(res.metrics.mean_accepted_length)
                cell.tokens.append(res.token_ids)
                done += 1
                if progress:
                    progress(done, total)
    rows = []
    for (i, method), cell in sorted(cells.items()):
        base = cells[(i, "ar")] if "ar" in methods else None
        tpot = statistics.median(cell.tpot_ms)
        rows.append({
            "prompt": i,
            "category": prompts[i][0],
            "method": method,
            "tpot_ms": tpot,
            "tpot_ms_all": cell.tpot_ms,
            "mean_accepted_length": statistics.mean(cell.mean_accepted),
            "speedup_vs_ar": statistics.median(base.tpot_ms) / tpot if base else None,
            "same_as_ar": cell.tokens[0] == base.tokens[0] if base else None,
        })
    return {"rows": rows, "methods": methods, "rounds": rounds, "max_new_tokens": max_new_tokens}


def summarize(result: dict) -> list[dict]:
    """Per category and method: median TPOT over the prompts, speed-up as the ratio of ar's median
    to the method's, mean accepted length, and how many greedy outputs equal ar's."""
    out = []
    cats = sorted({r["category"] for r in result["rows"]})
    for cat in cats:
        base = [r["tpot_ms"] for r in result["rows"] if r["category"] == cat and r["method"] == "ar"]
        for method in result["methods"]:
            rows = [r for r in result["rows"] if r["category"] == cat and r["method"] == method]
            tpot = statistics.median(r["tpot_ms"] for r in rows)
            out.append({
                "category": cat,
                "method": method,
                "prompts": len(rows),
                "tpot_ms": tpot,
                "speedup_vs_ar": statistics.median(base) / tpot if base else None,
                "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in rows),
                "same_as_ar": sum(bool(r["same_as_ar"]) for r in rows),
            })
    return out


def main() -> None:
    import ygg_runtime
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default="artifacts/default")
    ap.add_argument("--prompts", type=Path, default=None, help="Spec-Bench style JSONL (default: built-in)")
    ap.add_argument("--categories", nargs="*", default=None)
    ap.add_argument("--limit", type=int, default=None, help="prompts per category")
    ap.add_argument("--methods", nargs="*", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("-o", "--output", type=Path, default=None, help="write the raw results as JSON here")
    a = ap.parse_args()
    dec = ygg_runtime.load(a.artifact)
    methods = a.methods or list(dec.methods)
    prompts = load_prompts(a.prompts, a.categories, a.limit)
    with Progress(console=Console(stderr=True)) as bar:
        task = bar.add_task("benchmarking", total=a.rounds * len(prompts) * len(methods))
        result = run(dec, prompts, methods, a.max_new_tokens, a.rounds, lambda d, t: bar.update(task, completed=d))
    table = Table(title=f"{a.artifact} · {dec.info.get('dtype')} · {a.max_new_tokens} new tokens · {a.rounds} round(s)")
    for col in ("category", "method", "prompts", "TPOT ms (median)", "speed-up vs ar", "mean accepted", "= ar"):
        table.add_column(col, justify="right")
    for s in summarize(result):
        table.add_row(s["category"], s["method"], str(s["prompts"]), f"{s['tpot_ms']:.1f}",
                      f"{s['speedup_vs_ar']:.2f}×" if s["speedup_vs_ar"] else "-", f"{s['mean_accepted_length']:.2f}",
                      f"{s['same_as_ar']}/{s['prompts']}")
    Console().print(table)
    if a.output:
        a.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **result}, indent=1))


if __name__ == "__main__":
    main()
