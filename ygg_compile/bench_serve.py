"""`ygg bench-serve`: the server under load — aggregate tokens/s and per-request latency of each
method at several concurrency levels, through the real `ygg serve` on loopback.

One server process (started here, stopped here) serves every level; this process is the load: at
concurrency c, c clients each send the next prompt as soon as their previous answer ends (a closed
loop), streaming, so each request's time to first token and time per output token are measured
as a client sees them. At every level the methods run back to back, in an order that alternates
from level to level. Prompts go as token ids (the artifact's chat template applied here, as `ygg
bench` does), so every method decodes the same tokens; greedy outputs are compared with `ar`'s.
/metrics is read around every (level, method): the tree nodes verified per sequence at each batch
size show how CAST shrinks the trees as the load grows.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ygg_compile import hardware, plots
from ygg_compile.bench import machine_info
from ygg_compile.options import ServeBenchOptions
from ygg_compile.prompts import read_jsonl
from ygg_runtime.ui import Reporter
from ygg_runtime.artifact import read_plan
from ygg_runtime.errors import YggError
from ygg_runtime.files import output_dir, write_atomic
from ygg_runtime.metrics import tpot_ms
from ygg_runtime.text import TextCodec

READY_S = 600  # loading an artifact (its compiled forwards included) takes at most this long
REQUEST_S = 900  # one request at most


def default_output(artifact: Path) -> Path:
    return Path("benchmarks/results") / (hardware.device_slug(read_plan(artifact).device) + "-serve")


class Client:
    """One loopback HTTP client of the server: a streamed completion, timed."""

    def __init__(self, port: int, model: str):
        self.port, self.model = port, model

    def complete(self, ids: list[int], method: str, max_tokens: int) -> dict:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "method": method, "return_token_ids": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_S)
        start = time.perf_counter()
        first, tokens, reason = None, [], None
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise YggError(f"the server answered {resp.status}: {resp.read()[:200].decode(errors='replace')}")
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise YggError(f"the server failed a request: {event['error']['message']}")
                choice = event["choices"][0]
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    tokens += choice["token_ids"]
                reason = choice.get("finish_reason") or reason
        finally:
            conn.close()
        end = time.perf_counter()
        n = len(tokens)
        return {"tokens": tokens, "generated": n, "finish_reason": reason, "latency_s": end - start,
                "ttft_s": (first or end) - start, "tpot_ms": tpot_ms(start, first, end, n) if first and n > 1 else None,
                "start": start, "end": end}


def scrape(port: int) -> dict[str, float]:
    """Every sample of the server's /metrics by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


# The /metrics samples a load run's timeline keeps, every SCRAPE_S seconds while it runs.
TIMELINE = {"generation_tokens": "vllm:generation_tokens_total", "drafts": "vllm:spec_decode_num_drafts_total",
            "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
            "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
SCRAPE_S = 2.0


class Scraper:
    """Reads the server's /metrics every SCRAPE_S seconds while a load level runs, as a monitoring
    system would: the timeline shows the counters moving under load."""

    def __init__(self, port: int):
        self.port, self.samples, self.start = port, [], time.perf_counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Scraper":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopped.wait(SCRAPE_S):
            try:
                now = scrape(self.port)
            except OSError:  # a scrape that fails is a gap in the timeline, not a failed benchmark
                continue
            self.samples.append({"t_s": round(time.perf_counter() - self.start, 2),
                                 **{k: now.get(name, 0.0) for k, name in TIMELINE.items()}})


def load_level(client: Client, prompts: list[tuple[str, list[int]]], method: str, concurrency: int,
               max_tokens: int) -> tuple[list[dict], float]:
    """Every prompt once, `concurrency` clients in a closed loop; (rows, wall seconds)."""
    work: queue.Queue = queue.Queue()
    for item in prompts:
        work.put(item)
    rows: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while not errors:
            try:
                key, ids = work.get_nowait()
            except queue.Empty:
                return
            try:
                row = client.complete(ids, method, max_tokens)
            except BaseException as e:
                errors.append(e)
                return
            with lock:
                rows.append({"prompt": key, **row})

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return rows, time.perf_counter() - start


def start_server(opts: ServeBenchOptions, max_batch: int) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ygg_compile", "serve", "--artifact", str(opts.artifact), "--port", str(port),
           "--max-batch", str(max_batch), "--max-queue", str(max(64, 4 * max_batch)), "--model-name", "bench"]
    if not opts.cost_aware:
        cmd.append("--no-cost-aware")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise YggError(f"ygg serve did not start: {proc.stderr.read().strip().splitlines()[-1:]}")
        try:
            scrape(port)
            return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise YggError("ygg serve did not become ready")


def percentile(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def level_summary(rows: list[dict], wall: float, before: dict, after: dict, timeline: list[dict] | None = None) -> dict:
    """A level's figures from its requests as the clients saw them and from the server's /metrics
    read before and after it; `metrics_agree` checks the two accounts against each other (tokens
    generated, requests finished, accepted tokens per position summing to accepted tokens)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tokens = sum(r["generated"] for r in rows)
    per_pos = sum(v - before.get(k, 0.0) for k, v in after.items()
                  if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    finished = sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith("vllm:request_success_total"))
    accepted_total = delta("vllm:spec_decode_num_accepted_tokens_total")
    agree = (delta("vllm:generation_tokens_total") == tokens and finished == len(rows) and per_pos == accepted_total
             and all(b["generation_tokens"] <= a["generation_tokens"] for a, b in zip(timeline[1:], timeline))
             if timeline is not None else None)
    by_size = {}
    for key in after:
        if key.startswith("ygg:batch_steps_total{sequences="):
            b = int(key.split("=")[1].rstrip("}"))
            steps = delta(key)
            if steps:
                by_size[b] = {"steps": int(steps),
                              "nodes_per_sequence": delta(f"ygg:batch_verified_nodes_total{{sequences={b}}}") / (steps * b)}
    steps = sum(v["steps"] for v in by_size.values())
    drafted, accepted = delta("vllm:spec_decode_num_draft_tokens_total"), delta("vllm:spec_decode_num_accepted_tokens_total")
    return {
        "requests": len(rows), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "tpot_ms_p50": percentile([r["tpot_ms"] for r in rows], 0.5),
        "tpot_ms_p95": percentile([r["tpot_ms"] for r in rows], 0.95),
        "ttft_ms_p50": 1000 * percentile([r["ttft_s"] for r in rows], 0.5),
        "latency_s_p50": percentile([r["latency_s"] for r in rows], 0.5),
        "mean_sequences_per_step": (sum(b * v["steps"] for b, v in by_size.items()) / steps) if steps else None,
        "nodes_per_sequence": (sum(v["nodes_per_sequence"] * v["steps"] * b for b, v in by_size.items())
                               / sum(v["steps"] * b for b, v in by_size.items())) if steps else None,
        "by_batch_size": {str(b): v for b, v in sorted(by_size.items())},
        "acceptance_rate": accepted / drafted if drafted else None,
        "metrics": {"generation_tokens": delta("vllm:generation_tokens_total"), "requests_finished": finished,
                    "drafts": delta("vllm:spec_decode_num_drafts_total"), "draft_tokens": drafted,
                    "accepted_tokens": accepted, "accepted_per_position_sum": per_pos,
                    "scrapes_during_run": len(timeline or [])},
        "metrics_agree": agree,
        "timeline": timeline or [],
    }


def run_bench_serve(opts: ServeBenchOptions, ui: Reporter | None = None) -> dict:
    ui = ui or Reporter()
    plan = read_plan(opts.artifact)
    unknown = [m for m in opts.methods if m not in plan.methods]
    if unknown:
        raise YggError(f"method '{unknown[0]}' is not in this artifact (it has: {', '.join(plan.methods)})")
    out = output_dir(opts.output or default_output(opts.artifact), "benchmark results")
    prompts = read_jsonl(opts.prompts, opts.categories, opts.limit)
    with ui.step("loading the tokenizer"):
        tok = plan.tokenizer
        codec = TextCodec(Path(opts.artifact) / tok.file, tok.chat_prefix, tok.chat_suffix)
    room = plan.max_context - opts.max_new_tokens - 128
    encoded = [(p.key, ids) for p in prompts if len(ids := codec.encode(p.text)) <= room]
    if not encoded:
        raise YggError("every prompt is longer than the artifact's context: compile with a larger --max-context")
    levels = sorted(set(opts.concurrency))
    with ui.step(f"starting ygg serve (batch ≤ {levels[-1]})"):
        proc, port = start_server(opts, levels[-1])
    client = Client(port, "bench")
    results: list[dict] = []
    runs: list[dict] = []
    try:
        with ui.step("warming up"):
            for m in opts.methods:
                client.complete(encoded[0][1], m, 8)
        total = len(levels) * len(opts.methods) * len(encoded)
        label = f"{len(encoded)} prompts × {len(opts.methods)} methods at concurrency {','.join(map(str, levels))}"
        done = 0
        with ui.step(label):
            for i, c in enumerate(levels):
                order = opts.methods if i % 2 == 0 else opts.methods[::-1]
                for m in order:
                    before = scrape(port)
                    with Scraper(port) as scraper:
                        rows, wall = load_level(client, encoded, m, c, opts.max_new_tokens)
                    after = scrape(port)
                    results.append({"method": m, "concurrency": c,
                                    **level_summary(rows, wall, before, after, scraper.samples)})
                    runs += [{"method": m, "concurrency": c, **r} for r in rows]
                    done += len(rows)
                    ui.progress(label, done, total, unit="requests")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    reference = {(r["concurrency"], r["prompt"]): r["tokens"] for r in runs if r["method"] == "ar"}
    for res in results:
        mine = [r for r in runs if r["method"] == res["method"] and r["concurrency"] == res["concurrency"]]
        same = [reference.get((r["concurrency"], r["prompt"])) == r["tokens"] for r in mine if reference]
        res["outputs_equal_ar"] = f"{sum(same)}/{len(same)}" if same else None
    single = {r["method"]: r["tokens_per_s"] for r in results if r["concurrency"] == levels[0]}
    for res in results:
        res["scaling_vs_lowest"] = res["tokens_per_s"] / single[res["method"]]
    ar = {r["concurrency"]: r["tokens_per_s"] for r in results if r["method"] == "ar"}
    for res in results:
        res["tokens_per_s_vs_ar"] = res["tokens_per_s"] / ar[res["concurrency"]] if res["concurrency"] in ar else None
    report = {"config": {"command": opts.command, "artifact": str(opts.artifact), "concurrency": levels,
                         "methods": opts.methods, "max_new_tokens": opts.max_new_tokens, "prompts": len(encoded),
                         "cost_aware": opts.cost_aware, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "machine": machine_info(plan), "summary": results,
              "runs": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in runs]}
    write_atomic(out / "results.json", json.dumps(report, indent=1).encode())
    write_atomic(out / "summary.md", summary_markdown(report).encode())
    write_atomic(out / "serve.png", plots.serve_curves(results))
    write_atomic(out / "metrics.png", plots.metrics_timeline(results))
    return report


def summary_markdown(report: dict) -> str:
    cfg, mach = report["config"], report["machine"]
    lines = ["# Yggdrasil serving benchmark", "",
             f"- **Command**: `{cfg['command']}`",
             f"- **Machine**: {mach['cpu']}, {mach['threads']} torch threads; {mach['dtype']} on {mach['device']}",
             f"- **Load**: {cfg['prompts']} prompts per (method, concurrency), {cfg['max_new_tokens']} new tokens at "
             f"most, greedy, closed loop; CAST allocation {'on' if cfg['cost_aware'] else 'off'}",
             "",
             "| method | concurrency | tokens/s | × own c=1 | × ar | TPOT p50 ms | TPOT p95 ms | TTFT p50 ms | "
             "sequences/step | nodes/sequence | acceptance | outputs = ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, spec=".1f"):
        return "–" if v is None else f"{v:{spec}}"

    for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
        lines.append(f"| {r['method']} | {r['concurrency']} | {f(r['tokens_per_s'])} | {f(r['scaling_vs_lowest'], '.2f')} "
                     f"| {f(r['tokens_per_s_vs_ar'], '.2f')} | {f(r['tpot_ms_p50'])} | {f(r['tpot_ms_p95'])} "
                     f"| {f(r['ttft_ms_p50'], '.0f')} | {f(r['mean_sequences_per_step'], '.2f')} "
                     f"| {f(r['nodes_per_sequence'], '.2f')} | {f(r['acceptance_rate'], '.2f')} "
                     f"| {r['outputs_equal_ar'] or '–'} |")
    lines += ["", "nodes/sequence: tree nodes verified per sequence per step (root included; 1 = plain decoding), "
              "from the server's ygg:batch_verified_nodes and ygg:batch_steps counters.", "",
              "## /metrics during the load", "",
              f"Scraped every {SCRAPE_S:g} s while each level ran, and before and after it: the server's own account "
              "against the clients' (generated tokens, finished requests; accepted tokens per position summing to "
              "accepted tokens; generated tokens never falling between scrapes).", "",
              "| method | concurrency | scrapes | generated (server / clients) | requests (server / clients) | drafts "
              "| draft tokens | accepted | agree |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
        m = r.get("metrics")
        if not m:
            continue
        lines.append(f"| {r['method']} | {r['concurrency']} | {m['scrapes_during_run']} | {m['generation_tokens']:.0f} / "
                     f"{r['tokens']} | {m['requests_finished']:.0f} / {r['requests']} | {m['drafts']:.0f} | "
                     f"{m['draft_tokens']:.0f} | {m['accepted_tokens']:.0f} | "
                     f"{'yes' if r['metrics_agree'] else 'NO'} |")
    return "\n".join(lines + [""])
