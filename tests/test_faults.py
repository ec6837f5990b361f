"""Faults and bad input, as a table: every case is the real `ygg` command, and each must end in one
line on stderr naming the problem, a non-zero exit, no traceback, and nothing changed on disk.
Also the artifact's trust model: a plan hash a deployment pins, YAML read safely, modes by umask."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from helpers import YGG, assert_one_line_error, ygg

N = ["--max-new-tokens", "4"]
TABLE = os.environ.get("YGG_FAULT_TABLE")  # a JSONL file each table case appends its outcome to (for the docs)


def _record(command: str, case: str, said: str, code: int) -> None:
    """The last line a case printed on stderr and its exit code, into the YGG_FAULT_TABLE file."""
    if TABLE:
        lines = said.strip().splitlines() or ["(nothing)"]
        with open(TABLE, "a") as f:
            f.write(json.dumps({"command": command, "case": case, "line": lines[-1], "code": code}) + "\n")


def _damaged(change: Callable[[Path], None]) -> Callable[[Path, Path], list]:
    """A case on a copy of the artifact that `change` damages (the suite's artifact stays intact)."""

    def setup(art: Path, tmp: Path) -> list:
        copy = tmp / "art"
        shutil.copytree(art, copy)
        change(copy)
        return ["p.txt", "-a", copy, *N]

    return setup


def _plan_line(art: Path, old: str, new: str) -> None:
    plan = art / "plan.yaml"
    text = plan.read_text()
    assert old in text
    plan.write_text(text.replace(old, new, 1))


def _flip_bytes(path: Path, at: int) -> None:
    """Change bytes in place, keeping the size (so only the sha256 can tell)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(8)
        f.seek(at)
        f.write(bytes(x ^ 0xFF for x in b))


def _write(name: str, data: bytes) -> Callable[[Path, Path], list]:
    def setup(art: Path, tmp: Path) -> list:
        (tmp / name).write_bytes(data)
        return [name, "-a", art, *N]

    return setup


def _args(*extra: str) -> Callable[[Path, Path], list]:
    return lambda art, tmp: ["p.txt", "-a", art, *extra]


# case: (setup(artifact, tmp) -> the arguments after `ygg run`, words the line must hold, exit code)
RUN_CASES = {
    "prompt file missing": (lambda art, tmp: ["nope.txt", "-a", art, *N], "nope.txt does not exist", 1),
    "prompt file empty": (_write("empty.txt", b""), "is empty", 1),
    "prompt only blank lines": (_write("blank.txt", b"\n \n\t\n"), "is empty", 1),
    "prompt not UTF-8": (_write("latin1.txt", "café crème".encode("latin-1")), "is not UTF-8 text", 1),
    "prompt binary": (_write("blob.bin", b"\x7fELF\x02\x01\x01\x00\x00\x00abc"), "NUL bytes", 1),
    "prompt path is a directory": (lambda art, tmp: [tmp, "-a", art, *N], "is a directory", 1),
    "max-new-tokens 0": (_args("--max-new-tokens", "0"), "--max-new-tokens must be at least 1, not 0", 1),
    "max-new-tokens -1": (_args("--max-new-tokens", "-1"), "--max-new-tokens must be at least 1, not -1", 1),
    "max-new-tokens beyond the context": (_args("--max-new-tokens", "100000"), "does not fit the context", 1),
    "max-new-tokens not a number": (_args("--max-new-tokens", "many"), "Invalid value for '--max-new-tokens'", 2),
    "temperature -1": (_args(*N, "--temperature", "-1"), "--temperature must be a finite number >= 0", 1),
    "temperature NaN": (_args(*N, "--temperature", "nan"), "not nan", 1),
    "temperature inf": (_args(*N, "--temperature", "inf"), "not inf", 1),
    "top-p 0": (_args(*N, "-t", "1", "--top-p", "0"), "--top-p must be in (0, 1], not 0.0", 1),
    "top-p 1.5": (_args(*N, "-t", "1", "--top-p", "1.5"), "--top-p must be in (0, 1], not 1.5", 1),
    "seed -1": (_args(*N, "-t", "1", "--seed", "-1"), "--seed must be in [0, 2^63), not -1", 1),
    "unknown method": (_args(*N, "--method", "medusa"), "method 'medusa' is not in this artifact", 1),
    "device cuda for a cpu artifact": (_args(*N, "--device", "cuda"), "compiled for cpu, not cuda", 1),
    "a cuda artifact on a machine without one": (_damaged(lambda a: _plan_line(a, "device: cpu", "device: cuda")),
                                                 "compiled for cuda but CUDA is not available here", 1),
    "dtype other than the artifact's": (_args(*N, "--dtype", "bfloat16"), "float32", 1),
    "unknown option": (_args("--temprature", "1"), "No such option: --temprature", 2),
    "artifact missing": (lambda art, tmp: ["p.txt", "-a", tmp / "none", *N], "does not exist (run `ygg compile` first)", 1),
    "artifact is a plain directory": (lambda art, tmp: ["p.txt", "-a", tmp, *N], "not a Yggdrasil artifact", 1),
    "plan of another format version": (_damaged(lambda a: _plan_line(a, "format_version: ", "format_version: 1")),
                                       "not supported by this runtime", 1),
    "plan.yaml not YAML": (_damaged(lambda a: (a / "plan.yaml").write_text("files: [unclosed\n  : :\n")), "is corrupt", 1),
    "plan.yaml not UTF-8": (_damaged(lambda a: (a / "plan.yaml").write_bytes(b"\xff\xfe plan")), "is corrupt", 1),
    "plan.yaml with an object-constructing tag": (
        _damaged(lambda a: (a / "plan.yaml").write_text("x: !!python/object/apply:os.system ['touch PWNED']\n"
                                                       + (a / "plan.yaml").read_text())),
        "could not determine a constructor", 1),
    "model.safetensors truncated": (_damaged(lambda a: os.truncate(a / "target" / "model.safetensors", 1000)),
                                    "target/model.safetensors has changed since compile", 1),
    "model.safetensors altered in place": (_damaged(lambda a: _flip_bytes(a / "draft" / "model.safetensors", 4096)),
                                           "draft/model.safetensors has changed since compile (sha256 differs)", 1),
    "model.pt2 corrupted": (_damaged(lambda a: _flip_bytes(a / "target" / "model.pt2", 5000)),
                            "target/model.pt2 has changed since compile (sha256 differs)", 1),
    "kernels.so deleted": (_damaged(lambda a: (a / "kernels.so").unlink()), "kernels.so is missing", 1),
    "tokenizer.json deleted": (_damaged(lambda a: (a / "tokenizer.json").unlink()), "tokenizer.json is missing", 1),
    "expect-plan of another artifact": (_args(*N, "--expect-plan", "0" * 64), "not the expected " + "0" * 64, 1),
    "expect-plan not a sha256": (_args(*N, "--expect-plan", "abc"), "64-digit hex sha256", 1),
}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("case", RUN_CASES)
def test_run_refuses_in_one_line_and_changes_nothing(case, artifact, tmp_path):
    setup, needle, code = RUN_CASES[case]
    if "without one" in case and _has_cuda():
        pytest.skip("this machine has CUDA")
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    args = setup(artifact, tmp_path)
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*"))
    proc = subprocess.run([YGG, "run", *map(str, args)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    _record("run", case, proc.stderr, proc.returncode)
    assert_one_line_error(proc, needle)
    assert proc.returncode == code and proc.stdout == ""
    assert sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / "PWNED").exists()


def test_run_with_closed_stdin_says_so(artifact):
    proc = subprocess.run([YGG, "run", "-", "-a", str(artifact), *N], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))
    assert_one_line_error(proc, "no standard input")
    _record("run", "closed stdin", proc.stderr, proc.returncode)


def test_run_into_a_reader_that_closes_early_exits_quietly(artifact, tmp_path):
    """`ygg run ... | head -c 1`: the reader goes away; no traceback, no error line, success."""
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    run = subprocess.Popen([YGG, "run", "p.txt", "-a", str(artifact), "-n", "200", "--ignore-eos", "--stats"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.read(1)
    run.stdout.close()
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0 and b"Traceback" not in err and b"error" not in err
    _record("run", "output read by `| head -c 1`", "(nothing: it stops quietly)", run.returncode)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_pinned_plan_hash_runs_that_artifact_and_refuses_a_tampered_one(artifact, tmp_path):
    pin = _sha256(artifact / "plan.yaml")
    ok = ygg("run", "-", "-a", artifact, *N, "--expect-plan", pin.upper(), stdin="Once upon a time")
    assert ok.returncode == 0, ok.stderr
    shown = ygg("inspect", artifact, "-o", tmp_path / "inspect")
    assert shown.returncode == 0 and pin in shown.stdout
    # Tampered weights whose size and mtime are restored: the unpinned run's size-and-mtime shortcut
    # cannot see it (that record is a speed-up for the user's own files), the pinned run hashes afresh.
    copy = tmp_path / "art"
    shutil.copytree(artifact, copy)
    assert ygg("run", "-", "-a", copy, *N, stdin="Once").returncode == 0  # records the files as checked
    weights = copy / "target" / "model.safetensors"
    st = weights.stat()
    _flip_bytes(weights, st.st_size - 64)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert_one_line_error(ygg("run", "-", "-a", copy, *N, "--expect-plan", pin, stdin="Once"),
                          "target/model.safetensors has changed since compile (sha256 differs)")


def test_serve_pins_a_plan_hash_too_before_it_listens(artifact):
    proc = ygg("serve", "-a", artifact, "--port", 0, "--expect-plan", "e" * 64)
    assert_one_line_error(proc, "not the expected " + "e" * 64)
    _record("serve", "expect-plan of another artifact", proc.stderr, proc.returncode)


def test_the_python_api_pins_a_plan_hash_too(artifact):
    import ygg_runtime
    from ygg_runtime.artifact.load import plan_sha256

    assert plan_sha256(artifact) == _sha256(artifact / "plan.yaml")
    with pytest.raises(ygg_runtime.YggError, match="not the expected"):
        ygg_runtime.load(artifact, expect_plan="f" * 64)


def test_run_refuses_weights_that_do_not_fit_in_the_memory_left(artifact, monkeypatch):
    """Before reading them (the OOM killer would end the run with no word); the memory reading
    itself is the machine's: MemAvailable + free swap, capped by a cgroup's limit."""
    import ygg_runtime
    from ygg_runtime.checks import integrity

    assert 0 < integrity.available_memory() < 1 << 50
    monkeypatch.setattr(integrity, "available_memory", lambda device="cpu": 50_000)
    with pytest.raises(ygg_runtime.YggError, match=r"holds 0\.\d MB of weights and 50 kB of memory is available"):
        ygg_runtime.load(artifact)


def test_eager_executes_none_of_the_artifacts_native_code(artifact, tmp_path):
    """--eager loads neither the compiled forwards nor the artifact's kernels.so (the kernels are
    built from the installed package's sources): with both replaced by garbage it still runs, and
    gives the same tokens as on the intact artifact."""
    copy = tmp_path / "art"
    shutil.copytree(artifact, copy)
    native = [copy / "kernels.so", *copy.glob("*/model.pt2")]
    assert len(native) == 3
    for f in native:
        f.write_bytes(b"#!/bin/sh\ntouch PWNED\n")
    args = ["run", "p.txt", "-n", 12, "--ignore-eos", "--json", "--eager"]
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    want = subprocess.run([YGG, *map(str, args), "-a", str(artifact)], capture_output=True, text=True, cwd=tmp_path)
    got = subprocess.run([YGG, *map(str, args), "-a", str(copy)], capture_output=True, text=True, cwd=tmp_path)
    assert want.returncode == 0 and got.returncode == 0, want.stderr + got.stderr
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]
    assert json.loads(got.stdout)["metrics"]["forward"] == "eager"
    assert_one_line_error(ygg("run", "-", "-a", copy, *N, stdin="Once"), "has changed since compile")  # not eager
    assert not (tmp_path / "PWNED").exists()


SAFE_LOADING = """
import pickle, sys, yaml
import torch
import ygg_runtime

def refuse(*a, **k):
    raise AssertionError("something was unpickled")

def audit(event, args):  # every unpickler, C or Python, subclass or not, looks globals up through this
    if event == "pickle.find_class":
        raise AssertionError(f"unpickling looked up {args}")

sys.addaudithook(audit)
pickle.load = pickle.loads = torch.load = refuse
class NoUnpickler(pickle.Unpickler):
    def __init__(self, *a, **k):
        refuse()
pickle.Unpickler = NoUnpickler
safe = (yaml.SafeLoader, getattr(yaml, "CSafeLoader", yaml.SafeLoader))
real_load = yaml.load
def load(stream, Loader):
    assert issubclass(Loader, safe), f"YAML read with {Loader.__name__}"
    return real_load(stream, Loader)
yaml.load = load
decoder = ygg_runtime.load(sys.argv[1])
res = decoder.generate("Once upon a time", max_new_tokens=8, method="egt")
assert res.token_ids
print("ok", decoder.forwards)
"""


def test_loading_an_artifact_unpickles_nothing_and_reads_yaml_safely(artifact):
    proc = subprocess.run([sys.executable, "-c", SAFE_LOADING, str(artifact)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok compiled ahead of time")


def test_the_artifact_is_readable_as_the_umask_says(artifact):
    """Compile builds in a temporary directory (mode 0700, some files 0600); the artifact it leaves
    has the modes the user's umask gives new files (the suite's compile ran under this umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    for p in [artifact, *artifact.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        full = 0o777 if p.is_dir() or mode & 0o100 else 0o666
        assert mode == full & ~mask, (p, oct(mode))


# ------------------------------------------------------------------ compile


def _compile_args(pair, out: Path, target: Path | None = None) -> list:
    return ["compile", "--draft", pair["draft"], "--target", target or pair["target"], "-o", out,
            "--dtype", "float32", "--max-context", 256, "--no-aot", "--quick"]


def _tree(d: Path) -> list:
    """What a directory holds: every file's path and sha256 (an artifact's state, for 'untouched')."""
    return sorted((str(p.relative_to(d)), _sha256(p)) for p in d.rglob("*") if p.is_file())


def _beside(out: Path) -> list[str]:
    """What a compile left beside its output (its temporary directory, its lock): nothing, once it ended."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.fixture(scope="module", autouse=True)
def own_profiles(tmp_path_factory):
    """These compiles store their latency profiles apart: test_cli edits the suite's stored profile
    of this pair on purpose, and a parallel worker's compile here must not meet it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YGG_PROFILES", str(tmp_path_factory.mktemp("profiles")))
        yield


@pytest.fixture(scope="module")
def previous(pair, tmp_path_factory, own_profiles) -> Path:
    """An artifact a failed compile must leave as it was (a quick, eager one)."""
    out = tmp_path_factory.mktemp("previous") / "art"
    proc = ygg(*_compile_args(pair, out))
    assert proc.returncode == 0, proc.stderr
    return out


def _with_previous(previous: Path, tmp: Path) -> Path:
    out = tmp / "art"
    shutil.copytree(previous, out)
    return out


def _state(root: Path) -> list:
    """Everything under root, hidden entries included: each file's path and sha256, each directory's
    path (for "nothing written, nothing changed")."""
    return sorted((str(p.relative_to(root)), _sha256(p) if p.is_file() else "dir") for p in root.rglob("*"))


def _gguf(path: Path, arch: str = "llama", tensor_type: int = 0, shape: tuple = (8, 4)) -> Path:
    """A small GGUF v3 file, written from the format's spec by hand (not by our reader's author's
    library): one key, general.architecture, and one tensor of tensor_type."""
    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + text("general.architecture") + struct.pack("<I", 8) + text(arch)
    head += text("token_embd.weight") + struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
    head += struct.pack("<IQ", tensor_type, 0)
    head += bytes(-len(head) % 32)
    path.write_bytes(head + bytes(4 * math.prod(shape)))
    return path


def _huge_checkpoint(pair, tmp: Path) -> Path:
    """The tiny target's directory with a safetensors header declaring 100 billion float32
    parameters (400 GB) and no data: compile must refuse it from the header, reading nothing else."""
    d = tmp / "huge"
    shutil.copytree(pair["target"], d)
    half = 4 * 50_000 * 1_000_000
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [1_000_000, 50_000], "data_offsets": [0, half]},
                         "lm_head.weight": {"dtype": "F32", "shape": [1_000_000, 50_000], "data_offsets": [half, 2 * half]}})
    header = header.encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return d


def _with_target(make: Callable[[dict, Path], Path], *extra) -> Callable[[dict, Path, Path], list]:
    return lambda pair, out, tmp: [*_compile_args(pair, out, make(pair, tmp)), *extra]


def _mamba(pair, tmp: Path) -> Path:
    weird = tmp / "weird"
    shutil.copytree(pair["target"], weird)
    config = weird / "config.json"
    config.write_text(config.read_text().replace('"model_type": "llama"', '"model_type": "mamba"'))
    return weird


def _into(make: Callable[[Path], Path]) -> Callable[[dict, Path, Path], list]:
    """A case whose -o is something other than the previous artifact."""
    return lambda pair, out, tmp: _compile_args(pair, make(tmp))


def _file(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("mine")
    return tmp / "notes.txt"


def _other_dir(tmp: Path) -> Path:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.tex").write_text("mine")
    return tmp / "mine"


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _aot(args: list) -> list:
    return [a for a in args if a != "--no-aot"]


# case: (setup(pair, out, tmp) -> the arguments of `ygg`, words the line must hold, file-size limit in bytes).
# `out` holds a copy of a previous artifact; nothing under tmp may change. The file-size limit
# (RLIMIT_FSIZE) is a disk that fills: 200 kB stops the weights, 600 kB lets them through (the
# kernels' library is linked from the cache, not written) and stops AOTInductor's C++ compiler.
COMPILE_CASES = {
    "-o is a file": (_into(_file), ["refusing to overwrite", "not a Yggdrasil artifact"], None),
    "-o is a directory of other files": (_into(_other_dir), ["refusing to overwrite", "not a Yggdrasil artifact"], None),
    "unknown model": (lambda pair, out, tmp: _compile_args(pair, out, "gpt-17"), ["unknown model 'gpt-17'"], None),
    "GGUF file missing": (lambda pair, out, tmp: _compile_args(pair, out, tmp / "gone.gguf"), ["gone.gguf does not exist"], None),
    "model directory without config.json": (_with_target(lambda pair, tmp: (tmp / "empty").mkdir() or tmp / "empty"),
                                            ["has no config.json"], None),
    "target of an unsupported architecture": (_with_target(_mamba), ["model type 'mamba' is not supported"], None),
    "GGUF of an unsupported architecture": (_with_target(lambda pair, tmp: _gguf(tmp / "m.gguf", arch="mamba")),
                                            ["holds a 'mamba' model, which is not supported", "llama, qwen2"], None),
    "GGUF tensor type gguf cannot decode": (_with_target(lambda pair, tmp: _gguf(tmp / "q.gguf", tensor_type=15)),
                                            ["token_embd.weight is of type Q8_K", "cannot dequantize"], None),
    "GGUF tensor type newer than gguf": (_with_target(lambda pair, tmp: _gguf(tmp / "n.gguf", tensor_type=99)),
                                         ["is of type number 99"], None),
    "GGUF file that is not GGUF": (_with_target(lambda pair, tmp: _bytes(tmp / "x.gguf", b"<html>404</html>")),
                                   ["could not read GGUF file", "not a GGUF file"], None),
    "GGUF file cut short": (_with_target(lambda pair, tmp: _bytes(tmp / "c.gguf", _gguf(tmp / "f.gguf").read_bytes()[:30])),
                            ["the file ends inside its header"], None),
    "weights that do not fit in memory": (_with_target(_huge_checkpoint),
                                          ["do not fit in memory", "converting the target needs about 800.00 GB",
                                           "(target 100.0B, draft 0.1M parameters in float32)", "--dtype bfloat16 halves it"], None),
    "--weights unknown": (lambda pair, out, tmp: [*_compile_args(pair, out), "--weights", "int5"], ["--weights must be"], None),
    "--device cuda without one": (lambda pair, out, tmp: [*_compile_args(pair, out), "--device", "cuda"],
                                  ["--device cuda was asked for but CUDA is not available"], None),
    "--dtype unknown": (lambda pair, out, tmp: [*_compile_args(pair, out), "--dtype", "fp8"], ["unknown dtype 'fp8'"], None),
    "--calib missing": (lambda pair, out, tmp: [*_compile_args(pair, out), "--calib", tmp / "no.txt"],
                        ["calibration path", "does not exist"], None),
    "disk full writing the weights": (lambda pair, out, tmp: _compile_args(pair, out),
                                      ["out of disk space (File too large)", "nothing was written to"], 200_000),
    "disk full in the C++ compiler": (lambda pair, out, tmp: _aot(_compile_args(pair, out)),
                                      ["out of disk space", "nothing was written to"], 600_000),
}


def _file_size_limit(limit: int | None):
    if limit is None:
        return None

    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


# Cases whose compile must reach AOTInductor itself: they run on a cache of their own (the suite's
# native kernels linked in), which holds no package of the same graph to reuse (`aot.GRAPHS`).
OWN_GRAPH_CACHE = {"disk full in the C++ compiler"}


def _own_graph_cache(root: Path) -> dict:
    shared = Path(os.environ["YGG_CACHE"]) / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    root.mkdir()
    (root / "kernels").symlink_to(shared, target_is_directory=True)
    return {**os.environ, "YGG_CACHE": str(root)}


@pytest.mark.parametrize("case", COMPILE_CASES)
def test_compile_refuses_in_one_line_and_changes_nothing(case, pair, previous, tmp_path, tmp_path_factory):
    setup, needles, limit = COMPILE_CASES[case]
    if "without one" in case and _has_cuda():
        pytest.skip("this machine has CUDA")
    out = _with_previous(previous, tmp_path)
    args = setup(pair, out, tmp_path)
    env = _own_graph_cache(tmp_path_factory.mktemp("cache") / "c") if case in OWN_GRAPH_CACHE else None
    before = _state(tmp_path)
    proc = subprocess.run([YGG, *map(str, args)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          preexec_fn=_file_size_limit(limit), env=env)
    _record("compile", case, proc.stderr, proc.returncode)
    assert_one_line_error(proc, *needles)
    assert "C++ compile error" not in proc.stderr  # a full disk is named as such, not as the compiler's failure
    assert _state(tmp_path) == before


def test_disk_full_is_recognised_in_every_writer_s_words():
    """What the compile's writers said when the disk filled here: Python, safetensors (Rust),
    and AOTInductor's C++ compiler under a file-size limit (a CppCompileError's text)."""
    from ygg_runtime.errors import out_of_space

    said = {
        OSError(28, "No space left on device"): "No space left on device",
        Exception('Error while serializing: IoError(Os { code: 27, kind: FileTooLarge, message: "File too large" })'): "File too large",
        Exception("C++ compile error\nCommand:\ng++ header.hpp -o x.gch\nOutput:\ng++: internal compiler error: "
                  "File size limit exceeded signal terminated program cc1plus"): "File size limit exceeded",
        Exception("OSError: [Errno 122] Disk quota exceeded"): "Disk quota exceeded",
    }
    for e, words in said.items():
        assert out_of_space(e) == words
    assert out_of_space(Exception("C++ compile error\nOutput:\nerror: 'foo' was not declared")) is None


def test_a_compile_the_disk_cannot_hold_is_refused_before_it_starts(pair, previous, tmp_path, monkeypatch, capsys):
    """The estimate against the free space the filesystem reports (made small here: no test can fill
    a real disk), through the real CLI in this process."""
    from ygg_compile import cli

    out = _with_previous(previous, tmp_path)
    before = _state(tmp_path)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=5_000_000))
    monkeypatch.setattr(sys, "argv", ["ygg", *map(str, _compile_args(pair, out))])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: not enough disk space: this compile writes about"), lines
    assert "5.0 MB is free" in lines[0] and "the artifact" in lines[0]
    _record("compile", "disk too small for the estimate", lines[0], stop.value.code)
    assert _state(tmp_path) == before


def test_two_compiles_racing_for_one_output_one_wins_and_the_other_says_so(pair, previous, tmp_path):
    out = _with_previous(previous, tmp_path)
    before = _tree(out)
    first = subprocess.Popen([YGG, *map(str, _compile_args(pair, out))], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _staging_appears(first, out)
        second = ygg(*_compile_args(pair, out))
        assert_one_line_error(second, "another `ygg compile` is writing", "wait for it to finish, or compile to another -o")
        _record("compile", "a second compile into the -o another is writing", second.stderr, second.returncode)
        assert _tree(out) == before  # the loser touched nothing; the winner has not renamed yet
    finally:
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert _tree(out) != before and (out / "plan.yaml").exists() and _beside(out) == []
    pin = _sha256(out / "plan.yaml")  # what the winner printed is the value that pins what it wrote
    assert f"plan sha256 {pin}" in " ".join(err.split()) and f"ygg run --expect-plan {pin}" in " ".join(err.split())


def _staging_appears(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(".tmp-" in name for name in _beside(out)):
            time.sleep(0.5)  # into the work, past the directory's creation
            return
        time.sleep(0.05)
    raise AssertionError("the compile never started writing")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_compile_stopped_by_a_signal_leaves_nothing_and_keeps_the_previous_artifact(sig, pair, previous, tmp_path):
    out = _with_previous(previous, tmp_path)
    before = _tree(out)
    proc = subprocess.Popen([YGG, *map(str, _compile_args(pair, out))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _staging_appears(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "error: interrupted", err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    _record("compile", f"{sig.name} mid-compile", err, proc.returncode)
    assert _tree(out) == before and _beside(out) == []


def test_the_next_compile_removes_what_a_killed_one_left(pair, previous, tmp_path):
    out = _with_previous(previous, tmp_path)
    proc = subprocess.Popen([YGG, *map(str, _compile_args(pair, out))], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _staging_appears(proc, out)
    proc.kill()  # SIGKILL: no handler runs, the temporary directory stays
    proc.wait(timeout=60)
    stale = _beside(out)
    assert len(stale) == 2 and stale[0] == ".art.lock" and stale[1].startswith(".art.tmp-")  # its lock file too
    unrelated = tmp_path / ".art.tmp-notours"  # not the shape of our temporary directories: left alone
    unrelated.mkdir()
    again = ygg(*_compile_args(pair, out))
    assert again.returncode == 0, again.stderr
    assert _beside(out) == [".art.tmp-notours"]
    _record("compile", "the compile after a SIGKILL mid-compile", "(compiles; the killed compile's temporary directory"
            " and lock are gone, an unrelated .art.tmp-notours is not)", again.returncode)


def test_a_draft_larger_than_the_target_is_a_warning_not_an_error(pair, tmp_path):
    import tiny

    bigger = tiny.save_pair_dir(tmp_path / "bigger", tiny.hf_model("llama", seed=7, num_hidden_layers=4), pair["tokenizer"])
    proc = ygg("compile", "--draft", bigger, "--target", pair["target"], "-o", tmp_path / "swapped",
               "--dtype", "float32", "--max-context", 256, "--no-aot", "--quick")
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stderr.split())
    assert "warning: the draft (0.2M parameters) is larger than the target (0.1M)" in said
    assert "swapped --draft and --target?" in said
    warning = said[said.index("warning:"):said.index("--target?") + len("--target?")]  # rich wraps it at 80
    _record("compile", "draft larger than the target (a warning)", warning, proc.returncode)


# ------------------------------------------------------------------ bench, inspect


@pytest.fixture(scope="module")
def earlier_bench(artifact, tmp_path_factory) -> Path:
    """A finished quick benchmark (ar alone, one built-in prompt, 4 tokens) to --resume."""
    out = tmp_path_factory.mktemp("bench") / "results"
    proc = ygg("bench", "-a", artifact, "--peers", "none", "--methods", "ar", "--categories", "qa", "-n", 4, "-o", out)
    assert proc.returncode == 0, proc.stderr
    return out


def _prompts(data: bytes) -> Callable[[Path, Path, Path], list]:
    def setup(art: Path, tmp: Path, earlier: Path) -> list:
        (tmp / "p.jsonl").write_bytes(data)
        return ["bench", "-a", art, "--peers", "none", "--prompts", "p.jsonl", "-o", tmp / "res"]

    return setup


def _bench(*extra) -> Callable[[Path, Path, Path], list]:
    return lambda art, tmp, earlier: ["bench", "-a", art, "--peers", "none", "-o", tmp / "res", *extra]


def _resume(change: Callable[[Path], None] | None, *extra) -> Callable[[Path, Path, Path], list]:
    """--resume in a copy of the earlier run's directory, changed by `change` first."""
    def setup(art: Path, tmp: Path, earlier: Path) -> list:
        shutil.copytree(earlier, tmp / "res")
        if change:
            change(tmp / "res" / "runs.jsonl")
        return ["bench", "-a", art, "--peers", "none", "--methods", "ar", "--categories", "qa", "-n", 4,
                "-o", tmp / "res", "--resume", *extra]

    return setup


def _cut_in_the_middle(log: Path) -> None:
    """A run's line cut short with a whole line after it: not an interrupt's trace (only a last line
    can be cut by one), so no line can be trusted."""
    config, run, *rest = log.read_text().splitlines()
    log.write_text("\n".join([config, run[:20], run, *rest]) + "\n")


GOOD = b'{"question_id": 1, "category": "qa", "turns": ["What is a tree?"]}\n'

# case: (setup(artifact, tmp, earlier run) -> the arguments of `ygg`, words the line must hold)
BENCH_CASES = {
    "prompts file missing": (_bench("--prompts", "nope.jsonl"), ["nope.jsonl does not exist"]),
    "prompts file is a directory": (lambda art, tmp, e: [*_bench("--prompts", tmp)(art, tmp, e)], ["is a directory"]),
    "prompts file empty": (_prompts(b"\n\n"), ["p.jsonl is empty"]),
    "prompts line not JSON": (_prompts(GOOD + b'{"turns": ["unclosed"\n' + GOOD), ["p.jsonl:2 is not a prompt record"]),
    "prompts line without a prompt": (_prompts(GOOD + GOOD + b'{"category": "qa", "turns": []}\n'),
                                      ["p.jsonl:3 is not a prompt record"]),
    "prompts line not UTF-8": (_prompts(GOOD + '{"turns": ["café"]}\n'.encode("latin-1")), ["p.jsonl:2 is not UTF-8 text"]),
    "category with no prompts": (_bench("--categories", "poetry"), ["no prompts in", "for categories poetry", "it has: coding"]),
    "--categories empty": (_bench("--categories", ","), ["--categories is empty"]),
    "--limit 0": (_bench("--limit", "0"), ["--limit must be at least 1, not 0"]),
    "--rounds 0": (_bench("--rounds", "0"), ["--rounds must be at least 1, not 0"]),
    "--max-new-tokens 0": (_bench("-n", "0"), ["--max-new-tokens must be at least 1, not 0"]),
    "--temperature -1": (_bench("-t", "-1"), ["--temperature must be a finite number >= 0"]),
    "unknown peer": (_bench("--peers", "vllm"), ["unknown peer 'vllm'"]),
    "unknown method": (_bench("--methods", "medusa"), ["method 'medusa' is not in this artifact"]),
    "artifact missing": (lambda art, tmp, e: _bench()(tmp / "none", tmp, e), ["does not exist (run `ygg compile` first)"]),
    "-o is a file": (lambda art, tmp, e: ["bench", "-a", art, "--peers", "none", "--methods", "ar", "--categories", "qa", "-n", 4, "-o", _file(tmp)],
                     ["notes.txt is a file: benchmark results go in a directory"]),
    "--resume with other settings": (_resume(None, "-n", "5"), ["cannot resume", "different max_new_tokens"]),
    "--resume of a log corrupt mid-way": (_resume(_cut_in_the_middle), ["runs.jsonl is corrupt at line 2", "drop --resume"]),
    "--resume of another file": (_resume(lambda log: log.write_text('{"hello": 1}\n')),
                                 ["runs.jsonl is not a benchmark log"]),
}


@pytest.mark.parametrize("case", BENCH_CASES)
def test_bench_refuses_in_one_line_and_changes_nothing(case, artifact, earlier_bench, tmp_path):
    setup, needles = BENCH_CASES[case]
    args = setup(artifact, tmp_path, earlier_bench)
    before = _state(tmp_path)
    proc = subprocess.run([YGG, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    _record("bench", case, proc.stderr, proc.returncode)
    assert_one_line_error(proc, *needles)
    assert proc.stdout == "" and _state(tmp_path) == before


def _inspect(*extra) -> Callable[[Path, Path], list]:
    return lambda art, tmp: ["inspect", art, "-o", tmp / "figures", *extra]


INSPECT_CASES = {
    "artifact missing": (lambda art, tmp: _inspect()(tmp / "none", tmp), ["does not exist (run `ygg compile` first)"]),
    "--step 0": (_inspect("--prompt", "Hi", "--step", "0"), ["--step must be at least 1"]),
    "--step beyond the generation": (_inspect("--prompt", "Hi", "-n", "2", "--step", "50"),
                                     ["the generation took only", "earlier --step"]),
    "--prompt empty": (_inspect("--prompt", "  "), ["the prompt is empty"]),
    "--prompt file not UTF-8": (lambda art, tmp: _inspect("--prompt", _bytes(tmp / "p.txt", "café".encode("latin-1")))(art, tmp),
                                ["p.txt is not UTF-8 text"]),
    "--method unknown": (_inspect("--prompt", "Hi", "--method", "medusa"), ["method 'medusa' is not in this artifact"]),
    "--max-new-tokens 0": (_inspect("--prompt", "Hi", "-n", "0"), ["--max-new-tokens must be at least 1, not 0"]),
    "-o is a file": (lambda art, tmp: ["inspect", art, "-o", _file(tmp)], ["notes.txt is a file: inspect's figures go in a directory"]),
}


@pytest.mark.parametrize("case", INSPECT_CASES)
def test_inspect_refuses_in_one_line_and_changes_nothing(case, artifact, tmp_path):
    setup, needles = INSPECT_CASES[case]
    args = setup(artifact, tmp_path)
    before = _state(tmp_path)
    proc = subprocess.run([YGG, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    _record("inspect", case, proc.stderr, proc.returncode)
    assert_one_line_error(proc, *needles)
    assert proc.stdout == "" and _state(tmp_path) == before
