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

import http.client
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ygg_compile import hardware, plots
from ygg_compile.bench import machine_info
from ygg_compile.options import ServeBenchOptions
from ygg_compile.peer_process import crash_hint, how_it_ended
from ygg_compile.peers import llama_gguf
from ygg_compile.prompts import read_jsonl
from ygg_runtime.ui import Reporter
from ygg_runtime.artifact import read_plan
from ygg_runtime.backend import native
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.files import output_dir, write_atomic
from ygg_runtime.metrics import tpot_ms
from ygg_runtime.text import TextCodec

READY_S = 600  # loading an artifact (its compiled forwards included) takes at most this long
REQUEST_S = 900  # one request at most


def default_output(artifact: Path) -> Path:
    return Path("benchmarks/results") / (hardware.device_slug(read_plan(artifact).device) + "-serve")


def completion_events(port: int, body: dict, who: str) -> Iterator[dict]:
    """A streamed /v1/completions (or /v1/chat/completions, when the body has messages) on a
    loopback port: each server-sent event as it arrives."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_S)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise YggError(f"{who} answered {resp.status}: {resp.read()[:200].decode(errors='replace')}")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
    finally:
        conn.close()


def request(prompt: "Prompt", max_tokens: int | None, chat: bool) -> dict:
    """The body's prompt part: a chat turn of the prompt's text (max_tokens left out when None, as
    the openai client sends it by default), or its token ids (the chat template applied here)."""
    body = {"messages": [{"role": "user", "content": prompt[2]}]} if chat else {"prompt": prompt[1]}
    return body | ({"max_tokens": max_tokens} if max_tokens is not None else {})


class Client:
    """One loopback HTTP client of the server: a streamed completion, timed."""

    def __init__(self, port: int, model: str, chat: bool = False):
        self.port, self.model, self.chat = port, model, chat

    def complete(self, prompt: "Prompt", method: str, max_tokens: int | None) -> dict:
        body = {"model": self.model, **request(prompt, max_tokens, self.chat), "temperature": 0, "stream": True,
                "method": method, "return_token_ids": True}
        start = time.perf_counter()
        first, tokens, reason = None, [], None
        for event in completion_events(self.port, body, "the server"):
            if "error" in event:
                raise YggError(f"the server failed a request: {event['error']['message']}")
            choice = event["choices"][0]
            if choice.get("token_ids"):
                first = first or time.perf_counter()
                tokens += choice["token_ids"]
            reason = choice.get("finish_reason") or reason
        end = time.perf_counter()
        n = len(tokens)
        return {"tokens": tokens, "generated": n, "finish_reason": reason, "latency_s": end - start,
                "ttft_s": (first or end) - start, "tpot_ms": tpot_ms(start, first, end, n) if first and n > 1 else None,
                "start": start, "end": end}


# what a peer server's death or misbehaviour raises here (a refused or cut connection, a cut stream)
PEER_ERRORS = (YggError, OSError, ValueError, http.client.HTTPException)

LLAMA_SERVER_MISSING = ("peer llama.cpp-server needs llama-cpp-python's server: pip install -e '.[llama]' "
                        "(it builds llama.cpp from source, a few minutes)")


class LlamaServer:
    """llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on the target's GGUF, on
    loopback, started and stopped here. One model, one request at a time (its own lock): later
    requests wait, as its users see it. Not interrupted by a waiting request (its default would
    cut a stream short whenever another arrives), greedy with no repetition penalty."""

    name = "llama.cpp-server"

    def __init__(self, gguf: Path, threads: int, n_ctx: int, codec: TextCodec, chat: bool = False):
        self.gguf, self.threads, self.n_ctx, self.codec, self.chat = gguf, threads, n_ctx, codec, chat
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @staticmethod
    def check(plan) -> Path:
        """The GGUF file it serves; YggError in one line when it cannot run here."""
        return llama_gguf(plan, LlamaServer.name, ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"),
                          LLAMA_SERVER_MISSING)

    def start(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--host", "127.0.0.1",
               "--port", str(self.port), "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
               "--n_ctx", str(self.n_ctx), "--n_batch", "512", "--interrupt_requests", "False", "--verbose", "False"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_ready(self.proc, lambda: _get(self.port, "/v1/models"), "llama.cpp-server")

    def stop(self) -> None:
        stop(self.proc)

    def failure(self, e: BaseException) -> str:
        """Why it failed, in one line: how its process ended when it died (a signal: llama.cpp's
        native code), else the error the request met."""
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            return f"peer {self.name} crashed: its process {how_it_ended(code)}{crash_hint(self.name, code)}"
        return f"peer {self.name} failed: {first_line(e)}"

    def complete(self, prompt: "Prompt", method: str, max_tokens: int | None) -> dict:
        """The same prompt as text (its chat template included, as our ids hold it), streamed; or,
        for a chat load, the same chat turn (its own template, the GGUF's, applied)."""
        text = prompt[1] and self.codec.tokenizer.decode(prompt[1], skip_special_tokens=False)
        body = {**request((prompt[0], text, prompt[2]), max_tokens, self.chat), "temperature": 0, "top_k": 0,
                "min_p": 0, "top_p": 1, "repeat_penalty": 1.0, "stream": True}
        start = time.perf_counter()
        first, text, chunks, reason = None, "", 0, None
        for event in completion_events(self.port, body, "llama.cpp-server"):
            choice = event["choices"][0]
            delta = choice.get("text") or (choice.get("delta") or {}).get("content")
            if delta:
                first = first or time.perf_counter()
                text += delta
                chunks += 1
            reason = choice.get("finish_reason") or reason
        end = time.perf_counter()
        # Its stream carries text, not ids: the tokens are its text as our tokenizer reads it (the
        # same vocabulary; a greedy output tokenizes back to itself but for rare merges).
        n = max(chunks, len(self.codec.encode(text, raw=True))) if text else 0
        return {"tokens": [], "text": text, "generated": n, "finish_reason": reason, "latency_s": end - start,
                "ttft_s": (first or end) - start, "tpot_ms": tpot_ms(start, first, end, n) if first and n > 1 else None,
                "start": start, "end": end}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def wait_ready(proc: subprocess.Popen, probe, name: str) -> None:
    """Until `probe` answers (its OSError: not yet); YggError if the process dies or takes too long."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise YggError(f"{name} did not start: {proc.stderr.read().strip().splitlines()[-1:]}")
        try:
            probe()
            return
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise YggError(f"{name} did not become ready")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


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
            "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
            "preemptions": "vllm:num_preemptions_total", "kv_held": "ygg:kv_cache_tokens{kind=held}",
            "kv_written": "ygg:kv_cache_tokens{kind=written}"}
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


# A prompt of the load: (its key, its token ids with the chat template, its text)
Prompt = tuple[str, list[int], str]


def load_level(client: "Client | LlamaServer", prompts: list[Prompt], method: str, concurrency: int,
               max_tokens: int | None) -> tuple[list[dict], float]:
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
                prompt = work.get_nowait()
            except queue.Empty:
                return
            try:
                row = client.complete(prompt, method, max_tokens)
            except BaseException as e:
                errors.append(e)
                return
            with lock:
                rows.append({"prompt": prompt[0], **row})

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return rows, time.perf_counter() - start


def serve_command(opts: ServeBenchOptions, port: int, max_batch: int) -> list[str]:
    """`ygg serve` of the artifact on a loopback port, as every server of ours here runs it."""
    cmd = [sys.executable, "-m", "ygg_compile", "serve", "--artifact", str(opts.artifact), "--port", str(port),
           "--max-batch", str(max_batch), "--max-queue", str(max(64, 4 * max_batch)), "--model-name", "bench"]
    if not opts.cost_aware:
        cmd.append("--no-cost-aware")
    if opts.kv_cache_gb is not None:
        cmd += ["--kv-cache-gb", str(opts.kv_cache_gb)]
    return cmd


def start_server(opts: ServeBenchOptions, max_batch: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(serve_command(opts, port, max_batch), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    wait_ready(proc, lambda: scrape(port), "ygg serve")
    return proc, port


class RayServer:
    """`ygg serve --ray` of the same artifact on loopback: `replicas` replicas sharing the threads
    the direct server has (each `threads // replicas`), each with the direct server's batch, in a
    Ray of this machine alone started by the command (and stopped with it). Driven by the same
    clients; its /metrics through Ray's proxy is one replica's, so its levels carry no server
    account. While another contestant runs, its Ray idles: the CPU its processes take then is
    recorded (`background_cores`), as it slows whatever else runs on the machine."""

    def __init__(self, opts: ServeBenchOptions, max_batch: int, replicas: int, threads: int):
        self.opts, self.max_batch = opts, max_batch
        self.replicas, self.threads = replicas, max(1, threads // replicas)
        self.name = f"ray×{replicas}"
        self.proc: subprocess.Popen | None = None
        self.client: Client | None = None

    def start(self, chat: bool) -> None:
        port = free_port()
        cmd = serve_command(self.opts, port, self.max_batch) + ["--ray", "--replicas", str(self.replicas),
                                                                 "--replica-threads", str(self.threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)  # a Ctrl-C here reaches it through stop(), once

        def models() -> None:  # Ray's proxy is up before the application: 200 once a replica answers
            if _get(port, "/v1/models") != 200:
                raise OSError("not yet")
        wait_ready(self.proc, models, f"ygg serve --ray ({self.name})")
        self.client = Client(port, "bench", chat)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of the command and every process of its Ray so far."""
        import psutil  # comes with ray

        if self.proc is None:
            return 0.0
        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        stop(self.proc)


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
    per_token = after.get("ygg:kv_cache_token_bytes")

    def per_gb(kind: str) -> float | None:
        """Written tokens per GiB of cache held (`kind`), over the level's steps."""
        slots = delta(f"ygg:kv_cache_token_steps_total{{kind={kind}}}")
        return delta("ygg:kv_cache_token_steps_total{kind=written}") / (slots * per_token / 2**30) if slots else None
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
        "running_peak": max((t["running"] for t in timeline or []), default=None),
        "preemptions": delta("vllm:num_preemptions_total") if after else None,
        # the cache: tokens of the running requests' sequences per GiB their regions hold, and per
        # GiB reserving each one's max_tokens up front (Yggdrasil 0.2) held for the same requests
        "kv_tokens_per_gb": per_gb("held"), "kv_tokens_per_gb_upfront": per_gb("upfront"),
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
    gguf = LlamaServer.check(plan) if opts.peers else None  # refused before anything is written or started
    if plan.device.startswith("cpu") and (Path(opts.artifact) / native.LIBRARY).is_file():
        native.load(Path(opts.artifact) / native.LIBRARY)  # machine_info then measures the machine's roofs
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
    threads = torch_threads()  # the direct server's (it runs with the default): the peers' and Rays' too
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
    report = {"config": {"command": opts.command, "artifact": str(opts.artifact), "concurrency": levels,
                         "methods": opts.methods, "peers": list(peers), "left_out": left_out,
                         "ray": [{"name": r.name, "replicas": r.replicas, "threads_each": r.threads} for r in rays],
                         "max_new_tokens": budget, "chat": opts.chat,
                         "kv_cache_gb": opts.kv_cache_gb, "prompts": len(encoded),
                         "cost_aware": opts.cost_aware, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "machine": machine_info(plan), "summary": results,
              "runs": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in runs]}
    write_atomic(out / "results.json", json.dumps(report, indent=1).encode())
    write_atomic(out / "summary.md", summary_markdown(report).encode())
    write_atomic(out / "serve.png", plots.serve_curves(results))
    write_atomic(out / "metrics.png", plots.metrics_timeline(results))
    return report


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def summary_markdown(report: dict) -> str:
    cfg, mach = report["config"], report["machine"]
    bandwidth = f", {mach['read_bandwidth_gbs']} GB/s read" if mach.get("read_bandwidth_gbs") else ""
    lines = ["# Yggdrasil serving benchmark", "",
             f"- **Command**: `{cfg['command']}`",
             f"- **Machine**: {mach['cpu']}{bandwidth}, {mach['threads']} torch threads; {mach['dtype']} on "
             f"{mach['device']}",
             f"- **Load**: {cfg['prompts']} prompts per (method, concurrency), "
             + ("chat requests without max_tokens (each answer runs to its end of turn or the context)"
                if cfg.get("chat") else f"{cfg['max_new_tokens']} new tokens at most")
             + f", greedy, closed loop; CAST allocation {'on' if cfg['cost_aware'] else 'off'}; KV cache "
             + (f"{cfg['kv_cache_gb']:g} GiB" if cfg.get("kv_cache_gb") else "the server's default"),
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
              "## The KV cache during the load", "",
              "From /metrics around each level: the most requests running at once (sampled), preemptions, and "
              "the tokens the running requests had written per GiB of cache their regions held, over its steps — against "
              "reserving each request's max_tokens (the rest of the context, for a chat request without one) up "
              "front, as Yggdrasil 0.2 did, for the same requests.", "",
              "| method | concurrency | running at most | preemptions | tokens per GiB held | reserved up front | × |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
        if r.get("peer") or r.get("kv_tokens_per_gb") is None:
            continue
        now, before = r["kv_tokens_per_gb"], r["kv_tokens_per_gb_upfront"]
        lines.append(f"| {r['method']} | {r['concurrency']} | {f(r['running_peak'], '.0f')} | {f(r['preemptions'], '.0f')} "
                     f"| {now:,.0f} | {f(before, ',.0f')} | {f(now / before if before else None, '.1f')} |")
    lines += ["",
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
    for peer, why in (cfg.get("left_out") or {}).items():
        lines += ["", f"Left out: **{peer}**, {why}"]
    if cfg.get("ray"):
        lines += ["", "## Through Ray Serve", "",
                  "Each method through `ygg serve --ray` (" + ", ".join(
                      f"{r['name']}: {r['replicas']} replica(s) of {r['threads_each']} thread(s)" for r in cfg["ray"])
                  + f") over the same method served directly ({mach['threads']} threads), at the same concurrency, "
                  "in the same run: ratios above 1 are Ray's cost for TTFT and TPOT, its gain for tokens/s. "
                  "Idle Ray: the cores the processes of the Rays not under load took while the direct level "
                  "ran (a Ray idling beside a server slows it).", "",
                  "| through | method | concurrency | tokens/s × | TTFT p50 × | TPOT p50 × | idle Ray, cores |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
            if v := r.get("vs_direct"):
                lines.append(f"| {r['via']} | {r['method'].split('@')[0]} | {r['concurrency']} "
                             f"| {f(v['tokens_per_s'], '.3f')} | {f(v['ttft_ms_p50'], '.3f')} "
                             f"| {f(v['tpot_ms_p50'], '.3f')} | {f(r['direct_background_cores'], '.3f')} |")
    if cfg.get("peers"):
        lines += ["", "## Against the serving peers", "",
                  "Ours over theirs at the same concurrency, on the same prompts (tokens/s: higher is better for us; "
                  "TTFT p50: lower). The peer's 'outputs = ar' column above is its text against our ar's: not "
                  "required to agree, its batch shapes change its numerics.", "",
                  "| method | concurrency | peer | tokens/s × | TTFT p50 × |", "|---|---|---|---|---|"]
        for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
            for p, v in (r.get("vs_peers") or {}).items():
                lines.append(f"| {r['method']} | {r['concurrency']} | {p} | {v['tokens_per_s']:.2f} "
                             f"| {v['ttft_ms_p50']:.2f} |")
    return "\n".join(lines + [""])
