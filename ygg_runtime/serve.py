"""`ygg serve`: an OpenAI-compatible HTTP server over one artifact, its requests decoded together.

The HTTP side is FastAPI on uvicorn; the decoding side is one scheduler thread that owns the models
and steps a `ygg_runtime.batch.Batch`: requests wait in a bounded queue (full: 429), join the batch
when it has a free row and cache room, stream their tokens back as they are accepted, and leave
when done, stopped, or when their client goes away (the scheduler drops them before its next step).
The KV cache is sized by memory (`--kv-cache-gb`, `kv_slots`) and taken on demand: a request holds
what it has written, not its max_tokens, so requests without max_tokens batch like any other; when
the cache is full the newest is preempted and recomputed later (`ygg_runtime.batch`).
Every request's greedy output is what it gets alone (`ygg_runtime.batch`).

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as server-sent events, or
not), GET /v1/models, /health and /metrics (Prometheus text, vLLM's names where vLLM has one).
Errors are OpenAI's JSON: {"error": {"message", "type", "param", "code"}}.

FastAPI, uvicorn and prometheus-client (the `serve` extra, with pydantic) are imported where they
are used, so that a process that only reads this module's types (the tests, `ygg bench-serve`) does
not pay for them. (No `from __future__
import annotations` here: FastAPI then reads the endpoints' annotations as the objects `create_app`
imported, not as names to look up in this module.)
"""

import asyncio
import hmac
import json
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ygg_runtime.artifact import load
from ygg_runtime.batch import Member
from ygg_runtime.decoder import Decoder
from ygg_runtime.errors import YggError
from ygg_runtime.metrics import Step
from ygg_runtime.integrity import available_memory
from ygg_runtime.options import KV_CACHE_SHARE, MAX_BATCH, MAX_ROWS, SAMPLINGS, ServeOptions
from ygg_runtime.text import StreamDecoder
from ygg_runtime.ui import err

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

# How long a waiting handler sleeps between checks that its client is still there.
POLL_S = 0.25
# Position labels of vllm:spec_decode_num_accepted_tokens_per_pos (deeper acceptances count in the last).
MAX_POSITIONS = 16


class ApiError(Exception):
    """An error answered in OpenAI's JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> "JSONResponse":
        from fastapi.responses import JSONResponse

        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ------------------------------------------------------------------ requests (OpenAI's schema)


class BaseRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are accepted and ignored, as OpenAI's
    clients send some (user, logit_bias at its default) that change nothing here."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, description="tokens to generate at most (default 16; chat: up to the context)")
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extra: generate max_tokens tokens whatever the eos
    method: str | None = None  # Yggdrasil's extra: a compiled method (default: the artifact's)
    sampling: str | None = None  # Yggdrasil's extra: coupled or rejection at temperature > 0 (default: the artifact's)
    return_token_ids: bool = False  # vLLM's extra: the prompt's and the output's token ids in the response


class CompletionRequest(BaseRequest):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None


class ChatRequest(BaseRequest):
    messages: list[Message]
    max_completion_tokens: int | None = None


# ------------------------------------------------------------------ metrics


class ServerMetrics:
    """The /metrics families, in one registry per server (tests start several in one process).
    Spec-decode counters follow vLLM and count what each step's event (`ygg_runtime.metrics.Step`)
    says, as `ygg run --json` and `ygg bench` do: a draft is one verified tree with at least one
    drafted node, its draft tokens are those nodes, accepted tokens are the drafted tokens in the
    output (bonus excluded, after any stop or length cut), and accepted_tokens_per_pos[i] counts
    drafts whose accepted path reached depth i + 1."""

    def __init__(self, mirror: Callable[..., Any] | None = None) -> None:
        """mirror(metric, kind, name, doc, labels, buckets): what to use in the metric's place, given
        it (`ygg_runtime.ray_serve` sends every update to Ray's metrics too, labelled by replica)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}

        def family(kind: str, name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple | None = None):
            extra = {"buckets": buckets} if buckets else {}
            made = kinds[kind](name, doc, labels, registry=r, **extra)
            return made if mirror is None else mirror(made, kind, name, doc, labels, buckets)

        self.num_drafts = family("counter", "vllm:spec_decode_num_drafts", "Verified trees with a drafted token")
        self.num_draft_tokens = family("counter", "vllm:spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.num_accepted_tokens = family("counter", "vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.accepted_per_pos = family("counter", "vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Drafts whose accepted path reached this depth (0-based)", ("position",))
        self.running = family("gauge", "vllm:num_requests_running", "Requests decoding in the batch")
        self.waiting = family("gauge", "vllm:num_requests_waiting", "Requests queued for a batch row")
        self.prompt_tokens = family("counter", "vllm:prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = family("counter", "vllm:generation_tokens", "Tokens generated")
        self.success = family("counter", "vllm:request_success", "Requests finished", ("finished_reason",))
        self.tpot = family("histogram", "vllm:time_per_output_token_seconds", "Time per output token after the first",
                           buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5))
        self.latency = family("histogram", "vllm:e2e_request_latency_seconds", "Request latency, arrival to last token",
                              buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300))
        self.ttft = family("histogram", "vllm:time_to_first_token_seconds", "Arrival to first token",
                           buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20))
        self.steps = family("counter", "ygg:batch_steps", "Target verify forwards, by sequences verified together",
                            ("sequences",))
        self.nodes = family("counter", "ygg:batch_verified_nodes", "Tree nodes (roots included) verified, by sequences "
                            "verified together: divided by ygg:batch_steps and sequences, the tree size per sequence",
                            ("sequences",))
        self.preemptions = family("counter", "vllm:num_preemptions", "Requests preempted: their cache slots taken "
                                  "back, recomputed when room returns")
        self.kv_usage = family("gauge", "vllm:kv_cache_usage_perc", "Share of the KV cache's slots the running "
                               "requests hold (1 = full)")
        self.kv_tokens = family("gauge", "ygg:kv_cache_tokens", "KV cache slots: the cache's (capacity), the running "
                                "requests' regions' (held), their sequences' tokens (written), and what reserving each "
                                "one's max_tokens up front would hold for them (upfront: how Yggdrasil 0.2 took the "
                                "cache)", ("kind",))
        self.kv_token_steps = family("counter", "ygg:kv_cache_token_steps", "ygg:kv_cache_tokens (held, written, "
                                     "upfront) summed over the batch's steps: their ratios over an interval are the "
                                     "cache's use in it, whatever the scrape interval", ("kind",))
        self.kv_token_bytes = family("gauge", "ygg:kv_cache_token_bytes", "Bytes a token takes in the KV cache (both "
                                     "models)")
        self.method = family("counter", "ygg:request_method", "Requests admitted, by the method each runs and how it "
                             "was chosen: asked (the request's method field), plan (the plan's method), request "
                             "(another modelled faster over the whole request: a long prompt the drafter's prefill "
                             "would not repay runs without the drafter, or with a drafter that reads only its last "
                             "tokens)", ("method", "chosen"))
        self.window = family("counter", "ygg:request_draft_window", "Requests admitted, by how many of the prompt's "
                             "last tokens their drafter reads (\"whole\": all of them)", ("window",))
        self.kv_moves = family("counter", "ygg:kv_region_moves", "Regions moved to grow (their rows copied)")
        self.kv_moved = family("counter", "ygg:kv_moved_tokens", "Rows those moves copied")

    def record(self, step: Step) -> None:
        if step.drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(step.drafted)
            self.num_accepted_tokens.inc(step.accepted)
            for i in range(step.accepted):
                self.accepted_per_pos.labels(str(min(i, MAX_POSITIONS - 1))).inc()


# ------------------------------------------------------------------ the scheduler's thread


@dataclass(eq=False)
class Job:
    """One request as the scheduler sees it: what to decode, and the queue its events go to."""

    prompt: list[int]
    method: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    sampling: str | None
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    draft_window: int | None = None  # the drafter reads the last this many prompt tokens (None: all)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the handler: the client went away or a stop string was met
    member: Member | None = None

    def send(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutting down): nobody is listening
            pass


class Scheduler:
    """Owns the models: admits queued jobs into the batch and steps it, on the thread that loaded
    the models (`run`; `ygg serve`'s main thread, the HTTP server in another). One thread for
    every torch op: a second thread running the forwards, with an OpenMP team of its own beside the
    loader's, measured 1.5x slower per forward on 2 cores (the 1.5B target: 61 -> 96 ms)."""

    def __init__(self, decoder: Decoder, max_batch: int, max_queue: int, metrics: ServerMetrics,
                 cost_aware: bool = True, kv_slots: int | None = None):
        self.decoder, self.metrics, self.max_queue = decoder, metrics, max_queue
        self.batch = decoder.batch(max_batch, cost_aware, kv_slots)
        self._counted = [0, 0, 0]  # the batch's preemptions, moves and moved rows already counted
        self.queue: deque[Job] = deque()
        self.jobs: list[Job] = []  # admitted and not finished
        self.cond = threading.Condition()
        self.stopping = False
        self._load_seen: dict[int, list[int]] = {}
        metrics.kv_tokens.labels("capacity").set(self.batch.regions.capacity)
        metrics.kv_token_bytes.set(decoder.kv_bytes_per_token())
        self._gauge()

    def stop(self) -> None:
        """Stop `run` (from another thread): queued and running jobs are answered 503."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it (429) when the queue is full."""
        with self.cond:
            if len(self.queue) >= self.max_queue:
                raise ApiError(429, f"the server is busy: {len(self.queue)} requests are waiting (--max-queue "
                                    f"{self.max_queue}); retry later", "server_busy", code="queue_full")
            self.queue.append(job)
            self.metrics.waiting.set(len(self.queue) + self._preempted())
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Step the batch until `stop` (or until `alive()` turns false: the HTTP side is gone)."""
        torch.set_grad_enabled(False)
        while True:
            with self.cond:
                while not self.stopping and not self.queue and not self.jobs:
                    if not alive():
                        self.stopping = True
                        break
                    self.cond.wait(timeout=POLL_S)
                if self.stopping:
                    for job in list(self.queue) + self.jobs:
                        job.send("error", ApiError(503, "the server is shutting down", "server_error"))
                    return
                self._admit()
            self._drop_cancelled()
            if self.jobs:
                self._step()

    def _admit(self) -> None:
        """Move queued jobs into the batch while it has a row and cache room, oldest first (caller
        holds the lock)."""
        while self.queue:
            job = self.queue[0]
            if job.cancelled:
                self.queue.popleft()
                job.send("done", "cancelled")
                continue
            try:
                member = self.batch.join(job.prompt, job.method, max_new_tokens=job.max_tokens,
                                         temperature=job.temperature, top_p=job.top_p, seed=job.seed,
                                         sampling=job.sampling,
                                         eos_ids=frozenset() if job.ignore_eos else self.decoder.eos_ids,
                                         on_tokens=lambda new, job=job: self._emit(job, new),
                                         on_event=self.metrics.record, draft_window=job.draft_window)
            except YggError as e:  # checked before queueing; only a race with nothing left could land here
                self.queue.popleft()
                job.send("error", ApiError(400, str(e)))
                continue
            if member is None:
                break
            self.queue.popleft()
            job.member = member
            self.jobs.append(job)
            self.metrics.prompt_tokens.inc(len(job.prompt))
        self._gauge()

    def _preempted(self) -> int:
        """Admitted requests whose member the batch preempted (vLLM counts them as waiting)."""
        return sum(j.member.preempted for j in list(self.jobs))

    def _gauge(self) -> tuple[int, int, int]:
        """Running and waiting as vLLM counts them (a preempted request waits), and the cache;
        returns what the cache holds (`Batch.held`)."""
        preempted = self._preempted()
        self.metrics.waiting.set(len(self.queue) + preempted)
        self.metrics.running.set(len(self.jobs) - preempted)
        held = self.batch.held()
        for kind, n in zip(("held", "written", "upfront"), held):
            self.metrics.kv_tokens.labels(kind).set(n)
        self.metrics.kv_usage.set(held[0] / self.batch.regions.capacity)
        return held

    def _emit(self, job: Job, new: list[int]) -> None:
        """A step's accepted tokens: counted as they are made (a scrape mid-request sees them), then sent."""
        self.metrics.generation_tokens.inc(len(new))
        job.send("tokens", new)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.jobs if j.cancelled]:
            self.batch.cancel(job.member)
            self._finish(job, "cancelled")

    def _step(self) -> None:
        try:
            finished = self.batch.step()
        except Exception as e:  # a fault of the batch itself: every running request learns it
            for job in list(self.jobs):
                self.batch.cancel(job.member)
                job.send("error", ApiError(500, f"decoding failed: {e}", "server_error"))
                self.jobs.remove(job)
            return
        for b, (steps, nodes) in self.batch.load.items():
            seen = self._load_seen.setdefault(b, [0, 0])
            self.metrics.steps.labels(str(b)).inc(steps - seen[0])
            self.metrics.nodes.labels(str(b)).inc(nodes - seen[1])
            seen[:] = [steps, nodes]
        now = [self.batch.preemptions, self.batch.moves, self.batch.moved_slots]
        for counter, n, seen in zip((self.metrics.preemptions, self.metrics.kv_moves, self.metrics.kv_moved), now,
                                    self._counted):
            counter.inc(n - seen)
        self._counted = now
        for member in finished:
            job = next(j for j in self.jobs if j.member is member)
            if member.error is not None:
                self.jobs.remove(job)
                job.send("error", ApiError(500, f"decoding failed: {member.error}", "server_error"))
                continue
            gen = member.generation
            eos = bool(gen.out) and gen.out[-1] in gen.eos_ids
            self._finish(job, "stop" if eos else "length")
        held = self._gauge()
        for kind, n in zip(("held", "written", "upfront"), held):  # the step's share of ygg:kv_cache_token_steps
            self.metrics.kv_token_steps.labels(kind).inc(n)

    def _finish(self, job: Job, reason: str) -> None:
        self.jobs.remove(job)
        self._gauge()
        m = job.member.generation.metrics
        self.metrics.success.labels(reason).inc()
        self.metrics.latency.observe(time.perf_counter() - job.arrived)
        if m.generated_tokens > 1:  # vLLM's: no TPOT for a one-token answer
            self.metrics.tpot.observe(m.tpot_ms / 1000)
        job.send("done", reason)


# ------------------------------------------------------------------ the HTTP side


@dataclass
class Output:
    """What a handler collects of its job: text deltas past any stop string, and why it ended."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class StopText:
    """Cuts text at the first stop string, holding back a tail that could still begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.sent = "", 0

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was met)."""
        self.text += delta
        hits = [i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stops) if i >= 0]
        if hits:
            out, self.sent = self.text[self.sent : min(hits)], min(hits)
            return out, True
        upto = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : upto], upto
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class Server:
    def __init__(self, decoder: Decoder, model_name: str, max_batch: int = MAX_BATCH, max_queue: int = 64,
                 cost_aware: bool = True, kv_slots: int | None = None, metrics: ServerMetrics | None = None):
        if decoder.codec is None:
            raise YggError("this artifact has no tokenizer to serve text with")
        self.decoder, self.model_name = decoder, model_name
        self.metrics = metrics or ServerMetrics()
        self.scheduler = Scheduler(decoder, max_batch, max_queue, self.metrics, cost_aware, kv_slots)
        self.created = int(time.time())
        self.context = decoder.max_context or decoder.target.max_len

    # -------------------------------------------------------------- request checks

    def job(self, req: BaseRequest, prompt: list[int], chat: bool) -> Job:
        """The scheduler's job for a request, or the 4xx that refuses it."""
        if req.model != self.model_name:
            raise ApiError(404, f"the model `{req.model}` does not exist: this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        if req.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        max_tokens = req.max_tokens
        if chat and isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        method = req.method or self.decoder.default_method  # until the request's length is known
        if max_tokens is None and chat:  # OpenAI's defaults: the rest of the context for chat, 16 for a completion
            try:
                max_tokens = min(self.context, self.scheduler.batch.longest(method)) - len(prompt)
            except YggError as e:  # an unknown method
                raise ApiError(400, str(e)) from None
        elif max_tokens is None:
            max_tokens = 16
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, not {max_tokens}", param="max_tokens")
        if not req.temperature >= 0 or req.temperature > 2:
            raise ApiError(400, f"temperature must be in [0, 2], not {req.temperature}", param="temperature")
        if not 0 < req.top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], not {req.top_p}", param="top_p")
        if req.seed is not None and not 0 <= req.seed < 2**63:
            raise ApiError(400, f"seed must be in [0, 2^63), not {req.seed}", param="seed")
        if req.sampling is not None and req.sampling not in SAMPLINGS:
            raise ApiError(400, f"sampling must be one of {', '.join(SAMPLINGS)}, not {req.sampling!r}", param="sampling")
        chosen, window = "asked", None
        if not req.method:  # the whole request priced: a long prompt may not repay the drafter's whole prefill
            choice = self.decoder.choose(len(prompt), max_tokens)
            method, window = choice.method, choice.window
            chosen = "plan" if method == self.decoder.default_method and window is None else "request"
        if len(prompt) + max_tokens > self.context:
            raise ApiError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) is more than the context "
                                f"of {self.context} tokens; shorten the prompt or lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")
        try:
            self.scheduler.batch.admissible(prompt, method, max_new_tokens=max_tokens, temperature=req.temperature,
                                         top_p=req.top_p)
        except YggError as e:
            raise ApiError(400, str(e).replace("--max-new-tokens", "max_tokens"),
                           param="max_tokens" if "fit" in str(e) else None) from None
        self.metrics.method.labels(method, chosen).inc()
        self.metrics.window.labels(str(window or "whole")).inc()
        return Job(prompt, method, max_tokens, req.temperature, req.top_p, req.seed, req.sampling, req.ignore_eos,
                   asyncio.get_running_loop(), asyncio.Queue(), draft_window=window)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, list):
            vocab = self.decoder.target.vocab_size
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return req.prompt
        return self.decoder.codec.encode(req.prompt, raw=True)

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        """The artifact's chat template was frozen at compile time for one user turn: a
        conversation of one user message (after any system message the template already holds)."""
        codec = self.decoder.codec
        turns = [m for m in req.messages if m.role != "system"]
        if len(turns) != 1 or turns[0].role != "user" or turns[0].content is None:
            raise ApiError(400, "this artifact's chat template takes one user message (its template was frozen at "
                                "compile time); send earlier turns inside it, or use /v1/completions", param="messages")
        if len(req.messages) != 1:
            raise ApiError(400, "this artifact's chat template has its own system prompt; send one user message",
                           param="messages")
        return codec.encode(turns[0].content) if codec.has_chat_template else codec.encode(turns[0].content, raw=True)

    # -------------------------------------------------------------- running a job

    async def events(self, job: Job, request: "Request") -> AsyncIterator[tuple[str, Any]]:
        """The job's events until it ends (it is queued already); a client that goes away cancels it."""
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield kind, value
                if kind in ("done", "error"):
                    return
        finally:
            if not job.cancelled:
                job.cancelled = True
                self.scheduler.wake()

    async def outputs(self, job: Job, request: "Request", stops: list[str]) -> AsyncIterator[Output]:
        """Text deltas of a job (stop strings applied); the last one carries the finish reason."""
        stream, stop = StreamDecoder(self.decoder.codec), StopText(stops)
        first = True
        async for kind, value in self.events(job, request):
            if kind == "error":
                raise value
            if kind == "tokens":
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - job.arrived)
                    first = False
                text, hit = stop.push(stream.push(value))
                yield Output(text, list(value))
                if hit:
                    yield Output(finish_reason="stop")
                    return
            elif kind == "done":
                yield Output(stop.push(stream.finish())[0] + stop.flush(), finish_reason=value)
                return

    async def answer(self, req: BaseRequest, prompt: list[int], request: "Request", chat: bool):
        job = self.job(req, prompt, chat)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        from fastapi.responses import JSONResponse, StreamingResponse

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.scheduler.submit(job)  # a full queue refuses it here, before any response starts
        if req.stream:
            return StreamingResponse(self.sse(job, request, stops, rid, chat, req.return_token_ids),
                                     media_type="text/event-stream")
        text, ids, reason = [], [], None
        async for out in self.outputs(job, request, stops):
            text.append(out.text)
            ids += out.token_ids
            reason = out.finish_reason or reason
        body = self.envelope(rid, chat, False)
        content = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        if req.return_token_ids:
            choice["token_ids"] = ids
            body["prompt_token_ids"] = prompt
        body["choices"] = [choice]
        body["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                         "total_tokens": len(prompt) + len(ids)}
        return JSONResponse(body)

    def envelope(self, rid: str, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    async def sse(self, job: Job, request: "Request", stops: list[str], rid: str, chat: bool,
                  token_ids: bool) -> AsyncIterator[str]:
        def event(body: dict) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield event(self.envelope(rid, chat, True) | {
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            async for out in self.outputs(job, request, stops):
                if not out.text and not out.finish_reason and not token_ids:
                    continue
                delta: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
                if chat:
                    delta["delta"] = {"content": out.text} if out.text or not out.finish_reason else {}
                else:
                    delta["text"] = out.text
                if token_ids:
                    delta["token_ids"] = out.token_ids
                yield event(self.envelope(rid, chat, True) | {"choices": [delta]})
        except ApiError as e:
            yield event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        finally:  # the client went away (the stream is closed or cancelled) or the job ended: either way, drop it
            job.cancelled = True
            self.scheduler.wake()
        yield "data: [DONE]\n\n"


def create_app(server: Server, api_key: str | None = None) -> "FastAPI":
    """The ASGI app; the end of its lifespan stops the scheduler. api_key: every /v1 request must
    send it as `Authorization: Bearer <key>`, or gets 401 (/health and /metrics stay open to load
    balancers and scrapers, as vLLM's do)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:  # after uvicorn's graceful shutdown has let running requests finish
            server.scheduler.stop()

    app = FastAPI(title="Yggdrasil", lifespan=lifespan)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next):
            sent = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1") and not hmac.compare_digest(sent, expected):
                return ApiError(401, "invalid or missing API key: send the header `Authorization: Bearer <key>`",
                                code="invalid_api_key").response()
            return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        what = "the body is not valid JSON" if first.get("type") == "json_invalid" else first.get("msg", "invalid request")
        return ApiError(400, f"{where}: {what}" if where and first.get("type") != "json_invalid" else what,
                        param=where).response()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await server.answer(req, server.completion_prompt(req), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await server.answer(req, server.chat_prompt(req), request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "yggdrasil", "max_model_len": server.context}]}

    @app.get("/health")
    async def health():
        """200 while serving (what load balancers and vLLM's clients look for), with whether the
        greedy output on this machine is guaranteed to be plain decoding's and the sampling rule."""
        exact, why = server.decoder.verdict()
        return {"status": "ok", "exact": exact, "exactness": why, "sampling": server.decoder.sampling}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def kv_slots(decoder: Decoder, gb: float | None, max_batch: int) -> tuple[int, str]:
    """The KV cache's slots for `ygg serve` (both models' caches have that many), and the line that
    says so: `gb` GiB, or KV_CACHE_SHARE of the memory free now, at most what max_batch sequences of
    the artifact's longest use (and never less than one such sequence: the artifact's own cache)."""
    per = decoder.kv_bytes_per_token()
    longest = decoder.target.max_len  # the artifact's context and a step's room
    useful = MAX_ROWS + max_batch * longest
    if gb is not None:
        slots = int(gb * 2**30) // per
        if slots < MAX_ROWS + 256:
            raise YggError(f"--kv-cache-gb {gb:g} holds {max(0, slots - MAX_ROWS)} tokens of this artifact "
                           f"({per / 1024:.1f} KiB each); give it at least {(MAX_ROWS + 256) * per / 2**30:.3g}")
        how = f"--kv-cache-gb {gb:g}"
    else:
        free = available_memory(decoder.target.device)  # the GPU's own memory on a GPU
        slots = useful if free is None else max(MAX_ROWS + longest, min(useful, int(free * KV_CACHE_SHARE) // per))
        where = f" on {decoder.target.device}" if decoder.target.device.type != "cpu" else ""
        how = (f"{KV_CACHE_SHARE:.0%} of the {free / 2**30:.1f} GiB free{where}" if free is not None and slots < useful else
               f"--max-batch {max_batch} sequences of the artifact's {longest:,} slots") + "; --kv-cache-gb sets it"
    return slots, (f"KV cache: {slots * per / 2**30:.2f} GiB, {slots - MAX_ROWS:,} tokens for both models "
                   f"({per / 1024:.0f} KiB a token; {how})")


def serve(decoder: Decoder, model_name: str, opts: ServeOptions = ServeOptions(), slots: int | None = None) -> None:
    """Run the server until SIGINT or SIGTERM, which stop new connections, let running requests
    finish, then stop the scheduler. Call from the main thread (the one that loaded the decoder):
    the scheduler steps there, uvicorn serves HTTP from a thread of its own. slots: the KV cache's
    (None: `kv_slots` of the options)."""
    import uvicorn

    opts.check_address()
    host, port = opts.host, opts.port
    if slots is None:
        slots, why = kv_slots(decoder, opts.kv_cache_gb, opts.max_batch)
        err.print(why)
    server = Server(decoder, model_name, opts.max_batch, opts.max_queue, opts.cost_aware, slots)
    config = uvicorn.Config(create_app(server, opts.api_key), host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=600)
    http = uvicorn.Server(config)
    # Signals reach the main thread only: hand them to uvicorn, whose graceful shutdown stops
    # accepting, waits for running requests, then ends the app's lifespan (which stops the scheduler).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, http.handle_exit)
    thread = threading.Thread(target=http.run, name="ygg-http")
    thread.start()
    try:
        server.scheduler.run(alive=thread.is_alive)
    finally:
        http.should_exit = True
        thread.join()
    if not http.started:
        raise YggError(f"the HTTP server did not start on {host}:{port} (its log above says why)")


def model_name(decoder: Decoder, given: str | None = None) -> str:
    """The model name clients send: `given`, or the target's (a path's last part)."""
    target = decoder.plan.models["target"].spec if decoder.plan else "model"
    return given or (Path(target).name if "/" in target or Path(target).exists() else target)


def serve_artifact(opts: ServeOptions, artifact: Path, given: str | None, eager: bool,
                   expect_plan: str | None) -> None:
    """What `ygg serve` does once `ygg_runtime.cli` has checked its arguments."""
    decoder = load(artifact, eager=eager, expect_plan=expect_plan)
    slots, cache = kv_slots(decoder, opts.kv_cache_gb, opts.max_batch)
    name = model_name(decoder, given)
    err.print(f"serving {name} ({decoder.default_method}, {decoder.forwards}) on http://{opts.host}:{opts.port}/v1 · batch "
              f"≤ {opts.max_batch}, queue ≤ {opts.max_queue} · Ctrl-C or SIGTERM stops it once running requests finish")
    err.print(f"exactness: {decoder.verdict()[1]} · sampling at temperature > 0: {decoder.sampling} (a request's seed gives "
              + ("the text plain decoding gives it, whatever else is running)" if decoder.sampling == "coupled"
                 else "a sample that depends on the batch it runs in)"))
    err.print(cache)
    if warning := opts.exposed():
        err.print(warning)
    serve(decoder, name, opts, slots)
    err.print("ygg serve: stopped")
