"""Where a compile writes: a temporary directory beside the output, renamed to it only when the
whole compile succeeded (one compile per output at a time; leftovers of killed ones removed), the
modes the user's umask asks for, a full disk said as such, and a Ctrl-C or SIGTERM remembered even
when a library swallows it — so an interrupted or failed compile leaves nothing half-written."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from ygg_runtime.errors import YggError, out_of_space
from ygg_runtime.files import cache_dir, locked


@contextlib.contextmanager
def interrupts() -> Iterator[threading.Event]:
    """Remember a Ctrl-C (or a SIGTERM: `kill`, a CI timeout) even if a library catches the
    KeyboardInterrupt it raises (AOTInductor's compile can), so the compile still stops at the next
    phase and leaves nothing behind."""
    seen = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        seen.set()
        raise KeyboardInterrupt

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield seen
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out`, renamed to `out` only when the body succeeds. One
    compile per `out` at a time (a lock beside it); holding the lock, the temporary directories of
    compiles that died (SIGKILL, power loss) are provably stale and removed."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with locked(out, wait=False, remove=True) as mine:
            if not mine:
                raise YggError(f"another `ygg compile` is writing {out} right now: wait for it to finish, "
                               "or compile to another -o")
            _remove_stale(out)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            try:
                yield tmp
                _honour_umask(tmp)
                old = None
                if out.exists():
                    old = out.with_name(f".{out.name}.old-{int(time.time())}")
                    out.rename(old)
                tmp.rename(out)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except YggError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):  # a copy's error names its source, then the file written
            raise no_space(out, e.strerror, e.filename2 or e.filename) from e
        if e.filename is None or not Path(e.filename).is_relative_to(out.parent):
            raise
        raise YggError(f"cannot write to {out.parent}: {e.strerror or e}") from e
    except Exception as e:  # libraries that write (safetensors, AOTInductor's C++ compiler) say it their own way
        if full := out_of_space(e):
            raise no_space(out, full, None) from e
        raise


def no_space(out: Path, why: str, filename: str | None) -> YggError:
    """A full disk (or file-size limit) anywhere a compile writes, named as such: AOTInductor's
    C++ compiler reported it as a bare "C++ compile error"."""
    if filename:
        return YggError(f"out of disk space ({why}) writing {filename}: nothing was written to {out} — free space "
                        "and compile again")
    return YggError(f"out of disk space ({why}): nothing was written to {out} — free space where a compile writes "
                    f"(beside it, the cache {cache_dir()}, and {tempfile.gettempdir()} for the C++ compiler) and "
                    "compile again")


def _remove_stale(out: Path) -> None:
    """Leftovers of killed compiles into `out` (the caller holds its lock, so none is running):
    our temporary directories, and a previous artifact set aside just before a kill."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp-[a-z0-9_]{{8}}|old-\d+)")
    for p in out.parent.iterdir():
        if p.is_dir() and pattern.fullmatch(p.name):
            if p.name.startswith(f".{out.name}.old-") and not out.exists():
                p.rename(out)  # killed between setting the old artifact aside and renaming the new one in
            else:
                shutil.rmtree(p, ignore_errors=True)


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it; else set, read, restore."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _honour_umask(root: Path) -> None:
    """Give the artifact the modes the user's umask asks for: mkdtemp and the temporary files some
    writers use are created 0700/0600, which would leave an artifact built by one account (or a CI
    job) unreadable to another."""
    mask = _umask()
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        full = 0o777 if p.is_dir() or p.stat().st_mode & 0o111 else 0o666
        p.chmod(full & ~mask)
