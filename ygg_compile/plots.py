"""PNG figures for `ygg inspect` (and the figure helpers `ygg_bench.plots` draws with). Each function
returns the PNG bytes, so callers write them atomically; matplotlib runs headless (Agg)."""

from __future__ import annotations

import io

from ygg_runtime.schema.plan import Profile


def figure(**kw):
    """A new figure and axes; matplotlib (half a second to import) loads on the first plot only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kw)


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def tw_curves(profile: Profile, title: str = "Forward latency T(W)") -> bytes:
    """Measured ms per forward against the number of new tokens W, per model and context length."""
    fig, ax = figure(figsize=(6, 4))
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
    return png(fig)


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
    fig, ax = figure(figsize=(2.2 * (max(depth) + 2), max(2.5, 0.45 * rows + 1)))
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
    return png(fig)
