"""The benchmarks' commands, `ygg bench` and `ygg bench-serve`, which join the runtime's `ygg` app
(`ygg_runtime.cli`) as this module is imported (an entry point of pyproject.toml's
`yggdrasil.commands`). Each parses and checks its arguments, then, once its extras are found
installed, runs its body in `ygg_bench.commands`; a refused call answers in one line before torch is
imported."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import typer

from ygg_bench.options import HF_PEERS, SERVE_CONCURRENCY, SERVE_METHODS, SERVE_PEERS, BenchOptions, ServeBenchOptions
from ygg_runtime.cli import SAMPLING_HELP, TOOLCHAIN, app, require
from ygg_runtime.errors import YggError
from ygg_runtime.options import DEFAULT_DIR

__all__ = ["app"]


def commands(command: str) -> ModuleType:
    """What the benchmark commands do, imported once a command's arguments have passed their checks
    and its extras are found (the one import of our own inside a function here, on purpose:
    tests/test_imports.py counts it)."""
    require(command)
    from ygg_bench import commands as implementation

    return implementation


def split(values: Optional[list[str]], option: str | None = None) -> Optional[list[str]]:
    """`--methods ar,chain --methods egt` -> [ar, chain, egt]; None when the option was not given
    (an option given with nothing in it, `--categories ""`, is refused: it would mean "all")."""
    if not values:
        return None
    items = [v.strip() for item in values for v in item.split(",") if v.strip()]
    if not items and option:
        raise YggError(f"{option} is empty: name at least one, or leave the option out for all")
    return items


def _lengths(value: str | None) -> list[int] | None:
    """--long's comma-separated token counts (None: not given)."""
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise YggError(f"--long takes token counts, comma-separated (e.g. 1000,4000,16000), not '{value}'") from None


@app.command("bench", rich_help_panel=TOOLCHAIN)
def bench_cmd(
    artifact: Path = typer.Option(DEFAULT_DIR, "--artifact", "-a", help="artifact directory from `ygg compile`"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Spec-Bench style JSONL (default: a small built-in set)"),
    categories: Optional[list[str]] = typer.Option(None, "--categories", help="only these categories (comma-separated)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="at most this many prompts per category"),
    methods: Optional[list[str]] = typer.Option(None, "--methods", help="compiled methods to time (default: all, plus the ablations that apply: egt-fixed without the depth predictor, egt-eager without the compiled forwards, egt-plain / egt-ahead with the stage order the plan did not pick, ar-eager the plain decoding egt-eager is compared with; ar always runs)"),
    peers: list[str] = typer.Option([",".join(HF_PEERS)], "--peers",
                                    help="peers: hf, hf-assisted, hf-pld (transformers), llama.cpp, llama.cpp-pld (llama-cpp-python, the extra '.[llama]'), "
                                         "openvino, openvino-sd, openvino-pld, openvino-gguf (OpenVINO GenAI: make install-openvino), or none"),
    max_new_tokens: int = typer.Option(BenchOptions.max_new_tokens, "--max-new-tokens", "-n", help="tokens to generate per prompt at most"),
    temperature: float = typer.Option(BenchOptions.temperature, "--temperature", "-t", help="0 = greedy (outputs compared with ar's)"),
    top_p: float = typer.Option(BenchOptions.top_p, "--top-p", help="nucleus sampling mass (at temperature > 0)"),
    sampling: Optional[str] = typer.Option(None, "--sampling", help=f"rule at temperature > 0: {SAMPLING_HELP} (default: the artifact's)"),
    rounds: int = typer.Option(BenchOptions.rounds, "--rounds", help="times each prompt runs per contestant (median kept)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="results directory (default: benchmarks/results/<device>)"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted benchmark in the same directory"),
    long: Optional[str] = typer.Option(None, "--long", metavar="TOKENS", help="long prompts in place of the prompt set: code from the standard library to summarise, about this many tokens each (comma-separated, e.g. 1000,4000,16000); reports time to first token and whole-request latency beside TPOT"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="every contestant generates --max-new-tokens tokens, past the answer's end (ours and the peers alike)"),
) -> None:
    """Time every compiled method and the peers (transformers, llama.cpp, OpenVINO GenAI) on the same prompts, interleaved."""
    peer_list = [p for p in split(peers) or [] if p != "none"]
    opts = BenchOptions(
        artifact=artifact, prompts=prompts, categories=split(categories, "--categories"), limit=limit, methods=split(methods, "--methods"),
        peers=peer_list, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        sampling=sampling, rounds=rounds, output=output,
        resume=resume, command=shlex.join(["ygg", *[a for a in sys.argv[1:] if a != "--debug"]]),
        long=_lengths(long), ignore_eos=ignore_eos,
    )
    commands("bench").bench(opts)


@app.command("bench-serve", rich_help_panel=TOOLCHAIN)
def bench_serve_cmd(
    artifact: Path = typer.Option(DEFAULT_DIR, "--artifact", "-a", help="artifact directory from `ygg compile`"),
    concurrency: str = typer.Option(",".join(map(str, SERVE_CONCURRENCY)), "--concurrency", "-c", help="concurrent requests at each level (comma-separated)"),
    methods: str = typer.Option(",".join(SERVE_METHODS), "--methods", help="compiled methods to load the server with (comma-separated)"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Spec-Bench style JSONL (default: a small built-in set)"),
    categories: Optional[list[str]] = typer.Option(None, "--categories", help="only these categories (comma-separated)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="at most this many prompts per category"),
    max_new_tokens: int = typer.Option(ServeBenchOptions.max_new_tokens, "--max-new-tokens", "-n", help="tokens to generate per request at most"),
    no_cost_aware: bool = typer.Option(False, "--no-cost-aware", help="serve without CAST allocation (ablation)"),
    no_adapt: bool = typer.Option(False, "--no-adapt", help="serve without each request's acceptance estimate (ablation)"),
    peers: Optional[list[str]] = typer.Option(None, "--peers", help=f"other servers to drive with the same load ({', '.join(SERVE_PEERS)}; needs the llama extra), or none (the default)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="results directory (default: benchmarks/results/<device>-serve)"),
    chat: bool = typer.Option(False, "--chat", help="chat requests without max_tokens, as the openai client sends them by default (answers run to their end of turn)"),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", metavar="GiB", help="the server's KV cache (default: ygg serve's)"),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="R1,R2", help="each method also through `ygg serve --ray` with these replica counts, sharing the server's threads (needs the ray extra)"),
) -> None:
    """Load `ygg serve` on loopback at several concurrency levels: aggregate tokens/s and per-request TPOT."""
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise YggError(f"--concurrency takes integers, e.g. 1,2,4,8 (not {concurrency})") from None
    try:
        replicas = [int(r) for r in (ray or "").split(",") if r.strip()]
    except ValueError:
        raise YggError(f"--ray takes replica counts, e.g. 1,2 (not {ray})") from None
    opts = ServeBenchOptions(artifact, prompts, split(categories, "--categories"), limit, levels,
                             [m.strip() for m in methods.split(",") if m.strip()], max_new_tokens, output,
                             not no_cost_aware, "ygg " + shlex.join(sys.argv[1:]),
                             [p for p in split(peers, "--peers") or [] if p != "none"],
                             chat, kv_cache_gb, replicas, adapt=not no_adapt)
    commands("bench-serve --ray" if replicas else "bench-serve").bench_serve(opts)
