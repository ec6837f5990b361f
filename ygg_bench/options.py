"""What a user chooses when benchmarking: `ygg bench`'s and `ygg bench-serve`'s options, their
defaults and the peers' names, in one place for the `ygg` command and the Python API.

Imports nothing heavy (no torch): the command line builds its options from this module before it
loads anything, and each options type refuses bad values when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ygg_compile.options import check_limit
from ygg_runtime.errors import YggError
from ygg_runtime.options import ServeOptions, check_max_new_tokens, check_sampling, check_settings

HF_PEERS = ("hf", "hf-assisted", "hf-pld")
LLAMA_PEERS = ("llama.cpp", "llama.cpp-pld")  # an optional extra: pip install -e '.[llama]'
# OpenVINO GenAI, from a venv of its own (`make install-openvino`; `ygg_bench.openvino_peers`)
OPENVINO_PEERS = ("openvino", "openvino-sd", "openvino-pld", "openvino-gguf")
PEERS = HF_PEERS + LLAMA_PEERS + OPENVINO_PEERS
# Each speculative peer's own plain decoding: what its greedy output must equal (its exactness, beside ours)
OWN_PLAIN = {"hf-assisted": "hf", "hf-pld": "hf", "llama.cpp-pld": "llama.cpp", "openvino-sd": "openvino",
             "openvino-pld": "openvino"}
SERVE_CONCURRENCY = (1, 2, 4, 8)  # `ygg bench-serve`'s load levels
SERVE_METHODS = ("egt", "ar")  # and the methods it loads the server with
# Servers `ygg bench-serve` drives beside ours (opt-in: llama-cpp-python's server, the llama extra)
SERVE_PEERS = ("llama.cpp-server",)

MIN_LONG = 64  # the shortest --long prompt: its instruction and some code


@dataclass
class BenchOptions:
    artifact: Path
    prompts: Path | None = None  # Spec-Bench style JSONL; None = the built-in set
    categories: list[str] | None = None
    limit: int | None = None  # prompts per category
    methods: list[str] | None = None  # None = every method of the artifact
    peers: list[str] = field(default_factory=lambda: list(HF_PEERS))  # llama.cpp's are opt-in (an extra)
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    sampling: str | None = None  # at temperature > 0 (None: the artifact's)
    rounds: int = 1
    output: Path | None = None  # None: default_output(artifact)
    resume: bool = False
    command: str = ""
    long: list[int] | None = None  # prompts of about these many tokens in place of the prompt set (ygg_compile.prompts)
    ignore_eos: bool = False  # every contestant generates max_new_tokens, past the answer's end

    def __post_init__(self) -> None:
        check_settings(self.max_new_tokens, self.temperature, self.top_p, self.seed)
        if self.sampling is not None:
            check_sampling(self.sampling)
        check_limit(self.limit)
        if self.long is not None:
            if not self.long or min(self.long) < MIN_LONG:
                raise YggError(f"--long takes prompt lengths in tokens of at least {MIN_LONG}, comma-separated")
            if self.prompts is not None or self.categories or self.limit is not None:
                raise YggError("--long replaces the prompt set: leave out --prompts, --categories and --limit")
        if self.rounds < 1:
            raise YggError(f"--rounds must be at least 1, not {self.rounds}")
        for peer in self.peers:
            if peer not in PEERS:
                raise YggError(f"unknown peer '{peer}' (choose from {', '.join(PEERS)}, or none)")


@dataclass
class ServeBenchOptions:
    artifact: Path
    prompts: Path | None = None
    categories: list[str] | None = None
    limit: int | None = None  # prompts per category
    concurrency: list[int] = field(default_factory=lambda: list(SERVE_CONCURRENCY))
    methods: list[str] = field(default_factory=lambda: list(SERVE_METHODS))
    max_new_tokens: int = 128
    output: Path | None = None
    cost_aware: bool = True
    command: str = ""
    peers: list[str] = field(default_factory=list)  # SERVE_PEERS driven with the same load
    chat: bool = False  # chat requests without max_tokens (the openai client's default), not completions
    kv_cache_gb: float | None = None  # the server's KV cache (None: its default)
    ray: list[int] = field(default_factory=list)  # replica counts: each method also through `ygg serve --ray`
    adapt: bool = True  # the server shapes each request's steps by its acceptance estimate (`--no-adapt`: off)

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1 or max(self.concurrency) > 64:
            raise YggError("--concurrency takes levels in 1..64, e.g. 1,2,4,8")
        if self.ray and (min(self.ray) < 1 or len(set(self.ray)) != len(self.ray)):
            raise YggError("--ray takes distinct replica counts of at least 1, e.g. 1,2")
        ServeOptions(kv_cache_gb=self.kv_cache_gb)  # serve's own check of it
        if unknown := [p for p in self.peers if p not in SERVE_PEERS]:
            raise YggError(f"unknown serving peer '{unknown[0]}' (choose from {', '.join(SERVE_PEERS)}, or none)")
        check_max_new_tokens(self.max_new_tokens)
        check_limit(self.limit)
