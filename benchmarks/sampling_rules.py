"""Coupled against rejection sampling on the real pair: tokens per target forward for every method
at each temperature (what chose `ygg_runtime.options.SAMPLING`), and whether each method's coupled
text is `ar`'s for the same seed.

    .venv/bin/python benchmarks/sampling_rules.py ARTIFACT [--prompts benchmarks/data/spec_bench/question.jsonl]
        [--per-category 2] [-n 64] [--methods a,b] [--no-equality] [-o FILE.json]

Acceptance: Spec-Bench, `--per-category` prompts in each of six categories, `-n` new tokens, every
method under both rules interleaved prompt by prompt, seed = the prompt's index, T = 0.7 and 1.0
(top_p 1). Tokens per forward counts the output's tokens over the target verifies (bonus included),
summed over the prompts: it does not depend on the machine's speed, so it is the same run alone or
not (the ms/token beside it does, and is only indicative unless the script ran alone).

Equality: for T in {0.7, 1.0}, top_p in {1.0, 0.9} and seeds 0-4, every method's coupled text on
the first prompt of each of two categories against `ar`'s with the same seed and settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import ygg_runtime
from ygg_bench import harness
from ygg_compile import prompts

CATEGORIES = ("coding", "writing", "math_reasoning", "qa", "translation", "summarization")
RULES = ("coupled", "rejection")


def main() -> None:
    ap = harness.parser(__doc__, artifact="", repeats=None)
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/data/spec_bench/question.jsonl"))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--methods", help="these methods only (default: every one but ar)")
    ap.add_argument("--no-equality", action="store_true", help="the acceptance part only")
    args = harness.parse(ap)
    dec = ygg_runtime.load(args.artifact)
    methods = args.methods.split(",") if args.methods else [m for m in dec.methods if m != "ar"]
    bench = prompts.read_jsonl(args.prompts, list(CATEGORIES), args.per_category)
    ids = [dec.encode(p.text) for p in bench]
    n = args.max_new_tokens

    acceptance = []  # per (temperature, method, rule): tokens, target forwards, seconds
    for t in map(float, args.temperatures.split(",")):
        sums = {(m, r): [0, 0, 0.0] for m in methods for r in RULES}
        for i, prompt in enumerate(ids):
            for m in methods if i % 2 == 0 else methods[::-1]:
                for r in RULES if i % 2 == 0 else RULES[::-1]:
                    res = dec.generate(prompt, max_new_tokens=n, temperature=t, seed=i, sampling=r, method=m)
                    s = sums[(m, r)]
                    s[0] += len(res.token_ids)
                    s[1] += res.steps
                    s[2] += res.metrics.decode_s
            print(f"T={t}: prompt {i + 1}/{len(ids)}", flush=True)
        for (m, r), (tokens, steps, seconds) in sums.items():
            acceptance.append({"temperature": t, "method": m, "rule": r, "tokens": tokens, "forwards": steps,
                               "tokens_per_forward": tokens / steps, "ms_per_token": 1000 * seconds / tokens})

    equality = []  # per (temperature, top_p, method): seeds whose text equals ar's
    first = [next(i for i, p in enumerate(bench) if p.category == c) for c in ("coding", "writing")]
    for t in () if args.no_equality else (0.7, 1.0):
        for top_p in (1.0, 0.9):
            same = dict.fromkeys(methods, 0)
            for i in first:
                for seed in range(5):
                    kw = dict(max_new_tokens=n, temperature=t, top_p=top_p, seed=seed, sampling="coupled")
                    ref = dec.generate(ids[i], method="ar", **kw).token_ids
                    for m in methods:
                        same[m] += dec.generate(ids[i], method=m, **kw).token_ids == ref
            for m in methods:
                equality.append({"temperature": t, "top_p": top_p, "method": m, "equal": same[m], "runs": 5 * len(first)})
                print(f"equality T={t} top_p={top_p} {m}: {same[m]}/{5 * len(first)}", flush=True)

    out = {"artifact": str(args.artifact), "prompts": [p.key for p in bench], "max_new_tokens": n,
           "acceptance": acceptance, "equality": equality}
    print(json.dumps(out, indent=1))
    if args.out:
        harness.write_json(args.out, out)


if __name__ == "__main__":
    main()
