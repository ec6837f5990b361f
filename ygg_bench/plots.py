"""PNG figures of the benchmarks: `ygg bench`'s speed-ups and acceptance, `ygg bench-serve`'s curves
and /metrics timeline. Each function returns the PNG bytes, so callers write them atomically."""

from __future__ import annotations

from ygg_compile.plots import figure, png


COLORS = {"ar": "#7f7f7f", "chain": "#1f77b4", "specinfer": "#ff7f0e", "sequoia": "#9467bd", "egt": "#2ca02c",
          "hf": "#bcbd22", "hf-assisted": "#d62728", "hf-pld": "#8c564b", "pld": "#17becf", "llama.cpp": "#e377c2",
          "llama.cpp-pld": "#f7b6d2", "auto": "#393b79", "openvino": "#084594", "openvino-sd": "#6a3d9a",
          "openvino-pld": "#b15928", "openvino-gguf": "#636363"}


# Contestants without a colour of their own (egt-eager, egt-nograft, ar-eager, ...) take tab20's light
# shades, none of which a named one has (matplotlib's C0..C9 are those: egt-eager drew in llama.cpp's pink).
OTHERS = ("#98df8a", "#aec7e8", "#ffbb78", "#c5b0d5", "#ff9896", "#c49c94", "#dbdb8d", "#9edae5", "#c7c7c7")


def _color(name: str, i: int) -> str:
    return COLORS.get(name, OTHERS[i % len(OTHERS)])


def speedup_bars(summary: list[dict]) -> bytes:
    """Speed-up over `ar` per category (grouped bars, one per contestant); 1.0 is plain decoding."""
    cats = list(dict.fromkeys(r["category"] for r in summary))
    names = [n for n in dict.fromkeys(r["contestant"] for r in summary) if n != "ar"]
    value = {(r["category"], r["contestant"]): r["speedup_vs_ar"] for r in summary}
    fig, ax = figure(figsize=(max(6.0, 1.2 * len(cats) * max(1, len(names)) / 3), 4))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cats))]
        ys = [value.get((c, name)) or 0.0 for c in cats]
        bars = ax.bar(xs, ys, width, label=name, color=_color(name, j))
        for b, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_ylabel("speed-up over ar (median of per-prompt TPOT ratios)")
    ax.set_title("Speed-up over plain decoding, same run")
    ax.legend(fontsize=8, ncol=min(6, max(1, len(names))), loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return png(fig)


def tpot_vs_accepted(runs: list[dict]) -> bytes:
    """One point per (prompt, contestant): TPOT against tokens per target forward."""
    fig, ax = figure(figsize=(6, 4))
    names = list(dict.fromkeys(r["contestant"] for r in runs))
    for j, name in enumerate(names):
        pts = [(r["mean_accepted_length"], r["tpot_ms"]) for r in runs if r["contestant"] == name]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=16, label=name, color=_color(name, j), alpha=0.8)
    ax.set_xlabel("mean accepted length (tokens per target forward)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("TPOT vs accepted length, one point per prompt")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return png(fig)


def serve_curves(summary: list[dict]) -> bytes:
    """`ygg bench-serve`: aggregate tokens/s, per-request TPOT (p50, p95 dashed) and the verified
    tree size per sequence against concurrency, one line per method."""
    fig, axes = figure(ncols=3, figsize=(13, 3.8))
    methods = sorted({r["method"] for r in summary})
    for i, m in enumerate(methods):
        rows = sorted((r for r in summary if r["method"] == m), key=lambda r: r["concurrency"])
        c = [r["concurrency"] for r in rows]
        color = _color(m, i)
        axes[0].plot(c, [r["tokens_per_s"] for r in rows], "o-", color=color, label=m)
        axes[1].plot(c, [r["tpot_ms_p50"] for r in rows], "o-", color=color, label=f"{m} p50")
        axes[1].plot(c, [r["tpot_ms_p95"] for r in rows], "o--", color=color, alpha=0.6, label=f"{m} p95")
        if all(r["nodes_per_sequence"] is not None for r in rows):  # a peer's server has no trees to count
            axes[2].plot(c, [r["nodes_per_sequence"] for r in rows], "o-", color=color, label=m)
    for ax, title in zip(axes, ("aggregate tokens/s", "TPOT per request (ms)", "tree nodes verified per sequence")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return png(fig)


def metrics_timeline(summary: list[dict]) -> bytes:
    """`ygg bench-serve`: the server's /metrics as scraped while each load level ran — tokens
    generated (vllm:generation_tokens) and requests running — against the level's own clock."""
    fig, axes = figure(ncols=2, figsize=(11, 3.8))
    for i, r in enumerate(sorted(summary, key=lambda r: (r["method"], r["concurrency"]))):
        tl = r.get("timeline") or []
        if not tl:
            continue
        t = [s["t_s"] for s in tl]
        style = "-" if r["method"] == "egt" else "--"
        label = f"{r['method']} c={r['concurrency']}"
        axes[0].plot(t, [s["generation_tokens"] - tl[0]["generation_tokens"] for s in tl], style, label=label)
        axes[1].plot(t, [s["running"] for s in tl], style, label=label)
    for ax, title in zip(axes, ("tokens generated since the first scrape", "requests running")):
        ax.set_xlabel("seconds into the level")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    return png(fig)
