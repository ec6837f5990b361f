"""The runtime stands alone: `pip install 'yggdrasil[serve]'` into a fresh venv (no toolchain) loads an
artifact the toolchain compiled, runs it and serves it, and the toolchain's commands there say in
one line which extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import Served, assert_one_line_error, ygg
from ygg_runtime.cli import EXTRAS

REPO = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory) -> Path:
    """A fresh venv with the runtime and its server extra only, installed from this checkout as a
    user would (a built wheel, not an editable link to the tree)."""
    venv = tmp_path_factory.mktemp("runtime") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0", f"{REPO}[serve]"],
                         capture_output=True, text=True, timeout=1200)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return venv / "bin"


def test_the_runtime_install_has_none_of_the_toolchain(runtime_venv):
    code = ("import importlib.util as u, json, sys\n"
            "print(json.dumps({m: u.find_spec(m) is not None for m in sys.argv[1:]}))")
    # huggingface_hub comes with tokenizers, a dependency of the runtime's own
    toolchain = [m for m in EXTRAS["compile"] if m != "huggingface_hub"]
    found = json.loads(subprocess.run([str(runtime_venv / "python"), "-c", code, *toolchain, *EXTRAS["serve"]],
                                      capture_output=True, text=True, timeout=120, check=True).stdout)
    assert [m for m in toolchain if found[m]] == []
    assert all(found[m] for m in EXTRAS["serve"])


def test_the_runtime_alone_runs_an_artifact_as_the_full_install_does(runtime_venv, artifact, tmp_path):
    """Same tokens as the full install's `ygg run`; and of our own modules, the runtime ones and the
    command line's light modules are all the process imported (`python -X importtime`)."""
    (tmp_path / "p.txt").write_text(PROMPT)
    args = ["run", str(tmp_path / "p.txt"), "-a", str(artifact), "-n", "12", "--raw", "--ignore-eos", "--json"]
    want = ygg(*args)
    assert want.returncode == 0, want.stderr
    got = subprocess.run([str(runtime_venv / "python"), "-X", "importtime", "-m", "ygg_runtime", *args],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]
    imported = {line.split("|")[-1].strip() for line in got.stderr.splitlines() if line.startswith("import time:")}
    assert {"torch", "ygg_runtime.artifact.load", "ygg_runtime.run"} <= imported
    assert {m for m in imported if m.split(".")[0] in ("ygg_compile", "ygg_bench")} <= {
        "ygg_compile", "ygg_compile.cli", "ygg_compile.options", "ygg_compile.registry",
        "ygg_bench", "ygg_bench.cli", "ygg_bench.options"}


def test_the_runtime_alone_serves_an_artifact(runtime_venv, artifact):
    server = Served(artifact, "--max-batch", "2", command=str(runtime_venv / "ygg"))
    try:
        got = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    finally:
        log = server.stop()
    want = json.loads(ygg("run", "-", "-a", artifact, "-n", "12", "--raw", "--ignore-eos", "--json",
                          stdin=PROMPT).stdout)["token_ids"]
    assert got.choices[0].model_extra["token_ids"] == want, log


@pytest.mark.parametrize("args, extra", [
    (["compile", "--draft", "a", "--target", "b"], "compile"),
    (["bench"], "compile"),
    (["cache", "ls"], "compile"),
])
def test_a_toolchain_command_without_the_toolchain_names_the_extra_in_one_line(runtime_venv, tmp_path, args, extra):
    proc = subprocess.run([str(runtime_venv / "ygg"), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert_one_line_error(proc, f"needs the '{extra}' extra", f"pip install 'yggdrasil[{extra}]'")
