"""One event per verified step, and one dataclass of counters that every method fills from those
events; each derived metric is defined next to it.

`Step` is what a generation says about each step, once, as its output sees it: `Metrics` (one
generation's counters) and the server's Prometheus counters (`ygg serve`'s /metrics) both consume
it, so a drafted token the budget or an eos cut is counted as accepted by neither. `Metrics` is
the one schema of a run: `ygg run --json` prints `to_dict()`, `Result` reads its fields from it, and
each `ygg bench` row of ours is `to_dict()` plus the tokens (the summary and the CSV then aggregate
those keys per category).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ygg_runtime.decoding.tree import ADJACENCY, CONTEXT, DRAFT


def tpot_ms(start: float, first: float, last: float, tokens: int) -> float:
    """Time per output token in ms, the one definition every figure of ours and of the peers uses
    (vLLM's): from the first output token to the last, over the tokens after the first —
    (last − first) / (tokens − 1). Prompt processing and the wait for the first token are the time
    to first token's, not TPOT's; tokens that arrive together (a speculative step's) share its
    time. A single token has no interval: its own time since `start` (the decode's start) stands in.
    Times in seconds, on one clock."""
    if tokens > 1:
        return 1000.0 * (last - first) / (tokens - 1)
    return 1000.0 * (first - start) if tokens == 1 else 0.0

# Per-step lists stay out of to_dict(): a run's record stays small whatever its length (Result
# carries accepted_lengths; tree_depths and the depth counters are summarised by their properties).
PER_STEP = ("accepted_lengths", "depth_tries", "depth_accepts", "tree_depths")
# The derived metrics, in the order to_dict() reports them after the counters.
DERIVED = ("mean_accepted_length", "acceptance_rate", "depth_acceptance", "mean_tree_depth", "tokens_per_step_by_source",
           "retrieval_ms_per_step", "tpot_ms", "forward")


@dataclass(frozen=True)
class Step:
    """One verified step of one sequence, as its output sees it."""

    drafted: int  # tree nodes sent to the target (root excluded), drafted or retrieved
    accepted: int  # of those, the ones in the output (bonus excluded; after any budget or eos cut)
    yielded: int  # tokens the step added to the output (accepted, and the bonus unless cut)
    tried_depths: int  # how deep the accepted path could have gone (the accepted node's deepest child)
    tree_depth: int  # the verified tree's depth (0: plain decoding)
    sources: tuple[int, ...]  # DRAFT, CONTEXT or ADJACENCY per drafted node
    accepted_sources: tuple[int, ...]  # ... per accepted token
    verify_width: int  # the target forward's width (the tree, padded to a compiled width)
    draft_s: float  # proposer work: drafter forwards and tree building
    verify_s: float  # the target forward over the tree
    other_s: float  # acceptance, compaction, bookkeeping
    retrieval_s: float = 0.0  # indexing and retrieval, part of draft_s
    ahead_hit: bool = False  # the next root was already fed to the drafter (egt's head draft)


@dataclass
class Metrics:
    method: str = ""
    choice: str = ""  # why the request ran `method`: "asked for", "the plan's method", or the modelled costs
    draft_window: int = 0  # the drafter read only this many last prompt tokens (0: the whole prompt)
    sampling: str = "greedy"  # how tokens were drawn: "greedy", "coupled" or "rejection" (options.SAMPLINGS)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # target verify forwards after the prefill
    drafted_tokens: int = 0  # tree nodes sent to the target (root excluded), drafted or retrieved
    accepted_tokens: int = 0  # of those, the ones the target accepted (bonus excluded)
    retrieved_tokens: int = 0  # tree nodes sent to the target that retrieval proposed and the drafter did not
    accepted_context: int = 0  # accepted tokens the context index proposed (prompt lookup)
    accepted_adjacency: int = 0  # accepted tokens the adjacency table proposed
    retrieval_steps: int = 0  # steps that verified retrieved tokens without a drafter forward
    retrieval_s: float = 0.0  # indexing and retrieval, part of draft_s
    accepted_lengths: list[int] = field(default_factory=list)  # per step, bonus included
    depth_tries: list[int] = field(default_factory=list)  # [d-1]: steps that reached depth d-1 with a child to try
    depth_accepts: list[int] = field(default_factory=list)  # [d-1]: steps whose accepted path reached depth d
    tree_depths: list[int] = field(default_factory=list)  # per step, the verified tree's depth (0: plain)
    # Steps by shape, "depth×width": the verified tree's depth (0: a plain step) and the verify's width.
    shapes: dict[str, int] = field(default_factory=dict)
    plain_steps: int = 0  # steps that verified the root alone (no drafted or retrieved token)
    # The request's acceptance estimate at its end against calibration's (`ygg_runtime.decoding.estimate`);
    # None: the method did not adapt (`--no-adapt`, or a method with fixed trees).
    adapt: dict | None = None
    ahead_hits: int = 0  # steps whose next root the drafter had already fed ahead of the verify (egt's AOT head draft)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # proposer work: drafter forwards and tree building
    verify_s: float = 0.0  # target forwards over the trees
    other_s: float = 0.0  # acceptance, compaction, bookkeeping
    decode_s: float = 0.0  # wall time from the end of the prefill to the last token
    first_token_s: float = 0.0  # of it, until the first output token
    compiled_forwards: int = 0  # model forwards (target and drafter, prefill included) run ahead-of-time compiled
    eager_forwards: int = 0  # ... and run eager (`--eager`, no compiled forwards, or wider than they hold)

    def record(self, step: Step) -> None:
        """Count one step."""
        self.steps += 1
        self.tree_depths.append(step.tree_depth)
        shape = f"{step.tree_depth}×{step.verify_width}"
        self.shapes[shape] = self.shapes.get(shape, 0) + 1
        self.plain_steps += step.drafted == 0
        self.drafted_tokens += step.drafted
        self.accepted_tokens += step.accepted
        self.accepted_lengths.append(step.yielded)
        while len(self.depth_tries) < step.tried_depths:
            self.depth_tries.append(0)
            self.depth_accepts.append(0)
        for d in range(step.tried_depths):
            self.depth_tries[d] += 1
            self.depth_accepts[d] += d < step.accepted
        retrieved = sum(s != DRAFT for s in step.sources)
        self.retrieved_tokens += retrieved
        self.retrieval_steps += bool(retrieved) and retrieved == len(step.sources)
        self.accepted_context += step.accepted_sources.count(CONTEXT)
        self.accepted_adjacency += step.accepted_sources.count(ADJACENCY)
        self.ahead_hits += step.ahead_hit
        self.retrieval_s += step.retrieval_s
        self.draft_s += step.draft_s
        self.verify_s += step.verify_s
        self.other_s += step.other_s

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward, bonus included: the speculation's raw gain (1.0 for `ar`)."""
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafted tokens over drafted tokens: how much of the verify width was useful
        (None when nothing was drafted: `ar`, or `egt` at depth 0 throughout)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def depth_acceptance(self) -> list[float]:
        """[d-1]: P(the path reaches depth d | it reached depth d-1 and a child was drafted there)."""
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepts, self.depth_tries)]

    @property
    def mean_tree_depth(self) -> float:
        """Mean depth of the verified trees: how far ahead a method drafted (egt's depth predictor
        moves it step by step)."""
        return sum(self.tree_depths) / max(1, len(self.tree_depths))

    @property
    def tokens_per_step_by_source(self) -> dict[str, float]:
        """mean_accepted_length split by where each token came from: the drafter, the context index,
        the adjacency table, and the target's own bonus token."""
        steps = max(1, self.steps)
        retrieved = self.accepted_context + self.accepted_adjacency
        return {"draft": (self.accepted_tokens - retrieved) / steps, "context": self.accepted_context / steps,
                "adjacency": self.accepted_adjacency / steps,
                "bonus": (sum(self.accepted_lengths) - self.accepted_tokens) / steps}

    @property
    def retrieval_ms_per_step(self) -> float:
        """What retrieval (indexing accepted tokens, lookups, grafting) adds to a step, in ms."""
        return 1000.0 * self.retrieval_s / max(1, self.steps)

    @property
    def forward(self) -> str:
        """Which forwards ran: "compiled", "eager" or "mixed" (some wider than the compiled graphs)."""
        if self.compiled_forwards and self.eager_forwards:
            return "mixed"
        return "compiled" if self.compiled_forwards else "eager"

    @property
    def tpot_ms(self) -> float:
        """Time per output token in ms after the first (`tpot_ms`, the one definition)."""
        return tpot_ms(0.0, self.first_token_s, self.decode_s, self.generated_tokens)

    def to_dict(self) -> dict:
        """The counters (per-step lists left out) and the derived metrics, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PER_STEP} | {
            name: getattr(self, name) for name in DERIVED}
