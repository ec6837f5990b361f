"""What the request's acceptance estimate adds to a step's host time (issue 73: at most 50 µs).

Runs egt on a prompt with an artifact, recording every verified tree and its verdict, then replays
those steps through the estimate's own work alone, many times: `Estimate.observe` (the update after
the verify), `Estimate.reach` + `objective.best_depth` at each step's context (the choice before
drafting, as egt makes it; nothing remembered between replays),
and `estimate.scale` for every node the step priced (the drafted and retrieved nodes' path values).
Prints the median microseconds a step of each and their sum, beside `best_depth` summing each
shape's forwards at every step (what a plan with a depth predictor paid before `StepCosts`). The forwards are not part of it: this is host work.

    python benchmarks/adapt_overhead.py artifacts/default [--prompt FILE] [--tokens 128] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import ygg_runtime
from ygg_runtime.decoding import objective
from ygg_runtime.decoding.estimate import Estimate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompt", type=Path, default=Path("demo/code.txt"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()

    decoder = ygg_runtime.load(args.artifact)
    egt = decoder.methods["egt"]
    if egt.adapt is None or egt.adapt.policy is None and egt.depth_policy is None:
        raise SystemExit("this artifact's egt has no acceptance estimate: compile it again")
    steps: list = []
    result = decoder.generate(args.prompt.read_text(), max_new_tokens=args.tokens, method="egt",
                              on_step=lambda tree, verdict: steps.append((tree, list(verdict.path))))
    proposer = decoder.proposer("egt")
    policy, curves = proposer.policy, proposer.planner.curves
    prior = policy.reach
    contexts, at = [], result.prompt_tokens
    for n in result.accepted_lengths:  # each step's context
        contexts.append(at)
        at += n

    def observe() -> float:
        est = Estimate(egt.adapt.strength, egt.adapt.half_life, egt.adapt.reach_strength)
        t = time.perf_counter()
        for tree, path in steps:
            est.reach(prior)
            est.observe(tree, path)
        return (time.perf_counter() - t) / len(steps)

    def choose(adapting: bool) -> float:
        """The depth choice at each step's own context, nothing remembered from the last replay."""
        est = Estimate(egt.adapt.strength, egt.adapt.half_life, egt.adapt.reach_strength)
        curves._memo.clear()
        t = time.perf_counter()
        costs = objective.StepCosts(proposer.shapes, curves) if adapting else None  # egt keeps one per batch size
        for context in contexts:
            reach = est.reach(prior) if adapting else prior
            objective.best_depth(reach, proposer.factors, proposer.shapes, curves, context, costs=costs)
        return (time.perf_counter() - t) / len(steps)

    def scale() -> float:
        est = Estimate(egt.adapt.strength, egt.adapt.half_life, egt.adapt.reach_strength)
        t = time.perf_counter()
        for tree, _ in steps:
            for v in range(1, len(tree)):
                est.scale(tree.sources[v], tree.depths[v])
        return (time.perf_counter() - t) / len(steps)

    timed = {name: statistics.median(f() for _ in range(args.repeats)) * 1e6
             for name, f in (("observe (after the verify)", observe), ("reach + best_depth", lambda: choose(True)),
                             ("scale every node", scale), ("best_depth, forwards summed", lambda: choose(False)))}
    nodes = statistics.mean(len(t) for t, _ in steps)
    print(f"{len(steps)} egt steps of {result.prompt_tokens} + {len(result.token_ids)} tokens, {nodes:.1f} verified "
          f"nodes a step; median µs a step over {args.repeats} replays:")
    for name, us in timed.items():
        print(f"  {name:28s} {us:7.1f}")
    total = timed["observe (after the verify)"] + timed["reach + best_depth"] + timed["scale every node"]
    print(f"  {'a step adapting, in all':28s} {total:7.1f}")


if __name__ == "__main__":
    main()
