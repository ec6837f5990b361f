"""The one harness every benchmark runs on: `ygg bench`, `ygg bench-serve` and each script in
benchmarks/. What makes two figures comparable lives here, once:

- `parser`: the arguments every benchmark takes (`-o/--out`, `--repeats`, `--threads`; an artifact
  and `--widths` where it has them), parsed and checked the same way everywhere;
- `interleaved` (with `rotated`, `time_ms`, `median_ms`, `medians`, `ratio_median`): the timer,
  `ygg_compile.timing`'s, the one the compile's latency profiles are measured with too. Every
  candidate once per round, in an order rotated from round to round, so a slow drift of a shared
  machine hits all alike; medians over the rounds. On a GPU each call is timed by CUDA events;
- `machine`: what ran it (CPU model, vector ISA class and flags, threads, cores, torch, python, GPU)
  and its two roofs, read bandwidth and compute peak, measured beside the run: two machines of one
  name differ in bandwidth, and a figure is read against its machine's floor;
- `revision`: the repository's commit, and whether the tree differed from it;
- `write_json`: one writer: the result with the command that made it, the machine and the
  revision, written atomically (a reader never sees half a file).

The runtime never imports this package; it imports the runtime and the toolchain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from ygg_compile import hardware
from ygg_compile.roofline import Roofs, measure_roofs
from ygg_compile.timing import interleaved, median_ms, medians, ratio_median, rotated, time_ms  # noqa: F401  (the timer)
from ygg_runtime.errors import YggError
from ygg_runtime.files import write_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"  # one folder per machine (benchmarks/results/README.md indexes them)


# ---------------------------------------------------------------- arguments


def ints(text: str) -> list[int]:
    """A comma-separated list of positive integers (widths, lengths, replica counts)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes integers, comma-separated (e.g. 1,2,4,8), not '{text}'") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"takes integers of at least 1, comma-separated, not '{text}'")
    return values


def parser(doc: str | None, *, artifact: str | None = None, repeats: int | None = 5,
           widths: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's argument parser with the arguments every benchmark shares: `-o/--out` (where
    its results go), `--repeats` (timed rounds; None: the benchmark has none), `--threads` (torch
    threads; default: torch's own), the artifact it reads (positional; `artifact` is its default,
    "" for a required one, None for none) and `--widths` (forward widths; `widths` their default)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if artifact is not None:
        if artifact:
            ap.add_argument("artifact", type=Path, nargs="?", default=Path(artifact), help="artifact directory")
        else:
            ap.add_argument("artifact", type=Path, help="artifact directory")
    if widths is not None:
        ap.add_argument("--widths", type=ints, default=ints(widths), help="forward widths, comma-separated")
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats, help="timed rounds (medians over them)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("-o", "--out", type=Path, help="where the results go")
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, check what every benchmark shares and apply --threads before anything is timed."""
    args = ap.parse_args(argv)
    if getattr(args, "repeats", 1) < 1:
        ap.error("--repeats must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    artifact = getattr(args, "artifact", None)
    if artifact is not None and not (Path(artifact) / "plan.yaml").is_file():
        ap.error(f"{artifact} is not an artifact directory (no plan.yaml): `ygg compile` writes one")
    return args


# ---------------------------------------------------------------- the timer


def child_json(cmd: list[str], env: dict | None, what: str) -> dict:
    """The result of a benchmark's child process (a setting fixed per process: an environment
    variable, a library, another revision's tree): the JSON of its last line of output; its failure
    one line naming `what`."""
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the child {what} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the machine and the revision


def roofs(device: str | torch.device = "cpu") -> Roofs:
    """This machine's two roofs, measured now (a second or two): the read bandwidth and the compute
    peak (int8 dot products on a CPU, bf16 tensor cores on a GPU). On a CPU this registers the
    checkout's kernel library when none is loaded yet."""
    if torch.device(device).type == "cuda":
        return measure_roofs(1 << 30, repeats=5, device=device)
    return measure_roofs(512 << 20, repeats=3)


def machine(device: str = "cpu", dtype: str | None = None, measured: Roofs | None = None) -> dict:
    """What ran the benchmark, and its roofs (`measured`, else measured now: where there is no
    kernel library or GPU to measure them, the record says so)."""
    cpu = hardware.cpu_info()
    info = {
        "cpu": cpu.model,
        "isa": hardware.isa_class(cpu.isa) or "none",  # the class the device slug names (avx2, avx512, amx)
        "cpu_flags": list(cpu.isa),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "device": str(device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if dtype is not None:
        info["dtype"] = dtype
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    gpu = str(device).startswith("cuda") and torch.cuda.is_available()
    if gpu:
        info["gpu"] = torch.cuda.get_device_name()
    try:
        measured = measured or roofs(device if gpu else "cpu")
    except (YggError, OSError, RuntimeError) as e:  # no compiler for the kernel library, say
        info["roofs"] = f"not measured: {e}"
        return info
    info["roofs"] = measured.as_dict()
    info["read_bandwidth_gbs"] = round(measured.bandwidth / 1e9, 1)
    info["int8_peak_gmacs" if not gpu else "matmul_peak_gmacs"] = round(measured.int8_peak / 1e9)
    return info


def revision() -> dict:
    """The commit the benchmark ran at and whether tracked files differed from it; {} outside a
    git checkout (the GPU machine gets a copy of the tree)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def at_revision(record: dict) -> str:
    """", at 1d32d63" (", at 1d32d63 with uncommitted changes") for a result's summary; "" where none
    was recorded."""
    rev = record.get("revision") or {}
    if not rev.get("commit"):
        return ""
    return f", at {rev['commit'][:7]}" + (" with uncommitted changes" if rev.get("dirty") else "")


def command() -> str:
    """This process's command line, as a user would type it again."""
    argv0 = Path(sys.argv[0])
    head = ["python", sys.argv[0]] if argv0.suffix == ".py" else [argv0.name]
    return shlex.join(head + sys.argv[1:])


def header(device: str = "cpu", dtype: str | None = None, measured: Roofs | None = None,
           cmd: str | None = None) -> dict:
    """What every result file starts with: the command, the revision and the machine."""
    return {"command": cmd or command(), "revision": revision(), "machine": machine(device, dtype, measured)}


def write_json(path: Path, result: dict, *, device: str = "cpu", dtype: str | None = None,
               measured: Roofs | None = None, cmd: str | None = None, markdown: str | None = None) -> dict:
    """`result` under the header, written atomically (and `markdown`, its table for people, beside
    it as the same name's .md); returns what was written. What `result` already carries of the
    header (its command, revision or machine) is kept, the rest filled in."""
    record = {"command": result.get("command") or cmd or command(),
              "revision": result["revision"] if "revision" in result else revision(),
              "machine": result["machine"] if "machine" in result else machine(device, dtype, measured)}
    record |= {k: v for k, v in result.items() if k not in record}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(record, indent=1, default=str) + "\n").encode())
    if markdown is not None:
        write_atomic(path.with_suffix(".md"), markdown.encode())
    return record


def output(out: Path | None, slug_suffix: str, device: str = "cpu") -> Path:
    """Where results go: `out` when given, else benchmarks/results/<device slug><suffix>."""
    return out if out is not None else RESULTS / (hardware.device_slug(device) + slug_suffix)
