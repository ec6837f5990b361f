"""`ygg cache ls|clear` end to end, on a cache laid out by the writers' own path functions: every kind
listed with its size, cleared by kind, and an entry a live process is writing left alone."""

from __future__ import annotations

import json

import torch
from helpers import assert_one_line_error, ygg

from ygg_compile import aot, sources
from ygg_runtime.files import locked


def _fill(root) -> dict:
    """One entry of every kind, shaped as the writers shape them, plus two unfinished conversions:
    one whose writer is alive (this test holds its lock), one whose writer died."""
    conv = sources.conversion_dir("ab" * 32, torch.bfloat16)
    assert conv.is_relative_to(root)
    conv.mkdir(parents=True)
    (conv / "model.safetensors").write_bytes(bytes(3_000_000))
    (conv / "config.json").write_text("{}")
    (conv / sources.SOURCE_FILE).write_text(json.dumps({"gguf": "/models/qwen.gguf", "sha256": "ab" * 32,
                                                        "dtype": "bfloat16", "created": "2026-11-25T08:00:00Z"}))
    legacy = conv.parent / ("cd" * 16)  # a float32 conversion of an earlier version: no source record
    legacy.mkdir()
    (legacy / "model.safetensors").write_bytes(bytes(1_000_000))
    dead = conv.parent / f".tmp-{legacy.name}-dead1234"  # its writer was killed
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(bytes(500_000))
    alive = conv.parent / ".tmp-ef-bfloat16-alive123"  # being written: see the test
    alive.mkdir()
    (root / "packages").mkdir()
    (root / "packages" / "qwen.gguf").write_bytes(bytes(2_000_000))
    (root / "packages" / "qwen.sha256").write_text("ab" * 32 + "\n")
    (root / "kernels").mkdir()
    (root / "kernels" / "kernels-0123456789abcdef.so").write_bytes(bytes(400_000))
    (root / aot.GRAPHS).mkdir()
    (root / aot.GRAPHS / f"llama-{'9f' * 16}.pt2").write_bytes(bytes(600_000))
    (root / "profiles" / "cpu-x").mkdir(parents=True)
    (root / "profiles" / "cpu-x" / "a.yaml").write_text("widths: [1]\n")
    (root / "verified.json").write_text("{}")
    return {"conv": conv, "legacy": legacy, "dead": dead, "alive": alive}


def test_cache_ls_lists_every_kind_and_clear_removes_them_but_what_is_being_written(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("YGG_CACHE", str(root))  # this process's writers' paths and the commands' cache
    c = _fill(root)
    ls = ygg("cache", "ls")
    assert ls.returncode == 0, ls.stderr
    out = ls.stdout
    for needle in ("qwen.gguf in bfloat16", "3.0 MB", "made by an earlier version", "unfinished",
                   "kernels-0123456789abcdef.so", f"llama-{'9f' * 16}.pt2", "1 profile(s)", "hash record", "9 entries"):
        assert needle in out, (needle, out)
    assert "packages" in out and "2.0 MB" in out

    with locked(c["conv"].parent / "ef-bfloat16", wait=False) as mine:  # what the writer of .tmp-ef-bfloat16-* holds
        assert mine
        cleared = ygg("cache", "clear", "conversions")
    assert cleared.returncode == 0, cleared.stderr
    assert "removed 3 entries (conversions 3)" in cleared.stdout and "freed" in cleared.stdout
    assert "left conversions .tmp-ef-bfloat16-alive123: a running process is writing it" in cleared.stderr
    assert not c["conv"].exists() and not c["legacy"].exists() and not c["dead"].exists() and c["alive"].exists()
    assert (root / "packages" / "qwen.gguf").exists() and (root / "kernels").exists()

    everything = ygg("cache", "clear")  # the writer is gone now
    assert everything.returncode == 0, everything.stderr
    assert "removed 6 entries (conversions 1, packages 1, kernels 1, graphs 1, profiles 1, checks 1)" in everything.stdout
    assert not c["alive"].exists() and not (root / "packages" / "qwen.gguf").exists()
    assert not (root / "packages" / "qwen.sha256").exists() and not (root / "verified.json").exists()
    assert "0 entries" in ygg("cache", "ls").stdout


def test_cache_clear_of_an_unknown_kind_is_one_line(tmp_path):
    assert_one_line_error(ygg("cache", "clear", "weights", env={"YGG_CACHE": str(tmp_path)}),
                          "unknown cache kind 'weights'", "conversions, packages, kernels, graphs, openvino, profiles, checks")
