"""The one measurement harness (`ygg_bench.harness`): what makes two figures comparable — the
interleaved timer, the common arguments, the record every result file starts with — and that every
benchmark script runs on it rather than on a copy of its own."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ygg_bench import harness

ROOT = Path(__file__).resolve().parent.parent


def test_the_timer_rotates_the_order_every_round_and_times_no_warm_up():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = harness.interleaved(fns, repeats=3, warmup=1)
    assert calls == list("abc" "bca" "cab" "abc")  # round r starts at candidate r
    assert {n: len(s) for n, s in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(ms >= 0 for s in samples.values() for ms in s)


def test_the_timer_runs_setup_untimed_before_every_call():
    seen = []
    samples = harness.interleaved({"slow-setup": lambda: seen.append("call")}, repeats=2, warmup=0,
                                  setup=lambda name: (seen.append(f"setup {name}"), __import__("time").sleep(0.05)))
    assert seen == ["setup slow-setup", "call"] * 2
    assert max(samples["slow-setup"]) < 40  # the 50 ms of setup are outside the sample


def test_medians_and_paired_ratios():
    assert harness.medians({"a": [3.0, 1.0, 2.0]}) == {"a": 2.0}
    assert harness.ratio_median([2.0, 9.0, 4.0], [1.0, 3.0, 4.0]) == 2.0


def test_the_common_arguments_are_parsed_and_checked_alike(tmp_path, capsys):
    ap = harness.parser("A benchmark.\n\nMore.", artifact="", repeats=5, widths="1,2,4")
    (tmp_path / "plan.yaml").write_text("{}")
    threads = torch.get_num_threads()
    try:
        args = harness.parse(ap, [str(tmp_path), "--widths", "1,8", "--threads", "1", "-o", "x.json"])
        assert (args.widths, args.repeats, args.out, torch.get_num_threads()) == ([1, 8], 5, Path("x.json"), 1)
    finally:
        torch.set_num_threads(threads)
    for argv, said in ([str(tmp_path), "--repeats", "0"], "--repeats must be at least 1"), \
                      ([str(tmp_path), "--widths", "1,x"], "takes integers"), \
                      ([str(tmp_path / "none")], "is not an artifact directory"):
        with pytest.raises(SystemExit):
            harness.parse(ap, argv)
        assert said in capsys.readouterr().err


def test_a_result_file_names_its_command_machine_roofs_and_revision(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/some.py", "--repeats", "3"])
    roofs = harness.Roofs(40e9, 300e9, 2)
    written = harness.write_json(tmp_path / "deep" / "r.json", {"rows": [1]}, measured=roofs, markdown="| a |\n")
    on_disk = json.loads((tmp_path / "deep" / "r.json").read_text())
    assert on_disk == json.loads(json.dumps(written, default=str))
    assert on_disk["command"] == "python benchmarks/some.py --repeats 3" and on_disk["rows"] == [1]
    assert on_disk["machine"]["read_bandwidth_gbs"] == 40.0 and on_disk["machine"]["roofs"]["bandwidth"] == 40e9
    assert {"cpu", "isa", "threads", "torch", "date"} <= set(on_disk["machine"])
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert on_disk["revision"]["commit"] == head and isinstance(on_disk["revision"]["dirty"], bool)
    assert (tmp_path / "deep" / "r.md").read_text() == "| a |\n"
    # what a result already carries of the header is kept (a section named machine, a command given)
    kept = harness.write_json(tmp_path / "k.json", {"command": "ygg bench", "revision": {}, "machine": "its own"})
    assert (kept["command"], kept["revision"], kept["machine"]) == ("ygg bench", {}, "its own")


def _calls(path: Path) -> set[str]:
    """Dotted names of everything `path` calls (`argparse.ArgumentParser`, `time.perf_counter`, ...)."""
    def name(node) -> str:
        return f"{name(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "?")
    return {name(n.func) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}


def test_every_benchmark_script_runs_on_the_harness_and_keeps_no_timer_parser_or_writer_of_its_own():
    """Each script in benchmarks/ calls the harness, and none builds its own argument parser, reads
    a clock to time something, or writes a file of results itself (printing JSON lines is allowed:
    a child's answer, progress)."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) >= 10
    own = {"argparse.ArgumentParser", "time.perf_counter", "time.monotonic", "json.dump"}  # time.time: budgets
    found = {}
    for path in scripts:
        calls = _calls(path)
        assert any(c.startswith("harness.") for c in calls), f"{path.name} does not run on the harness"
        found[path.name] = sorted(c for c in calls if c in own or c.endswith(".write_text"))
    assert {k: v for k, v in found.items() if v} == {}


def test_the_script_check_finds_a_timer_of_its_own(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("import argparse, time\nap = argparse.ArgumentParser()\nt = time.perf_counter()\n"
                    "out.write_text('{}')\n")
    assert {"argparse.ArgumentParser", "time.perf_counter", "out.write_text"} <= _calls(path)


def test_a_summary_names_the_commit_and_whether_the_tree_differed():
    assert harness.at_revision({"revision": {"commit": "1d32d63abc", "dirty": False}}) == ", at 1d32d63"
    assert harness.at_revision({"revision": {"commit": "1d32d63abc", "dirty": True}}) == ", at 1d32d63 with uncommitted changes"
    assert harness.at_revision({"revision": {}}) == harness.at_revision({}) == ""
