"""Each decoding method's parameters, as the plan holds them (plan.yaml's `methods:`) and the command
line sets them: one frozen dataclass per method, nested parts typed too (egt's depth policy and
stage order, the retrieval settings of egt and pld). The defaults live here; each checks its values
when made. Light on purpose (no torch): `ygg_runtime.schema.plan` builds a plan's methods with these, and
the command line reads plans before it imports torch. Each method's parameters also say what its
typical step costs in forwards (`step_shape`, which the objective prices), how `ygg inspect` sums them
up (`summary`) and whether compile writes them into every plan at their defaults (`hand_set`), and
register under the method's name as they are defined (`PARAMS`); how a method drafts is its
proposer's (`ygg_runtime.decoding.proposers`), registered there the same way. A method is these
parameters and its proposer module: nothing else names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ygg_runtime.errors import YggError
from ygg_runtime.schema.typed import build, plain

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # the forward widths compiled, profiled and checked for exactness


def fit_width(n: int, widths: tuple[int, ...] | list[int]) -> int:
    """The smallest compiled width that holds n tokens (n itself when none is wide enough)."""
    return next((w for w in sorted(widths) if w >= n), n)


@dataclass(frozen=True)
class StepShape:
    """What one step of a method costs in forwards: drafter widths in order, then one verify."""

    draft_widths: tuple[int, ...]
    verify_width: int  # tree nodes scored by the target, root included


# A drafting step begins by feeding the drafter what it has not seen: the bonus token, and the
# accepted leaf when the whole path was accepted. Modelled as 2 (T(1) ≈ T(2) on every curve
# measured so far).
BEGIN_WIDTH = 2


def egt_shape(depth: int, draft_width: int, verify_width: int, begin: tuple[int, ...] = (BEGIN_WIDTH,)) -> StepShape:
    """A depth-`depth` egt step: its first drafter forward (`begin`: more when the drafter is
    behind), then depth - 1 rounds of `draft_width`, then the verify; depth 0 is plain decoding."""
    if depth == 0:
        return StepShape((), 1)
    return StepShape(begin + (draft_width,) * (depth - 1), verify_width)


@dataclass(frozen=True)
class Settings:
    """Frozen settings with their defaults, made from a mapping; subclasses check values in
    __post_init__."""

    label: ClassVar[str] = "settings"  # how an error names them

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, where: str | None = None):
        """The settings as a plan or the command line gives them, refusing an unknown one, or a
        value of the wrong kind, in one line."""
        where = where or cls.label
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values or {}) - names)
        if unknown:
            raise YggError(f"{where} has no parameter {', '.join(unknown)} (it takes: {', '.join(sorted(names)) or 'none'})")
        try:
            return build(cls, values or {}, where, "", "")
        except TypeError as e:  # a value of the wrong kind where a comparison needed a number
            raise YggError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return plain(self)


# Every decoding method's parameters by its name, in the order they are defined (the order the command
# line lists the methods): each class registers itself (`Params.__init_subclass__`); `ar`, which has
# none, is the base class.
PARAMS: dict[str, type["Params"]] = {}


@dataclass(frozen=True)
class Params(Settings):
    """A method's parameters, with their defaults (`ar` has none)."""

    method: ClassVar[str] = "ar"
    label: ClassVar[str] = "method ar"
    # compile writes the method into every plan at these defaults (unless the user sets them); a
    # method compile plans (sequoia's tree, egt's shape) is written only by its planning
    hand_set: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.label = f"method {cls.method}"  # errors name the method
        if "method" in cls.__dict__:  # a method's own parameters: registered under its name
            PARAMS[cls.method] = cls

    def step_shape(self) -> StepShape:
        """The forwards of the method's typical step, from its parameters alone (no model): what
        compile plans with, `ygg inspect` shows and the objective prices. Plain decoding: one verify."""
        return StepShape((), 1)

    def summary(self) -> str:
        """The parameters in a table cell (`ygg inspect`)."""
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items()) or "–"


PARAMS["ar"] = Params


@dataclass(frozen=True)
class ChainParams(Params):
    method: ClassVar[str] = "chain"
    k: int = 4  # drafted tokens per step

    def __post_init__(self):
        if self.k < 1:
            raise YggError("chain needs k >= 1")

    def step_shape(self) -> StepShape:
        return StepShape((BEGIN_WIDTH,) + (1,) * (self.k - 1), self.k + 1)


@dataclass(frozen=True)
class SpecInferParams(Params):
    method: ClassVar[str] = "specinfer"
    width: int = 2  # children per node
    depth: int = 3

    def __post_init__(self):
        if self.width < 1 or self.depth < 1:
            raise YggError("specinfer needs width >= 1 and depth >= 1")

    @property
    def nodes(self) -> int:
        return sum(self.width**d for d in range(self.depth + 1))

    def step_shape(self) -> StepShape:
        return StepShape((BEGIN_WIDTH,) + tuple(self.width**d for d in range(1, self.depth)), self.nodes)


@dataclass(frozen=True)
class SequoiaParams(Params):
    method: ClassVar[str] = "sequoia"
    hand_set: ClassVar[bool] = False  # its tree is planned at compile time
    parents: list[int] = field(default_factory=lambda: [-1])  # the static tree (node 0 the root)
    ranks: list[int] = field(default_factory=lambda: [0])  # node v: the drafter's rank-ranks[v] child of its parent
    widths: list[int] = field(default_factory=lambda: list(WIDTHS))  # the drafter's and target's compiled widths

    def __post_init__(self):
        parents, ranks = list(self.parents), list(self.ranks)
        if not parents or parents[0] != -1 or len(ranks) != len(parents) or any(
            not 0 <= p < v for v, p in enumerate(parents) if v
        ):
            raise YggError("sequoia needs a static tree: parents[0] == -1 and every other parent earlier in the list")
        if not self.widths or min(self.widths) < 1:
            raise YggError("sequoia needs compiled widths >= 1")

    def children(self) -> list[list[int]]:
        """Each node's children, in the order the acceptance walk tries them (rank 0 first)."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for v in range(1, len(self.parents)):
            kids[self.parents[v]].append(v)
        return [sorted(k, key=lambda v: self.ranks[v]) for k in kids]

    def levels(self) -> list[list[int]]:
        """The inner nodes (those with children) of each depth: one drafter forward each."""
        depth = [0] * len(self.parents)
        for v in range(1, len(self.parents)):
            depth[v] = depth[self.parents[v]] + 1
        kids = self.children()
        return [[v for v in range(len(self.parents)) if depth[v] == d and kids[v]] for d in range(max(depth))]

    def step_shape(self) -> StepShape:
        levels = self.levels()
        if not levels:
            return StepShape((), 1)
        widths = sorted(self.widths)
        inner = tuple(fit_width(len(lv), widths) for lv in levels[1:])
        return StepShape((BEGIN_WIDTH,) + inner, fit_width(len(self.parents), widths))

    def summary(self) -> str:
        return f"{len(self.parents)}-node tree"


# The retrieval value tables' axes: match length, position in the copied run (the last bucket holds
# every later one: deep in a copied span, the next token is likelier still), adjacency rank.
MAX_N, POSITIONS, RANKS = 4, 8, 4


@dataclass(frozen=True)
class GraftParams(Settings):
    """How a method retrieves (the plan's `graft`, in `egt` and `pld`; `ygg_runtime.decoding.retrieval`).
    The value tables are what compile measured; the defaults are rough priors."""

    label: ClassVar[str] = "graft"

    length: int = 16  # tokens of a retrieved continuation at most (pruning keeps what is worth verifying)
    limit: int = 3  # continuations per lookup
    max_n: int = MAX_N  # the longest suffix matched
    min_n: int = 1  # the shortest
    under: int = 4  # best drafted nodes a lookup also runs under, besides the root (egt)
    budget: int = 32  # retrieved nodes per step at most (they become cache slots: it bounds a tree)
    k: int = RANKS  # adjacency successors kept per token
    adjacency_depth: int = 2  # the adjacency chain under the root
    file: str | None = None  # the artifact's seeded adjacency table
    # context[n - 1][position][seen twice or more]: P(accepted | parent accepted) of a context node
    context: list[list[list[float]]] | None = None
    # adjacency[rank][position > 0]: the same for an adjacency node
    adjacency: list[list[float]] | None = None

    def __post_init__(self):
        if (self.length < 1 or self.limit < 1 or not 1 <= self.min_n <= self.max_n <= MAX_N or self.under < 0
                or self.budget < 0 or not 1 <= self.k <= RANKS or self.adjacency_depth < 0):
            raise YggError(f"graft needs length, limit >= 1, 1 <= min_n <= max_n <= {MAX_N}, under, budget, "
                           f"adjacency_depth >= 0 and 1 <= k <= {RANKS}")
        for name, table, shape in (("context", self.context, (MAX_N, POSITIONS, 2)), ("adjacency", self.adjacency, (RANKS, 2))):
            if table is not None and _shape(table) != shape:
                raise YggError(f"graft's {name} table must be {' x '.join(map(str, shape))}")


def _shape(table) -> tuple[int, ...]:
    shape, x = [], table
    while isinstance(x, list):
        shape.append(len(x))
        x = x[0] if x else None
    return tuple(shape)


@dataclass(frozen=True)
class Stages:
    """Which of egt's drafter stages run ahead of the verify (docs/design.md, "Stages")."""

    tail: str = "plain"  # plain | ahead
    head: str = "plain"

    def __post_init__(self):
        if not {self.tail, self.head} <= {"plain", "ahead"}:
            raise YggError(f"egt stages must be tail/head: plain or ahead, not tail {self.tail}, head {self.head}")

    def ahead(self) -> bool:
        return "ahead" in (self.tail, self.head)


@dataclass(frozen=True)
class DepthPolicy:
    """egt's depth every step (`objective.best_depth`): the draft width its steps grow with, and per
    depth D the calibrated factor and the verify width of a depth-D step (index 0: plain decoding).
    Its reach, P(accepted length >= d), comes every step from the depth predictor in `file`
    (`ygg_compile.predictor_training.plan_policy`), or, with no file, from calibration's `reach`
    (`ygg_compile.calibrate.reach_policy`), corrected by the request's acceptance estimate
    (`ygg_runtime.decoding.estimate`)."""

    file: str | None
    draft_width: int
    factors: list[float]
    verify_widths: list[int]
    reach: list[float] | None = None  # calibration's P(A >= d), d = 1..D: the prior without a predictor

    def __post_init__(self):
        if len(self.factors) != len(self.verify_widths) or len(self.factors) < 2 or self.draft_width < 1:
            raise YggError("egt's depth policy needs a factor and a verify width per depth 0..D (D >= 1) and draft_width >= 1")
        if self.file is None and (self.reach is None or len(self.reach) != self.max_depth):
            raise YggError("egt's depth policy needs a depth predictor file or calibration's reach at every depth 1..D")

    @property
    def max_depth(self) -> int:
        return len(self.factors) - 1


@dataclass(frozen=True)
class Adapt(Settings):
    """The request's acceptance estimate (`ygg_runtime.decoding.estimate`), as compile fitted it:
    how many expected acceptances calibration's prior counts for (`strength` for the nodes' prices,
    `reach_strength` for egt's reach: each the one that best predicts held-out calibration prompts
    step by step, `ygg_compile.calibrate.fit_strength`), how
    many steps old evidence keeps half its weight, and, for egt without a depth predictor, the depth
    policy whose reach the estimate corrects every step."""

    label: ClassVar[str] = "adapt"

    strength: float  # of the nodes' prices
    half_life: float
    reach_strength: float | None = None  # of egt's reach (None: `strength`)
    weight: float = 1.0  # P(a request's node prices are calibration's kind); the rest: a one-acceptance prior
    reach_weight: float = 1.0  # P(a request's reach is calibration's kind); the rest: a one-try prior
    policy: DepthPolicy | None = None

    def __post_init__(self):
        if not self.strength > 0 or not self.half_life > 0 or self.reach_strength is not None and not self.reach_strength > 0:
            raise YggError("adapt needs strength, reach_strength > 0 and half_life > 0")
        if not (0.0 < self.weight <= 1.0 and 0.0 < self.reach_weight <= 1.0):
            raise YggError("adapt's weight and reach_weight must be in (0, 1]")
        if self.policy is not None and self.policy.file is not None:
            raise YggError("adapt's depth policy is calibration's (no predictor file)")


@dataclass(frozen=True)
class EGTParams(Params):
    method: ClassVar[str] = "egt"
    hand_set: ClassVar[bool] = False  # its shape is planned at compile time
    depth: int = 4  # drafter rounds per step (0: plain decoding); the fixed depth without a predictor
    draft_width: int = 4  # nodes each round after the first feeds
    top_k: int = 8  # children added under each fed node
    verify_widths: list[int] = field(default_factory=lambda: list(WIDTHS[:-1]))  # the target's compiled widths
    verify_width: int | None = None  # the usual verify width, for the step shape (None: the widest)
    accept: list[list[float]] | None = None  # the calibrated map draft probability -> P(accept)
    depth_policy: DepthPolicy | None = None  # with a depth predictor: the depth every step
    stages: Stages = field(default_factory=Stages)
    graft: GraftParams | None = None  # retrieval grafting; None: off
    tokens_per_step: float | None = None  # calibrated E[A] at the fixed depth: what a retrieval-only step must beat
    adapt: Adapt | None = None  # the request's acceptance estimate; None: every step as planned

    def __post_init__(self):
        if (self.depth < 0 or self.draft_width < 1 or self.top_k < 1 or not self.verify_widths
                or min(self.verify_widths) < 1):
            raise YggError("egt needs depth >= 0, draft_width >= 1, top_k >= 1 and verify widths >= 1")

    def step_shape(self) -> StepShape:
        return egt_shape(self.depth, self.draft_width, self.verify_width or max(self.verify_widths))

    def summary(self) -> str:
        policy = self.depth_policy
        if policy is not None:
            return f"depth 0–{policy.max_depth} by predictor, draft_width={policy.draft_width}, top_k={self.top_k}"
        return f"depth={self.depth}, draft_width={self.draft_width}, top_k={self.top_k}"


@dataclass(frozen=True)
class PLDParams(Params):
    method: ClassVar[str] = "pld"
    verify_widths: list[int] = field(default_factory=lambda: list(WIDTHS[:-1]))  # the target's compiled widths
    graft: GraftParams = field(default_factory=GraftParams)  # retrieval settings and calibrated values
    adapt: Adapt | None = None  # the request's acceptance estimate (retrieval's sources); None: the calibrated values

    def __post_init__(self):
        if not self.verify_widths or min(self.verify_widths) < 1:
            raise YggError("pld needs verify widths >= 1")

    def step_shape(self) -> StepShape:
        return StepShape((), min(self.verify_widths))

    def summary(self) -> str:
        g = self.graft
        return f"up to {g.limit} continuations of {g.length} tokens" + (", calibrated" if g.context else "")


def parse(name: str, values: "dict[str, Any] | Params | None", where: str | None = None) -> Params:
    """A method's parameters, checked: an unknown method, parameter or value is refused in one line."""
    if name not in PARAMS:
        raise YggError(f"unknown method '{name}' (choose from {', '.join(PARAMS)})")
    if isinstance(values, Params):
        if type(values) is not PARAMS[name]:
            raise YggError(f"{type(values).__name__} are not method {name}'s parameters")
        return values
    return PARAMS[name].from_dict(values, where)
