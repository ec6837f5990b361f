"""The scheduler's thread: it owns the models, admits queued requests into the batch and steps it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ygg_runtime.decoding.batch import Member
from ygg_runtime.decoding.decoder import Decoder
from ygg_runtime.errors import YggError
from ygg_runtime.serving.api import ApiError
from ygg_runtime.serving.metrics import ServerMetrics

# How long a waiting handler sleeps between checks that its client is still there.
POLL_S = 0.25


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
                 cost_aware: bool = True, kv_slots: int | None = None, adapt: bool = True):
        self.decoder, self.metrics, self.max_queue = decoder, metrics, max_queue
        self.batch = decoder.batch(max_batch, cost_aware, kv_slots, adapt)
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
