"""`ruff check` over the repository finds nothing (pyproject.toml says which rules: bugs and dead code,
not style)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_would_find_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "F401" in proc.stdout, proc.stdout + proc.stderr
