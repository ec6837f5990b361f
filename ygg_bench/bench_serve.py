"""`ygg bench-serve`: the server under load — aggregate tokens/s and per-request latency of each
method at several concurrency levels, through the real `ygg serve` on loopback.

One server process (started here, stopped here) serves every level; this process is the load: at
concurrency c, c clients each send the next prompt as soon as their previous answer ends (a closed
loop), streaming, so each request's time to first token and time per output token are measured
as a client sees them. At every level the methods run back to back, in an order that alternates
from level to level. Prompts go as token ids (the artifact's chat template applied here, as `ygg
bench` does), so every method decodes the same tokens; greedy outputs are compared with `ar`'s.
With `--chat`, the load is chat requests without max_tokens, as the openai client sends them by
default: each answer runs to its end of turn or the context, and the server's cache holds what the
requests have written (/metrics' ygg:kv_cache_token_steps around each level: tokens written per GiB
held, against what reserving each request's max_tokens up front held for the same requests).
/metrics is read around every (level, method): the tree nodes verified per sequence at each batch
size show how CAST shrinks the trees as the load grows.

Peers (`--peers llama.cpp-server`): llama-cpp-python's OpenAI server on the target's own GGUF, with
our threads, started on loopback beside ours (each idles while the other is loaded), driven by the
same clients with the same prompts (the same templated text; it tokenizes it itself) in the same
rotation. Its greedy text is compared with our `ar`'s and the agreement reported: not required, as
its batch shapes change its numerics.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ygg_bench import harness, plots
from ygg_bench.clients import Client, Scraper, level_summary, load_level, scrape
from ygg_bench.options import ServeBenchOptions
from ygg_bench.serve_report import summary_markdown
from ygg_bench.servers import PEER_ERRORS, LlamaServer, RayServer, start_server, stop
from ygg_compile.prompts import read_jsonl
from ygg_runtime.artifact.load import read_plan
from ygg_runtime.backend import native
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.files import output_dir, write_atomic
from ygg_runtime.text import TextCodec
from ygg_runtime.ui import Reporter


def default_output(artifact: Path) -> Path:
    return harness.output(None, "-serve", read_plan(artifact).device)


def run_bench_serve(opts: ServeBenchOptions, ui: Reporter | None = None) -> dict:
    ui = ui or Reporter()
    plan = read_plan(opts.artifact)
    unknown = [m for m in opts.methods if m not in plan.methods]
    if unknown:
        raise YggError(f"method '{unknown[0]}' is not in this artifact (it has: {', '.join(plan.methods)})")
    gguf = LlamaServer.check(plan) if opts.peers else None  # refused before anything is written or started
    if plan.device.startswith("cpu") and (Path(opts.artifact) / native.LIBRARY).is_file():
        native.load(Path(opts.artifact) / native.LIBRARY)  # the harness then measures the roofs on the artifact's kernels
    out = output_dir(opts.output or default_output(opts.artifact), "benchmark results")
    prompts = read_jsonl(opts.prompts, opts.categories, opts.limit)
    with ui.step("loading the tokenizer"):
        tok = plan.tokenizer
        codec = TextCodec(Path(opts.artifact) / tok.file, tok.chat_prefix, tok.chat_suffix)
    room = plan.max_context - 128 - (0 if opts.chat else opts.max_new_tokens)  # a chat answer: the rest
    encoded = [(p.key, ids, p.text) for p in prompts if len(ids := codec.encode(p.text)) <= room]
    budget = None if opts.chat else opts.max_new_tokens  # a chat load sends no max_tokens
    if not encoded:
        raise YggError("every prompt is longer than the artifact's context: compile with a larger --max-context")
    levels = sorted(set(opts.concurrency))
    peers: dict[str, LlamaServer] = {}
    threads = torch.get_num_threads()  # the direct server's (it runs with the default): the peers' and Rays' too
    if gguf is not None:
        peers[LlamaServer.name] = LlamaServer(gguf, threads, plan.max_context, codec, opts.chat)
    rays = [RayServer(opts, levels[-1], r, threads) for r in opts.ray]
    via = {f"{m}@{ray.name}": (ray, m) for ray in rays for m in opts.methods}  # a method through Ray Serve
    contestants = [*opts.methods, *via, *peers]
    proc = None
    results: list[dict] = []
    runs: list[dict] = []
    left_out: dict[str, str] = {}  # a peer that crashed or failed: one line, the others go on

    def leave_out(name: str, e: BaseException) -> None:
        left_out[name] = peers[name].failure(e)
        ui.note(f"{left_out[name]}; its runs are left out, every other contestant's are kept")
        peers.pop(name).stop()

    def lose_ray(ray: RayServer, e: BaseException) -> None:
        why = f"ygg serve --ray ({ray.name}) failed: {first_line(e)}"
        ui.note(f"{why}; its runs are left out, every other contestant's are kept")
        left_out.update({m: why for m, (r, _) in via.items() if r is ray})
        ray.stop()

    try:
        with ui.step(f"starting ygg serve (batch ≤ {levels[-1]})"):
            proc, port = start_server(opts, levels[-1])
        client = Client(port, "bench", opts.chat)
        for name, peer in list(peers.items()):
            with ui.step(f"starting {name} on {Path(peer.gguf).name}"):
                try:
                    peer.start()
                    peer.complete(encoded[0], name, 8)  # its warm-up: a build that crashes does so here
                except PEER_ERRORS as e:
                    leave_out(name, e)
        for ray in rays:
            with ui.step(f"starting ygg serve --ray with {ray.replicas} replica(s) of {ray.threads} thread(s)"):
                ray.start(opts.chat)
        with ui.step("warming up"):
            for m in opts.methods:
                client.complete(encoded[0], m, 8)
                for ray in rays:  # every replica: Ray's router spreads requests sent together
                    load_level(ray.client, [encoded[0]] * 2 * ray.replicas, m, 2 * ray.replicas, 8)
        total = len(levels) * len(contestants) * len(encoded)
        label = f"{len(encoded)} prompts × {len(contestants)} contestants at concurrency {','.join(map(str, levels))}"
        done = 0
        with ui.step(label):
            for i, c in enumerate(levels):
                order = contestants if i % 2 == 0 else contestants[::-1]
                for m in order:
                    if m in left_out:
                        done += len(encoded)
                        continue
                    idle = {ray: ray.cpu_seconds() for ray in rays if via.get(m, (None,))[0] is not ray}
                    if m in via:  # ours through Ray's proxy: no one account of the replicas' /metrics here
                        try:
                            rows, wall = load_level(via[m][0].client, encoded, via[m][1], c, budget)
                        except PEER_ERRORS as e:
                            lose_ray(via[m][0], e)
                            done += len(encoded)
                            continue
                        summary = {**level_summary(rows, wall, {}, {}, None), "metrics": None}
                    elif m in peers:  # no /metrics of ours to read
                        try:
                            rows, wall = load_level(peers[m], encoded, m, c, budget)
                        except PEER_ERRORS as e:
                            leave_out(m, e)
                            done += len(encoded)
                            continue
                        summary = {**level_summary(rows, wall, {}, {}, None), "metrics": None}
                    else:
                        before = scrape(port)
                        with Scraper(port) as scraper:
                            rows, wall = load_level(client, encoded, m, c, budget)
                        summary = level_summary(rows, wall, before, scrape(port), scraper.samples)
                    background = sum(ray.cpu_seconds() - before for ray, before in idle.items())
                    results.append({"method": m, "concurrency": c, "peer": m in peers,
                                    "via": via[m][0].name if m in via else None, **summary,
                                    "background_cores": background / wall if rays else None})
                    runs += [{"method": m, "concurrency": c, **r} for r in rows]
                    done += len(rows)
                    ui.progress(label, done, total, unit="requests")
    finally:
        stop(proc)
        for server in [*peers.values(), *rays]:
            server.stop()
    results = [r for r in results if r["method"] not in left_out]  # a level it finished before it died too
    runs = [r for r in runs if r["method"] not in left_out]
    reference = {(r["concurrency"], r["prompt"]): r["tokens"] for r in runs if r["method"] == "ar"}
    for res in results:
        mine = [r for r in runs if r["method"] == res["method"] and r["concurrency"] == res["concurrency"]]
        if res["peer"]:  # its text against ar's (not required to agree: its numerics are its own)
            same = [codec.decode(reference[k]) == r["text"] for r in mine
                    if (k := (r["concurrency"], r["prompt"])) in reference]
        else:
            same = [reference.get((r["concurrency"], r["prompt"])) == r["tokens"] for r in mine if reference]
        res["outputs_equal_ar"] = f"{sum(same)}/{len(same)}" if same else None
    single = {r["method"]: r["tokens_per_s"] for r in results if r["concurrency"] == levels[0]}
    for res in results:
        res["scaling_vs_lowest"] = res["tokens_per_s"] / single[res["method"]]
    ar = {r["concurrency"]: r["tokens_per_s"] for r in results if r["method"] == "ar"}
    for res in results:
        res["tokens_per_s_vs_ar"] = res["tokens_per_s"] / ar[res["concurrency"]] if res["concurrency"] in ar else None
    direct = {(r["method"], r["concurrency"]): r for r in results if not r["peer"] and not r["via"]}
    for res in results:  # through Ray against the same method served directly, at the same level
        if res["via"] and (d := direct.get((via[res["method"]][1], res["concurrency"]))):
            res["vs_direct"] = {k: res[k] / d[k] if res[k] and d[k] else None
                                for k in ("tokens_per_s", "ttft_ms_p50", "tpot_ms_p50")}
            res["direct_background_cores"] = d["background_cores"]  # the idle Rays beside the direct level
    by_peer = {(r["method"], r["concurrency"]): r for r in results if r["peer"]}
    for res in results:  # each of ours against each peer at the same level
        res["vs_peers"] = {p: {"tokens_per_s": res["tokens_per_s"] / other["tokens_per_s"],
                               "ttft_ms_p50": res["ttft_ms_p50"] / other["ttft_ms_p50"]}
                           for (p, c), other in by_peer.items() if c == res["concurrency"] and not res["peer"]}
    report = {**harness.header(plan.device, plan.dtype, cmd=opts.command),
              "config": {"command": opts.command, "artifact": str(opts.artifact), "concurrency": levels,
                         "methods": opts.methods, "peers": list(peers), "left_out": left_out,
                         "ray": [{"name": r.name, "replicas": r.replicas, "threads_each": r.threads} for r in rays],
                         "max_new_tokens": budget, "chat": opts.chat,
                         "kv_cache_gb": opts.kv_cache_gb, "prompts": len(encoded),
                         "cost_aware": opts.cost_aware, "adapt": opts.adapt},
              "summary": results,
              "runs": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in runs]}
    harness.write_json(out / "results.json", report)
    write_atomic(out / "summary.md", summary_markdown(report).encode())
    write_atomic(out / "serve.png", plots.serve_curves(results))
    write_atomic(out / "metrics.png", plots.metrics_timeline(results))
    return report
