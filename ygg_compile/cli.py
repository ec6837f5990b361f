"""The toolchain's half of the `ygg` command: `ygg compile`, `ygg inspect` and `ygg cache`, added to
the runtime's app (`ygg run`, `ygg serve`, in `ygg_runtime.cli`, the script pyproject.toml installs)
as this module is imported (an entry point of `yggdrasil.commands`). Each parses and checks its arguments, then,
once the command's extra is found installed, runs its body in `ygg_compile.commands`. Light on purpose, like the runtime's half: a refused call answers in one line
before torch or the toolchain is imported."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Optional

import typer

from ygg_compile.options import CompileOptions
from ygg_compile.registry import model_kind
from ygg_runtime.cli import METHODS, SAMPLING_HELP, TOOLCHAIN, app, main, read_prompt, require
from ygg_runtime.errors import YggError
from ygg_runtime.options import DEFAULT_DIR, check_max_new_tokens
from ygg_runtime.schema.plan import plan_bytes

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
