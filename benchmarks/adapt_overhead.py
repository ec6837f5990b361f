"""What the request's acceptance estimate adds to a step's host time (issue 73: at most 50 µs).

    .venv/bin/python benchmarks/adapt_overhead.py [ARTIFACT] [--prompt FILE] [--tokens 128] [--repeats 100] [-o FILE.json]

Runs egt on a prompt with the artifact, recording every verified tree and its verdict, then replays
those steps through the estimate's own work alone, timed by the harness (interleaved rounds,
medians): `Estimate.observe` (the update after the verify), `Estimate.reach` + `objective.best_depth`
at each step's own context with `objective.StepCosts` (the choice before drafting, as egt makes it;
the curves remember nothing from the last round), and `Estimate.scale` for every node the step
priced. Beside them, `best_depth` summing each shape's forwards through the curves at every step
(what a plan with a depth predictor paid before `StepCosts`). Host work only: no forward runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import ygg_runtime
from ygg_bench import harness
from ygg_runtime.decoding import estimate, objective
from ygg_runtime.errors import YggError


def main() -> None:
    ap = harness.parser(__doc__, artifact="artifacts/default", repeats=100)
    ap.add_argument("--prompt", type=Path, default=Path("demo/code.txt"), help="the prompt file egt decodes")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens")
    args = harness.parse(ap)
    decoder = ygg_runtime.load(args.artifact)
    egt = decoder.methods.get("egt")
    if egt is None or egt.adapt is None or egt.adapt.policy is None:
        raise YggError(f"{args.artifact}'s egt keeps no acceptance estimate (compiled before it): compile it again")
    steps: list = []
    result = decoder.generate(args.prompt.read_text(), max_new_tokens=args.tokens, method="egt",
                              on_step=lambda tree, verdict: steps.append((tree, list(verdict.path))))
    proposer = decoder.proposer("egt")
    # calibration's reach as each step's prior (a plan with a depth predictor reads its own each step: the same work)
    curves, prior = proposer.planner.curves, egt.adapt.policy.reach
    contexts, at = [], result.prompt_tokens
    for n in result.accepted_lengths:  # each step's context
        contexts.append(at)
        at += n

    def observe() -> None:
        est = estimate.of(egt)
        for tree, path in steps:
            est.reach(prior)
            est.observe(tree, path)

    def choose(costs: bool) -> None:
        est = estimate.of(egt)
        table = objective.StepCosts(proposer.shapes, curves) if costs else None  # egt keeps one per batch size
        for context in contexts:
            objective.best_depth(est.reach(prior), proposer.factors, proposer.shapes, curves, context, costs=table)

    def scale() -> None:
        est = estimate.of(egt)
        for tree, _ in steps:
            for v in range(1, len(tree)):
                est.scale(tree.sources[v], tree.depths[v])

    work = {"observe": observe, "reach + best_depth": lambda: choose(True), "scale every node": scale,
            "best_depth, forwards summed": lambda: choose(False)}
    samples = harness.interleaved(work, args.repeats, setup=lambda name: curves._memo.clear())
    us = {name: round(ms * 1000 / len(steps), 1) for name, ms in harness.medians(samples).items()}
    out = {"steps": len(steps), "prompt_tokens": result.prompt_tokens, "tokens": len(result.token_ids),
           "verified_nodes_per_step": round(sum(len(t) for t, _ in steps) / len(steps), 2), "us_per_step": us,
           "adapting_us_per_step": round(us["observe"] + us["reach + best_depth"] + us["scale every node"], 1)}
    print(json.dumps(out))
    if args.out:
        harness.write_json(args.out, out)


if __name__ == "__main__":
    main()
