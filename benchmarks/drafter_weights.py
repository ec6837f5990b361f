"""The drafter's weights and head against its acceptance: for each (code width, head rows), the
drafter's compiled forward at 1 row and the tokens a greedy chain of k = 4 gets per target forward
on the 12-prompt drafter benchmark (Spec-Bench, 2 prompts per category, 128 new tokens: the text is
the target's own, whatever the drafter), next to the same artifact's target.

    .venv/bin/python benchmarks/drafter_weights.py ARTIFACT [--variants 4:all,4:32768,3:all,...]
        [--prompts benchmarks/data/spec_bench/question.jsonl] [-o FILE.json]

The target, its compiled forward and the drafter's source come from ARTIFACT (its drafter is
rebuilt from the GGUF file it names, at each width: `ygg_compile.quantize`, with the head rows of
`ygg_compile.draft_vocab` ranked on the artifact's calibration prompts). Run it alone.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

import ygg_runtime
from ygg_bench import harness
from ygg_compile import draft_vocab, prompts, quantize, sources
from ygg_compile.aot import compile_model
from ygg_compile.convert import convert_state
from ygg_runtime.decoding import engine, proposers
from ygg_runtime.backend import native
from ygg_runtime.model.compiled import CompiledForward
from ygg_runtime.model.transformer import from_state
from ygg_runtime.model.runner import ModelRunner

CATEGORIES = ("coding", "writing", "math_reasoning", "qa", "translation", "summarization")


def main() -> None:
    ap = harness.parser(__doc__, artifact="", repeats=5)
    ap.add_argument("--variants", default="4:all,4:65536,4:32768,4:16384,3:all,3:32768,2:all")
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/data/spec_bench/question.jsonl"))
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    args = harness.parse(ap)
    native.load()  # this checkout's kernels (the artifact's copy may predate a format the drafters use)
    dec = ygg_runtime.load(args.artifact)
    plan, target = dec.plan, dec.target
    draft_gguf = Path(plan.models["draft"].gguf)
    bench = prompts.read_jsonl(args.prompts, list(CATEGORIES), 2)
    ids = [dec.encode(p.text) for p in bench]
    # the rows' ranking: the artifact's calibration prompts and the target's greedy continuations
    calib = [dec.encode(t) for t in prompts.calibration(None)]
    ar = proposers.build("ar", {}, None)
    texts = [c + engine.generate(target, ar, c, max_new_tokens=48)[0] for c in calib]
    special = sorted(set(dec.eos_ids))
    src = sources.materialize(sources.identify(sources.locate(plan.models["draft"].spec)), torch.bfloat16)
    hf = sources.load_model(src, torch.bfloat16)
    float_args, float_state = convert_state(hf, torch.bfloat16)
    del hf
    built = []  # (bits, rows, bytes read per forward, runner)
    tmp = tempfile.TemporaryDirectory()
    for spec in args.variants.split(","):
        bits, vocab = spec.split(":")
        a, state, info = quantize.quantize_state(dict(float_state), float_args, f"int{bits}", draft_gguf)
        if vocab != "all":
            order = draft_vocab.ranking(texts, special, a.vocab_size)
            a, state = draft_vocab.cut_head(a, state, torch.tensor(sorted(order[: int(vocab)])))
        model = from_state(a, state)
        runner = ModelRunner(model, plan.cache_slots)
        path = Path(tmp.name) / f"{bits}-{vocab}.pt2"
        compile_model(model, path)
        runner.compiled = CompiledForward(path, model)
        read = sum(v.numel() * v.element_size() for k, v in state.items() if not k.startswith("tok_embeddings."))
        built.append((int(bits), int(vocab) if vocab != "all" else a.vocab_size, read, runner))
    # T(1) at context 100 of every drafter and of the target, interleaved (the machine's speed drifts)
    runners = {i: r for i, (_, _, _, r) in enumerate(built)} | {"target": target}
    t1 = harness.medians(harness.interleaved({i: lambda r=r: r.forward_chain([100]) for i, r in runners.items()},
                                             args.repeats, warmup=2, setup=lambda i: runners[i].reset(100)), 2)
    target_t1 = t1["target"]
    rows = []
    for i, (bits, head, read, runner) in enumerate(built):
        chain = proposers.build("chain", {"k": 4}, proposers.Drafter(runner, target.vocab_size))
        tokens = forwards = 0
        for p in ids:
            out, m = engine.generate(target, chain, p, max_new_tokens=args.max_new_tokens, eos_ids=frozenset(dec.eos_ids))
            tokens, forwards = tokens + len(out), forwards + m.steps
        row = {"bits": bits, "head_rows": head, "bytes_per_forward": read, "draft_t1_ms": t1[i],
               "target_t1_ms": target_t1, "draft_over_target": round(t1[i] / target_t1, 3),
               "tokens_per_target_forward": round(tokens / forwards, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        harness.write_json(args.out, {"artifact": str(args.artifact), "prompts": str(args.prompts), "rows": rows})


if __name__ == "__main__":
    main()
