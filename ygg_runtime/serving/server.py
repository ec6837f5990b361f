"""A request as the server sees it: checked (or refused with its 4xx), queued, its events turned
into text (stop strings applied) and answered as JSON or server-sent events; and the KV cache's size."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from ygg_runtime.decoding.decoder import Decoder
from ygg_runtime.errors import YggError
from ygg_runtime.checks.integrity import available_memory
from ygg_runtime.options import KV_CACHE_SHARE, MAX_BATCH, MAX_ROWS, SAMPLINGS
from ygg_runtime.serving.api import ApiError, BaseRequest, ChatRequest, CompletionRequest
from ygg_runtime.serving.metrics import ServerMetrics
from ygg_runtime.serving.scheduler import POLL_S, Job, Scheduler
from ygg_runtime.text import StreamDecoder

if TYPE_CHECKING:
    from fastapi import Request


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
                 cost_aware: bool = True, kv_slots: int | None = None, metrics: ServerMetrics | None = None,
                 adapt: bool = True):
        if decoder.codec is None:
            raise YggError("this artifact has no tokenizer to serve text with")
        self.decoder, self.model_name = decoder, model_name
        self.metrics = metrics or ServerMetrics()
        self.scheduler = Scheduler(decoder, max_batch, max_queue, self.metrics, cost_aware, kv_slots, adapt)
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
            self.scheduler.batch.admissible(prompt, method, max_new_tokens=max_tokens)
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
