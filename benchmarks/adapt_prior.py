"""What the acceptance estimate's robust prior buys (issue 73): per prompt, the plan's estimate against
the same estimate with its robust weights set to 1 (calibration's kind for certain: the estimate
before the robust prior), `--no-adapt` and plain decoding.

    .venv/bin/python benchmarks/adapt_prior.py [ARTIFACT] [--prompts FILE.jsonl] [--tokens 96] [--repeats 2] [-o FILE.json]

Each prompt's four contestants run in the harness's interleaved rounds (the order rotated from round
to round), each a whole request through the Python API with the plan's request-level choice (the
default: no method named); the figure is the median of the rounds' ms a request, and each text is
checked against plain decoding's. Prompts: `ygg bench`'s JSONL (the first turn of each line).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from pathlib import Path

import ygg_runtime
from ygg_bench import harness
from ygg_runtime.errors import YggError

CONTESTANTS = ("ar", "no-adapt", "weights 1", "plan")


def without_robust_prior(decoder):
    """The decoder with every adapting method's robust weights set to 1, sharing its models."""
    twin = copy.copy(decoder)
    twin.methods = {name: dataclasses.replace(p, adapt=dataclasses.replace(p.adapt, weight=1.0, reach_weight=1.0))
                    if getattr(p, "adapt", None) is not None else p for name, p in decoder.methods.items()}
    return twin


def main() -> None:
    ap = harness.parser(__doc__, artifact="artifacts/default", repeats=2)
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/data/unseen_prompts.jsonl"), help="JSONL prompts")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens a request")
    args = harness.parse(ap)
    decoder = ygg_runtime.load(args.artifact)
    if not any(getattr(p, "adapt", None) is not None for p in decoder.methods.values()):
        raise YggError(f"{args.artifact} keeps no acceptance estimate (compiled before it): compile it again")
    twin = without_robust_prior(decoder)
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    rows = []
    for p in prompts:
        text, name = p["turns"][0], p.get("category", str(p.get("question_id")))
        runs = {"ar": lambda: decoder.generate(text, max_new_tokens=args.tokens, method="ar"),
                "no-adapt": lambda: decoder.generate(text, max_new_tokens=args.tokens, adapt=False),
                "weights 1": lambda: twin.generate(text, max_new_tokens=args.tokens),
                "plan": lambda: decoder.generate(text, max_new_tokens=args.tokens)}
        want, same = decoder.generate(text, max_new_tokens=args.tokens, method="ar").text, []

        def checked(who: str):
            def call():
                same.append(runs[who]().text == want)  # every run of every contestant, plain decoding's text
            return call

        ms = harness.medians(harness.interleaved({c: checked(c) for c in CONTESTANTS}, args.repeats, warmup=0), 1)
        rows.append({"prompt": name, "ms": ms, "x_ar": {c: round(ms["ar"] / ms[c], 3) for c in CONTESTANTS},
                     "equal_to_ar": all(same)})
        print(f"{name:16s} " + "  ".join(f"{c} {ms[c]:7.0f} ms {ms['ar'] / ms[c]:4.2f}x" for c in CONTESTANTS)
              + ("" if rows[-1]["equal_to_ar"] else "  TEXT DIFFERS"), flush=True)
    summary = {c: {"median_x_ar": round(statistics.median(r["x_ar"][c] for r in rows), 3),
                   "min_x_ar": round(min(r["x_ar"][c] for r in rows), 3)} for c in CONTESTANTS}
    paired = [r["ms"]["weights 1"] / r["ms"]["plan"] for r in rows]
    summary["plan over weights 1, paired median"] = round(statistics.median(paired), 3)
    print(json.dumps(summary))
    if args.out:
        harness.write_json(args.out, {"artifact": str(args.artifact), "tokens": args.tokens, "rows": rows,
                                      "summary": summary})


if __name__ == "__main__":
    main()
