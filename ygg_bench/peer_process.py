"""A family of peers (llama.cpp, transformers) in a child process of its own.

A peer is someone else's native code: a llama.cpp build that trips over the CPU it runs on (its AMX
repack on a Xeon dies with SIGSEGV in the first decode) would take the benchmark, and every result
measured before it, down with it. In a child, such a crash is one line naming the peer and its
signal; the parent keeps every other contestant's runs and writes them.

Timing stays the peer's own (`PeerRun` is measured inside the child, where it generates), so the
pipe between the processes costs none of it. The child is spawned, not forked: a fork of a process
whose OpenMP threads have run can hang in its first parallel region.
"""

from __future__ import annotations

import multiprocessing
import signal
from dataclasses import dataclass

import torch

from ygg_bench.peers import REBUILD_LLAMA, HFPeers, LlamaCppPeers
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.machine import cpu_flags

START_S = 600  # loading a peer's model (transformers may convert a GGUF file first)


class PeerCrashed(YggError):
    """The peer's process died (a signal, or an exit without an answer)."""


def how_it_ended(exitcode: int | None) -> str:
    """A process's end in words: 'was killed by SIGSEGV (signal 11)', 'exited with status 3'."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "a signal"
        return f"was killed by {name} (signal {-exitcode})"
    return f"exited with status {exitcode}"


def crash_hint(kind: str, exitcode: int | None) -> str:
    """What to do about a peer killed by a signal (a negative exit code), where we know: llama.cpp
    built with ggml's AMX path, on a CPU with AMX (ygg_bench.peers.llama_cmake_args)."""
    if exitcode is not None and exitcode < 0 and kind.startswith("llama.cpp") and "amx_tile" in cpu_flags():
        return f" (llama.cpp built with ggml's AMX path dies on this CPU; rebuild it without: {REBUILD_LLAMA})"
    return ""


@dataclass(frozen=True)
class PeerFamily:
    """What the child needs to load a family's peers (picklable: it crosses into a spawned process)."""

    kind: str  # "hf" or "llama.cpp"
    args: tuple
    threads: int

    def load(self) -> HFPeers | LlamaCppPeers:
        torch.set_num_threads(self.threads)
        if self.kind == "llama.cpp":
            return LlamaCppPeers(*self.args)
        target, draft, dtype, device, eos = self.args
        return HFPeers(target, draft, getattr(torch, dtype), device, eos)


def _serve(conn, family: PeerFamily) -> None:
    """The child: load the family, then answer generate requests until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    try:
        peers = family.load()
    except BaseException as e:  # noqa: BLE001 -- whatever it is, the parent reports it in one line
        conn.send(("error", first_line(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            conn.send(("ok", peers.generate(*request)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", first_line(e)))


class PeerProcess:
    """A peer family served by a child process, started on the first request (and again after a
    crash, for the family's other peers). generate() has HFPeers'/LlamaCppPeers' signature."""

    def __init__(self, family: PeerFamily):
        self.family = family
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.conn = None

    def start(self, peer: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, self.family), daemon=True, name=f"ygg-peer-{self.family.kind}")
        self.proc.start()
        child.close()  # only the child holds its end: its death reads as EOF here
        try:
            self._answer(f"peer {peer}", "loading its model", START_S)
        except YggError:
            self.close()  # a load that failed: its process has ended or is stopped here
            raise

    def generate(self, peer: str, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False):
        if self.proc is None or not self.proc.is_alive():
            self.start(peer)
        try:
            self.conn.send((peer, ids, max_new_tokens, temperature, top_p, seed, ignore_eos))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            raise self._crashed(f"peer {peer}", "generating") from None
        return self._answer(f"peer {peer}", "generating")

    def _answer(self, who: str, doing: str, timeout: float | None = None):
        try:
            if timeout is not None and not self.conn.poll(timeout):
                self.close()
                raise PeerCrashed(f"{who} did not finish {doing} in {timeout:.0f} s")
            kind, value = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise self._crashed(who, doing) from None
        if kind == "error":
            raise YggError(value)
        return value

    def _crashed(self, who: str, doing: str) -> PeerCrashed:
        self.proc.join(10)
        code = self.proc.exitcode
        self.close()
        return PeerCrashed(f"{who} crashed {doing}: its process {how_it_ended(code)}{crash_hint(self.family.kind, code)}")

    def close(self) -> None:
        """Stop the child (politely, then by force); safe to call twice."""
        if self.proc is None:
            return
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
        self.conn.close()
        self.proc = self.conn = None
