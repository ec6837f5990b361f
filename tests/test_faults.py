"""Faults and bad input, as a table: every case is the real `ygg` command, and each must end in one
line on stderr naming the problem, a non-zero exit, no traceback, and nothing changed on disk.
Also the artifact's trust model: a plan hash a deployment pins, YAML read safely, modes by umask."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
from helpers import YGG, assert_one_line_error, ygg

N = ["--max-new-tokens", "4"]


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


@pytest.mark.parametrize("case", RUN_CASES)
def test_run_refuses_in_one_line_and_changes_nothing(case, artifact, tmp_path):
    setup, needle, code = RUN_CASES[case]
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    args = setup(artifact, tmp_path)
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*"))
    proc = subprocess.run([YGG, "run", *map(str, args)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert_one_line_error(proc, needle)
    assert proc.returncode == code and proc.stdout == ""
    assert sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / "PWNED").exists()


def test_run_with_closed_stdin_says_so(artifact):
    proc = subprocess.run([YGG, "run", "-", "-a", str(artifact), *N], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))
    assert_one_line_error(proc, "no standard input")


def test_run_into_a_reader_that_closes_early_exits_quietly(artifact, tmp_path):
    """`ygg run ... | head -c 1`: the reader goes away; no traceback, no error line, success."""
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    run = subprocess.Popen([YGG, "run", "p.txt", "-a", str(artifact), "-n", "200", "--ignore-eos", "--stats"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.read(1)
    run.stdout.close()
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0 and b"Traceback" not in err and b"error" not in err


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


def test_the_python_api_pins_a_plan_hash_too(artifact):
    import ygg_runtime
    from ygg_runtime.artifact import plan_sha256

    assert plan_sha256(artifact) == _sha256(artifact / "plan.yaml")
    with pytest.raises(ygg_runtime.YggError, match="not the expected"):
        ygg_runtime.load(artifact, expect_plan="f" * 64)


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


def _limit_file_size() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # a disk that fills after ~200 kB per file


def test_a_compile_that_runs_out_of_disk_says_so_and_keeps_the_previous_artifact(pair, previous, tmp_path):
    out = _with_previous(previous, tmp_path)
    before = _tree(out)
    proc = subprocess.run([YGG, *map(str, _compile_args(pair, out))], capture_output=True, text=True, timeout=600,
                          preexec_fn=_limit_file_size)
    assert_one_line_error(proc, "out of disk space writing", "File too large")
    assert _tree(out) == before and _beside(out) == []


def test_a_compile_into_a_file_is_refused(pair, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert_one_line_error(ygg(*_compile_args(pair, out)), "refusing to overwrite", "not a Yggdrasil artifact")
    assert out.read_text() == "mine" and _beside(out) == []


def test_a_target_of_an_unsupported_architecture_is_refused(pair, previous, tmp_path):
    weird = tmp_path / "weird"
    shutil.copytree(pair["target"], weird)
    config = weird / "config.json"
    config.write_text(config.read_text().replace('"model_type": "llama"', '"model_type": "mamba"'))
    out = _with_previous(previous, tmp_path)
    before = _tree(out)
    assert_one_line_error(ygg(*_compile_args(pair, out, weird)), "model type 'mamba' is not supported")
    assert _tree(out) == before and _beside(out) == []


def test_a_second_compile_into_the_same_output_is_refused_while_the_first_runs(pair, previous, tmp_path):
    from ygg_runtime.files import locked

    out = _with_previous(previous, tmp_path)
    before = _tree(out)
    with locked(out, wait=False, remove=True) as mine:  # what a running compile holds
        assert mine
        assert_one_line_error(ygg(*_compile_args(pair, out)), "another `ygg compile` is writing")
    assert _tree(out) == before and _beside(out) == []


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
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in err
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


def test_a_draft_larger_than_the_target_is_a_warning_not_an_error(pair, tmp_path):
    proc = ygg("compile", "--draft", pair["target"], "--target", pair["draft"], "-o", tmp_path / "swapped",
               "--dtype", "float32", "--max-context", 256, "--no-aot", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert "warning: the draft" in proc.stderr and "swapped --draft and --target?" in proc.stderr.replace("\n", " ")
