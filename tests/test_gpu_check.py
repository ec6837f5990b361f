"""`make gpu-check` (benchmarks/gpu_check.py) end to end on small shapes on the CPU, so the one call a
session with a GPU makes does not fail on anything a CPU could have caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_every_section_on_small_shapes(artifact, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--small", "--no-aot", "--dtype", "float32", "--vocab", "512",
         "--device", "cpu", "-o",
         str(tmp_path), "--budget", "1200", "--calibration", str(artifact / "calibration.safetensors")],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "TRITON_INTERPRET": "1"})
    results = json.loads((tmp_path / "gpu-check.json").read_text())
    assert proc.returncode == 0, (proc.stdout[-3000:], (tmp_path / "gpu-check.log").read_text()[-3000:])
    head = {k: results.pop(k) for k in ("command", "revision")}  # the harness's record: what ran it, at which commit
    assert head["command"].startswith("python ") and "--small" in head["command"] and "commit" in head["revision"]
    assert [name for name in results] == ["machine", "kernels", "tiny pair", "real shapes", "7B shapes", "start", "modelled"]
    assert all(r["status"] == "ok" for r in results.values())
    assert results["machine"]["roofs"]["bandwidth"] > 0 and results["machine"]["isa"]
    attention = results["kernels"]["attention"]
    assert attention["bfloat16"]["row_bits_plain_eq_tree"] and attention["float32"]["row_bits_plain_eq_tree"]
    assert results["tiny pair"]["all_equal"]
    assert [r["width"] for r in results["7B shapes"]["models"]["target"]["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    assert set(results["start"]) >= {"first start", "second start", "kernels compiled anew"}
    modelled = results["modelled"]["qwen2.5-1.5b on H200"]
    assert modelled["kernels_per_layer"] == 8 and [r["width"] for r in modelled["rows"]] == [1, 8, 64]
    real = results["real shapes"]
    assert real["calibration"].startswith("calibration-from")
    assert [r["width"] for r in real["models"]["target"]["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    assert real["egt_plan"]["modelled_speedup_over_ar"] >= 1.0  # depth 0, plain decoding, is always a candidate
    assert real["decode"]["all_equal"]
    for method in ("ar", "egt"):  # each step's host work with its forwards replayed
        overhead = real["step_overhead"][method]
        assert overhead["host_ms_per_step"] > 0 and overhead["steps"] > 0
        assert overhead["host_reads_per_step"] == overhead["to_host_per_step"] >= 1
        assert overhead["device_ops_per_step"] >= 1  # at least the target's choice
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| real shapes | ok |" in md and "**target**" in md and "host work a step, forwards replayed" in md
