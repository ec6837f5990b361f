"""Where a compile writes: a temporary directory beside the output, renamed to it only when the
whole compile succeeded (one compile per output at a time; leftovers of killed ones removed), the
modes the user's umask asks for, a full disk said as such, and a Ctrl-C or SIGTERM taken where the
compile chooses — so an interrupted or failed compile leaves nothing half-written."""

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
from ygg_runtime.ui import Reporter


@contextlib.contextmanager
def interrupts() -> Iterator[threading.Event]:
    """Take a Ctrl-C (SIGINT) or a SIGTERM (`kill`, a CI timeout) as a request to stop, remembered
    in the event yielded: the compile stops where it looks (`Stopping`: between its phases and at
    every progress report of a long loop). The handler raises nothing, so no exception starts inside
    a finalizer (where Python prints "Exception ignored in ..." with a traceback and goes on) or in a
    library that would turn it into an error of its own. A second signal stops at once, wherever
    the compile is: work that reports no progress (a C++ build, AOTInductor) runs to its end after
    a first SIGTERM sent to the compile alone (a terminal's Ctrl-C reaches its compilers too)."""
    seen = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        if seen.is_set():
            raise KeyboardInterrupt
        seen.set()

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield seen
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


class Stopping(Reporter):
    """A compile's reporter that stops it (KeyboardInterrupt) at its next step or progress report
    once a signal came (`interrupts`): the long loops report progress, so they are where it stops."""

    def __init__(self, ui: Reporter, interrupted: threading.Event):
        self.ui, self.interrupted = ui, interrupted

    def check(self) -> None:
        if self.interrupted.is_set():
            raise KeyboardInterrupt

    def step(self, description: str) -> contextlib.AbstractContextManager:
        self.check()
        return self.ui.step(description)

    def progress(self, description: str, done: int, total: int, unit: str = "B") -> None:
        self.check()
        self.ui.progress(description, done, total, unit)

    def note(self, text: str) -> None:
        self.ui.note(text)


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
