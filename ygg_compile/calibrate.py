"""Calibration: learn how well the drafter predicts the target, on the target's own continuations,
and plan `egt` and `sequoia` from it with the measured curves (DESIGN.md §2–3, §5).

A *probe* (a deep, wide `egt`: PROBE_DEPTH rounds of PROBE_WIDTH nodes, every node's top PROBE_TOP_K
children, the PROBE_VERIFY best verified) decodes each calibration prompt greedily, so the text is
exactly the target's, and every step is recorded: the whole drafted tree, the target's argmax at
every verified node, the accepted length and the target's final hidden state at the root. From it:
- the acceptance map, P(child accepted | parent accepted) against the child's draft probability
  (isotonic, so path values never increase down a path);
- the per-rank acceptance vector for Sequoia (how often the target's token is the drafter's rank r);
- every smaller `egt` shape replayed on the recorded trees with the same code the runtime runs, so
  its tokens per step are measured, not modelled; the objective then picks depth and draft width
  (depth 0, plain decoding, included);
- per-step accepted lengths with the hidden state, kept in calibration.safetensors for the depth
  predictor.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ygg_compile.build import Reporter
from ygg_compile.sequoia import SequoiaTables
from ygg_runtime import engine, objective
from ygg_runtime.errors import YggError
from ygg_runtime.objective import Curves
from ygg_runtime.proposers import Drafter
from ygg_runtime.proposers.egt import EGT
from ygg_runtime.proposers.sequoia import Sequoia
from ygg_runtime.runner import ModelRunner
from ygg_runtime.text import TextCodec

BUILTIN_PROMPTS = Path(__file__).parent / "data" / "calib_prompts.jsonl"
PROBE_DEPTH, PROBE_WIDTH, PROBE_TOP_K, PROBE_VERIFY = 6, 8, 8, 32
PROBE_ROOM = 1 + PROBE_TOP_K * (1 + PROBE_WIDTH * (PROBE_DEPTH - 1)) + PROBE_WIDTH  # cache slots of a probe tree
EGT_WIDTHS = (1, 2, 4, 8)  # draft widths tried (≤ PROBE_WIDTH, so replays stay inside the probe)
SEQUOIA_MAX_DEPTH = 8
MAP_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
MIN_PAIRS = 50  # below this many labelled children the map stays the identity


def load_prompts(path: Path | None) -> list[str]:
    """Calibration prompts: a JSONL file (`turns` or `prompt` fields), a text file (prompts
    separated by lines holding only `---`), or a directory of such files; default: our own set."""
    from ygg_compile.bench import load_prompts as load_jsonl

    path = Path(path) if path is not None else BUILTIN_PROMPTS
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".txt", ".md") and p.is_file())
        prompts = [t for f in files for t in load_prompts(f)]
    elif path.is_file():
        if path.suffix == ".jsonl":
            prompts = [p.text for p in load_jsonl(path)]
        else:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise YggError(f"calibration file {path} is not UTF-8 text") from None
            prompts = [part.strip() for part in _split(text)]
    else:
        raise YggError(f"calibration path {path} does not exist")
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise YggError(f"no calibration prompts in {path}")
    return prompts


def _split(text: str) -> list[str]:
    parts, cur = [], []
    for line in text.splitlines():
        if line.strip() == "---":
            parts.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    return parts + ["\n".join(cur)]


@dataclass
class ProbeStep:
    """One recorded probe step (node ids are the full drafted tree's)."""

    parents: list[int]
    tokens: list[int]
    probs: list[float]
    children: dict[int, list[int]]  # expanded node -> its children, in draft-rank order
    argmax: dict[int, int]  # verified node -> the target's greedy token after it
    accepted: int  # tokens the step yielded (bonus included)
    context: int
    prompt: int
    hidden: torch.Tensor = field(repr=False)


@dataclass
class Calibration:
    steps: list[ProbeStep]
    prompts: int
    tokens: int
    seconds: float

    def labelled_children(self) -> tuple[list[float], list[int]]:
        """(draft prob, accepted?) of every child of a node the target reached and verified."""
        qs, labels = [], []
        for s in self.steps:
            for node in _reached(s):
                for c in s.children.get(node, []):
                    qs.append(s.probs[c])
                    labels.append(int(s.tokens[c] == s.argmax[node]))
        return qs, labels

    def rank_acceptance(self) -> list[float]:
        """p[r]: how often the target's token was the drafter's rank-r candidate (Sequoia's vector)."""
        counts, total = [0] * PROBE_TOP_K, 0
        for s in self.steps:
            for node in _reached(s):
                kids = s.children.get(node)
                if not kids:
                    continue
                total += 1
                rank = next((r for r, c in enumerate(kids) if s.tokens[c] == s.argmax[node]), None)
                if rank is not None:
                    counts[rank] += 1
        return [c / total if total else 0.0 for c in counts]


def _reached(s: ProbeStep) -> list[int]:
    """Verified nodes whose whole path agrees with the target: where acceptance can be labelled."""
    out, node = [], 0
    while node in s.argmax:
        out.append(node)
        node = next((c for c in s.children.get(node, []) if s.tokens[c] == s.argmax[node]), None)
        if node is None:
            break
    return out


def run_probe(
    target: ModelRunner, draft: ModelRunner, codec: TextCodec, prompts: list[str], tokens: int, ui: Reporter
) -> Calibration:
    """Decode every prompt with the probe and record each step."""
    drafter = Drafter(draft, target.vocab_size)
    probe = EGT(drafter, PROBE_DEPTH, PROBE_WIDTH, PROBE_TOP_K, [PROBE_VERIFY])
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        target.model.register_forward_hook(lambda m, a, out: seen.__setitem__("logits", out[0])),
        target.model.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("hidden", out[0, 0])),
    ]
    steps: list[ProbeStep] = []
    start, made, used = time.time(), 0, 0
    try:
        for i, text in enumerate(prompts):
            ids = codec.encode(text)
            if len(ids) + tokens + probe.max_tree_size > target.max_len:
                ui.note(f"calibration prompt {i + 1} ({len(ids)} tokens) does not fit the context: skipped")
                continue
            context = [len(ids)]

            def record(tree, verdict, i=i, context=context):
                full = probe.last_tree
                origin = tree.origin  # the probe verifies a pruned tree
                best = seen["logits"][: len(tree)].argmax(-1).tolist()
                children = {v: list(kids) for v, kids in enumerate(full.children) if kids}
                steps.append(ProbeStep(
                    full.parents, full.tokens, full.draft_probs, children,
                    {origin[v]: best[v] for v in range(len(tree))}, verdict.accepted + 1, context[0], i,
                    seen["hidden"].float().clone(),
                ))
                context[0] += verdict.accepted + 1

            out, _ = engine.generate(target, probe, ids, max_new_tokens=tokens, on_step=record)
            made, used = made + len(out), used + 1
            ui.progress("calibrating on the target's own continuations", i + 1, len(prompts), unit="prompts")
    finally:
        for h in hooks:
            h.remove()
    return Calibration(steps, used, made, time.time() - start)


def acceptance_map(calib: Calibration) -> list[list[float]]:
    """Isotonic fit of acceptance against draft probability, sampled on MAP_GRID."""
    qs, labels = calib.labelled_children()
    if len(qs) < MIN_PAIRS:
        return [[0.0, 0.0], [1.0, 1.0]]
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip").fit(qs, labels)
    return [[q, round(float(a), 4)] for q, a in zip(MAP_GRID, iso.predict(list(MAP_GRID)))]


def replay(egt: EGT, step: ProbeStep) -> tuple[int, int]:
    """Run `egt`'s growth and pruning on a recorded step: (tokens the step yields, verify width).
    A node the probe never expanded has no children here and one it never verified accepts
    nothing below it, so a replay can only under-count against a real run."""
    probe_of = {0: 0}

    def probe_node(tree, v: int) -> int | None:
        if v not in probe_of:
            parent = probe_node(tree, tree.parents[v])
            kids = step.children.get(parent, []) if parent is not None else []
            probe_of[v] = next((c for c in kids if step.tokens[c] == tree.tokens[v]), None)
        return probe_of[v]

    def kids(p: int | None) -> tuple[list[float], list[int]]:
        cs = step.children.get(p, [])[: egt.top_k] if p is not None else []
        return [step.probs[c] for c in cs], [step.tokens[c] for c in cs]

    tree = egt.grow(step.tokens[0], kids(0), lambda t, picks: [kids(probe_node(t, v)) for v in picks])
    sub = egt.prune(tree, step.context)
    node, accepted = 0, 0
    while True:
        p = probe_node(tree, sub.origin[node])
        if p is None or p not in step.argmax:
            break
        nxt = next((c for c in sub.children[node] if sub.tokens[c] == step.argmax[p]), None)
        if nxt is None:
            break
        node, accepted = nxt, accepted + 1
    return accepted + 1, sub.verify_width


def plan_egt(calib: Calibration, curves: Curves, accept: list[list[float]], verify_widths: tuple[int, ...],
             draft_widths: tuple[int, ...]) -> tuple[dict, list[dict]]:
    """Replay every (depth, draft width) on the probe steps; the objective picks the fastest.
    Returns the egt parameters and the table of candidates."""
    plain = sum(objective.plain_ms(curves, s.context) for s in calib.steps) / max(1, len(calib.steps))
    rows = [{"depth": 0, "draft_width": 0, "tokens_per_step": 1.0, "step_ms": round(plain, 2), "speedup": 1.0, "verify_width": 1}]
    tried = [w for w in EGT_WIDTHS if w in draft_widths] or [min(draft_widths)]
    for depth in range(1, PROBE_DEPTH + 1):
        for w in tried[: 1 if depth == 1 else None]:  # depth 1 has no round after the root's
            egt = EGT(None, depth, w, PROBE_TOP_K, verify_widths, accept=accept, curves=curves)
            got, ms, plain_total, widths = 0, 0.0, 0.0, []
            for s in calib.steps:
                n, vw = replay(egt, s)
                got += n
                ms += egt.step_ms(egt.step_shape().draft_widths, vw, s.context)
                plain_total += n * objective.plain_ms(curves, s.context)
                widths.append(vw)
            rows.append({"depth": depth, "draft_width": w, "tokens_per_step": round(got / len(calib.steps), 3),
                         "step_ms": round(ms / len(calib.steps), 2), "speedup": round(plain_total / ms, 3),
                         "verify_width": int(statistics.median_low(widths))})
    best = max(rows, key=lambda r: r["speedup"])
    params = {"depth": best["depth"], "draft_width": max(1, best["draft_width"]), "top_k": PROBE_TOP_K,
              "verify_widths": list(verify_widths), "verify_width": best["verify_width"], "accept": accept}
    return params, rows


def plan_sequoia(p: list[float], curves: Curves, widths: tuple[int, ...], context: int) -> tuple[dict, list[dict]]:
    """Sequoia's tree for every (budget, depth), timed by the objective; the fastest wins (or the
    bare root, plain decoding, when no tree pays for itself)."""
    budgets = [w for w in widths if w >= 2]
    tables = SequoiaTables(p, max(budgets, default=1), SEQUOIA_MAX_DEPTH)
    rows = [{"budget": 1, "depth": 0, "expected_accepted": 1.0, "speedup": 1.0, "parents": [-1], "ranks": [0]}]
    for n in budgets:
        for d in range(1, SEQUOIA_MAX_DEPTH + 1):
            tree = tables.tree(n, d)
            if tree.depth < d:  # the same tree as a shallower bound
                continue
            shape = Sequoia(None, tree.parents, tree.ranks, widths).step_shape()
            rows.append({"budget": n, "depth": d, "expected_accepted": round(tree.expected_accepted, 3),
                         "speedup": round(objective.speedup(tree.expected_accepted, shape, curves, context), 3),
                         "parents": list(tree.parents), "ranks": list(tree.ranks)})
    best = max(rows, key=lambda r: r["speedup"])
    table = [{k: v for k, v in r.items() if k not in ("parents", "ranks")} for r in rows]
    return {"parents": best["parents"], "ranks": best["ranks"], "widths": list(widths)}, table


def save_steps(calib: Calibration, path: Path) -> None:
    """Per-step hidden states and accepted lengths, the depth predictor's training data."""
    from safetensors.torch import save_file

    if not calib.steps:
        return
    save_file({
        "hidden": torch.stack([s.hidden for s in calib.steps]).to(torch.float16),
        "accepted": torch.tensor([s.accepted for s in calib.steps], dtype=torch.int32),
        "context": torch.tensor([s.context for s in calib.steps], dtype=torch.int32),
        "prompt": torch.tensor([s.prompt for s in calib.steps], dtype=torch.int32),
    }, str(path), metadata={"probe": json.dumps({"depth": PROBE_DEPTH, "width": PROBE_WIDTH, "top_k": PROBE_TOP_K,
                                                  "verify": PROBE_VERIFY})})

