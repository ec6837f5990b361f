"""The `ygg` command (the script pyproject.toml installs): the runtime's app (`ygg run`, `ygg serve`,
in `ygg_runtime.cli`) plus the toolchain's commands, defined here. Each parses and checks its
arguments, then, once the command's extra is found installed, runs its body in
`ygg_compile.commands`. Light on purpose, like the runtime's half: a refused call answers in one line
before torch or the toolchain is imported."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import typer

from ygg_compile.options import HF_PEERS, SERVE_CONCURRENCY, SERVE_METHODS, SERVE_PEERS, BenchOptions, CompileOptions, ServeBenchOptions
from ygg_compile.registry import model_kind
from ygg_runtime.cli import METHODS, SAMPLING_HELP, TOOLCHAIN, app, main, read_prompt, require
from ygg_runtime.errors import YggError
from ygg_runtime.options import DEFAULT_DIR, check_max_new_tokens
from ygg_runtime.plan import plan_bytes

__all__ = ["app", "main"]


def commands(command: str) -> ModuleType:
    """What the toolchain's commands do, imported once a command's arguments have passed their checks
    and its extra is found: it imports torch and the toolchain (the one import of our own inside a
    function here, on purpose: tests/test_imports.py counts it)."""
    require(command)
    from ygg_compile import commands as implementation

    return implementation


@app.command("compile", rich_help_panel=TOOLCHAIN)
def compile_cmd(
    draft: str = typer.Option(..., "--draft", help="draft model: alias, local HF directory, .gguf file or Hub id"),
    target: str = typer.Option(..., "--target", help="target model (same forms as --draft)"),
    output: Path = typer.Option(DEFAULT_DIR, "-o", "--output", help="artifact directory to write"),
    method: str = typer.Option(CompileOptions.method, "--method", help=f"default method of the artifact: {METHODS}"),
    sampling: str = typer.Option(CompileOptions.sampling, "--sampling", help=f"the artifact's sampling rule at temperature > 0: {SAMPLING_HELP}"),
    device: str = typer.Option(CompileOptions.device, "--device", help="cpu or cuda"),
    dtype: str = typer.Option(CompileOptions.dtype, "--dtype", help="auto (bf16 where the hardware has it), float32, bfloat16, float16"),
    weights: str = typer.Option(CompileOptions.weights, "--weights",
                                help="how weights are held: auto (on CPUs with the fast kernel, a GGUF target's own quantization exactly and a GGUF drafter at 4 bits; else the float dtype), bf16 (the float dtype), int8 (at most 8 bits: a GGUF file's numbers, exactly), int4, int3 or int2 (at most that many bits: wider tensors requantized, lossy); a float checkpoint is quantized here (lossy)"),
    draft_weights: Optional[str] = typer.Option(None, "--draft-weights", help="the drafter's weights, when they differ from --weights (same choices; fewer bits make drafting cheaper and stay lossless: only acceptance moves)"),
    draft_vocab: str = typer.Option(CompileOptions.draft_vocab, "--draft-vocab", help="the drafter's output head: auto (cut to the tokens it needs, the size measured: acceptance x cost), all, or a number of tokens (the most frequent in calibration, then by id); lossless either way: a token without a row is never drafted"),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="longest prompt + generation the artifact serves (default: the models' own, 32768 for the Qwen pair, where this machine's memory holds both caches at that length)"),
    chain_k: Optional[int] = typer.Option(None, "--chain-k", help="chain: drafted tokens per step (default: the method's own; `ygg inspect` shows it)"),
    tree_width: Optional[int] = typer.Option(None, "--tree-width", help="specinfer: children per node (default: the method's own)"),
    tree_depth: Optional[int] = typer.Option(None, "--tree-depth", help="specinfer: tree depth (default: the method's own)"),
    calib: Optional[Path] = typer.Option(
        None, "--calib", help="calibration prompts: .jsonl (turns/prompt), text (prompts split by --- lines) or a directory; default: a shipped set"
    ),
    calib_tokens: int = typer.Option(CompileOptions.calib_tokens, "--calib-tokens", help="tokens the target generates per calibration prompt"),
    calibration_from: Optional[Path] = typer.Option(
        None, "--calibration-from", help="plan from another compile's calibration (an artifact directory, or its calibration.safetensors) instead of calibrating here: acceptance is the pair's, the latency profiles are measured on this device"),
    reprofile: bool = typer.Option(False, "--reprofile", help="measure T(W) even if profiles/ holds a matching profile"),
    profiles: Optional[Path] = typer.Option(None, "--profiles", help="directory of stored latency profiles (default: the checkout's profiles/)"),
    no_predictor: bool = typer.Option(False, "--no-predictor", help="no depth predictor: egt keeps one planned depth"),
    force_predictor: bool = typer.Option(False, "--force-predictor", help="use the depth predictor even if it does not beat the fixed depth on held-out prompts (ablation)"),
    no_aot: bool = typer.Option(False, "--no-aot", help="compile no forwards ahead of time: `ygg run` runs the models eager"),
    quick: bool = typer.Option(False, "--quick", help="a smaller plan, sooner: 6 calibration prompts of at most 32 tokens, no depth predictor"),
) -> None:
    """Convert a draft/target pair and write an artifact that `ygg run` loads."""
    if no_predictor and force_predictor:
        raise YggError("--no-predictor and --force-predictor contradict each other: pick one")
    opts = CompileOptions(
        draft=draft,
        target=target,
        output=output,
        device=device,
        dtype=dtype,
        weights=weights,
        draft_weights=draft_weights,
        draft_vocab=draft_vocab,
        method=method,
        sampling=sampling,
        methods=_given({"chain": {"k": chain_k}, "specinfer": {"width": tree_width, "depth": tree_depth}}),
        max_context=max_context,
        calib=calib,
        calib_tokens=calib_tokens,
        calibration_from=calibration_from,
        reprofile=reprofile,
        profiles=profiles,
        predictor=not no_predictor,
        force_predictor=force_predictor,
        aot=not no_aot,
        quick=quick,
    )
    require("compile")  # a runtime-only install hears of the extra first
    for spec in (draft, target):
        model_kind(spec)  # a name that names no model: one line, before torch loads
    commands("compile").compile(opts)


def _given(methods: dict[str, dict]) -> dict[str, dict]:
    """The method parameters the user set (None: not given, the method's default)."""
    given = {name: {k: v for k, v in params.items() if v is not None} for name, params in methods.items()}
    return {name: params for name, params in given.items() if params}


def _lengths(value: str | None) -> list[int] | None:
    """--long's comma-separated token counts (None: not given)."""
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise YggError(f"--long takes token counts, comma-separated (e.g. 1000,4000,16000), not '{value}'") from None


def _split(values: Optional[list[str]], option: str | None = None) -> Optional[list[str]]:
    """`--methods ar,chain --methods egt` -> [ar, chain, egt]; None when the option was not given
    (an option given with nothing in it, `--categories ""`, is refused: it would mean "all")."""
    if not values:
        return None
    items = [v.strip() for item in values for v in item.split(",") if v.strip()]
    if not items and option:
        raise YggError(f"{option} is empty: name at least one, or leave the option out for all")
    return items


@app.command("bench", rich_help_panel=TOOLCHAIN)
def bench_cmd(
    artifact: Path = typer.Option(DEFAULT_DIR, "--artifact", "-a", help="artifact directory from `ygg compile`"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Spec-Bench style JSONL (default: a small built-in set)"),
    categories: Optional[list[str]] = typer.Option(None, "--categories", help="only these categories (comma-separated)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="at most this many prompts per category"),
    methods: Optional[list[str]] = typer.Option(None, "--methods", help="compiled methods to time (default: all, plus the ablations that apply: egt-fixed without the depth predictor, egt-eager without the compiled forwards, egt-plain / egt-ahead with the stage order the plan did not pick, ar-eager the plain decoding egt-eager is compared with; ar always runs)"),
    peers: list[str] = typer.Option([",".join(HF_PEERS)], "--peers",
                                    help="peers: hf, hf-assisted, hf-pld (transformers), llama.cpp, llama.cpp-pld (llama-cpp-python, the extra '.[llama]'), or none"),
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
    """Time every compiled method and the peers (transformers, llama.cpp) on the same prompts, interleaved."""
    peer_list = [p for p in _split(peers) or [] if p != "none"]
    opts = BenchOptions(
        artifact=artifact, prompts=prompts, categories=_split(categories, "--categories"), limit=limit, methods=_split(methods, "--methods"),
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
    peers: Optional[list[str]] = typer.Option(None, "--peers", help=f"other servers to drive with the same load ({', '.join(SERVE_PEERS)}; needs the llama extra)"),
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
    opts = ServeBenchOptions(artifact, prompts, _split(categories, "--categories"), limit, levels,
                             [m.strip() for m in methods.split(",") if m.strip()], max_new_tokens, output,
                             not no_cost_aware, "ygg " + shlex.join(sys.argv[1:]), _split(peers, "--peers") or [],
                             chat, kv_cache_gb, replicas)
    commands("bench-serve --ray" if replicas else "bench-serve").bench_serve(opts)


cache_app = typer.Typer(no_args_is_help=True, help="List or clear what Yggdrasil keeps in the user cache "
                        "($YGG_CACHE, else ~/.cache/yggdrasil): all of it is rebuilt when next needed.")
app.add_typer(cache_app, name="cache", rich_help_panel=TOOLCHAIN)


@cache_app.command("ls")
def cache_ls() -> None:
    """Every entry of the cache: its kind, what it is, its size and when it was last used."""
    commands("cache").cache_ls()


@cache_app.command("clear")
def cache_clear(
    kinds: Optional[list[str]] = typer.Argument(None, metavar="[KIND]...", help="only these kinds (`ygg cache ls` names them); default: all"),
) -> None:
    """Remove cache entries (all, or those of the kinds given); entries being written are left."""
    commands("cache").cache_clear(kinds or None)


@app.command("inspect", rich_help_panel=TOOLCHAIN)
def inspect_cmd(
    artifact: Path = typer.Argument(DEFAULT_DIR, metavar="[DIR]", help="artifact directory"),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="a prompt (or a file holding one): run every method on it and draw a tree"),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="whose tree to draw (default: the plan's method)"),
    step: int = typer.Option(1, "--step", help="which decoding step's tree to draw"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="tokens each method generates on the prompt"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="where the PNGs go (default: DIR-inspect)"),
) -> None:
    """Show what the plan is and why: step shapes, modelled costs, T(W) curves, an example tree."""
    if step < 1:
        raise YggError("--step must be at least 1")
    text = None
    if prompt is not None:
        text = read_prompt(prompt) if Path(prompt).is_file() else prompt
        if not text.strip():
            raise YggError("the prompt is empty")
    check_max_new_tokens(max_new_tokens)
    plan_bytes(artifact)
    commands("inspect").inspect(artifact, text, method, step, max_new_tokens, output)
