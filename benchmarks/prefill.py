"""Prompt processing: our target's prefill against llama.cpp's on the same GGUF, same threads, and
both against the machine's roofline.

    .venv/bin/python benchmarks/prefill.py [ARTIFACT] [--lengths 1000,4000] [--repeats 3] [-o FILE.json]

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

import json

import torch

import ygg_runtime
from ygg_bench import harness
from ygg_compile.prompts import long_prompts
from ygg_compile.roofline import floor_ms, model_costs


def main() -> None:
    ap = harness.parser(__doc__, artifact="artifacts/default", repeats=3)
    ap.add_argument("--lengths", type=harness.ints, default=[1000, 4000], help="prompt lengths in tokens")
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    args = harness.parse(ap)
    dec = ygg_runtime.load(args.artifact)
    runner = dec.target
    runner.prefix = None  # every token computed, as llama.cpp does
    lengths = args.lengths
    def encode(t):
        return dec.encode(t, raw=True)

    ids = encode(long_prompts([max(lengths)], encode, dec.codec.decode)[0].text)
    llm = None
    if not args.no_llama:
        from llama_cpp import Llama

        llm = Llama(model_path=str(dec.plan.models["target"].gguf), n_ctx=max(lengths) + 64, n_threads=torch.get_num_threads(),
                    n_threads_batch=torch.get_num_threads(), n_batch=512, verbose=False)

    roofs = harness.roofs()
    costs = model_costs(runner.model)
    head = runner.model.output
    prompt_macs = costs.macs_per_row - head.in_features * head.out_features
    a = runner.model.args
    key_macs = 2 * a.n_heads * a.head_dim * a.n_layers  # a row's attention, per key it sees
    rows = []
    for n in lengths:
        tokens = ids[:n]
        contestants = {"ours": lambda: runner.prefill(tokens)} | ({"llama.cpp": lambda: llm.eval(tokens)} if llm else {})
        reset = {"ours": runner.reset, "llama.cpp": llm.reset if llm else None}
        samples = harness.interleaved(contestants, args.repeats, setup=lambda name: reset[name]())
        per_token = {name: [ms / n for ms in s] for name, s in samples.items()}
        floor = floor_ms(costs, roofs, n, 0)
        compute = 1000.0 * prompt_macs / roofs.int8_peak  # per token
        row = {"tokens": n, "ours_ms_per_token": harness.medians(per_token)["ours"],
               "compute_floor_ms_per_token": round(compute, 3),
               "memory_floor_ms_per_token": round(floor["memory_ms"] / n, 3)}
        row["of_compute_floor"] = round(row["ours_ms_per_token"] / row["compute_floor_ms_per_token"], 2)
        work = prompt_macs + key_macs * n / 2  # a row's multiply-adds, its attention at the mean context
        row["of_int8_peak"] = round(work / (row["ours_ms_per_token"] / 1000.0) / roofs.int8_peak, 3)
        if llm is not None:
            row["llama_cpp_ms_per_token"] = harness.medians(per_token)["llama.cpp"]
            row["ours_over_llama_cpp"] = round(harness.ratio_median(samples["ours"], samples["llama.cpp"]), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"macs_per_prompt_row": prompt_macs, "attention_macs_per_key": key_macs, "rows": rows}
    print(json.dumps(out | {"roofs": roofs.as_dict()}))
    if args.out:
        harness.write_json(args.out, out, measured=roofs)


if __name__ == "__main__":
    main()
