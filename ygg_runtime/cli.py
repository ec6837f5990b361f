"""The `ygg` command (the script pyproject.toml installs): `ygg run` and `ygg serve`, the error
handling every command shares, and the check that a command's libraries are installed. The
toolchain's commands (compile, inspect, cache) and the benchmarks' (bench, bench-serve) join this app
from the modules that declare them as entry points (`COMMANDS`: `ygg_compile.cli`, `ygg_bench.cli`),
so the runtime names neither.

Light on purpose (typer and rich, our option types): a refused call, a missing prompt file or
artifact or a bad option, answers in one line before torch is imported. Every failure a user can
cause ends in one line on stderr and exit code 1; `--debug` (anywhere on the command line) shows the
traceback instead."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ygg_runtime.errors import YggError, first_line
from ygg_runtime.options import DEFAULT_DIR, MAX_NEW_TOKENS, Ablation, RayOptions, RunOptions, ServeOptions
from ygg_runtime.schema.params import PARAMS
from ygg_runtime.schema.plan import plan_bytes

METHODS = ", ".join(PARAMS)  # for help strings: every method, as the schema registers them
SAMPLING_HELP = "coupled (every method prints the text `ar` prints with the same seed) or rejection"
RUNTIME = "Run an artifact"  # the help's two panels: what the runtime install does ...
TOOLCHAIN = r"Make and measure artifacts (pip install 'yggdrasil\[compile]')"  # ... and what the toolchain adds (rich markup)

# What each command needs beyond the runtime's own dependencies: the extra of pyproject.toml that
# installs it and the modules that extra provides (a test holds these to pyproject.toml's extras).
EXTRAS = {
    "serve": ("fastapi", "uvicorn", "pydantic", "prometheus_client"),
    "compile": ("transformers", "accelerate", "huggingface_hub", "gguf", "sklearn", "matplotlib"),
    "ray": ("ray", "psutil"),
}
NEEDS = {"run": (), "serve": ("serve",), "serve --ray": ("serve", "ray"), "compile": ("compile",), "bench": ("compile",),
         "bench-serve": ("compile", "serve"), "bench-serve --ray": ("compile", "serve", "ray"), "inspect": ("compile",), "cache": ("compile",)}

COMMANDS = "yggdrasil.commands"  # the entry-point group of the modules that add commands to `app`

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Yggdrasil: lossless, latency-optimal tree speculative decoding, compiled ahead of time.",
)


def require(command: str) -> None:
    """Refuse in one line a command whose extra is not installed, naming the pip line that installs
    it (find_spec looks for a module without importing it)."""
    for extra in NEEDS[command]:
        missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
        if missing:
            raise YggError(f"`ygg {command}` needs the '{extra}' extra, which is not installed (no {', '.join(missing)}): "
                           f"pip install 'yggdrasil[{extra}]'")


@app.command("run", rich_help_panel=RUNTIME)
def run_cmd(
    prompt_file: str = typer.Argument(..., metavar="PROMPT_FILE", help="file holding the prompt, or - for stdin"),
    artifact: Path = typer.Option(DEFAULT_DIR, "--artifact", "-a", help="artifact directory from `ygg compile`"),
    method: Optional[str] = typer.Option(None, "--method", "-m", help=f"{METHODS} (default: the plan's)"),
    max_new_tokens: int = typer.Option(MAX_NEW_TOKENS, "--max-new-tokens", "-n", help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples losslessly"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass"),
    seed: Optional[int] = typer.Option(None, "--seed", help="random seed for sampling"),
    sampling: Optional[str] = typer.Option(None, "--sampling", help=f"rule at temperature > 0: {SAMPLING_HELP} (default: the plan's)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    stats: bool = typer.Option(False, "--stats", help="print a table of decoding statistics (stderr)"),
    raw: bool = typer.Option(False, "--raw", help="do not wrap the prompt in the model's chat template"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="always generate --max-new-tokens tokens"),
    draft_window: Optional[int] = typer.Option(None, "--draft-window", metavar="K", help="the drafter reads only the prompt's last K tokens (0: all of it; default: as the plan prices the request, all when --method is given)"),
    no_predictor: bool = typer.Option(False, "--no-predictor", help="egt: ignore the depth predictor, keep the planned depth"),
    no_graft: bool = typer.Option(False, "--no-graft", help="egt: draft only, without grafting retrieved tokens into its trees"),
    no_adapt: bool = typer.Option(False, "--no-adapt", help="egt, pld: shape every step as planned, without learning this request's acceptance (for A/B)"),
    eager: bool = typer.Option(False, "--eager", help="run the models eager, not through the artifact's compiled forwards"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default and only choice: the artifact's)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="must be the artifact's (default: the artifact's)"),
    expect_plan: Optional[str] = typer.Option(None, "--expect-plan", metavar="SHA256", help="refuse the artifact unless its plan.yaml has this sha256 (`ygg compile` prints it)"),
) -> None:
    """Generate from a prompt with a compiled artifact: exactly the target's own output, faster."""
    prompt = read_prompt(prompt_file)
    options = RunOptions(max_new_tokens, temperature, top_p, seed, sampling, method, draft_window, raw, ignore_eos,
                         adapt=not no_adapt, ablation=Ablation(predictor=not no_predictor, graft=not no_graft, eager=eager))
    plan_bytes(artifact, expect_plan)
    require("run")
    from ygg_runtime import run  # torch and the models: only once the arguments have passed

    run.run(prompt, artifact, options, as_json=as_json, stats=stats, device=device, dtype=dtype, expect_plan=expect_plan)


@app.command("serve", rich_help_panel=RUNTIME)
def serve_cmd(
    artifact: Path = typer.Option(DEFAULT_DIR, "--artifact", "-a", help="artifact directory from `ygg compile`"),
    host: str = typer.Option(ServeOptions.host, "--host", help="address to bind (loopback unless told otherwise)"),
    port: int = typer.Option(ServeOptions.port, "--port", help="TCP port"),
    max_batch: int = typer.Option(ServeOptions.max_batch, "--max-batch", help="requests decoded together at most"),
    max_queue: int = typer.Option(ServeOptions.max_queue, "--max-queue", help="requests waiting for a batch row at most (more: 429)"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the model name clients send (default: the target's)"),
    no_cost_aware: bool = typer.Option(False, "--no-cost-aware", help="keep every request's own tree under load (no CAST allocation)"),
    no_adapt: bool = typer.Option(False, "--no-adapt", help="shape every request's steps as planned, without learning its acceptance (for A/B)"),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", metavar="GiB", help="the KV cache both models share (default: half the free memory, at most what --max-batch sequences of the artifact's context use)"),
    eager: bool = typer.Option(False, "--eager", help="run the models eager, not through the artifact's compiled forwards"),
    expect_plan: Optional[str] = typer.Option(None, "--expect-plan", metavar="SHA256", help="refuse the artifact unless its plan.yaml has this sha256 (`ygg compile` prints it)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="YGG_API_KEY", metavar="KEY", show_envvar=True, help="every /v1 request must send `Authorization: Bearer KEY` (else 401)"),
    ray: bool = typer.Option(False, "--ray", help="serve as replicas of a Ray Serve application; --artifact may then be a directory of artifacts, one per machine kind (pip install 'yggdrasil[ray]')", rich_help_panel="Ray Serve"),
    replicas: int = typer.Option(1, "--replicas", help="--ray: replicas to run", rich_help_panel="Ray Serve"),
    autoscale: Optional[str] = typer.Option(None, "--autoscale", metavar="MIN,MAX", help="--ray: as many replicas as the load asks, between MIN and MAX", rich_help_panel="Ray Serve"),
    replica_threads: Optional[int] = typer.Option(None, "--replica-threads", help="--ray: torch threads (and Ray CPUs) a replica (default: this machine's cores over the replicas; 1 on a cluster joined)", rich_help_panel="Ray Serve"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="--ray: join this running Ray cluster (default: start one of this machine alone, on loopback)", rich_help_panel="Ray Serve"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="--ray: the Prometheus port of the Ray this command starts, with every replica's metrics", rich_help_panel="Ray Serve"),
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API, its requests decoded together."""
    opts = ServeOptions(host, port, max_batch, max_queue, cost_aware=not no_cost_aware, kv_cache_gb=kv_cache_gb,
                        api_key=api_key, adapt=not no_adapt)
    given = {"--replicas": replicas != 1, "--autoscale": autoscale is not None, "--replica-threads": replica_threads
             is not None, "--ray-address": ray_address is not None, "--metrics-port": metrics_port is not None}
    if not ray and any(given.values()):
        raise YggError(f"{', '.join(k for k, v in given.items() if v)} needs --ray")
    if given["--replicas"] and given["--autoscale"]:
        raise YggError("give --replicas or --autoscale, not both")
    if not ray:
        opts.check_address()
        plan_bytes(artifact, expect_plan)
        require("serve")
        from ygg_runtime.serving import app as serve  # torch, FastAPI and the models: only once the arguments have passed

        serve.serve_artifact(opts, artifact, model_name, eager, expect_plan)
        return
    ray_opts = RayOptions(replicas, RayOptions.parse_autoscale(autoscale), replica_threads, ray_address, metrics_port)
    if ray_address is None:
        opts.check_address()
    require("serve --ray")
    from ygg_runtime.serving import ray_serve

    ray_serve.candidates(artifact)  # one line now for a directory without artifacts or with a broken plan
    ray_serve.serve_ray(opts, ray_opts, artifact, model_name, eager, expect_plan)



def read_prompt(spec: str) -> str:
    """The prompt in a file (or on stdin for -), refused in one line when it is not text."""
    if spec == "-":
        if sys.stdin is None or sys.stdin.closed:
            raise YggError("no standard input to read the prompt from (it is closed); give a prompt file")
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError:
            raise YggError("the prompt on standard input is not UTF-8 text") from None
    else:
        path = Path(spec)
        if path.is_dir():
            raise YggError(f"prompt file {spec} is a directory; give a text file (or - for stdin)")
        if not path.exists():
            raise YggError(f"prompt file {spec} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise YggError(f"prompt file {spec} is not UTF-8 text") from None
        except OSError as e:
            raise YggError(f"cannot read prompt file {spec}: {e.strerror or e}") from None
    if "\x00" in text:
        raise YggError(f"the prompt in {spec} holds NUL bytes: it looks binary, not text")
    if not text.strip():
        raise YggError(f"the prompt in {spec} is empty")
    return text.rstrip("\n")


def add_commands() -> None:
    """Import every module an installed package declares in `COMMANDS` (in name order): each adds its
    commands to `app`, light as this module is (its bodies load when a command runs). Through the
    import statement's own path, which `python -X importtime` reports (tests read what a command
    imported from it)."""
    from importlib.metadata import entry_points

    for point in sorted(entry_points(group=COMMANDS), key=lambda p: p.name):
        __import__(point.module)


def main() -> None:
    debug = "--debug" in sys.argv or os.environ.get("YGG_DEBUG") == "1"
    args = [a for a in sys.argv[1:] if a != "--debug"]
    try:
        add_commands()
        code = app(args=args, standalone_mode=False, prog_name="ygg")
        if code == 130:  # typer turns a Ctrl-C into exit code 130, which click returns here
            raise KeyboardInterrupt
        if isinstance(code, int) and code:
            sys.exit(code)
    except YggError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, typer.Abort):
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.TyperException as e:  # a usage error (typer's vendored click raises it): one line, not click's box
        ctx = getattr(e, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        print(f"error: {e.format_message()}{where}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:
        if debug:
            raise
        detail = first_line(e)
        what = detail if detail == type(e).__name__ else f"{type(e).__name__}: {detail}"
        print(f"error: {what} (run with --debug for the traceback)", file=sys.stderr)
        sys.exit(1)
