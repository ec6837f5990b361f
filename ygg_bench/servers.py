"""The servers `ygg bench-serve` starts on loopback and stops: ours (`ygg serve`, and `ygg serve
--ray` with its replicas), and the peers driven with the same load (llama-cpp-python's OpenAI
server). Each is started, waited for, and stopped here; a peer that dies costs one line."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
from pathlib import Path

from ygg_bench.clients import Client, Prompt, completion_events, request, scrape
from ygg_bench.options import ServeBenchOptions
from ygg_bench.peer_process import crash_hint, how_it_ended
from ygg_bench.peers import llama_gguf
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.decoding.metrics import tpot_ms
from ygg_runtime.text import TextCodec

READY_S = 600  # loading an artifact (its compiled forwards included) takes at most this long

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
        wait_ready(self.proc, lambda: get_status(self.port, "/v1/models"), "llama.cpp-server")

    def stop(self) -> None:
        stop(self.proc)

    def failure(self, e: BaseException) -> str:
        """Why it failed, in one line: how its process ended when it died (a signal: llama.cpp's
        native code), else the error the request met."""
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            return f"peer {self.name} crashed: its process {how_it_ended(code)}{crash_hint(self.name, code)}"
        return f"peer {self.name} failed: {first_line(e)}"

    def complete(self, prompt: Prompt, method: str, max_tokens: int | None) -> dict:
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


def get_status(port: int, path: str) -> int:
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


def serve_command(opts: ServeBenchOptions, port: int, max_batch: int) -> list[str]:
    """`ygg serve` of the artifact on a loopback port, as every server of ours here runs it."""
    cmd = [sys.executable, "-m", "ygg_runtime", "serve", "--artifact", str(opts.artifact), "--port", str(port),
           "--max-batch", str(max_batch), "--max-queue", str(max(64, 4 * max_batch)), "--model-name", "bench"]
    if not opts.cost_aware:
        cmd.append("--no-cost-aware")
    if not opts.adapt:
        cmd.append("--no-adapt")
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
            if get_status(port, "/v1/models") != 200:
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
