"""A request's own acceptance, learnt as it goes: what shapes each step of `egt` and `pld` (issue 73).

Calibration prices every node of a tree: P(accepted | parent accepted), from the drafter's
probability through the acceptance map, or from retrieval's value tables (`TokenTree.accepts`),
and egt's depth choice reads a reach, P(accepted length >= d), from the depth predictor or from
calibration (`DepthPolicy`). A request accepts more than calibration's average (code, copying) or
less (another language, a style the drafter never saw). The estimate counts, per row — each source
of nodes (drafter, context, adjacency), and the reach — and per depth, the acceptances the request
showed (O) against those its prior expected (E), over the tries it made (N):

    a source's node prices, scaled by a Gamma–Poisson posterior mean ratio (n0: expected acceptances)
        row:     R    = (n0 + O) / (n0 + E)
        depth d: r_d  = (n0 · R_-d + O_d) / (n0 + E_d)
    the reach's conditional c_d = P(A >= d | A >= d - 1), moved to θc / (1 - c + θc) by an odds ratio
    θ = odds(p) / odds(E / N), p the Beta–Binomial posterior mean (m: tries) of the tries' rate
        row:     p    = (m · E / N + O) / (m + N)
        depth d: p_d  = (m · c̃_d + O_d) / (m + N_d),  c̃_d: E_d / N_d moved by the other depths' θ

each depth shrunk towards what its row's other depths show (_-d: without its own evidence; a depth
never tried takes their θ). E for a source is the sum of the tried children's prices under every
accepted node; for the reach, the prior's conditional at every depth a drafted step tried. A node
price is a sum over rival children (a ratio suits it); a reach try succeeds or fails (odds suit it:
a request that accepts everything drives every depth towards 1, the deeper ones it has not tried
yet too, so its tree grows). n0 and m are fitted by compile on held-out calibration prompts
(`ygg_compile.calibrate.fit_strength`). Evidence fades with a half-life in steps, so a request
priced out of drafting drifts back to the prior and tries again (the estimate recovers when the
request does).

The scaled prices move everything the objective decides: pruning's verify width (path values),
egt's depth every step (`reach`), depth 0 — a retrieval-only or plain step, no drafter forward —
and retrieval's own trees. The tokens a step accepts never depend on them.
"""

from __future__ import annotations

from ygg_runtime.artifact.params import Params
from ygg_runtime.decoding.tree import SOURCES, TokenTree

DEPTHS = 8  # cells per row; deeper tries share the last
REACH = len(SOURCES)  # the row after the sources': egt's reach
ROWS = ("draft", "context", "adjacency", "reach")


def of(params: Params) -> "Estimate | None":
    """A new request's estimate for a method, from its plan's `adapt` (None: the method does not
    adapt: its trees are fixed, or the plan fitted no estimate)."""
    adapt = getattr(params, "adapt", None)
    return Estimate(adapt.strength, adapt.half_life, adapt.reach_strength) if adapt is not None else None


class Estimate:
    """One request's acceptance against calibration's, updated with every verified step."""

    def __init__(self, strength: float, half_life: float, reach_strength: float | None = None):
        """strength: n0 of the nodes' prices; reach_strength: m of the reach (default: the same)."""
        self.strength = strength
        self.reach_strength = strength if reach_strength is None else reach_strength
        self.half_life = half_life
        self.keep = 0.5 ** (1.0 / half_life)  # each step's weight on the evidence before it
        self.observed = [[0.0] * DEPTHS for _ in ROWS]  # faded acceptances seen, [row][depth - 1]
        self.expected = [[0.0] * DEPTHS for _ in ROWS]  # faded acceptances the prior expected there
        self.tries = [0.0] * DEPTHS  # the reach's faded tries
        self.ratios = [[1.0] * DEPTHS for _ in ROWS[:REACH]]  # r_d of each source
        self.odds = [1.0] * DEPTHS  # the reach's odds ratio θ at each depth
        # The whole request, unfaded, for what `ygg run --stats` shows: per row (tries, expected, accepted).
        self.totals = [[0, 0.0, 0] for _ in ROWS]
        self.steps = 0
        self.prior: list[float] | None = None  # the reach this step's depth was chosen on (before the shift)

    def scale(self, source: int, depth: int) -> float:
        """What this request makes of calibration's price of a node from `source` at `depth` (≥ 1)."""
        return self.ratios[source][min(depth, DEPTHS) - 1]

    def reach(self, prior: list[float]) -> list[float]:
        """This step's reach: the prior's (the depth predictor's or calibration's, P(accepted length
        >= d) for d = 1..D) with each depth's conditional moved by the request's, non-increasing. The
        prior is kept to score the step against when it is verified (unless `plain` says the step
        did not draft)."""
        self.prior = prior
        out, before, got = [], 1.0, 1.0
        for d, p in enumerate(prior):
            c = min(1.0, p / before) if before > 0 else 0.0
            theta = self.odds[min(d, DEPTHS - 1)]
            got *= theta * c / (1.0 - c + theta * c) if 0.0 < c < 1.0 else c
            before = p
            out.append(got)
        return out

    def plain(self) -> None:
        """This step does not draft after all (depth 0): its outcome says nothing of the reach."""
        self.prior = None

    def observe(self, tree: TokenTree, path: list[int]) -> None:
        """One verified step: `tree` as the target scored it, `path` the accepted nodes from the root.
        Every accepted node's children were tried; the next node on the path (if any) succeeded."""
        keep = self.keep
        self.observed = [[x * keep for x in row] for row in self.observed]
        self.expected = [[x * keep for x in row] for row in self.expected]
        self.tries = [x * keep for x in self.tries]
        children, sources, accepts, depths = tree.children, tree.sources, tree.accepts, tree.depths
        for i, u in enumerate(path):
            kids = children[u]
            if not kids:
                continue
            d = min(depths[u] + 1, DEPTHS) - 1
            for c in kids:
                self._count(sources[c], d, accepts[c])
            if i + 1 < len(path):
                self._seen(sources[path[i + 1]], d)
        if self.prior is not None:  # a drafted step: a reach try at every depth its accepted path could go on from
            tried = len(path) - (0 if children[path[-1]] else 1)
            before = 1.0
            for d in range(min(tried, len(self.prior))):
                p, cell = self.prior[d], min(d, DEPTHS - 1)
                self._count(REACH, cell, p / before if before > 0 else 0.0)
                self.tries[cell] += 1.0
                if d + 1 < len(path):
                    self._seen(REACH, cell)
                before = p
            self.prior = None
        self.steps += 1
        n0 = self.strength
        for r in range(REACH):
            o, e = self.observed[r], self.expected[r]
            so, se = n0 + sum(o), n0 + sum(e)
            if se > n0:  # a row never tried keeps calibration's prices
                self.ratios[r] = [(n0 * (so - od) / (se - ed) + od) / (n0 + ed) for od, ed in zip(o, e)]
        o, e, n = self.observed[REACH], self.expected[REACH], self.tries
        so, se, sn = sum(o), sum(e), sum(n)
        if sn > 0:  # a depth never tried (or long ago) takes the whole row's odds
            whole = self._odds(so, se, sn)
            self.odds = [whole if nd < 1e-3 else self._odds(od, ed, nd, self._odds(so - od, se - ed, sn - nd))
                         for od, ed, nd in zip(o, e, n)]

    def _odds(self, o: float, e: float, n: float, base: float = 1.0) -> float:
        """The odds ratio θ of tries that succeeded o times of n where their prior expected e: the
        Beta–Binomial posterior mean of their rate, from the prior's mean moved by `base`, against
        the prior's mean."""
        if n <= 1e-3:
            return base
        c = min(1.0 - 1e-3, max(1e-3, e / n))
        prior = base * c / (1.0 - c + base * c)
        p = min(1.0 - 1e-3, max(1e-3, (self.reach_strength * prior + o) / (self.reach_strength + n)))
        return p / (1.0 - p) * (1.0 - c) / c

    def _count(self, row: int, d: int, expected: float) -> None:
        """A try at depth d + 1 of a row, which its prior expected to succeed this often."""
        self.expected[row][d] += expected
        self.totals[row][0] += 1
        self.totals[row][1] += expected

    def _seen(self, row: int, d: int) -> None:
        """... and succeeded."""
        self.observed[row][d] += 1.0
        self.totals[row][2] += 1

    def to_dict(self) -> dict:
        """The request's estimate against the prior: per source, its price ratio now (whole, and by
        depth); for the reach, its odds ratio (whole, and by depth); and per row what the request
        showed over its whole life (tries, acceptances the prior expected, acceptances seen)."""
        out: dict = {"strength": self.strength, "reach_strength": self.reach_strength, "half_life": self.half_life,
                     "steps": self.steps}
        for r, name in enumerate(ROWS):
            tries, expected, accepted = self.totals[r]
            if not tries:
                continue
            deepest = max((d + 1 for d in range(DEPTHS) if self.expected[r][d] > 0), default=1)
            o, e = sum(self.observed[r]), sum(self.expected[r])
            if r == REACH:
                now = {"odds": round(self._odds(o, e, sum(self.tries)), 3),
                       "by_depth": [round(x, 3) for x in self.odds[:deepest]]}
            else:
                now = {"ratio": round((self.strength + o) / (self.strength + e), 3),
                       "by_depth": [round(x, 3) for x in self.ratios[r][:deepest]]}
            out[name] = now | {"tries": tries, "expected": round(expected, 2), "accepted": accepted}
        return out
