"""The interface every method implements, and the drafter that the model-based methods share.

A proposer has two verbs, like transformers' CandidateGenerator: `propose(state)` builds a token
tree rooted at the last accepted token, `update(verdict)` learns what the target accepted of it;
`start(prompt)` begins a generation. It is small on purpose: the target forward, the acceptance
rule, compaction, metrics and the batch's cost sharing live in the engine and never in a proposer.
Its parameters are its own `Params` dataclass (`ygg_runtime.schema.params`): the defaults live there,
compile writes them into the plan, and what the cost model needs without a drafter (a step's
forwards, `Params.step_shape`) is computed from them alone. A proposer class registers itself
under its `name` as it is defined (`PROPOSERS`), and builds itself from what it uses of an
artifact's `Parts` (`Proposer.build`): a method is its parameters and its module, named nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ygg_runtime.decoding.accept import Verdict, warp
from ygg_runtime.decoding.estimate import Estimate
from ygg_runtime.errors import YggError
from ygg_runtime.schema.params import Params, SequoiaParams, fit_width
from ygg_runtime.model.runner import ModelRunner
from ygg_runtime.decoding.select import top_k
from ygg_runtime.transfer import read_top, to_device
from ygg_runtime.decoding.tree import ChildRule, TokenTree

if TYPE_CHECKING:
    from ygg_runtime.decoding.coupling import Noise
    from ygg_runtime.decoding.objective import Curves
    from ygg_runtime.decoding.predictor import DepthPredictor
    from ygg_runtime.decoding.retrieval import AdjacencyTable


Children = tuple[list[float], list[int]]  # a node's top children: (draft probabilities, tokens)


@dataclass
class Sampling:
    """Sampling settings of one generation; None in place of this object means greedy. Coupled
    sampling carries the generation's noise (`ygg_runtime.decoding.coupling`); rejection sampling its
    generator."""

    temperature: float
    top_p: float
    generator: torch.Generator | None = None  # rejection
    noise: "Noise | None" = None  # coupled

    @property
    def rule(self) -> str:
        return "coupled" if self.noise is not None else "rejection"


class DraftRows:
    """A drafter forward's logits rows over its own head [n, H], and what they mean on the target's
    vocabulary. A cut head (`ygg_compile.draft_vocab`) holds a third of the vocabulary and gives every
    other token nothing, so the greedy children — the top k of each row and their draft
    probabilities — are read off the head as it is; the rows fitted to the whole vocabulary
    (`full`) are made only for what needs every token (the coupled noise, a sampled draw)."""

    def __init__(self, logits: Tensor, ids: Tensor | None, vocab: int):
        self.logits = logits  # [n, H]
        self.ids = ids  # the token id of each head row; None: row i is token i
        self.vocab = vocab  # the target's vocabulary

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, i: int) -> "DraftRows":
        """Row i, as rows of one."""
        return DraftRows(self.logits[i : i + 1], self.ids, self.vocab)

    def top(self, k: int) -> tuple[Tensor, Tensor]:
        """Each row's k likeliest tokens (on the device): draft probabilities and token ids [n, k]."""
        rows = self.logits if self.ids is not None else self.logits[:, : self.vocab]  # past it: padding rows
        rows = rows.float()
        _, top = top_k(rows, k)
        return torch.softmax(rows, -1).gather(1, top), top if self.ids is None else self.ids[top]

    def full(self) -> Tensor:
        """The rows on the target's vocabulary [n, V]: a cut head's rows at their token ids and
        padding rows left out, -inf (no draft mass) for every token the drafter has no row for."""
        logits = self.logits
        if self.ids is not None:
            out = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
            return out.index_copy_(1, self.ids, logits)
        v = logits.shape[-1]
        if v > self.vocab:
            return logits[:, : self.vocab]
        if v < self.vocab:
            pad = logits.new_full((logits.shape[0], self.vocab - v), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits


@dataclass
class StepState:
    """What the engine knows before a step: all a proposer reads to build its tree."""

    seq: list[int]  # the accepted sequence, prompt included: its last token is the tree's root
    # The target's final hidden state at the last accepted position (None before the first step of
    # a one-token prompt): what egt's depth predictor reads.
    hidden: Tensor | None = None
    sampling: Sampling | None = None  # None: greedy
    # Sequences whose trees share this step's forwards (`ygg_runtime.decoding.batch`): a method that weighs
    # its tree against measured costs prices it as its share (`Curves.shared`, CAST).
    sequences: int = 1
    # The request's acceptance estimate (`ygg_runtime.decoding.estimate`), which a method that adapts
    # prices its nodes and picks its depth by; None: as calibrated (`--no-adapt`, or a method that does not).
    estimate: Estimate | None = None
    remaining: int | None = None  # tokens the request may still make (its budget left): what a one-time cost is spread over
    # What the proposer asked to read with the last verdict (`Proposer.with_verdict`), at the last
    # accepted row; None at the first step (or when it asked for nothing).
    extra: list[float] | None = None

    def top(self, rows: DraftRows, depths: list[int], k: int) -> list[Children]:
        """The k best children (draft probabilities, tokens) of tree nodes at `depths`, one per draft
        row, read in one transfer: by draft probability when greedy (and for rejection sampling's
        children picked by rank); coupled, the drafter's k guesses at the target's token under the
        noise of the children's position (`Noise.candidates`)."""
        s = self.sampling
        if s is not None and s.noise is not None:
            return s.noise.candidates(rows.full(), [len(self.seq) + d for d in depths], k, s.temperature, s.top_p)
        return read_top(*rows.top(k))


@dataclass
class StepInfo:
    """What a proposer reports after a step (the engine's metrics count it)."""

    ahead_hit: bool = False  # the next root was fed to the drafter ahead of the verify (egt's AOT head draft)
    retrieval_s: float = 0.0  # spent indexing and retrieving for the step (egt's grafting, pld)


class Hook:
    """Compile-time instrumentation (calibration's probe, the stage search): set as a proposer's
    `hook`, it sees what the proposer drafted and, when `timed`, how long each drafter stage took.
    At run time there is none, and nothing is kept or timed."""

    timed = False  # True: the proposer synchronizes the device around its stages to time them

    def drafted(self, tree: TokenTree, state: StepState) -> None:
        """The whole tree a step drafted, before pruning to the verify width."""

    def stage(self, name: str, seconds: float) -> None:
        """Seconds a drafter stage of the step took (egt: "begin", "rounds", "ahead")."""


@dataclass
class Parts:
    """What an artifact offers a method to be built from (`Proposer.build`): each takes what it uses."""

    drafter: "Drafter | None" = None
    curves: "Curves | None" = None  # the plan's profile, to price trees by measured times
    predictor: "DepthPredictor | None" = None
    adjacency: "AdjacencyTable | None" = None  # the seeded table retrieval reads
    hook: "Hook | None" = None  # compile-time instrumentation


# Every method's proposer by its name, as each class registers itself (`Proposer.__init_subclass__`).
PROPOSERS: dict[str, type["Proposer"]] = {}


class Proposer:
    """A decoding method: two verbs and a start. The engine calls `start` once per generation, then
    per step `propose` and, after the target verified (part of) the tree, `update`."""

    name: ClassVar[str] = "?"
    Params: ClassVar[type[Params]] = Params

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a method (not a shared base like DraftProposer)
            PROPOSERS[cls.name] = cls

    def __init__(self, params: Params):
        self.params = params

    @classmethod
    def build(cls, params: Params, parts: Parts) -> "Proposer":
        """The method from its parameters and what it uses of the artifact's parts (plain decoding:
        nothing)."""
        return cls(params)

    @property
    def max_tree_size(self) -> int:
        """Nodes a step proposes at most, root included: bounds the cache room a step needs."""
        return 1

    def start(self, prompt: list[int]) -> None:
        """A new generation: forget the last one and see the prompt (all but its last token, which
        becomes the first root). A batch that preempted a generation starts it again with all it
        has, prompt and output so far, as the prompt."""

    def propose(self, state: StepState) -> TokenTree:
        """This step's tree, rooted at state.seq[-1]."""
        raise NotImplementedError

    def update(self, verdict: Verdict) -> StepInfo:
        """Learn what the target accepted of the tree `propose` returned last (the verdict in that
        tree's node numbering, whatever part of it the engine verified)."""
        return StepInfo()

    def with_verdict(self, hidden: Tensor) -> Tensor | None:
        """Values [n, m] of every verified row (from the target's final hidden states [n, dim] at the
        tree's nodes) that the next step needs on the host, computed on the device and read in the
        verdict's one transfer: which row the next step starts from is known only once the verdict
        is read, and a read of its own would be one more round trip (`StepState.extra`). None:
        nothing."""
        return None


class DraftProposer(Proposer):
    """A proposer driven by a draft model, whose cache follows the accepted sequence."""

    def __init__(self, params: Params, drafter: "Drafter | None"):
        if drafter is None:
            raise YggError(f"method {self.name} needs a draft model")
        super().__init__(params)
        self.drafter = drafter

    @classmethod
    def build(cls, params: Params, parts: Parts) -> "Proposer":
        return cls(params, parts.drafter)

    def start(self, prompt: list[int]) -> None:
        self.drafter.reset()
        self.drafter.prefill(prompt)

    def update(self, verdict: Verdict) -> StepInfo:
        self.drafter.finish(verdict)
        return StepInfo()


class Drafter:
    """A draft model that stays in step with the accepted sequence.

    Its cache has the target's layout: committed prefix, then tree node i at slot committed + i.
    Tokens it has not seen yet (an accepted leaf it never fed, and the bonus) are fed as a chain
    at the start of the next step, together with the new root — unless a stage ran ahead of the
    verify (egt's AOT tail and head drafts) and already fed them.

    Its vocabulary may be smaller than the target's (Qwen2.5-7B pads its embedding to 152 064 rows,
    Qwen2.5-0.5B to 151 936, over one tokenizer): a token it has no row for is fed as STAND_IN.
    Its guesses after one are worse, never wrong: the target verifies every token.

    A lazy drafter (a batch's: `ygg_runtime.decoding.batch`) feeds the prompt at the first step that drafts,
    not at prefill: under load a batch may decode plainly for a request's whole life, and then its
    drafter never runs at all. The prompt counts as fed for pricing (`behind`): like an eager
    prefill, it is paid once whatever the step, not by the step that happens to draft first.

    A drafter with a `window` reads only the last `window` tokens of a longer prompt (after the
    prefix cache's rows, the chat template's system turn, when the prompt starts with them): its
    prefill stops growing with the prompt, and so does the context its steps attend over. It sees
    the sequence with the `cut` tokens between `head` and the window left out, at positions that
    run on without them (RoPE sees only distances). Exactness is untouched: the drafter only
    proposes; the objective weighs the acceptance a window keeps (measured at compile,
    `Plan.draft_window`) against the prefill it saves (`Decoder.choose`).
    """

    STAND_IN = 0

    def __init__(self, runner: ModelRunner, target_vocab: int, lazy: bool = False, window: int | None = None):
        self.runner = runner
        self.target_vocab = target_vocab
        self.lazy = lazy
        self.window = window  # prompt tokens read at most (after the prefix cache's); None: all
        self.prompt = 0  # the prompt's tokens (all but the first root) the drafter sees, fed or owed
        self.head = self.cut = 0  # the prompt's tokens [head, head + cut) are left out (a window)
        self.fed: set[int] = set()
        self.ready: DraftRows | None = None  # the next root's draft row, when a head draft ran ahead

    def reset(self) -> None:
        self.runner.reset()
        self.ready = None
        self.prompt = self.head = self.cut = 0

    def view(self, seq: list[int]) -> list[int]:
        """The sequence as the drafter sees it: without the tokens its window leaves out."""
        return seq if not self.cut else seq[: self.head] + seq[self.head + self.cut :]

    def at(self, i: int) -> int:
        """Where position i of the sequence falls in the drafter's view."""
        return i if i <= self.head else max(self.head, i - self.cut)

    def behind(self, seq: list[int]) -> int:
        """Tokens of `seq` past the prompt the drafter has not fed: what its next step's first
        forward must catch up on (1, the root, after a drafting step)."""
        return self.at(len(seq)) - max(self.runner.committed, self.prompt)

    def known(self, tokens: list[int]) -> list[int]:
        """The tokens as the drafter can embed them (see STAND_IN)."""
        v = self.runner.vocab_size
        return tokens if all(t < v for t in tokens) else [t if t < v else self.STAND_IN for t in tokens]

    def prefill(self, tokens: list[int]) -> None:
        """See the prompt (all but the first root): the last `window` tokens of it, when it has a
        window and the prompt is longer, after the prefix cache's tokens when it starts with them."""
        prefix = self.runner.prefix
        self.head = len(prefix.tokens) if prefix is not None and prefix.covers(tokens) else 0
        self.cut = max(0, len(tokens) - self.head - self.window) if self.window else 0
        self.prompt = len(tokens) - self.cut
        if not self.lazy:
            self.runner.prefill(self.known(self.view(tokens)))

    def owes(self, upto: int) -> bool:
        """Whether a lazy drafter has prompt tokens before position `upto` of the sequence left to feed."""
        return self.runner.committed < min(self.at(upto), self.prompt)

    def feed_prompt(self, prompt: list[int], upto: int) -> None:
        """Feed a lazy drafter the prompt's tokens as far as position `upto` (a batch prefills its
        target in chunks, and the drafter follows a chunk behind, in the drafting forwards of the
        next step, so no step carries a whole prompt). The prefix cache's rows come first, as alone."""
        tokens = self.known(self.view(prompt)[: self.prompt])
        self.runner.take_prefix(tokens)
        if self.owes(upto):
            self.runner.prefill(tokens[self.runner.committed : self.at(upto)])

    def begin(self, seq: list[int]) -> DraftRows:
        """Feed the unseen tokens; the root's draft rows (one). The root sits at tree slot 0.
        After steps that skipped the drafter (egt at depth 0) there may be many: they go in
        chunks of the widest compiled width, so every forward keeps a compiled width."""
        if self.owes(len(seq)):  # a lazy drafter's first drafting step (a batch's: what it still owes)
            self.feed_prompt(seq, len(seq))
        pending = self.known(seq[self.runner.committed + self.cut :])  # committed ≥ head: past the cut
        ready, self.ready = self.ready, None
        if ready is not None and len(pending) == 1:  # the root was fed ahead, at tree slot 0
            self.fed = {0}
            return ready
        chunk = max(self.runner.widths, default=max(1, len(pending)))
        behind = (len(pending) - 1) // chunk * chunk  # whole chunks, leaving 1..chunk tokens
        self.runner.prefill(pending[:behind], chunk)
        pending = pending[behind:]
        logits = self.runner.forward_chain(pending)
        self.runner.commit(list(range(len(pending) - 1)))
        self.fed = {0}
        return self.rows(logits[-1:])

    def expand(self, tree: TokenTree, nodes: list[int], width: int = 0) -> DraftRows:
        """Run the drafter over tree nodes (their ancestors already fed), padded to `width`; their
        draft rows, one a node."""
        tokens = self.known([tree.tokens[i] for i in nodes])
        return self.feed(tokens, nodes, [tree.depths[i] for i in nodes], tree.ancestor_mask()[nodes], width)

    def feed(self, tokens: list[int] | Tensor, nodes: list[int] | Tensor, depths: list[int] | Tensor, mask: Tensor,
             width: int = 0) -> DraftRows:
        """Run the drafter over tree nodes at `depths` seeing the tree slots of `mask`'s rows,
        padded to `width`: their draft rows. tokens: on the device when the drafter's last forward
        chose them (`StaticTree`), as the drafter embeds them (see STAND_IN); nodes and depths too
        when a round chose the nodes there (`Planner.grow_on`, which records them as fed once it
        reads the tree)."""
        if isinstance(tokens, Tensor):
            tokens = torch.where(tokens < self.runner.vocab_size, tokens, self.STAND_IN)
        logits = self.runner.forward(tokens, nodes, depths, mask, width)
        if not isinstance(nodes, Tensor):
            self.fed.update(nodes)
        return self.rows(logits)

    def finish(self, verdict: Verdict, ahead: tuple[int, DraftRows] | None = None) -> None:
        """Commit the accepted path as far as the drafter has seen it. ahead: (node, its logits)
        when the bonus token was fed ahead of the verify as that node (egt's AOT head draft): if the
        drafter saw the whole path, the node's row becomes the next root's (tree slot 0)."""
        keep = []
        for node in verdict.path:
            if node not in self.fed:
                break
            keep.append(node)
        if ahead is not None and len(keep) == len(verdict.path):
            self.runner.commit(keep + [ahead[0]])
            self.runner.committed -= 1  # the root stays uncommitted, as begin() leaves it
            self.ready = ahead[1]
        else:
            self.runner.commit(keep)

    def rows(self, logits: Tensor) -> DraftRows:
        """A forward's logits [n, H] as draft rows over the target's vocabulary (`DraftRows`)."""
        return DraftRows(logits, self.runner.model.head_ids, self.target_vocab)

    def fit(self, logits: Tensor) -> Tensor:
        """Draft logits [n, H] on the target's vocabulary (`DraftRows.full`): calibration's rank of
        the target's token among the drafter's."""
        return self.rows(logits).full()


def pick_children(tree: TokenTree, nodes: list[int], rows: DraftRows, k: int, state: StepState) -> list[list[int]]:
    """Add k children under each of `nodes` from their draft rows: top-k when greedy;
    coupled, the top k of log q + the noise of the children's position (both read in one
    transfer for all the nodes); rejection, k draws from the warped draft distribution without
    replacement (Gumbel top-k), recorded for acceptance."""
    sampling = state.sampling
    if sampling is None or sampling.noise is not None:
        tops = state.top(rows, [tree.depths[n] for n in nodes], k)
        return [[tree.add(n, t, p) for p, t in zip(*top)] for n, top in zip(nodes, tops)]
    return [_draw_children(tree, n, row, k, sampling) for n, row in zip(nodes, rows.full())]


def _draw_children(tree: TokenTree, node: int, logits: Tensor, k: int, sampling: Sampling) -> list[int]:
    q = warp(logits, sampling.temperature, sampling.top_p)
    tree.draft_dists[node] = q
    k = min(k, int((q > 0).sum()))
    # Gumbel top-k: the k largest log q(x) - log E_x, E_x ~ Exp(1), are k draws without replacement.
    # exponential_ can return 0 (then -log E = inf): tokens q rules out get -inf, never NaN, which
    # topk would rank first.
    noise = torch.empty_like(q).exponential_(generator=sampling.generator)
    keys = torch.where(q > 0, q.log() - noise.log(), float("-inf"))
    picks = keys.topk(k).indices.tolist()
    return [tree.add(node, t, q[t].item()) for t in picks]


class StaticTree:
    """A tree whose shape is fixed before the step — chain's, specinfer's, sequoia's: node v is
    the rank-`ranks[v]` child of `parents[v]` — drafted greedily on the device. Each level's
    children are the top ranks of their parents' draft rows, and the next level's forward takes
    them as its input tokens where they are (`Drafter.feed`): nothing comes back to the host until
    the whole tree is read, once, whatever its depth (one round trip a step beside the verdict's).
    The masks, depths and slots of every level are the shape's, made once. Its nodes are numbered
    level by level, each inner node's children by rank: the order the per-level walk adds them in."""

    def __init__(self, parents: list[int], ranks: list[int]):
        shape = SequoiaParams(parents=parents, ranks=ranks)  # a static tree's children and levels
        kids, self.levels = shape.children(), shape.levels()
        tree_id, self.parents = {0: 0}, [-1]  # the static node's tree node; the tree's parents
        starts = []  # the tree node each level's children begin at (they are numbered together)
        self.rows: list[Tensor] = []  # per level: each child's row among the level's draft rows
        self.ranks: list[Tensor] = []  # ... and its rank there
        self.k: list[int] = []  # ranks a level reads
        for level in self.levels:
            starts.append(len(self.parents))
            row, rank = [], []
            for i, v in enumerate(level):
                for c in kids[v]:
                    tree_id[c] = len(self.parents)
                    self.parents.append(tree_id[v])
                    row.append(i)
                    rank.append(ranks[c])
            self.rows.append(torch.tensor(row))
            self.ranks.append(torch.tensor(rank))
            self.k.append(max(rank) + 1)
        skeleton = TokenTree(0)
        for p in self.parents[1:]:
            skeleton.add(p, 0, 1.0)
        mask = skeleton.ancestor_mask()
        self.nodes = [[tree_id[v] for v in level] for level in self.levels]  # each level's fed nodes
        self.masks = [mask[nodes] for nodes in self.nodes]
        # where each level's inner nodes sit among the previous level's children
        self.picks = [torch.tensor([n - starts[d - 1] for n in self.nodes[d]]) if d else None
                      for d in range(len(self.levels))]

    def _on(self, device: torch.device) -> None:
        """The level tables on the drafter's device, moved once (a copy from pageable memory each
        step would wait for the device)."""
        if self.rows[0].device != device:
            move = lambda ts: [t if t is None else to_device(t.tolist(), device) for t in ts]  # noqa: E731
            self.rows, self.ranks, self.picks = move(self.rows), move(self.ranks), move(self.picks)

    def draft(self, drafter: Drafter, seq: list[int], child_rule: ChildRule, widths: tuple[int, ...] = ()) -> TokenTree:
        """The greedy tree under seq[-1] (`widths`: the compiled widths a level's forward is padded to)."""
        rows = drafter.begin(seq)
        self._on(rows.logits.device)
        values, tokens = [], []
        for d, nodes in enumerate(self.nodes):
            if d:
                rows = drafter.feed(tokens[-1][self.picks[d]], nodes, [d] * len(nodes), self.masks[d],
                                    fit_width(len(nodes), widths) if widths else 0)
            q, top = rows.top(self.k[d])
            at = (self.rows[d], self.ranks[d])
            values.append(q[at])
            tokens.append(top[at])
        ((qs, ts),) = read_top(torch.cat(values)[None], torch.cat(tokens)[None])
        tree = TokenTree(seq[-1], child_rule=child_rule)
        for parent, q, t in zip(self.parents[1:], qs, ts):
            tree.add(parent, t, q)
        return tree
