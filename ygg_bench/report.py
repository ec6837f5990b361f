"""What a benchmark run means: per-category summaries with paired speed-ups, and the files and
tables that show them (results.json/csv, PNG plots, summary.md, the terminal table)."""

from __future__ import annotations

import collections
import csv
import io
import statistics
from pathlib import Path
from typing import Callable

from rich.table import Table

from ygg_bench import harness, plots
from ygg_bench.options import OWN_PLAIN
from ygg_compile.plots import tw_curves
from ygg_runtime.files import write_atomic
from ygg_runtime.schema.plan import Profile
from ygg_runtime.ui import fmt

# Contestants that run egt another way, each measuring what one part of the artifact adds
# (`bench.ablation` says how each runs; the summary reports egt's paired gain over each).
ABLATIONS = {
    "egt-fixed": "egt at its planned fixed depth: what the depth predictor adds",
    "egt-nograft": "egt drafting only, without retrieval grafted into its trees: what grafting adds",
    "egt-eager": "egt on the eager forwards: what the ahead-of-time compiled ones add",
    "egt-plain": "egt with the plain stage order: what the searched stage plan adds (when it is not plain)",
    "egt-ahead": "egt with the best stage order the search rejected (when it chose plain)",
    "egt-noadapt": "egt with every step shaped as planned (`--no-adapt`): what the request's acceptance estimate adds",
    "auto-noadapt": "`auto` with every step shaped as planned (`--no-adapt`): what the estimate adds to the default "
                    "(compared with `auto`)",
}
# What each ablation takes something away from (egt unless named here).
ABLATED = {"auto-noadapt": "auto"}

# The runtime's own choice: what a request that names no method runs (`Decoder.choose`).
AUTO = "auto"
CHOSEN = {AUTO: "no method named: per request, the plan's method (its drafter reading the whole prompt, or only its "
                "last K tokens: `@K`) or steps without the drafter, whichever is modelled faster over the whole "
                "request (prefill and decode)"}

# Plain decoding run another way: the reference for the greedy outputs of contestants run that way.
REFERENCES = {
    "ar-eager": "plain decoding on the eager forwards: what `egt-eager` must equal token for token (eager and "
                "compiled forwards round differently; each is exact against its own plain decoding)",
}

# ---------------------------------------------------------------- aggregation


def _ran(record: dict, name: str) -> str:
    """What a run ran: its method, and "@K" where its drafter read only the prompt's last K tokens."""
    window = record.get("draft_window")
    return record.get("method", name) + (f"@{window}" if window else "")


def _median_ratio(num: dict[str, float], den: dict[str, float]) -> float | None:
    ratios = [num[k] / den[k] for k in den if k in num and den[k] > 0]
    return statistics.median(ratios) if ratios else None


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(rows: list[dict], contestants: list[str], greedy: bool) -> list[dict]:
    """Per category (and "all") and contestant: TPOT median and quartiles over the prompts (each
    prompt's median over rounds), paired speed-ups over `ar` and `hf-assisted`, mean accepted
    length, acceptance, the time split, and how many greedy outputs equal `ar`'s."""
    per: dict[tuple[str, str], dict] = {}  # (contestant, prompt) -> rows
    cats: dict[str, str] = {}
    for r in rows:
        per.setdefault((r["contestant"], r["prompt"]), []).append(r)
        cats[r["prompt"]] = r["category"]
    tpot = {k: statistics.median(x["tpot_ms"] for x in v) for k, v in per.items()}
    prefill = {k: statistics.median(prefill_ms_per_token(x) for x in v) for k, v in per.items()}
    request = {k: statistics.median(x["wall_s"] for x in v) for k, v in per.items()}
    first = {k: statistics.median(first_token_s(x) for x in v) for k, v in per.items()}
    out = []
    for cat in sorted(set(cats.values())) + ["all"]:
        keys = [p for p, c in cats.items() if cat in ("all", c)]

        def of(table: dict, name: str, keys: list[str] = keys) -> dict[str, float]:
            """A contestant's figures in `table` by prompt, for the category's prompts it ran."""
            return {p: table[(name, p)] for p in keys if (name, p) in table}

        base, base_request, base_first = of(tpot, "ar"), of(request, "ar"), of(first, "ar")
        assisted, llama = of(tpot, "hf-assisted"), of(tpot, "llama.cpp")
        for name in contestants:
            mine = of(tpot, name)
            if not mine:
                continue
            runs = [per[(name, p)][0] for p in mine]
            values = sorted(mine.values())
            row = {
                "category": cat,
                "contestant": name,
                "kind": runs[0]["kind"],
                "prompts": len(mine),
                "tpot_ms": statistics.median(values),
                "tpot_p25_ms": _quantile(values, 0.25),
                "tpot_p75_ms": _quantile(values, 0.75),
                "prefill_ms_per_token": statistics.median(prefill[(name, p)] for p in mine),
                # the whole request as its user waits for it: to the first token, and to the last
                "first_token_s": statistics.median(first[(name, p)] for p in mine),
                "request_s": statistics.median(request[(name, p)] for p in mine),
                "first_token_vs_ar": _median_ratio(of(first, name), base_first),
                "request_speedup_vs_ar": _median_ratio(base_request, of(request, name)),
                "methods_run": dict(collections.Counter(_ran(r, name) for p in mine for r in per[(name, p)])),
                "speedup_vs_ar": _median_ratio(base, mine),
                "speedup_vs_hf_assisted": _median_ratio(assisted, mine),
                # over llama.cpp's plain decoding of the same GGUF file, when the run has it
                "speedup_vs_llama_cpp": _median_ratio(llama, mine),
                # an ablation is egt with one thing taken away: what that thing buys
                "egt_speedup_over": _median_ratio(mine, of(tpot, ABLATED.get(name, "egt"))) if name in ABLATIONS else None,
                "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in runs),
                "acceptance_rate": _mean([r["acceptance_rate"] for r in runs]),
                "depth_acceptance": _mean_lists([r["depth_acceptance"] for r in runs]),
                "mean_tree_depth": _mean([r.get("mean_tree_depth") for r in runs]),
                "generated_tokens": sum(r["generated"] for r in runs),
            }
            by_source = [r["tokens_per_step_by_source"] for r in runs if r.get("tokens_per_step_by_source")]
            if by_source and any(r.get("retrieved_tokens") for r in runs):  # a method that retrieves
                row["tokens_per_step_by_source"] = {k: statistics.mean(b[k] for b in by_source) for k in by_source[0]}
                row["retrieval_ms_per_step"] = statistics.mean(r["retrieval_ms_per_step"] for r in runs)
                row["retrieval_steps_share"] = sum(r["retrieval_steps"] for r in runs) / max(1, sum(r["steps"] for r in runs))
            split = [r for r in runs if r["draft_s"] is not None]
            if split:
                total = sum(r["draft_s"] + r["verify_s"] + r["other_s"] for r in split) or 1.0
                for part in ("draft", "verify", "other"):
                    row[f"{part}_share"] = sum(r[f"{part}_s"] for r in split) / total
            ref = reference(name, runs, per)
            if greedy and (ref, runs[0]["prompt"]) in per:
                divergences = [_first_divergence(per[(ref, p)][0]["tokens"], per[(name, p)][0]["tokens"]) for p in mine]
                row["reference"] = ref
                row["same_as_ar"] = sum(d is None for d in divergences)
                row["first_divergence"] = [d for d in divergences if d is not None]
            own = OWN_PLAIN.get(name)  # a speculative peer against its own plain decoding: its exactness
            both = [p for p in mine if (own, p) in per]
            if greedy and both:
                row["own_plain"] = own
                row["own_plain_prompts"] = len(both)
                row["same_as_own_plain"] = sum(per[(own, p)][0]["tokens"] == per[(name, p)][0]["tokens"] for p in both)
            out.append(row)
    return out


def first_token_s(run: dict) -> float:
    """Seconds from the call to the first output token: the prompt's prefill (both models' for a
    method that drafts) and the first step."""
    return run["prefill_s"] + (run.get("first_token_s") or 0.0)


def prefill_ms_per_token(run: dict) -> float:
    """Prompt processing as every contestant can be timed alike: from the call to the first output
    token, over the prompt's tokens. Ours: the prefill (both models: a drafting method's drafter
    reads the prompt too) and the first step; a peer's first token comes out of its prompt's
    forward. Our chat template's system turn, cached across calls, counts as processed (llama.cpp
    reads every prompt from scratch: `peers.LlamaCppPeers.generate`)."""
    return 1000.0 * first_token_s(run) / max(1, run["prompt_tokens"])


def reference(name: str, runs: list[dict], per: dict) -> str:
    """Whose plain decoding a contestant's greedy output must equal: `ar`, or `ar-eager` for a
    contestant of ours on the eager forwards when the run has it."""
    eager = runs[0].get("forward") == "eager" and name != "ar-eager"
    return "ar-eager" if eager and ("ar-eager", runs[0]["prompt"]) in per else "ar"


def _quantile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _mean_lists(lists: list[list[float]]) -> list[float]:
    depth = max((len(x) for x in lists), default=0)
    return [statistics.mean(x[d] for x in lists if len(x) > d) for d in range(depth)]


def winners(summary: list[dict]) -> dict[str, str]:
    """The contestant with the lowest median TPOT in each category."""
    best: dict[str, dict] = {}
    for row in summary:
        if row["category"] not in best or row["tpot_ms"] < best[row["category"]]["tpot_ms"]:
            best[row["category"]] = row
    return {cat: row["contestant"] for cat, row in best.items()}


CSV_FIELDS = ["category", "contestant", "kind", "prompts", "tpot_ms", "tpot_p25_ms", "tpot_p75_ms", "prefill_ms_per_token",
              "first_token_s", "request_s", "first_token_vs_ar", "request_speedup_vs_ar", "speedup_vs_ar",
              "speedup_vs_hf_assisted", "speedup_vs_llama_cpp", "egt_speedup_over", "mean_accepted_length", "acceptance_rate", "depth_acceptance",
              "mean_tree_depth", "draft_share", "verify_share", "other_share", "same_as_ar", "same_as_own_plain", "generated_tokens",
              "retrieval_ms_per_step", "retrieval_steps_share"]


def write_results(results: dict, out: Path) -> None:
    harness.write_json(out / "results.json", results)
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for row in results["summary"]:
        w.writerow({k: ("/".join(f"{x:.3f}" for x in v) if isinstance(v, list) else
                        f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
    write_atomic(out / "results.csv", buf.getvalue().encode())
    write_atomic(out / "speedup.png", plots.speedup_bars(results["summary"]))
    write_atomic(out / "tpot_vs_accepted.png", plots.tpot_vs_accepted(results["runs"]))
    write_atomic(out / "tw_curves.png", tw_curves(Profile.from_dict(results["profile"]), "T(W) measured during the benchmark"))
    write_atomic(out / "summary.md", summary_markdown(results).encode())


def summary_markdown(results: dict) -> str:
    cfg, mach, art = results["config"], results["machine"], results["artifact"]
    greedy = cfg["temperature"] == 0
    llama = any(r.get("speedup_vs_llama_cpp") is not None for r in results["summary"])
    models = art["models"]
    lines = [
        "# Yggdrasil benchmark",
        "",
        f"- **Models**: target `{models['target']['spec']}` ({models['target']['parameters'] / 1e6:.0f}M), "
        f"draft `{models.get('draft', {}).get('spec', '–')}`; {mach['dtype']} on {mach['device']}",
        f"- **Machine**: {mach['cpu']}, {mach['threads']} torch threads ({mach['cores']} cores)"
        + (f", GPU {mach['gpu']}" if "gpu" in mach else "")
        + (f", read bandwidth {mach['read_bandwidth_gbs']} GB/s and int8 peak {mach['int8_peak_gmacs']} G multiply-adds/s "
           "(measured after the runs)" if "read_bandwidth_gbs" in mach else "")
        + f"; torch {mach['torch']}, transformers {mach.get('transformers', '–')}, Python {mach['python']}; {mach['date']}",
        f"- **Prompts**: {cfg['prompts']}, {len(cfg['prompt_keys'])} prompts; {cfg['max_new_tokens']} new tokens at most "
        f"(stopping at end of sequence), temperature {cfg['temperature']}, {cfg['rounds']} round(s), interleaved",
        f"- **Peak memory** (resident, whole process): {results['peak_rss_gb']:.1f} GB",
        f"- **Command**: `{cfg['command']}`{harness.at_revision(results)}"
        + (f" (continuing `{cfg['resumed_from']}` with `--resume`: runs recorded by either are reported)"
           if cfg.get("resumed_from") and cfg["resumed_from"] != cfg["command"] else ""),
        "",
        "TPOT is the time per output token after the first (vLLM's: from the first token out to the last, over the "
        "tokens after the first; prompt processing excluded), the median over the prompts "
        "(p25–p75 in brackets). Speed-ups are paired: per prompt, the ratio of TPOTs measured back to back, "
        "median over the prompts. Mean accepted = tokens per target forward, bonus included. Prefill = prompt "
        "processing: from the call to the first output token, over the prompt's tokens (median over the prompts)."
        + (" `vs llama.cpp`: over llama.cpp's plain decoding of the same GGUF file, same threads and prompt ids."
           if llama else ""),
        "",
        "| category | contestant | prompts | TPOT ms | prefill ms/token | vs ar | vs hf-assisted | "
        + ("vs llama.cpp | " if llama else "") + "mean accepted | accept rate | draft/verify/other | " + ("= ar |" if greedy else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if llama else "") + ("---|" if greedy else ""),
    ]
    for r in results["summary"]:
        split = "/".join(f"{r[k] * 100:.0f}%" for k in ("draft_share", "verify_share", "other_share")) if "draft_share" in r else "–"
        versus = f" ({r['reference']})" if r.get("reference", "ar") != "ar" else ""
        same = f"{r['same_as_ar']}/{r['prompts']}{versus} |" if greedy and "same_as_ar" in r else ("– |" if greedy else "")
        lines.append(
            f"| {r['category']} | {r['contestant']} | {r['prompts']} | {r['tpot_ms']:.1f} ({r['tpot_p25_ms']:.0f}–{r['tpot_p75_ms']:.0f}) | "
            f"{fmt(r.get('prefill_ms_per_token'), '.2f')} | {fmt(r['speedup_vs_ar'], '.2f', '×')} | {fmt(r['speedup_vs_hf_assisted'], '.2f', '×')} | "
            + (f"{fmt(r.get('speedup_vs_llama_cpp'), '.2f', '×')} | " if llama else "")
            + f"{r['mean_accepted_length']:.2f} | {fmt(r['acceptance_rate'], '.0%')} | {split} | {same}"
        )
    wins = winners(results["summary"])
    lines += ["", "**Fastest per category**: " + ", ".join(f"{c}: `{w}`" for c, w in wins.items()), ""]
    lines += ["## At a glance", "", "Median TPOT, and in brackets the paired speed-up over `ar`; the fastest in bold.", "",
              *glance_table(results["summary"]), ""]
    lines += ["## Whole requests", "",
              "What a user waits for: the first token (prompt processing and the first step) and the whole "
              "request (the call's wall time), medians over the prompts; `vs ar` is the paired speed-up of the whole "
              "request over `ar`'s, `first token / ar` the paired ratio of times to the first token (below 1: sooner). "
              + (f"`{AUTO}`: {CHOSEN[AUTO]}; `ran` counts the methods it picked. " if any(
                  r["contestant"] == AUTO for r in results["summary"]) else ""), "",
              "| category | contestant | first token s | request s | vs ar | first token / ar | ran |",
              "|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        if r.get("request_s") is None:
            continue
        ran = ", ".join(f"{m} {n}" for m, n in r.get("methods_run", {}).items()) if r["contestant"].startswith(AUTO) else ""
        lines.append(f"| {r['category']} | {r['contestant']} | {r['first_token_s']:.2f} | {r['request_s']:.2f} | "
                     f"{fmt(r.get('request_speedup_vs_ar'), '.2f', '×')} | {fmt(r.get('first_token_vs_ar'), '.2f')} | {ran} |")
    lines.append("")
    ablated = [r for r in results["summary"] if r.get("egt_speedup_over") is not None]
    if ablated:
        lines += ["## What each part of `egt` buys", "",
                  "Paired speed-up of `egt` (of `auto`, for `auto-noadapt`) over each ablation: per prompt, the "
                  "ablation's TPOT over `egt`'s, median over the prompts.", "",
                  *(f"- `{n}`: {ABLATIONS[n]}" for n in dict.fromkeys(r["contestant"] for r in ablated)), "",
                  *_pivot(ablated, lambda r: fmt(r["egt_speedup_over"], ".2f", "×"), lambda n: f"egt vs {n}"), ""]
    retrieving = [r for r in results["summary"] if r.get("tokens_per_step_by_source")]
    if retrieving:
        lines += ["## Where the tokens come from", "",
                  "Tokens per target forward by source (mean over the prompts): drafted by the draft model, copied "
                  "by the context index (prompt lookup over the generation), proposed by the adjacency table, and "
                  "the target's own bonus token; then the share of steps that verified retrieval alone (no drafter "
                  "forward) and what retrieval (indexing, lookups, grafting) adds to a step on this machine.", "",
                  "| category | contestant | draft | context | adjacency | bonus | retrieval-only steps | retrieval ms/step |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in retrieving:
            b = r["tokens_per_step_by_source"]
            lines.append(f"| {r['category']} | {r['contestant']} | {b['draft']:.2f} | {b['context']:.2f} | {b['adjacency']:.2f} | "
                         f"{b['bonus']:.2f} | {r['retrieval_steps_share']:.0%} | {r['retrieval_ms_per_step']:.3f} |")
        lines.append("")
    if greedy:
        lines.append(
            "`= ar` counts prompts whose greedy output equals plain decoding's token for token: `ar`'s, or for a "
            "contestant of ours on the eager forwards `ar-eager`'s (eager and compiled forwards round differently; "
            "each is exact against its own plain decoding). Every one of our methods must equal it on every prompt: "
            "that is the artifact's exactness guarantee (`exactness` in plan.yaml). The peers run kernels of their "
            "own, which round differently again: their counts against `ar` are for information; what they owe is "
            "their own plain decoding (below)."
        )
        lines.append("")
        lines += peers_exactness(results["summary"])
    lines += peers_weights(results.get("peers") or {})
    prof = results["profile"]
    lines += [
        f"## Forward latency T(W) measured in this run (context {prof['contexts'][0]} tokens, ms)",
        "",
        "| model | " + " | ".join(f"W={w}" for w in prof["widths"]) + " |",
        "|---|" + "---|" * len(prof["widths"]),
    ]
    for role in ("target", "draft"):
        if f"{role}_ms" in prof:
            lines.append(f"| {role} | " + " | ".join(f"{t:.1f}" for t in prof[f"{role}_ms"][0]) + " |")
    if results["skipped_prompts"]:
        lines += ["", f"Skipped (longer than the context): {', '.join(results['skipped_prompts'])}"]
    for peer, why in (results.get("left_out") or {}).items():  # a peer that crashed or failed
        lines += ["", f"Left out: **{peer}**, {why}"]
    lines += ["", "![speed-up](speedup.png) ![TPOT vs accepted length](tpot_vs_accepted.png) ![T(W)](tw_curves.png)", ""]
    return "\n".join(lines)


def peers_exactness(summary: list[dict]) -> list[str]:
    """Each speculative peer's greedy outputs against its own plain decoding and against ours."""
    rows = [r for r in summary if "own_plain" in r]
    if not rows:
        return []
    lines = ["## The peers' exactness", "",
             "A speculative peer owes its own plain decoding token for token (greedy): how many of its outputs equal "
             "that, and how many equal ours (`ar`).", "",
             "| category | peer | = its plain | its plain | = ours (ar) |", "|---|---|---|---|---|"]
    for r in rows:
        ours = f"{r['same_as_ar']}/{r['prompts']}" if "same_as_ar" in r else "–"
        lines.append(f"| {r['category']} | {r['contestant']} | {r['same_as_own_plain']}/{r['own_plain_prompts']} | "
                     f"`{r['own_plain']}` | {ours} |")
    return lines + [""]


def peers_weights(about: dict) -> list[str]:
    """What each contestant family's target holds (its format and bytes), and the settings a peer was
    tuned to, so the table is honest about what each reads."""
    if len(about) < 2:
        return []
    lines = ["## What each reads", "", "The target's weights as each holds them (a plain step reads them once, "
             "the embedding table aside).", "", "| contestants | target weights | GB |", "|---|---|---|"]
    for who, a in about.items():
        if "weights" in a:
            gb = f"{a['bytes'] / 1e9:.2f}" if a.get("bytes") else "–"
            lines.append(f"| {'our methods' if who == 'ours' else who} | {a['weights']} | {gb} |")
    tuned = {who: a for who, a in about.items() if "settings" in a}
    if tuned:
        lines += ["", "Speculative settings, tuned on this machine on our calibration prompts (median ms a token of "
                      "each setting swept; the fastest kept):", ""]
        for who, a in tuned.items():
            swept = "; ".join(f"{k}: {v}" for k, v in a["swept"].items())
            chosen = ", ".join(f"{k}={v}" for k, v in sorted(a["settings"].items()))
            lines.append(f"- `{who}`: **{chosen}** (swept, ms a token: {swept})")
    return lines + [""]


def glance_table(summary: list[dict]) -> list[str]:
    """Median TPOT and paired speed-up over `ar`, categories × contestants, the fastest in bold: the
    table the README quotes, generated so it is never copied by hand."""
    wins = winners(summary)

    def text(r: dict) -> str:
        t = f"{r['tpot_ms']:.0f} ms" + ("" if r["contestant"] == "ar" or r["speedup_vs_ar"] is None
                                        else f" ({r['speedup_vs_ar']:.2f}×)")
        return f"**{t}**" if wins.get(r["category"]) == r["contestant"] else t

    return _pivot(summary, text)


def _pivot(rows: list[dict], text: Callable[[dict], str], header: Callable[[str], str] = str) -> list[str]:
    """Summary rows as a markdown table: a line per category, a column per contestant, in their order."""
    names = list(dict.fromkeys(r["contestant"] for r in rows))
    cell = {(r["category"], r["contestant"]): r for r in rows}
    lines = ["| category | " + " | ".join(header(n) for n in names) + " |", "|---|" + "---|" * len(names)]
    for cat in dict.fromkeys(r["category"] for r in rows):
        lines.append(f"| {cat} | " + " | ".join(text(cell[cat, n]) if (cat, n) in cell else "–" for n in names) + " |")
    return lines


def render_table(results: dict):
    """The summary as a rich table for the terminal."""
    cfg = results["config"]
    greedy = cfg["temperature"] == 0
    t = Table(title=f"{results['artifact']['path']} · {results['machine']['dtype']} · {cfg['max_new_tokens']} new tokens · "
                    f"{len(cfg['prompt_keys'])} prompts")
    llama = any(r.get("speedup_vs_llama_cpp") is not None for r in results["summary"])
    cols = ["category", "contestant", "n", "TPOT ms (p25–p75)", "prefill ms/tok", "×ar", "×hf-assisted", *(["×llama.cpp"] if llama else []),
            "acc. len", "accept", "d/v/o %"]
    cols += ["= ar"] if greedy else []
    for c in cols:
        t.add_column(c, justify="left" if c in ("category", "contestant") else "right", no_wrap=True)
    wins = winners(results["summary"])
    last = None
    for r in results["summary"]:
        if last is not None and r["category"] != last:
            t.add_section()
        last = r["category"]
        name = f"[bold green]{r['contestant']}[/]" if wins.get(r["category"]) == r["contestant"] else r["contestant"]
        split = "/".join(f"{r[k] * 100:.0f}" for k in ("draft_share", "verify_share", "other_share")) if "draft_share" in r else "–"
        row = [r["category"], name, str(r["prompts"]), f"{r['tpot_ms']:.1f} ({r['tpot_p25_ms']:.0f}–{r['tpot_p75_ms']:.0f})",
               fmt(r.get("prefill_ms_per_token"), ".2f"), fmt(r["speedup_vs_ar"], ".2f"), fmt(r["speedup_vs_hf_assisted"], ".2f"),
               *([fmt(r.get("speedup_vs_llama_cpp"), ".2f")] if llama else []),
               f"{r['mean_accepted_length']:.2f}", fmt(r["acceptance_rate"], ".0%"), split]
        if greedy:
            row.append(f"{r['same_as_ar']}/{r['prompts']}" if "same_as_ar" in r else "–")
        t.add_row(*row)
    return t

