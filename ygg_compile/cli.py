"""The `ygg` command. Every failure a user can cause ends in one line on stderr and exit code 1;
`--debug` (anywhere on the command line) shows the traceback instead."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ygg_runtime.artifact import DEFAULT_DIR
from ygg_runtime.errors import YggError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Yggdrasil: lossless, latency-optimal tree speculative decoding, compiled ahead of time.",
)


@app.command("compile")
def compile_cmd(
    draft: str = typer.Option(..., "--draft", help="draft model: alias, local HF directory, .gguf file or Hub id"),
    target: str = typer.Option(..., "--target", help="target model (same forms as --draft)"),
    output: Path = typer.Option(DEFAULT_DIR, "-o", "--output", help="artifact directory to write"),
    method: str = typer.Option("specinfer", "--method", help="default method of the artifact: ar, chain, specinfer"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 where the hardware has it), float32, bfloat16, float16"),
    max_context: int = typer.Option(4096, "--max-context", help="longest prompt + generation the artifact serves"),
    chain_k: int = typer.Option(4, "--chain-k", help="chain: drafted tokens per step"),
    tree_width: int = typer.Option(2, "--tree-width", help="specinfer: children per node"),
    tree_depth: int = typer.Option(3, "--tree-depth", help="specinfer: tree depth"),
) -> None:
    """Convert a draft/target pair and write an artifact that `ygg run` loads."""
    from ygg_compile.build import CompileOptions, compile_artifact
    from ygg_compile.ui import RichReporter, err

    opts = CompileOptions(
        draft=draft,
        target=target,
        output=output,
        device=device,
        dtype=dtype,
        method=method,
        methods={"ar": {}, "chain": {"k": chain_k}, "specinfer": {"width": tree_width, "depth": tree_depth}},
        max_context=max_context,
    )
    with RichReporter() as ui:
        plan = compile_artifact(opts, ui)
    models = plan["models"]
    err.print(
        f"[green]wrote[/] {output}  target {models['target']['spec']} ({models['target']['parameters'] / 1e6:.0f}M), "
        f"draft {models['draft']['spec']} ({models['draft']['parameters'] / 1e6:.0f}M), {plan['dtype']} on "
        f"{plan['device']}, default method {plan['method']} — try: ygg run prompt.txt --artifact {output} --stats"
    )


@app.command("run")
def run_cmd(
    prompt_file: str = typer.Argument(..., metavar="PROMPT_FILE", help="file holding the prompt, or - for stdin"),
    artifact: Path = typer.Option(DEFAULT_DIR, "--artifact", "-a", help="artifact directory from `ygg compile`"),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="ar, chain or specinfer (default: the plan's)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples losslessly"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass"),
    seed: Optional[int] = typer.Option(None, "--seed", help="random seed for sampling"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    stats: bool = typer.Option(False, "--stats", help="print a table of decoding statistics (stderr)"),
    raw: bool = typer.Option(False, "--raw", help="do not wrap the prompt in the model's chat template"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="always generate --max-new-tokens tokens"),
) -> None:
    """Generate from a prompt with a compiled artifact: exactly the target's own output, faster."""
    prompt = _read_prompt(prompt_file)
    import ygg_runtime

    decoder = ygg_runtime.load(artifact)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = decoder.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        method=method,
        raw=raw,
        ignore_eos=ignore_eos,
        on_text=None if as_json else stream,
    )
    if as_json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if stats:
        from ygg_compile.ui import err, stats_table

        err.print(stats_table(result.metrics, f"{result.method} · {artifact}"))


def _read_prompt(spec: str) -> str:
    if spec == "-":
        text = sys.stdin.read()
    else:
        path = Path(spec)
        if not path.is_file():
            raise YggError(f"prompt file {spec} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise YggError(f"prompt file {spec} is not UTF-8 text") from None
    if not text.strip():
        raise YggError(f"the prompt in {spec} is empty")
    return text.rstrip("\n")


def main() -> None:
    import click

    debug = "--debug" in sys.argv or os.environ.get("YGG_DEBUG") == "1"
    args = [a for a in sys.argv[1:] if a != "--debug"]
    try:
        app(args=args, standalone_mode=False, prog_name="ygg")
    except YggError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, click.exceptions.Abort):
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        if debug:
            raise
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {detail} (run with --debug for the traceback)", file=sys.stderr)
        sys.exit(1)
