"""Files written whole or not at all, and read back by hash: every writer of the project uses these."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ygg_runtime.errors import YggError

Progress = Callable[[str, int, int], None]


def cache_dir() -> Path:
    """Where Yggdrasil keeps what it can rebuild: $YGG_CACHE, else $XDG_CACHE_HOME/yggdrasil."""
    root = os.environ.get("YGG_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "yggdrasil"
    return Path(root)


def size(n: float) -> str:
    """Bytes as a person reads them in a message: 4.61 GB, 507.7 MB, 12 kB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


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
    if out.exists() and not out.is_dir():
        raise YggError(f"{out} is a file: {what} go in a directory (give another -o)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise YggError(f"cannot write {what} to {out}: {e.strerror or e}") from e
    return out


@contextlib.contextmanager
def locked(path: Path, wait: bool = True, remove: bool = False) -> Iterator[bool]:
    """Hold an exclusive lock on the hidden file `.NAME.lock` beside `path` while the body fills
    `path`: processes writing the same place take turns (wait=True) or learn that another one is
    at it (wait=False yields False without the lock). The kernel drops the lock when its holder
    dies, even by SIGKILL, so holding it proves no live writer is there. remove=True deletes the
    lock file on the way out (still holding it); a process that locked the deleted file meanwhile
    sees that its file is no longer the one at the path, and tries again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.parent / f".{path.name}.lock"
    while True:
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                if not lock.exists() or os.stat(lock).st_ino != os.fstat(f.fileno()).st_ino:
                    continue  # the holder before us removed it: lock the file now at the path
                try:
                    yield True
                finally:
                    if remove:
                        lock.unlink(missing_ok=True)
                return
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
