"""A family of peers (llama.cpp, transformers) in a child process of its own.

A peer is someone else's native code: a llama.cpp build that trips over the CPU it runs on (its AMX
repack on a Xeon dies with SIGSEGV in the first decode) would take the benchmark, and every result
measured before it, down with it. In a child, such a crash is one line naming the peer and its
signal; the parent keeps every other contestant's runs and writes them.

OpenVINO's peers need an interpreter of their own (its venv: `ygg_bench.openvino_peers`): their child is
that interpreter running `openvino_child.py` by path, spoken to over a socket pair with the same
pickled messages, so a crash there reads the same way.

Timing stays the peer's own (`PeerRun` is measured inside the child, where it generates), so the
pipe between the processes costs none of it. The child is spawned, not forked: a fork of a process
whose OpenMP threads have run can hang in its first parallel region.
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from ygg_bench import openvino_peers
from ygg_bench.peers import REBUILD_LLAMA, HFPeers, LlamaCppPeers, PeerRun
from ygg_runtime.decoding.metrics import tpot_ms
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

    kind: str  # "hf", "llama.cpp" or "openvino"
    args: tuple
    threads: int
    # openvino: each peer's GenerationConfig settings (tuned: `openvino_peers.tune`), sent with every request
    settings: dict = field(default_factory=dict, compare=False)

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


class _Interpreter:
    """Another interpreter's process, with the few `multiprocessing.Process` methods PeerProcess uses
    (its exit code is negative for a signal, as theirs), and its stderr kept for a crash's line."""

    def __init__(self, python: str, script: str, fd: int):
        self.log = tempfile.TemporaryFile()
        self.popen = subprocess.Popen([python, script, str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        self.popen.kill()

    def last_line(self) -> str:
        self.log.seek(0)
        lines = [x.strip() for x in self.log.read().decode(errors="replace").splitlines() if x.strip()]
        return lines[-1] if lines else ""


class PeerProcess:
    """A peer family served by a child process, started on the first request (and again after a
    crash, for the family's other peers). generate() has HFPeers'/LlamaCppPeers' signature."""

    def __init__(self, family: PeerFamily):
        self.family = family
        self.proc: multiprocessing.process.BaseProcess | _Interpreter | None = None
        self.conn = None

    def start(self, peer: str) -> None:
        if self.family.kind == "openvino":
            python, target, draft, gguf, _ = self.family.args
            mine, theirs = socket.socketpair()
            self.proc = _Interpreter(python, str(openvino_peers.CHILD), theirs.fileno())
            theirs.close()  # only the child holds its end: its death reads as EOF here
            self.conn = Connection(mine.detach())
            self.conn.send(("load", {"target": target, "draft": draft, "gguf": gguf, "threads": self.family.threads}))
        else:
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_serve, args=(child, self.family), daemon=True,
                                    name=f"ygg-peer-{self.family.kind}")
            self.proc.start()
            child.close()
        try:
            self._answer(f"peer {peer}", "loading its model", START_S)
        except YggError:
            self.close()  # a load that failed: its process has ended or is stopped here
            raise

    def generate(self, peer: str, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False,
                 settings: dict | None = None) -> PeerRun:
        """A peer's run; settings: an OpenVINO peer's GenerationConfig changes (default: its tuned ones)."""
        request = (peer, ids, max_new_tokens, temperature, top_p, seed, ignore_eos)
        if self.family.kind == "openvino":
            if temperature > 0:
                raise YggError(f"peer {peer} is measured greedy only here (its sampled output cannot be compared)")
            chosen = self.family.settings.get(peer, {}) if settings is None else settings
            request = (peer, ids, max_new_tokens, self.family.args[4], ignore_eos, chosen)
        if self.proc is None or not self.proc.is_alive():
            self.start(peer)
        try:
            self.conn.send(request)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            raise self._crashed(f"peer {peer}", "generating") from None
        answer = self._answer(f"peer {peer}", "generating")
        return self._openvino_run(answer) if self.family.kind == "openvino" else answer

    @staticmethod
    def _openvino_run(a: dict) -> PeerRun:
        """The child's stamps as a PeerRun, timed by the one definition (`tpot_ms`)."""
        marks, tokens = a["marks"], a["tokens"]
        if not marks:
            return PeerRun(tokens, 0.0, a["end"] - a["start"], a["end"] - a["start"], 0)
        return PeerRun(tokens, tpot_ms(a["start"], marks[0][0], marks[-1][0], len(tokens)), a["end"] - a["start"],
                       marks[0][0] - a["start"], len(marks))

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
        said = self.proc.last_line() if isinstance(self.proc, _Interpreter) else ""
        self.close()
        return PeerCrashed(f"{who} crashed {doing}: its process {how_it_ended(code)}{crash_hint(self.family.kind, code)}"
                           + (f" ({said})" if said else ""))

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
        if isinstance(self.proc, _Interpreter):
            self.proc.log.close()
        self.proc = self.conn = None
