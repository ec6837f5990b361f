"""`ygg cache ls|clear`: what Yggdrasil keeps under the user cache directory ($YGG_CACHE, else
~/.cache/yggdrasil), and its removal. Everything there is rebuilt when next needed (a conversion by
the next compile or benchmark of that model, a kernel by the next build), so clearing costs only
time. An entry a live process is writing (it holds the entry's lock) is left alone."""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ygg_compile.aot import GRAPHS
from ygg_compile.sources import CONVERSIONS, SOURCE_FILE
from ygg_runtime.errors import YggError
from ygg_runtime.files import cache_dir, locked

# kind: (where under the cache, what it holds)
KINDS = {
    "conversions": (CONVERSIONS, "GGUF models dequantized for compile (and the benchmark's transformers peers)"),
    "packages": ("packages", "packaged models' GGUF files, assembled from their pip packages' parts"),
    "kernels": ("kernels", "the native kernels built for this machine and torch"),
    "graphs": (GRAPHS, "compiled forwards (AOTInductor packages, no weights) a compile of the same graph reuses"),
    "openvino": ("openvino", "GGUF models exported to OpenVINO IR for the benchmark's openvino peers, and their tuned settings"),
    "profiles": ("profiles", "latency profiles measured here (used when no checkout's profiles/ is)"),
    "checks": ("verified.json", "which artifact files were hashed and found intact"),
}


@dataclass
class Entry:
    kind: str
    path: Path
    bytes: int
    what: str
    used: float  # modification time: a conversion's is touched whenever a compile uses it


def entries(root: Path | None = None) -> list[Entry]:
    """Every entry, by kind then name; unfinished leftovers (a killed writer's) included."""
    root = root or cache_dir()
    out = []
    for kind, (rel, _) in KINDS.items():
        where = root / rel
        if kind in ("profiles", "checks"):
            if where.exists():
                n = sum(1 for _ in where.rglob("*.yaml")) if where.is_dir() else 0
                out.append(Entry(kind, where, _size(where), f"{n} profile(s)" if kind == "profiles" else "hash record",
                                 where.stat().st_mtime))
            continue
        if not where.is_dir():
            continue
        for p in sorted(where.iterdir()):
            if p.name.endswith(".lock") or p.suffix == ".sha256":
                continue  # a lock or a package's checksum marker: goes with its entry
            out.append(Entry(kind, p, _size(p), _describe(kind, p), p.stat().st_mtime))
    return out


def _unfinished(p: Path) -> bool:
    """A writer's temporary: a conversion's `.tmp-*`, a package's `.partial`, a kernel build's `tmp*`,
    a compiled graph's `.NAME.PID.tmp`."""
    return p.name.startswith((".", "tmp")) or p.suffix == ".partial"


def _describe(kind: str, p: Path) -> str:
    if _unfinished(p):
        return "unfinished (its writer stopped, or is still at work)"
    if kind == "conversions":
        try:
            src = json.loads((p / SOURCE_FILE).read_text())
            return f"{Path(src['gguf']).name} in {src['dtype']}"
        except (OSError, ValueError, KeyError):
            return "float32, made by an earlier version (compiles no longer use it)"
    if kind == "openvino":
        try:
            src = json.loads((p / SOURCE_FILE).read_text())
            return f"{Path(src['gguf']).name} as OpenVINO IR ({src['weights']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "an export without its record (made again when next needed)"
    if kind == "kernels" and p.suffix == ".json":
        return f"{p.name}: the instruction-set flags they are built with here"
    return p.name


def _writer_alive(e: Entry) -> bool:
    """Whether an unfinished entry may still be written. A conversion's temporary directory
    (`.tmp-NAME-XXXXXXXX`) and a package's `.partial` file are written under the lock of the name
    they will be renamed to: alive while that lock is held. A kernel build or a compiled graph's
    copy takes no lock but lasts seconds, so a temporary younger than ten minutes counts. Any other
    leftover counts as alive while any lock in its directory is held."""
    if e.kind in ("kernels", "graphs"):
        return time.time() - e.used < 600
    if m := re.fullmatch(r"\.tmp-(.+)-[a-z0-9_]{8}", e.path.name):
        targets = [e.path.with_name(m.group(1))]
    elif e.path.suffix == ".partial":
        targets = [e.path.with_suffix(".gguf")]
    else:
        targets = [lock.with_name(lock.name[1:].removesuffix(".lock")) for lock in e.path.parent.glob(".*.lock")]
    for target in targets:
        with locked(target, wait=False, remove=True) as free:
            if not free:
                return True
    return False


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def clear(kinds: list[str] | None = None, root: Path | None = None) -> tuple[list[Entry], list[Entry]]:
    """Remove the entries of these kinds (None: all); returns (removed, left because in use)."""
    unknown = [k for k in kinds or [] if k not in KINDS]
    if unknown:
        raise YggError(f"unknown cache kind '{unknown[0]}' (choose from {', '.join(KINDS)})")
    removed, busy = [], []
    for e in entries(root):
        if kinds and e.kind not in kinds:
            continue
        if _unfinished(e.path) and _writer_alive(e):
            busy.append(e)
            continue
        with locked(e.path, wait=False, remove=True) as mine:  # a writer filling this entry holds it
            if not mine:
                busy.append(e)
                continue
            if e.path.is_dir():
                shutil.rmtree(e.path)
            else:
                e.path.unlink()
            if e.kind == "packages":
                e.path.with_suffix(".sha256").unlink(missing_ok=True)
        removed.append(e)
    return removed, busy
