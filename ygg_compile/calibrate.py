"""Calibration: learn how well the drafter predicts the target, on the target's own continuations,
and plan `egt` and `sequoia` from it with the measured curves (docs/design.md, "The objective").

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
- per-step accepted lengths with the hidden state, which the depth predictor is gated on (`ygg_compile.predictor_training`);
- retrieval's values (`graft_values`): at every position of the target's continuations, what the
  context index and the adjacency table would have proposed and how much of it the target wrote,
  which also seeds the adjacency table the artifact ships.

The probe yields one labelled step per ~5 tokens, and each costs a deep draft plus a wide verify:
too few for the depth predictor. So every calibration text (prompt and the target's continuation)
is also run once through both models teacher-forced (`agreement`): at every position, the target's
hidden state and the rank of the target's greedy token among the drafter's candidates, from which
the predictor's labels — how many of the next tokens a tree would get accepted — follow for every
position at the price of two prefills.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ygg_runtime.ui import Reporter
from ygg_compile.sequoia_tree import SequoiaTables
from ygg_runtime.decoding import engine, objective
from ygg_runtime.decoding.estimate import Estimate
from ygg_runtime.decoding.objective import AcceptanceMap, Curves
from ygg_runtime.options import MAX_ROWS
from ygg_runtime.decoding.proposers import Drafter
from ygg_runtime.decoding.proposers.base import Hook, StepState
from ygg_runtime.schema.params import MAX_N, POSITIONS, RANKS, EGTParams, GraftParams, SequoiaParams
from ygg_runtime.decoding.proposers.egt import EGT, Planner
from ygg_runtime.decoding.retrieval import (PRIOR_ADJACENCY, AdjacencyTable, Retriever, adjacency_cell, context_cell,
                                   prior_context)
from ygg_runtime.model.runner import ModelRunner
from ygg_runtime.text import TextCodec
from ygg_runtime.decoding.tree import DRAFT, TokenTree

PROBE_DEPTH, PROBE_WIDTH, PROBE_TOP_K, PROBE_VERIFY = 6, 8, 8, 32
PROBE_ROOM = 1 + PROBE_TOP_K * (1 + PROBE_WIDTH * (PROBE_DEPTH - 1)) + PROBE_WIDTH  # cache slots of a probe tree
EGT_WIDTHS = (1, 2, 4, 8)  # draft widths tried (≤ PROBE_WIDTH, so replays stay inside the probe)
SEQUOIA_MAX_DEPTH = 8
MAP_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
MIN_PAIRS = 50  # below this many labelled children the map stays the identity


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
    # The target's final hidden state at the last accepted position before this step (what the
    # runtime's depth predictor sees when it picks this step's depth); None on a first step
    # without a prefill.
    hidden: torch.Tensor | None = field(repr=False)


@dataclass
class Calibration:
    steps: list[ProbeStep]
    prompts: int
    tokens: int
    seconds: float
    texts: dict[int, list[int]] = field(default_factory=dict)  # prompt -> its tokens and the target's continuation
    prompt_lengths: dict[int, int] = field(default_factory=dict)  # prompt -> its tokens (where the continuation starts)

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


class _Drafted(Hook):
    """Keeps the probe's last drafted tree (before pruning) and the hidden state it was drafted on."""

    tree: TokenTree | None = None
    hidden: torch.Tensor | None = None

    def drafted(self, tree: TokenTree, state: StepState) -> None:
        self.tree, self.hidden = tree, state.hidden


def run_probe(
    target: ModelRunner, draft: ModelRunner, codec: TextCodec, prompts: list[str], tokens: int, ui: Reporter
) -> Calibration:
    """Decode every prompt with the probe and record each step."""
    drafter = Drafter(draft, target.vocab_size)
    seen = _Drafted()
    probe = EGT(EGTParams(PROBE_DEPTH, PROBE_WIDTH, PROBE_TOP_K, [PROBE_VERIFY]), drafter, hook=seen)
    steps: list[ProbeStep] = []
    texts: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    start, made, used = time.time(), 0, 0
    for i, text in enumerate(prompts):
        ids = codec.encode(text)
        if len(ids) + tokens + probe.max_tree_size > target.max_len:
            ui.note(f"calibration prompt {i + 1} ({len(ids)} tokens) does not fit the context: skipped")
            continue
        context = [len(ids)]

        def record(tree, verdict, i=i, context=context):
            full = seen.tree
            origin = tree.origin  # the probe verifies a pruned tree
            best = target.logits.argmax(-1).tolist()  # the verify's, as run (compiled or eager)
            children = {v: list(kids) for v, kids in enumerate(full.children) if kids}
            steps.append(ProbeStep(
                full.parents, full.tokens, full.draft_probs, children,
                {origin[v]: best[v] for v in range(len(tree))}, verdict.accepted + 1, context[0], i,
                None if seen.hidden is None else seen.hidden.float().clone(),
            ))
            context[0] += verdict.accepted + 1

        out, _ = engine.generate(target, probe, ids, max_new_tokens=tokens, on_step=record)
        texts[i], lengths[i] = ids + out, len(ids)
        made, used = made + len(out), used + 1
        ui.progress("calibrating on the target's own continuations", i + 1, len(prompts), unit="prompts")
    return Calibration(steps, used, made, time.time() - start, texts, lengths)


@dataclass
class Agreement:
    """Every calibration text run teacher-forced through both models, one row per position p
    (predicting token p + 1): the target's final hidden state there and `rank`, the rank of the
    target's greedy token among the drafter's (RANK_CAP: not in its top RANK_CAP). Along the
    target's own continuation a tree rooted at p gets token p + d accepted only if every token
    before it was, so the run of small ranks from p is how deep a tree rooted there would be
    accepted (`run`). Positions in a prefix every text shares (a chat template's) are left out:
    they would be the same sample many times."""

    hidden: torch.Tensor  # [N, dim] float32
    rank: torch.Tensor  # [N] int: rank at each position
    prompt: list[int]  # [N] the calibration prompt of each row
    position: list[int]  # [N] p within its text
    ends: dict[int, int]  # prompt -> its text's length (runs are cut there)

    def run(self, top: int, limit: int) -> torch.Tensor:
        """[N] how many of the next tokens (≤ limit) have the target's token within the drafter's
        top `top`: the accepted length of a tree with `top` children per node."""
        ok = (self.rank < top).tolist()
        out, length = [0] * len(ok), 0
        for i in range(len(ok) - 1, -1, -1):  # rows are in text order: count runs backwards
            same_text = i + 1 < len(ok) and self.prompt[i + 1] == self.prompt[i] and self.position[i + 1] == self.position[i] + 1
            length = (length + 1 if same_text else 1) if ok[i] else 0
            out[i] = min(length, limit)
        return torch.tensor(out)

    def row(self, prompt: int, position: int) -> int | None:
        """The row of `position` in `prompt`'s text (None: not a row)."""
        return self._index.get((prompt, position))

    @cached_property
    def _index(self) -> dict[tuple[int, int], int]:
        return {(q, p): i for i, (q, p) in enumerate(zip(self.prompt, self.position))}


RANK_CAP = 255


def agreement(target: ModelRunner, draft: ModelRunner, texts: dict[int, list[int]], chunk: int = 64) -> Agreement:
    """Run every text through both models teacher-forced (chunks of `chunk` tokens) and record
    hidden states and ranks (see `Agreement`)."""
    shared = _common_prefix(list(texts.values())) if len(texts) > 1 else 0
    drafter = Drafter(draft, target.vocab_size)
    hidden, rank, prompt, position, ends = [], [], [], [], {}
    for q, seq in texts.items():
        ends[q] = len(seq)
        t_logits, t_hidden = _teacher_forced(target, seq, chunk)
        d, _ = _teacher_forced(draft, drafter.known(seq), chunk)
        d = drafter.fit(d)
        best = t_logits.argmax(-1)
        r = (d > d.gather(1, best[:, None])).sum(1).clamp(max=RANK_CAP)
        keep = list(range(shared, len(seq) - 1))
        hidden.append(t_hidden[keep])
        rank.append(r[keep])
        prompt += [q] * len(keep)
        position += keep
    target.reset()
    draft.reset()
    return Agreement(torch.cat(hidden), torch.cat(rank), prompt, position, ends)


def _teacher_forced(runner: ModelRunner, seq: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits [n, V] and final hidden states [n, dim] of `seq` fed from an empty cache."""
    runner.reset()
    logits, hidden = [], []
    for i in range(0, len(seq), chunk):
        part = seq[i : i + chunk]
        logits.append(runner.forward_chain(part).float())
        hidden.append(runner.hidden.float())
        runner.commit(list(range(len(part))))
    return torch.cat(logits), torch.cat(hidden)


# The drafter's windows compile measures (`window_acceptance`), and the positions it scores: the
# last WINDOW_POSITIONS tokens of a text of WINDOW_TEXT (or the last quarter of as many as the
# context holds, when that is shorter).
WINDOWS = (64, 128, 256, 512, 1024, 2048)
WINDOW_POSITIONS = 256
WINDOW_TEXT = 4096


def window_acceptance(target: ModelRunner, draft: ModelRunner, text: list[int],
                      windows: tuple[int, ...] = WINDOWS, positions: int = WINDOW_POSITIONS) -> dict | None:
    """How much of the drafter's acceptance a window keeps (`Plan.draft_window`): at each of the
    text's last `positions` tokens, whether the drafter's greedy guess at the next token is the
    target's, the drafter reading the whole text before them, and reading only the last `w`
    tokens before them (as at run time: the window, then the tokens since). Teacher-forced: one
    prefill of the target, one of the drafter, and one short one per window. Windows that leave
    nothing out are not measured; None when none is left."""
    start = len(text) - positions
    windows = tuple(w for w in windows if w < start)
    if not windows or positions < 1:
        return None
    t0 = time.perf_counter()
    drafter = Drafter(draft, target.vocab_size)
    want = _greedy(target, text, start, lambda x: x)
    known = drafter.known(text)
    def agree(seq):
        return (_greedy(draft, seq, len(seq) - positions, drafter.fit) == want).float().mean().item()

    whole = agree(known)
    kept = [agree(known[start - w :]) / whole if whole else 1.0 for w in windows]
    target.reset()
    draft.reset()
    return {"windows": list(windows), "kept": [round(k, 4) for k in kept], "acceptance": round(whole, 4),
            "text_tokens": len(text), "positions": positions, "seconds": round(time.perf_counter() - t0, 1)}


def _greedy(runner: ModelRunner, seq: list[int], start: int, fit) -> torch.Tensor:
    """The model's greedy next token at positions start..len(seq) - 1 of `seq`, fed from an empty
    cache: the tokens before `start` in the prefill's forwards (no output head), the rest in
    forwards whose logits are kept only as their argmax (a long text's logits would not fit)."""
    runner.reset()
    runner.prefill(seq[:start])
    out = []
    for i in range(start, len(seq), MAX_ROWS):
        part = seq[i : i + MAX_ROWS]
        out.append(fit(runner.forward_chain(part)).argmax(-1))
        runner.commit(list(range(len(part))))
    return torch.cat(out)


def output_length(calib: Calibration, eos_ids: list[int]) -> dict | None:
    """How long the target's answers to the calibration prompts run (`Plan.output_length`): each
    continuation up to and with its first end-of-sequence token, or all of it where none came
    within the tokens calibration decoded (the probe decodes past an end: the answer is cut off
    there, not the text). None without continuations or an end token to look for."""
    ends = set(eos_ids)
    answers = [calib.texts[i][calib.prompt_lengths[i]:] for i in sorted(calib.texts)]
    answers = [a for a in answers if a]
    if not answers or not ends:
        return None
    lengths = [next((j + 1 for j, t in enumerate(a) if t in ends), None) for a in answers]
    return {"answers": len(answers), "ended": sum(n is not None for n in lengths),
            "tokens": sum(len(a) if n is None else n for a, n in zip(answers, lengths)),
            "budget": max(map(len, answers))}


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if len({s[i] for s in seqs}) > 1), n)


def acceptance_map(calib: Calibration) -> list[list[float]]:
    """Isotonic fit of acceptance against draft probability, sampled on MAP_GRID."""
    qs, labels = calib.labelled_children()
    if len(qs) < MIN_PAIRS:
        return [[0.0, 0.0], [1.0, 1.0]]
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip").fit(qs, labels)
    return [[q, round(float(a), 4)] for q, a in zip(MAP_GRID, iso.predict(list(MAP_GRID)))]


def replay(egt: Planner, depth: int, step: ProbeStep) -> tuple[int, int]:
    """Run egt's growth and pruning at `depth` on a recorded step: (tokens the step yields, verify width).
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

    tree = egt.grow(step.tokens[0], kids(0), lambda t, picks: [kids(probe_node(t, v)) for v in picks], depth)
    sub = egt.prune(tree, step.context, depth)
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


@dataclass
class Replays:
    """Every candidate egt shape replayed on every probe step, and timed by the objective:
    runs[(depth, draft width)][step] = (tokens the step yields, verify width, modelled ms)."""

    runs: dict[tuple[int, int], list[tuple[int, int, float]]]
    plain_ms: list[float]  # plain decoding's step at each step's context
    widths: list[int]  # the draft widths tried (depth 1 is replayed at the first only)

    def at(self, depth: int, width: int) -> list[tuple[int, int, float]]:
        if depth == 0:
            return [(1, 1, ms) for ms in self.plain_ms]
        return self.runs[(depth, self.widths[0] if depth == 1 else width)]

    def speedup(self, picks: list[tuple[int, int, int]]) -> float:
        """Modelled speed-up over plain decoding of running (step, depth, width) for each pick."""
        got = [self.at(d, w)[i] for i, d, w in picks]
        return sum(n * self.plain_ms[i] for (i, _, _), (n, _, _) in zip(picks, got)) / sum(ms for _, _, ms in got)


def replay_all(calib: Calibration, curves: Curves, accept: list[list[float]], verify_widths: tuple[int, ...],
               draft_widths: tuple[int, ...]) -> Replays:
    """Replay every (depth ≤ PROBE_DEPTH, draft width) egt on every probe step."""
    tried = [w for w in EGT_WIDTHS if w in draft_widths] or [min(draft_widths)]
    runs = {}
    for depth in range(1, PROBE_DEPTH + 1):
        for w in tried[: 1 if depth == 1 else None]:  # depth 1 has no round after the root's
            egt = Planner(EGTParams(depth, w, PROBE_TOP_K, list(verify_widths), accept=accept), curves)
            draft = egt.shape(depth).draft_widths
            runs[(depth, w)] = []
            for s in calib.steps:
                n, vw = replay(egt, depth, s)
                runs[(depth, w)].append((n, vw, egt.step_ms(draft, vw, s.context)))
    return Replays(runs, [objective.plain_ms(curves, s.context) for s in calib.steps], tried)


def plan_egt(replays: Replays, accept: list[list[float]], verify_widths: tuple[int, ...]) -> tuple[dict, list[dict]]:
    """The fixed (depth, draft width) with the best modelled speed-up over all probe steps.
    Returns the egt parameters and the table of candidates (depth 0 first)."""
    steps = range(len(replays.plain_ms))
    rows = []
    for depth, w in [(0, 0), *replays.runs]:
        runs = replays.at(depth, w)
        rows.append({"depth": depth, "draft_width": w, "tokens_per_step": round(sum(n for n, _, _ in runs) / len(runs), 3),
                     "step_ms": round(sum(ms for _, _, ms in runs) / len(runs), 2),
                     "speedup": round(replays.speedup([(i, depth, w) for i in steps]), 3),
                     "verify_width": int(statistics.median_low(vw for _, vw, _ in runs))})
    best = max(rows, key=lambda r: r["speedup"])
    params = {"depth": best["depth"], "draft_width": max(1, best["draft_width"]), "top_k": PROBE_TOP_K,
              "verify_widths": list(verify_widths), "verify_width": best["verify_width"], "accept": accept,
              "tokens_per_step": best["tokens_per_step"]}
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
            shape = SequoiaParams(list(tree.parents), list(tree.ranks), list(widths)).step_shape()
            rows.append({"budget": n, "depth": d, "expected_accepted": round(tree.expected_accepted, 3),
                         "speedup": round(objective.speedup(tree.expected_accepted, shape, curves, context), 3),
                         "parents": list(tree.parents), "ranks": list(tree.ranks)})
    best = max(rows, key=lambda r: r["speedup"])
    table = [{k: v for k, v in r.items() if k not in ("parents", "ranks")} for r in rows]
    return {"parents": best["parents"], "ranks": best["ranks"], "widths": list(widths)}, table


@dataclass
class GraftCalibration:
    """What retrieval would have got on the target's own continuations: the value tables (the
    plan's `graft`), the adjacency table seeded with every continuation, and the counts behind them."""

    values: dict  # GraftParams' context and adjacency tables
    table: AdjacencyTable
    tries: int  # labelled retrieved tokens
    hits: int  # ... that were the target's


GRAFT_PRIOR = 4.0  # pseudo-observations of the prior value per table cell: sparse cells stay near it


def graft_values(calib: Calibration, params: GraftParams = GraftParams()) -> GraftCalibration:
    """Replay retrieval at every position of each continuation (the prompt indexed first, the
    adjacency table learning from the earlier continuations and this one so far, as at run time):
    label each retrieved token by whether the target wrote it there, given its parent was, and
    estimate P(accept | source, match length, position, count) cell by cell, shrunk towards the
    prior by GRAFT_PRIOR pseudo-observations."""
    ctx_hits = torch.zeros(MAX_N, POSITIONS, 2)
    ctx_tries = torch.zeros(MAX_N, POSITIONS, 2)
    adj_hits, adj_tries = torch.zeros(RANKS, 2), torch.zeros(RANKS, 2)
    table = AdjacencyTable(params.k)
    for i, text in calib.texts.items():
        start = calib.prompt_lengths.get(i, len(text))
        r = Retriever(params, table)
        r.reset(text[: start - 1])
        for t in range(start, len(text)):  # what retrieval proposes after text[:t], against text[t:]
            r.sync(text[:t])
            for cont in r.index.lookup(params.length, params.limit):
                for j, token in enumerate(cont.tokens):
                    if t + j >= len(text):
                        break
                    cell = context_cell(cont, j)
                    ctx_tries[cell] += 1
                    if token != text[t + j]:
                        break
                    ctx_hits[cell] += 1
            parent, depth = text[t - 1], 0
            while depth < params.adjacency_depth and t + depth < len(text):
                succ = [s for s, _ in r.table.successors(parent)]
                for rank, token in enumerate(succ):
                    adj_tries[adjacency_cell(rank, depth)] += 1
                    adj_hits[adjacency_cell(rank, depth)] += token == text[t + depth]
                if not succ or succ[0] != text[t + depth]:
                    break
                parent, depth = succ[0], depth + 1
        r.sync(text)
        table = r.table
    ctx = (ctx_hits + GRAFT_PRIOR * torch.tensor(prior_context())) / (ctx_tries + GRAFT_PRIOR)
    adj = (adj_hits + GRAFT_PRIOR * torch.tensor(PRIOR_ADJACENCY)) / (adj_tries + GRAFT_PRIOR)
    values = {"context": [[[round(float(x), 4) for x in c] for c in row] for row in ctx],
              "adjacency": [[round(float(x), 4) for x in row] for row in adj]}
    tries = int(ctx_tries.sum() + adj_tries.sum())
    return GraftCalibration(values, table, tries, int(ctx_hits.sum() + adj_hits.sum()))


def reach_policy(calib: Calibration, replays: Replays, draft_width: int) -> dict:
    """egt's per-step depth policy without a depth predictor (`DepthPolicy` with no file): its prior
    reach, P(accepted length >= d) of the deepest replayed egt of `draft_width` over the probe steps
    (the runtime's own trees, pruned as it prunes: what a request's steps are scored against), and
    per depth D the factor that turns it into what a depth-D step yielded on the replays —
    1 + factors[D] · Σ_{d ≤ D} reach[d - 1] is that replay's mean tokens per step, so at the prior the
    runtime's `objective.best_depth` weighs the depths as `plan_egt` did. The request's acceptance
    estimate corrects the reach every step (`ygg_runtime.decoding.estimate`)."""
    w = _replayed_width(replays, draft_width)
    deep = _deepest(replays, w)
    reach = _reach(deep)
    factors, widths = [1.0], [1]
    for depth in range(1, PROBE_DEPTH + 1):
        runs = replays.at(depth, w)
        capped = sum(min(a, depth) for a in deep)
        factors.append(round(sum(n - 1 for n, _, _ in runs) / capped, 4) if capped else 0.0)
        widths.append(int(statistics.median_low(vw for _, vw, _ in runs)))
    return {"file": None, "draft_width": w, "factors": factors, "verify_widths": widths,
            "reach": [round(r, 4) for r in reach]}


def _replayed_width(replays: Replays, draft_width: int) -> int:
    """The draft width the replays hold nearest the plan's: its own, else the first tried."""
    return draft_width if draft_width in replays.widths else replays.widths[0]


def _deepest(replays: Replays, width: int) -> list[int]:
    """Each probe step's accepted length (bonus excluded) under the deepest replayed egt of `width`."""
    return [n - 1 for n, _, _ in replays.at(PROBE_DEPTH, width)]


def _reach(accepted: list[int]) -> list[float]:
    """P(accepted length >= d), d = 1..PROBE_DEPTH, over those steps."""
    return [sum(a >= d for a in accepted) / len(accepted) for d in range(1, PROBE_DEPTH + 1)]


# The prior strengths tried, in expected acceptances (the held-out likelihood picks one).
STRENGTHS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 512.0, 2048.0)
# The robust priors' weights tried on their strong part, for the prices and the reach (1: no robust part).
WEIGHTS = (1.0, 0.9, 0.75, 0.5, 0.25)
# Steps over which a request's evidence keeps half its weight. Not fitted: calibration's prompts do not
# change their character mid-answer, so their likelihood would always prefer never forgetting. It is
# what lets a request priced out of drafting try again (docs/design.md, "Adapting to the request").
HALF_LIFE = 32.0


def fit_strength(calib: Calibration, replays: Replays | None = None, draft_width: int = 0, folds: int = 4) -> dict:
    """The estimate's prior strengths that best predict held-out calibration prompts, one for the
    nodes' prices and one for egt's reach. Prompts are split into `folds`; for each, the acceptance
    map and the reach are fitted on the others, and each of its prompts is decoded again step by
    step (the recorded steps, in order) by a fresh estimate that predicts every try before it
    observes the step, exactly as the runtime does (`Estimate`): a node try — P(one of the children
    of an accepted node is accepted) = Σ min(1, r · a(q)) over the probe's children — and a reach
    try at every depth the deepest replayed egt of `draft_width` (`reach_policy`'s trees) could go
    on from, P = the estimate's conditional there. Returns each strength with the highest
    log-likelihood, with each strength's mean log-likelihood per try beside the prior's alone."""
    from math import log

    prompts = sorted({s.prompt for s in calib.steps})
    if len(prompts) < 2:
        return {"strength": None, "why": "fewer than two calibration prompts"}
    folds = min(folds, len(prompts))
    fold_of = {q: k % folds for k, q in enumerate(prompts)}
    by_prompt: dict[int, list[int]] = {}
    for i, s in enumerate(calib.steps):
        by_prompt.setdefault(s.prompt, []).append(i)
    deep = _deepest(replays, _replayed_width(replays, draft_width)) if replays is not None else []
    nodes = {(n0, w): 0.0 for n0 in STRENGTHS for w in WEIGHTS} | {None: 0.0}
    reach = {(m, w): 0.0 for m in STRENGTHS for w in WEIGHTS} | {None: 0.0}
    tries = reach_tries = 0
    clip = lambda p: min(1 - 1e-3, max(1e-3, p))  # noqa: E731
    for k in range(folds):
        held = [q for q in prompts if fold_of[q] == k]
        kept = [i for i, s in enumerate(calib.steps) if fold_of[s.prompt] != k]
        amap = AcceptanceMap(acceptance_map(Calibration([calib.steps[i] for i in kept], 0, 0, 0.0)))
        prior = _reach([deep[i] for i in kept]) if deep else []
        observed = {i: _observed(calib.steps[i], amap) for q in held for i in by_prompt[q]}
        for key in nodes:
            n0, w = key if key is not None else (1.0, 1.0)
            for q in held:
                est = Estimate(n0, HALF_LIFE, n0, w)  # the nodes' prices
                for i in by_prompt[q]:
                    tree, path = observed[i]
                    for j, u in enumerate(path):
                        if tree.children[u]:
                            r = est.scale(DRAFT, tree.depths[u] + 1) if key is not None else 1.0
                            p = clip(sum(min(1.0, r * tree.accepts[c]) for c in tree.children[u]))
                            nodes[key] += log(p) if j + 1 < len(path) else log(1 - p)
                            tries += key is None
                    est.observe(tree, path)
        if not prior:
            continue
        for key in reach:
            m, w = key if key is not None else (1.0, 1.0)
            for q in held:
                est = Estimate(1.0, HALF_LIFE, m, reach_weight=w)  # the reach
                for i in by_prompt[q]:
                    now = est.reach(prior)  # also what the step is scored against when observed
                    now = now if key is not None else prior
                    got, before = deep[i], 1.0
                    for d in range(min(got + 1, PROBE_DEPTH)):
                        c = clip(now[d] / before if before > 0 else 0.0)
                        reach[key] += log(c) if d < got else log(1 - c)
                        reach_tries += key is None
                        before = now[d]
                    est.observe(*_chain(got, prior))
    n0, w = max((key for key in nodes if key is not None), key=lambda key: nodes[key])
    out = {"strength": n0, "weight": w, "half_life": HALF_LIFE, "tries": tries, "folds": folds,
           "loglik_per_try": {str(k): round(nodes[k, w] / max(1, tries), 4) for k in STRENGTHS},
           "weight_loglik_per_try": {str(v): round(nodes[n0, v] / max(1, tries), 4) for v in WEIGHTS},
           "prior_loglik_per_try": round(nodes[None] / max(1, tries), 4)}
    if deep:
        m, w = max((key for key in reach if key is not None), key=lambda key: reach[key])
        out |= {"reach_strength": m, "reach_weight": w, "reach_tries": reach_tries,
                "reach_loglik_per_try": {str(n0): round(reach[n0, w] / max(1, reach_tries), 4) for n0 in STRENGTHS},
                "reach_weight_loglik_per_try": {str(v): round(reach[m, v] / max(1, reach_tries), 4) for v in WEIGHTS},
                "prior_reach_loglik_per_try": round(reach[None] / max(1, reach_tries), 4)}
    return out


def _chain(accepted: int, prior: list[float]) -> tuple[TokenTree, list[int]]:
    """A replayed step as the estimate's reach sees one: `accepted` nodes in a row, and a rejected
    child under the last where the tree went deeper."""
    tree, path = TokenTree(0), [0]
    for d in range(min(accepted + 1, len(prior))):
        node = tree.add(path[-1], d + 1, prior[d], prior[d])
        if d < accepted:
            path.append(node)
    return tree, path


def _observed(s: ProbeStep, amap: AcceptanceMap) -> tuple[TokenTree, list[int]]:
    """A probe step as the runtime's estimate observes one: the accepted path, every node on it with
    all its drafted children priced by the map (those the probe never verified too: the target's
    token there is known, and the map is fitted on exactly these children)."""
    tree, path, node = TokenTree(s.tokens[0]), [0], 0
    for u in _reached(s):
        nxt = None
        for c in s.children.get(u, []):
            v = tree.add(node, s.tokens[c], s.probs[c], amap(s.probs[c]))
            if s.tokens[c] == s.argmax[u]:
                nxt = v
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return tree, path
