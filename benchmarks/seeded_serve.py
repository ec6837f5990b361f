"""Seeded sampling under `ygg serve` on the real pair: requests with a `seed` sent all at once
through the official OpenAI client (every method, T 0.7 and 1.0, top_p 1.0 and 0.9, beside greedy
requests), each text compared with what `ar` prints alone with the same seed and settings.

    .venv/bin/python benchmarks/seeded_serve.py ARTIFACT [-n 48] [-o FILE.json]

Starts the server on a free loopback port and stops it at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai

import ygg_runtime
from ygg_bench import harness
from ygg_bench.clients import scrape
from ygg_bench.servers import free_port, stop, wait_ready

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash map is in two sentences.",
           "def quicksort(arr):", "List three uses of copper."]


def main() -> None:
    ap = harness.parser(__doc__, artifact="", repeats=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=48)
    args = harness.parse(ap)
    port = free_port()
    ygg = str(Path(sys.executable).parent / "ygg")
    proc = subprocess.Popen([ygg, "serve", "--artifact", str(args.artifact), "--port", str(port), "--max-batch", "8"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, lambda: scrape(port), "ygg serve")
        health = httpx.get(url + "/health", timeout=5).json()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1800)
        model = client.models.list().data[0].id
        methods = ["egt", "chain", "specinfer", "sequoia", "pld"]
        jobs = [(PROMPTS[i % len(PROMPTS)], methods[i % len(methods)], t, top_p, seed)
                for i, (t, top_p, seed) in enumerate((t, p, s) for t in (0.7, 1.0) for p in (1.0, 0.9) for s in range(2))]

        def sample(job):
            prompt, method, t, top_p, seed = job
            r = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=t,
                                          top_p=top_p, seed=seed,
                                          extra_body={"ignore_eos": True, "return_token_ids": True, "method": method})
            return r.choices[0].model_extra["token_ids"]

        def greedy(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True, "method": "egt"})

        got = []

        def serve_all() -> None:  # the sampled requests and two greedy ones beside them, all at once
            with ThreadPoolExecutor(len(jobs) + 2) as pool:
                side = [pool.submit(greedy, p) for p in PROMPTS[:2]]
                got.extend(pool.map(sample, jobs))
                for f in side:
                    f.result()

        served_s = harness.time_ms(serve_all) / 1000
    finally:
        stop(proc)
    dec = ygg_runtime.load(args.artifact)
    rows = []
    for job, tokens in zip(jobs, got):
        prompt, method, t, top_p, seed = job
        alone = dec.generate(prompt, max_new_tokens=args.max_tokens, temperature=t, top_p=top_p, seed=seed, raw=True,
                             ignore_eos=True, method="ar", sampling="coupled").token_ids
        rows.append({"prompt": prompt, "method": method, "temperature": t, "top_p": top_p, "seed": seed,
                     "equal_to_ar_alone": tokens == alone})
        print(f"{method:9s} T={t} top_p={top_p} seed={seed}: {'=' if tokens == alone else 'DIFFERS'}", flush=True)
    out = {"artifact": str(args.artifact), "health": health, "requests": len(jobs),
           "greedy_beside": 2, "served_s": round(served_s, 1), "equal": sum(r["equal_to_ar_alone"] for r in rows),
           "rows": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    if args.out:
        harness.write_json(args.out, out)


if __name__ == "__main__":
    main()
