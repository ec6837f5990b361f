"""PNG figures for `ygg bench` and `ygg inspect`. Each function returns the PNG bytes, so callers
write them atomically; matplotlib runs headless (Agg)."""

from __future__ import annotations

import io

from ygg_runtime.plan import Profile

COLORS = {"ar": "#7f7f7f", "chain": "#1f77b4", "specinfer": "#ff7f0e", "sequoia": "#9467bd", "egt": "#2ca02c",
          "hf": "#bcbd22", "hf-assisted": "#d62728", "hf-pld": "#8c564b", "pld": "#17becf", "llama.cpp": "#e377c2",
          "llama.cpp-pld": "#f7b6d2", "auto": "#393b79"}


def _figure(**kw):
    """A new figure and axes; matplotlib (half a second to import) loads on the first plot only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kw)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


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
    fig, ax = _figure(figsize=(max(6.0, 1.2 * len(cats) * max(1, len(names)) / 3), 4))
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
    return _png(fig)


def tpot_vs_accepted(runs: list[dict]) -> bytes:
    """One point per (prompt, contestant): TPOT against tokens per target forward."""
    fig, ax = _figure(figsize=(6, 4))
    names = list(dict.fromkeys(r["contestant"] for r in runs))
    for j, name in enumerate(names):
        pts = [(r["mean_accepted_length"], r["tpot_ms"]) for r in runs if r["contestant"] == name]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=16, label=name, color=_color(name, j), alpha=0.8)
    ax.set_xlabel("mean accepted length (tokens per target forward)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("TPOT vs accepted length, one point per prompt")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def serve_curves(summary: list[dict]) -> bytes:
    """`ygg bench-serve`: aggregate tokens/s, per-request TPOT (p50, p95 dashed) and the verified
    tree size per sequence against concurrency, one line per method."""
    fig, axes = _figure(ncols=3, figsize=(13, 3.8))
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
    return _png(fig)


def metrics_timeline(summary: list[dict]) -> bytes:
    """`ygg bench-serve`: the server's /metrics as scraped while each load level ran — tokens
    generated (vllm:generation_tokens) and requests running — against the level's own clock."""
    fig, axes = _figure(ncols=2, figsize=(11, 3.8))
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
    return _png(fig)


def tw_curves(profile: Profile, title: str = "Forward latency T(W)") -> bytes:
    """Measured ms per forward against the number of new tokens W, per model and context length."""
    fig, ax = _figure(figsize=(6, 4))
    widths = profile.widths
    for role, style in (("target", "o-"), ("draft", "s--")):
        for ctx, row in zip(profile.contexts, profile.ms(role)):
            ax.plot(widths, row, style, label=f"{role} @ {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("W (new tokens in one forward)")
    ax.set_ylabel("ms per forward")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title} ({profile.threads} threads)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="model @ context", title_fontsize=8)
    return _png(fig)


SOURCE_STYLE = {0: ("", "#888888"), 1: ("ctx", "#1f77b4"), 2: ("adj", "#9467bd")}  # tree.DRAFT, CONTEXT, ADJACENCY


def token_tree(tokens: list[str], parents: list[int], probs: list[float], accepted: list[int], bonus: str | None,
               title: str, sources: list[int] | None = None) -> bytes:
    """A drafted tree drawn left to right by depth: nodes labelled by token and draft probability
    (retrieved ones by their source, framed blue for the context index and purple for the
    adjacency table), the accepted path in green, the target's bonus token dashed after it."""
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    y: dict[int, float] = {}
    leaf = [0]

    def place(v: int) -> None:  # leaves get consecutive rows, a parent sits at its children's mean
        if not children[v]:
            y[v] = leaf[0]
            leaf[0] += 1
            return
        for c in children[v]:
            place(c)
        y[v] = sum(y[c] for c in children[v]) / len(children[v])

    place(0)
    on_path = set(accepted)
    rows = max(1, leaf[0])
    fig, ax = _figure(figsize=(2.2 * (max(depth) + 2), max(2.5, 0.45 * rows + 1)))
    for v in range(1, n):
        p = parents[v]
        good = v in on_path and p in on_path
        ax.plot([depth[p], depth[v]], [y[p], y[v]], color="#2ca02c" if good else "#bbbbbb", lw=2.5 if good else 1, zorder=1)
    for v in range(n):
        tag, edge = SOURCE_STYLE[sources[v] if sources else 0]
        label = tokens[v] if v == 0 else f"{tokens[v]}\n{tag or f'{probs[v]:.2f}'}"
        face = "#c7e9c0" if v in on_path else "white"
        ax.text(depth[v], y[v], label, ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", fc=face, ec=edge if tag else "#2ca02c" if v in on_path else edge,
                          lw=1.8 if tag else 1.0))
    if bonus is not None:
        last = accepted[-1]
        bx, by = depth[last] + 1, y[last] + (0.5 if children[last] else 0)
        ax.plot([depth[last], bx], [y[last], by], color="#2ca02c", ls="--", lw=1.5, zorder=1)
        ax.text(bx, by, f"{bonus}\n(bonus)", ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", fc="#fff7bc", ec="#2ca02c", ls="--"))
    ax.set_xlim(-0.6, max(depth) + 1.6)
    ax.set_ylim(rows, -1)
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    return _png(fig)
