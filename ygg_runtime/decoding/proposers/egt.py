"""`egt`: the Equal-Growth Tree (docs/design.md, "egt"), a tree that follows the context with static shapes.

Each step runs `depth` drafter forwards: the first feeds the new root (and the accepted leaf the
drafter never saw); each later one feeds exactly `draft_width` nodes, the unexpanded nodes with the
highest path value anywhere in the tree, and adds the top `top_k` children of each. A node's path
value is the estimated probability that its whole root path is accepted (draft probabilities through
the calibrated acceptance map). Verification pruning (`ygg_runtime.decoding.prune`) then takes the E[A]-best
root-connected subtree for every compiled verify width, and the objective picks the width with the
most tokens per modelled millisecond. Forwards narrower than their width are padded with masked
slots. Depth 0 is plain decoding: the drafter is not run.

With a depth predictor (`ygg_runtime.decoding.predictor`) and its `depth_policy` from the plan, the depth
is chosen every step from the target's hidden state (`objective.best_depth`); without one, from
calibration's reach (the plan's `adapt.policy`) when the request keeps an acceptance estimate
(`ygg_runtime.decoding.estimate`), which corrects either reach and scales every node's price to what
this request has shown; with neither, every step has the planned fixed `depth`.

Stages (docs/design.md, "Stages"): by default the next step's first drafter forward feeds the accepted leaf
the drafter never saw (tail draft) and the bonus token (head draft). The plan's `stages` can run
either ahead of the verify, in one extra drafter forward over a superset of its inputs: `tail:
ahead` feeds every verified leaf the drafter has not seen; `head: ahead` feeds, under every verified
node the drafter has seen, its best drafted child left out of the verify — that node's likeliest
bonus. When the bonus is that child, the next step needs no first forward. Which stages run ahead is
searched at compile time on measured times (`ygg_compile.stage_order`).

The tree arithmetic — growth, pruning, the forwards of a step — is `Planner`, with no drafter and
no state: the proposer drafts with it, and calibration replays recorded trees through the same code.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable

import torch
from torch import Tensor

from ygg_runtime.decoding import objective, prune
from ygg_runtime.decoding.accept import Verdict
from ygg_runtime.decoding.estimate import Estimate
from ygg_runtime.errors import YggError
from ygg_runtime.decoding.objective import AcceptanceMap, Curves
from ygg_runtime.schema.params import BEGIN_WIDTH, EGTParams, StepShape, egt_shape
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.proposers.base import (Children, DraftProposer, Drafter, DraftRows, Hook, Parts, StepInfo,
                                                 StepState)
from ygg_runtime.decoding.retrieval import AdjacencyTable, Retriever
from ygg_runtime.transfer import to_device, to_host
from ygg_runtime.decoding.tree import DRAFT, TokenTree



class Planner:
    """egt's tree arithmetic: grow a tree from children lists, prune it to the verify width the
    objective picks, and the forwards of a step. Pure: no drafter, nothing carried between calls."""

    def __init__(self, params: EGTParams, curves: Curves | None = None, draft_width: int | None = None):
        self.draft_width = draft_width or params.draft_width  # a depth policy brings its own
        self.top_k = params.top_k
        self.verify_widths = tuple(sorted(params.verify_widths))
        self.verify_width = params.verify_width or self.verify_widths[-1]
        self.accept = AcceptanceMap(params.accept)
        self.curves = curves

    def grow(self, root_token: int, root_children: Children, expand: Callable[[TokenTree, list[int]], list[Children]],
             depth: int, estimate: Estimate | None = None) -> TokenTree:
        """The drafted tree: the root's children, then depth - 1 rounds that each expand the
        draft_width best unexpanded nodes. expand(tree, nodes) gives each node's top children;
        `ygg_compile.calibrate` replays recorded trees through it. estimate: the request's, which
        scales each node's calibrated price."""
        tree = TokenTree(root_token, child_rule="deterministic")
        frontier: list[tuple[float, int]] = []  # (-path value, node): unexpanded nodes
        self._add_children(tree, 0, root_children, frontier, estimate)
        for _ in range(depth - 1):
            # ascending node order keeps each row's ancestors before it
            picks = sorted(heapq.heappop(frontier)[1] for _ in range(min(self.draft_width, len(frontier))))
            if not picks:
                break
            for node, children in zip(picks, expand(tree, picks)):
                self._add_children(tree, node, children, frontier, estimate)
        return tree

    def grow_on(self, drafter: Drafter, root_token: int, rows: DraftRows, depth: int,
                estimate: Estimate | None = None) -> TokenTree:
        """`grow`'s tree, greedy, with its rounds on the drafter's device: every node's token, parent,
        depth and path value kept there (slots numbered as `grow` numbers them), each round's
        draft_width best unexpanded nodes chosen there (a stable sort: equal values to the lower
        node, as the heap pops them) and fed as they are (`Drafter.feed`), their top children added
        there by `grow`'s arithmetic on tensors (`AcceptanceMap.on`). The host reads the tree once,
        after the last round, path values included (a test holds the two trees equal, bit for bit).
        rows: the root's draft row (`begin`)."""
        k, w = self.top_k, self.draft_width
        q, top = rows.top(k)
        device = q.device
        size = 1 + k + k * w * max(0, depth - 1)  # slots the rounds can fill
        tokens = torch.zeros(size, dtype=torch.long, device=device)
        parents = torch.zeros(size, dtype=torch.long, device=device)
        depths = torch.zeros(size, dtype=torch.long, device=device)
        probs = torch.zeros(size, dtype=torch.float64, device=device)
        values = torch.zeros(size, dtype=torch.float64, device=device)
        values[0] = 1.0
        unexpanded = torch.zeros(size, dtype=torch.bool, device=device)
        ancestors = torch.eye(size, dtype=torch.bool, device=device)
        scales = to_device([1.0] + [estimate.scale(DRAFT, d) if estimate is not None else 1.0
                                    for d in range(1, depth + 1)], device, torch.float64)

        def add(at: int, nodes: Tensor, q: Tensor, top: Tensor) -> int:
            """The top children [n, k] of `nodes` in slots from `at` on: `_add_children`'s price."""
            end = at + q.numel()
            parent = nodes.repeat_interleave(k)
            tokens[at:end], parents[at:end], depths[at:end] = top.reshape(-1), parent, depths[parent] + 1
            probs[at:end] = q.reshape(-1).double()
            price = (self.accept.on(probs[at:end]) * scales[depths[at:end]]).clamp(max=1.0)
            values[at:end] = values[parent] * price
            unexpanded[at:end] = True
            ancestors[at:end] |= ancestors[parent]
            return end

        filled = add(1, torch.zeros(1, dtype=torch.long, device=device), q, top)
        picked, open_ = [], k
        for _ in range(depth - 1):
            count = min(w, open_)
            if not count:
                break
            order = torch.where(unexpanded[:filled], values[:filled], float("-inf")).sort(descending=True, stable=True)
            picks = order.indices[:count].sort().values  # ascending: each row's ancestors before it
            unexpanded[picks] = False
            rows = drafter.feed(tokens[picks], picks, depths[picks], ancestors[picks][:, :filled], w)
            q, top = rows.top(k)
            filled = add(filled, picks, q, top)
            picked.append(picks)
            open_ += count * (k - 1)
        read = to_host(torch.cat([tokens[1:filled].double(), parents[1:filled].double(), probs[1:filled],
                                  values[1:filled]] + [p.double() for p in picked]))
        n = filled - 1
        tree = TokenTree(root_token, child_rule="deterministic")
        for token, parent, q in zip(read[:n], read[n : 2 * n], read[2 * n : 3 * n]):
            tree.add(int(parent), int(token), q, self.accept(q))
        tree.path_values[1:] = read[3 * n : 4 * n]  # the values the rounds chose by (`grow`'s, bit for bit)
        drafter.fed.update(int(v) for v in read[4 * n :])
        return tree

    def _add_children(self, tree: TokenTree, node: int, children: Children, frontier: list,
                      estimate: Estimate | None) -> None:
        scale = estimate.scale(DRAFT, tree.depths[node] + 1) if estimate is not None else 1.0
        for q, token in zip(*children):
            child = tree.add(node, token, q, self.accept(q), DRAFT, scale)
            heapq.heappush(frontier, (-tree.path_values[child], child))

    def prune(self, tree: TokenTree, context: int, depth: int, draft_context: int | None = None) -> TokenTree:
        """The verified subtree (`prune.verified`), the drafting of a depth-`depth` step counted (a
        catch-up the step began with is spent whatever the width: `catch_up_ms`)."""
        drafts = self.shape(depth).draft_widths
        return prune.verified(tree, self.verify_widths, self.curves, drafts, context, draft_context)

    def step_ms(self, draft_widths: tuple[int, ...], verify_width: int, context: int,
                draft_context: int | None = None) -> float:
        """The objective's modelled time of a step (`curves` required)."""
        return objective.step_ms(StepShape(draft_widths, verify_width), self.curves, context, draft_context)

    def shape(self, depth: int, verify_width: int | None = None, behind: int = 0) -> StepShape:
        """The forwards of a depth-`depth` step (at the usual verify width unless given). behind:
        tokens the drafter has not fed yet (after steps that skipped it), which its first forward
        feeds in chunks of `chunk` (Drafter.begin); 0: the usual bonus and leaf."""
        begin = (BEGIN_WIDTH,)
        if behind > BEGIN_WIDTH and self.curves is not None:
            chunk = max(self.curves.draft_widths)
            begin = (chunk,) * ((behind - 1) // chunk) + ((behind - 1) % chunk + 1,)
        return egt_shape(depth, self.draft_width, verify_width or self.verify_width, begin)

    def catch_up_ms(self, behind: int, draft_context: int) -> float:
        """What a drafting step's first forward costs beyond the usual one when the drafter is
        `behind` (after steps that skipped it): paid once, on the way back to drafting. The depth
        choice spreads it over the tokens the request may still make (`objective.best_depth`): charged
        to one step, it grows with every plain step and would keep the drafter out for good."""
        if behind <= BEGIN_WIDTH or self.curves is None:
            return 0.0
        begin = self.shape(1, behind=behind).draft_widths
        return sum(self.curves.t_draft(w, draft_context) for w in begin) - self.curves.t_draft(BEGIN_WIDTH, draft_context)


class EGT(DraftProposer):
    name = "egt"
    Params = EGTParams

    def __init__(self, params: EGTParams, drafter: Drafter | None, curves: Curves | None = None,
                 predictor: DepthPredictor | None = None, adjacency: AdjacencyTable | None = None,
                 hook: Hook | None = None):
        """curves: the plan's profile, to weigh depths and verify widths; predictor (with the
        params' depth policy): the depth every step; adjacency: the seeded table grafting retrieves
        from; hook: compile-time instrumentation (calibration's probe, the stage search)."""
        super().__init__(params, drafter)
        policy = params.depth_policy
        # The per-step depth: needs the predictor, its policy and the curves to weigh depths.
        self.predictor = predictor if policy is not None and curves is not None else None
        if self.predictor is not None and self.predictor.max_depth != policy.max_depth:
            raise YggError("the depth predictor and the plan's depth policy disagree on the depths: recompile")
        # The per-step depth's policy: the predictor's, else calibration's for a request that adapts
        # (compile plans it at the fixed depth's draft width).
        adapt = params.adapt.policy if params.adapt is not None and curves is not None else None
        self.policy = policy if self.predictor is not None else adapt
        self.planner = Planner(params, curves, self.policy.draft_width if self.policy is not None else None)
        self.curves = curves  # alone; in a batch the planner prices its step as a share of it (StepState.sequences)
        if self.policy is not None:
            self.factors = self.policy.factors
            self.shapes = tuple(self.planner.shape(d, w) for d, w in enumerate(self.policy.verify_widths))
        self.max_depth = (self.predictor.max_depth if self.predictor is not None else
                          max(params.depth, adapt.max_depth) if adapt is not None else params.depth)
        self.step_depth = params.depth  # this step's depth
        self.retriever = Retriever(params.graft, adjacency) if params.graft is not None else None
        self.hook = hook
        self.drafted: TokenTree | None = None  # the whole drafted tree of the step in progress
        self.verified: TokenTree | None = None  # the part of it proposed for the verify
        self.guesses: dict[int, tuple[int, DraftRows]] = {}  # AOT head draft: node -> (guess node, its draft row)

    @classmethod
    def build(cls, params: EGTParams, parts: Parts) -> "EGT":
        return cls(params, parts.drafter, parts.curves, parts.predictor, parts.adjacency, parts.hook)

    @property
    def max_tree_size(self) -> int:
        p = self.planner
        draft_slots = 1 + p.top_k * (1 + p.draft_width * max(0, self.max_depth - 1)) + p.draft_width
        grafted = self.retriever.params.budget if self.retriever is not None else 0
        return max(draft_slots if self.max_depth else 1, p.verify_widths[-1]) + grafted

    def start(self, prompt: list[int]) -> None:
        if self.max_depth:
            super().start(prompt)
        if self.retriever is not None:
            self.retriever.reset(prompt)

    def propose(self, state: StepState) -> TokenTree:
        self.verified = self._propose(state)
        return self.verified

    def _propose(self, state: StepState) -> TokenTree:
        seq = state.seq
        if self.curves is not None:  # priced as its share of the step's forwards (alone: the curves themselves)
            self.planner.curves = self.curves.shared(state.sequences)
        self.step_depth, self.guesses = self.params.depth, {}
        estimate = state.estimate
        retrieved = None  # the retrieval-only step: (its whole tree, the verified part)
        if self.retriever is not None:
            self.retriever.sync(seq)
            retrieved = self.retriever.alone(seq[-1], self.planner.verify_widths, self.planner.curves, len(seq),
                                             estimate)
            alone_value = sum(retrieved[1].path_values)  # its E[A]
        # After steps that skipped the drafter, its next step first feeds what it missed: a cost the
        # depth choice spreads over the budget left (`Planner.catch_up_ms`); the width choice, once
        # drafting, counts it spent.
        behind = self.drafter.behind(seq) if self.max_depth else 0
        drafts_at = self.drafter.at(len(seq))  # the drafter's context: shorter than seq's when it reads a window
        reach = None  # P(accepted length >= d) of this step: the predictor's, or calibration's for a request that adapts
        if self.predictor is not None and state.extra is not None:  # read with the last verdict
            reach = self.predictor.monotone(state.extra)
        elif self.predictor is not None and state.hidden is not None:
            reach = self.predictor.reach(state.hidden)
        elif self.predictor is None and self.policy is not None and estimate is not None:
            reach = self.policy.reach
        if reach is not None:
            if estimate is not None:
                reach = estimate.reach(reach)
            plain = None if retrieved is None else (alone_value, retrieved[1].verify_width)
            costs = self.planner.curves.costs(self.shapes)  # the shapes' times, kept per batch size (the curves' share)
            self.step_depth = objective.best_depth(reach, self.factors, self.shapes, self.planner.curves, len(seq),
                                                   plain, drafts_at, costs, self.planner.catch_up_ms(behind, drafts_at),
                                                   state.remaining)
            if self.step_depth == 0 and estimate is not None:
                estimate.plain()
        elif retrieved is not None and self.step_depth and self.planner.curves is not None and self.params.tokens_per_step:
            # without a predictor: retrieval alone when it beats the calibrated fixed-depth step per ms
            curves, context, tokens = self.planner.curves, len(seq), self.params.tokens_per_step
            alone_rate = alone_value / self.planner.step_ms((), retrieved[1].verify_width, context)
            shape = self.planner.shape(self.step_depth)
            ms = objective.step_ms(shape, curves, context, drafts_at)
            ms += objective.spread(self.planner.catch_up_ms(behind, drafts_at), tokens, state.remaining)
            if alone_rate > tokens / ms:
                self.step_depth = 0
        if self.step_depth == 0:  # the drafter catches up on these tokens at its next step
            self.drafted, verified = retrieved or (TokenTree(seq[-1], child_rule="deterministic"),) * 2
            if self.hook is not None:
                self.hook.drafted(self.drafted, state)
            return verified

        def expand(tree: TokenTree, picks: list[int]) -> list[Children]:
            rows = self.drafter.expand(tree, picks, self.planner.draft_width)
            return state.top(rows, [tree.depths[v] for v in picks], self.planner.top_k)

        mark = self._clock(None)
        rows = self.drafter.begin(seq)
        if state.sampling is None:  # greedy: the rounds on the device, the tree read once
            mark = self._clock("begin", mark)
            self.drafted = self.planner.grow_on(self.drafter, seq[-1], rows, self.step_depth, estimate)
        else:
            (root,) = state.top(rows, [0], self.planner.top_k)
            mark = self._clock("begin", mark)
            self.drafted = self.planner.grow(seq[-1], root, expand, self.step_depth, estimate)
        if self.hook is not None:
            self.hook.drafted(self.drafted, state)
        if self.retriever is not None:  # under the root and the likeliest drafted nodes
            tree = self.drafted
            best = sorted(range(1, len(tree)), key=lambda v: -tree.path_values[v])[: self.retriever.params.under]
            self.retriever.graft(tree, best, estimate)
        verified = self.planner.prune(self.drafted, len(seq), self.step_depth, drafts_at)
        mark = self._clock("rounds", mark)
        if self.params.stages.ahead():
            self.guesses = self._ahead(verified)
            self._clock("ahead", mark)
        return verified

    def _clock(self, stage: str | None, since: float = 0.0) -> float:
        """Report the time since `since` as a stage's (only to a timed hook, which is why the
        device is synchronized only then)."""
        if self.hook is None or not self.hook.timed:
            return 0.0
        self.drafter.runner.synchronize()
        now = time.perf_counter()
        if stage is not None:
            self.hook.stage(stage, now - since)
        return now

    def _ahead(self, verified: TokenTree) -> dict[int, tuple[int, DraftRows]]:
        """Run the stages planned ahead of the verify in one drafter forward (see the module
        docstring); returns the head draft's guesses by the node they hang from."""
        full, fed, kept = self.drafted, self.drafter.fed, set(verified.origin)
        tail, head = [], {}
        if self.params.stages.tail == "ahead":  # a retrieved leaf only when its parent's KV is the drafter's
            tail = [o for v, o in enumerate(verified.origin)
                    if not verified.children[v] and o not in fed and full.parents[o] in fed]
        if self.params.stages.head == "ahead":
            for o in verified.origin:
                guess = next((c for c in full.children[o] if c not in kept), None) if o in fed else None
                if guess is not None:
                    head[o] = guess
        nodes = sorted(set(tail) | set(head.values()))
        if not nodes:
            return {}
        logits = self.drafter.expand(full, nodes)
        row = {n: i for i, n in enumerate(nodes)}
        return {o: (g, logits[row[g]]) for o, g in head.items()}

    def with_verdict(self, hidden: Tensor) -> Tensor | None:
        """The depth predictor's heads at every verified row: the next step's reach travels with
        the verdict (a batched MLP over the tree's rows costs what one row's does)."""
        return self.predictor.raw(hidden) if self.predictor is not None else None

    def update(self, verdict: Verdict) -> StepInfo:
        spent = self.retriever.take_seconds() if self.retriever is not None else 0.0
        if not self.step_depth:
            return StepInfo(retrieval_s=spent)
        path = [self.verified.origin[v] for v in verdict.path]  # the proposed tree is pruned: its nodes in the drafted one
        guess = self.guesses.get(path[-1])
        hit = guess is not None and self.drafted.tokens[guess[0]] == verdict.bonus
        self.drafter.finish(Verdict(path, verdict.bonus), guess if hit else None)
        return StepInfo(ahead_hit=hit, retrieval_s=spent)
