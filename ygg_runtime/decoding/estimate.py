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
yet too, so its tree grows). Each prior is robust: with weight w calibration's kind at strength n0
(m), else one acceptance's (one try's) at the same mean (`ROBUST`); the row's marginal likelihood
under each (Gamma–Poisson, Beta–Binomial) moves w to the request's `like`, and every figure above
is the two posteriors mixed by it — a request far from calibration's kind (another language)
leaves its prices within a few tries, one like it keeps them. n0, m and both weights are fitted by
compile on held-out calibration prompts (`ygg_compile.calibrate.fit_strength`). Evidence fades with
a half-life in steps, so a request priced out of drafting drifts back to the prior and tries again
(the estimate recovers when the request does).

The scaled prices move everything the objective decides: pruning's verify width (path values),
egt's depth every step (`reach`), depth 0 — a retrieval-only or plain step, no drafter forward —
and retrieval's own trees. The tokens a step accepts never depend on them.
"""

from __future__ import annotations

from math import exp, lgamma, log

from ygg_runtime.schema.params import Params
from ygg_runtime.decoding.tree import SOURCES, TokenTree

DEPTHS = 8  # cells per row; deeper tries share the last
ROBUST = 1.0  # the strength, in tries, of the robust prior's vague part (a unit-information prior)
REACH = len(SOURCES)  # the row after the sources': egt's reach
ROWS = ("draft", "context", "adjacency", "reach")


def of(params: Params) -> "Estimate | None":
    """A new request's estimate for a method, from its plan's `adapt` (None: the method does not
    adapt: its trees are fixed, or the plan fitted no estimate)."""
    adapt = getattr(params, "adapt", None)
    if adapt is None:
        return None
    return Estimate(adapt.strength, adapt.half_life, adapt.reach_strength, adapt.weight, adapt.reach_weight)


class Estimate:
    """One request's acceptance against calibration's, updated with every verified step."""

    def __init__(self, strength: float, half_life: float, reach_strength: float | None = None,
                 weight: float = 1.0, reach_weight: float = 1.0):
        """strength: n0 of the nodes' prices; reach_strength: m of the reach (default: the same);
        weight, reach_weight: the prior probability that the request is calibration's kind, for the
        nodes' prices and the reach (the rest on a prior of one acceptance's, or one try's, strength:
        `ROBUST`)."""
        self.strength = strength
        self.reach_strength = strength if reach_strength is None else reach_strength
        self.weight, self.reach_weight = weight, reach_weight
        # each row's posterior weight: how far the request still looks like calibration's kind
        self.like = [weight] * REACH + [reach_weight]
        self.half_life = half_life
        self.keep = 0.5 ** (1.0 / half_life)  # each step's weight on the evidence before it
        self.observed = [[0.0] * DEPTHS for _ in ROWS]  # faded acceptances seen, [row][depth - 1]
        self.expected = [[0.0] * DEPTHS for _ in ROWS]  # faded acceptances the prior expected there
        self.tries = [0.0] * DEPTHS  # the reach's faded tries
        self.ratios = [[1.0] * DEPTHS for _ in ROWS[:REACH]]  # r_d of each source
        self.odds = [1.0] * DEPTHS  # the reach's odds ratio θ at each depth
        self.whole = [1.0] * len(ROWS)  # each row's ratio (the reach's: odds ratio) over all its depths
        self.used = [0] * len(ROWS)  # per row, the depth cells any try has reached (the rest hold no evidence)
        # observed, expected and tries are kept in units that grow by 1 / keep a step, so fading all
        # the evidence is one division: a cell's faded value is what it holds / unit
        self.unit = 1.0
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
        odds = self.odds if len(prior) <= DEPTHS else self.odds + self.odds[-1:] * (len(prior) - DEPTHS)
        out, before, got = [], 1.0, 1.0
        for p, theta in zip(prior, odds):
            c = (p / before if p < before else 1.0) if before > 0 else 0.0
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
        self.unit /= self.keep  # all evidence before this step fades by `keep`
        if self.unit > 1e100:
            self._rescale()
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
                self.tries[cell] += self.unit
                if d + 1 < len(path):
                    self._seen(REACH, cell)
                before = p
            self.prior = None
        self.steps += 1
        self._update()

    def _update(self) -> None:
        """The rows' ratios and the reach's odds from the faded evidence, each under a robust prior:
        calibration's kind (its fitted strength) with its weight, else one acceptance's or one try's
        worth (`ROBUST`). Each row weighs the two by how likely each makes what the request showed,
        so a request far from calibration's kind (another language) leaves the strong prior within a
        few tries, and one like it keeps it. Depths past the deepest ever tried take their row's."""
        inv = 1.0 / self.unit
        for r in range(REACH):
            k = self.used[r]
            o, e = [x * inv for x in self.observed[r][:k]], [x * inv for x in self.expected[r][:k]]
            so, se = sum(o), sum(e)
            if se <= 0:  # a row never tried keeps calibration's prices
                continue
            strong, whole = _ratios(self.strength, o, e)
            if self.weight < 1.0:
                like = self.like[r] = _posterior(
                    self.weight, _gamma_poisson(self.strength, so, se) - _gamma_poisson(ROBUST, so, se))
                weak, weak_whole = _ratios(ROBUST, o, e)
                strong = [like * x + (1.0 - like) * y for x, y in zip(strong, weak)]
                whole = like * whole + (1.0 - like) * weak_whole
            self.ratios[r], self.whole[r] = strong + [whole] * (DEPTHS - k), whole
        k = self.used[REACH]
        o, e, n = ([x * inv for x in row[:k]] for row in (self.observed[REACH], self.expected[REACH], self.tries))
        so, se, sn = sum(o), sum(e), sum(n)
        if sn <= 0:
            return
        m, w = self.reach_strength, self.reach_weight
        odds, whole = self._row_odds(m, o, e, n)
        if w < 1.0:  # the weak part: each depth's own tries on a prior of one try at its conditional
            c = _clip(se / sn)
            like = self.like[REACH] = _posterior(w, _beta_binomial(m, c, so, sn) - _beta_binomial(ROBUST, c, so, sn))
            odds = [_mix(like, a, *((_clip(ed / nd), od, nd) if nd >= 1e-3 else (c, so, sn)))
                    for a, od, ed, nd in zip(odds, o, e, n)]
            whole = _mix(like, whole, c, so, sn)
        self.odds, self.whole[REACH] = odds + [whole] * (DEPTHS - k), whole

    def _row_odds(self, m: float, o: list[float], e: list[float], n: list[float]) -> tuple[list[float], float]:
        """The reach's odds ratio at every depth under a prior of strength m, each depth's prior
        moved by what the row's other depths show (a depth never tried, or long ago, takes the whole
        row's); and the whole row's."""
        so, se, sn = sum(o), sum(e), sum(n)
        odds = self._odds
        whole = odds(so, se, sn, m)
        return [whole if nd < 1e-3 else odds(od, ed, nd, m, odds(so - od, se - ed, sn - nd, m))
                for od, ed, nd in zip(o, e, n)], whole

    @staticmethod
    def _odds(o: float, e: float, n: float, m: float, base: float = 1.0) -> float:
        """The odds ratio θ of tries that succeeded o times of n where their prior expected e: the
        Beta–Binomial posterior mean of their rate (prior strength m), from the prior's mean moved
        by `base`, against the prior's mean."""
        if n <= 1e-3:
            return base
        c = min(1.0 - 1e-3, max(1e-3, e / n))
        p = min(1.0 - 1e-3, max(1e-3, (m * base * c / (1.0 - c + base * c) + o) / (m + n)))
        return p / (1.0 - p) * (1.0 - c) / c

    def _rescale(self) -> None:
        """Bring the evidence back to plain units before `unit` grows past what a float holds."""
        inv = 1.0 / self.unit
        for row in self.observed + self.expected + [self.tries]:
            row[:] = [x * inv for x in row]
        self.unit = 1.0

    def _count(self, row: int, d: int, expected: float) -> None:
        """A try at depth d + 1 of a row, which its prior expected to succeed this often."""
        if d >= self.used[row]:
            self.used[row] = d + 1
        self.expected[row][d] += expected * self.unit
        self.totals[row][0] += 1
        self.totals[row][1] += expected

    def _seen(self, row: int, d: int) -> None:
        """... and succeeded."""
        self.observed[row][d] += self.unit
        self.totals[row][2] += 1

    def to_dict(self) -> dict:
        """The request's estimate against the prior: per source, its price ratio now (whole, and by
        depth); for the reach, its odds ratio (whole, and by depth); the posterior weight of
        calibration's kind (`like`); and per row what the request showed over its whole life (tries,
        acceptances the prior expected, acceptances seen)."""
        out: dict = {"strength": self.strength, "reach_strength": self.reach_strength, "weight": self.weight,
                     "reach_weight": self.reach_weight, "half_life": self.half_life, "steps": self.steps}
        for r, name in enumerate(ROWS):
            tries, expected, accepted = self.totals[r]
            if not tries:
                continue
            deepest = max((d + 1 for d in range(DEPTHS) if self.expected[r][d] > 0), default=1)
            like, whole = self.like[r], round(self.whole[r], 3)
            if r == REACH:
                now = {"odds": whole, "by_depth": [round(x, 3) for x in self.odds[:deepest]]}
            else:
                now = {"ratio": whole, "by_depth": [round(x, 3) for x in self.ratios[r][:deepest]]}
            out[name] = now | {"like": round(like, 3), "tries": tries, "expected": round(expected, 2),
                               "accepted": accepted}
        return out


def _clip(p: float) -> float:
    return min(1.0 - 1e-3, max(1e-3, p))


def _beta_binomial(m: float, c: float, o: float, n: float) -> float:
    """log P(o successes of n tries | a Beta prior of mean c and strength m), up to the binomial
    coefficient (the same for every prior; counts may be fractional: faded evidence)."""
    a, b = m * c, m * (1.0 - c)
    return lgamma(a + o) + lgamma(b + n - o) - lgamma(a + b + n) - lgamma(a) - lgamma(b) + lgamma(a + b)


def _gamma_poisson(n0: float, o: float, e: float) -> float:
    """log P(o acceptances where calibration expected e | a Gamma prior of mean 1 and strength n0 on
    their ratio), up to the terms every prior shares (counts may be fractional: faded evidence)."""
    return lgamma(n0 + o) - lgamma(n0) + n0 * log(n0 / (n0 + e)) - o * log(n0 + e)


def _ratios(n0: float, o: list[float], e: list[float]) -> tuple[list[float], float]:
    """A row's price ratio at every depth under a prior of strength n0, each depth's prior moved by
    the row's other depths (their Gamma–Poisson ratio); and the whole row's."""
    so, se = n0 + sum(o), n0 + sum(e)
    return [(n0 * (so - od) / (se - ed) + od) / (n0 + ed) for od, ed in zip(o, e)], so / se


def _posterior(w: float, strong_over_weak: float) -> float:
    """The strong part's posterior weight from its prior weight w and the log-likelihood ratio."""
    return 1.0 / (1.0 + (1.0 - w) / w * exp(-max(-50.0, min(50.0, strong_over_weak))))


def _mix(like: float, strong: float, c: float, o: float, n: float) -> float:
    """The odds ratio, at a prior mean c, of the robust prior's posterior mean rate: `like` of the
    strong part's (odds ratio `strong`), the rest of the weak part's — o successes of n tries on one
    try's worth of prior at c."""
    p = like * strong * c / (1.0 - c + strong * c) + (1.0 - like) * (ROBUST * c + o) / (ROBUST + n)
    p = min(1.0 - 1e-3, max(1e-3, p))
    return p / (1.0 - p) * (1.0 - c) / c
