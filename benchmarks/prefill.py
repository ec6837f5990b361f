"""Prompt processing: our target's prefill against llama.cpp's on the same GGUF, same threads, and
both against the machine's roofline.

    .venv/bin/python benchmarks/prefill.py [ARTIFACT] [--lengths 1000,4000] [--repeats 3] [--out FILE.json]

For each prompt length: the same prompt tokens (`ygg bench --long`'s text: the standard library's
source under an instruction to summarise it, cut to the length; raw, no chat template) are
prefilled by our runner (`ModelRunner.prefill`: what a generation runs before its first token) and
by llama.cpp (`Llama.eval` after a reset, with the binding's n_batch of 512), alternating, the order
flipped every repeat; medians of ms per prompt token and their paired ratio. A prompt row's
multiply-adds are the linear layers' without the output head (prefill computes no logits) and its
attention's over the keys before it (2 x heads x head dim a key and layer; the prompt's rows see
n / 2 keys on average); `of_int8_peak` is what share of the measured int8 peak that work runs at,
`of_compute_floor` the time over the linear layers' floor alone. The memory floor is the weight
bytes over the measured read bandwidth. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import ygg_runtime
from ygg_runtime.integrity import cpu_info
from ygg_compile.prompts import long_prompts
from ygg_compile.roofline import floor_ms, measure_roofs, model_costs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?", default="artifacts/default")
    ap.add_argument("--lengths", default="1000,4000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dec = ygg_runtime.load(args.artifact)
    runner = dec.target
    runner.prefix = None  # every token computed, as llama.cpp does
    lengths = [int(n) for n in args.lengths.split(",")]
    encode = lambda t: dec.encode(t, raw=True)
    ids = encode(long_prompts([max(lengths)], encode, dec.codec.decode)[0].text)
    llm = None
    if not args.no_llama:
        from llama_cpp import Llama

        llm = Llama(model_path=str(dec.plan.models["target"].gguf), n_ctx=max(lengths) + 64, n_threads=torch.get_num_threads(),
                    n_threads_batch=torch.get_num_threads(), n_batch=512, verbose=False)

    def ours(tokens: list[int]) -> float:
        runner.reset()
        start = time.perf_counter()
        runner.prefill(tokens)
        return time.perf_counter() - start

    def theirs(tokens: list[int]) -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - start

    roofs = measure_roofs(512 << 20, repeats=3)
    costs = model_costs(runner.model)
    head = runner.model.output
    prompt_macs = costs.macs_per_row - head.in_features * head.out_features
    a = runner.model.args
    key_macs = 2 * a.n_heads * a.head_dim * a.n_layers  # a row's attention, per key it sees
    rows = []
    for n in lengths:
        tokens = ids[:n]
        times = {"ours": [], "llama.cpp": []}
        ratios = []
        contestants = {"ours": ours} | ({"llama.cpp": theirs} if llm is not None else {})
        for r in range(args.repeats + 1):
            order = list(contestants) if r % 2 else list(contestants)[::-1]
            got = {name: contestants[name](tokens) for name in order}
            if r:  # the first round warms up
                for name, s in got.items():
                    times[name].append(1000 * s / n)
                if llm is not None:
                    ratios.append(got["ours"] / got["llama.cpp"])
        floor = floor_ms(costs, roofs, n, 0)
        compute = 1000.0 * prompt_macs / roofs.int8_peak  # per token
        row = {"tokens": n, "ours_ms_per_token": round(statistics.median(times["ours"]), 3),
               "compute_floor_ms_per_token": round(compute, 3),
               "memory_floor_ms_per_token": round(floor["memory_ms"] / n, 3)}
        row["of_compute_floor"] = round(row["ours_ms_per_token"] / row["compute_floor_ms_per_token"], 2)
        work = prompt_macs + key_macs * n / 2  # a row's multiply-adds, its attention at the mean context
        row["of_int8_peak"] = round(work / (row["ours_ms_per_token"] / 1000.0) / roofs.int8_peak, 3)
        if llm is not None:
            row["llama_cpp_ms_per_token"] = round(statistics.median(times["llama.cpp"]), 3)
            row["ours_over_llama_cpp"] = round(statistics.median(ratios), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"machine": cpu_info().model, "threads": torch.get_num_threads(), "roofs": roofs.as_dict(),
           "macs_per_prompt_row": prompt_macs, "attention_macs_per_key": key_macs, "rows": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
