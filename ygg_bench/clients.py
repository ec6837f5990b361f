"""`ygg bench-serve`'s load: loopback HTTP clients that stream completions and time them as a user
sees them (time to first token, time per output token), the closed loop that drives a server at one
concurrency level, the /metrics scraper, and a level's figures from both accounts."""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from collections.abc import Iterator

from ygg_runtime.errors import YggError
from ygg_runtime.decoding.metrics import tpot_ms

REQUEST_S = 900  # one request at most

# A prompt of the load: (its key, its token ids with the chat template, its text)
Prompt = tuple[str, list[int], str]


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


def load_level(client: "Client", prompts: list[Prompt], method: str, concurrency: int,
               max_tokens: int | None) -> tuple[list[dict], float]:
    """Every prompt once, `concurrency` clients in a closed loop; (rows, wall seconds). `client` is ours
    or any server with the same `complete` (a peer: `servers.LlamaServer`)."""
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
        "tpot_ms_p99": percentile([r["tpot_ms"] for r in rows], 0.99),
        "ttft_ms_p50": 1000 * percentile([r["ttft_s"] for r in rows], 0.5),
        "ttft_ms_p95": 1000 * percentile([r["ttft_s"] for r in rows], 0.95),
        "ttft_ms_p99": 1000 * percentile([r["ttft_s"] for r in rows], 0.99),
        "latency_s_p50": percentile([r["latency_s"] for r in rows], 0.5),
        "latency_s_p99": percentile([r["latency_s"] for r in rows], 0.99),
        "mean_sequences_per_step": (sum(b * v["steps"] for b, v in by_size.items()) / steps) if steps else None,
        "nodes_per_sequence": (sum(v["nodes_per_sequence"] * v["steps"] * b for b, v in by_size.items())
                               / sum(v["steps"] * b for b, v in by_size.items())) if steps else None,
        "by_batch_size": {str(b): v for b, v in sorted(by_size.items())},
        "acceptance_rate": accepted / drafted if drafted else None,
        "running_peak": max((t["running"] for t in timeline or []), default=None),
        "preemptions": delta("vllm:num_preemptions_total") if after else None,
        # the cache: tokens of the running requests' sequences per GiB their regions hold, and per
        # GiB reserving each one's max_tokens up front (the server before the cache on demand) held for the same requests
        "kv_tokens_per_gb": per_gb("held"), "kv_tokens_per_gb_upfront": per_gb("upfront"),
        "metrics": {"generation_tokens": delta("vllm:generation_tokens_total"), "requests_finished": finished,
                    "drafts": delta("vllm:spec_decode_num_drafts_total"), "draft_tokens": drafted,
                    "accepted_tokens": accepted, "accepted_per_position_sum": per_pos,
                    "scrapes_during_run": len(timeline or [])},
        "metrics_agree": agree,
        "timeline": timeline or [],
    }
