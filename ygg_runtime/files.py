"""Files written whole or not at all, and read back by hash: every writer of the project uses these."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ygg_runtime.errors import YggError

Progress = Callable[[str, int, int], None]


def sha256_of(paths: list[Path], progress: Progress | None = None, label: str = "hashing",
              copy_to: BinaryIO | None = None) -> str:
    """The sha256 of the files' concatenated bytes, read once in 16 MiB chunks; copy_to also
    receives every chunk (assembling a file from parts while hashing it)."""
    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    done = 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
                if copy_to is not None:
                    copy_to.write(chunk)
                done += len(chunk)
                if progress:
                    progress(label, done, total)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary sibling (named for this process, so concurrent writers do not share
    it) and a rename: readers never see a half-written file, and a failed write leaves none."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def output_dir(out: Path, what: str) -> Path:
    """Create `out` and make sure files can be written there, before any long work starts."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise YggError(f"cannot write {what} to {out}: {e.strerror or e}") from e
    return out
