"""The one exception type whose message is shown to the user as a single line."""


class YggError(Exception):
    """Bad input or a refused artifact: the CLI prints `error: <message>` and exits non-zero."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, cut to `limit` characters, or its type's
    name when the message is empty (a library's multi-line message inside our one-line errors)."""
    line = next((s.strip() for s in str(e).splitlines() if s.strip()), "")
    return (line[:limit] + "…" if len(line) > limit else line) or type(e).__name__


# How a full disk (ENOSPC, EDQUOT) or the process's file-size limit (EFBIG, SIGXFSZ) reads in the
# words of the OS, of a C++ compiler the limit killed, and of Rust's io errors (safetensors): a
# library that writes reports it in its own exception, often deep in a multi-line message.
NO_SPACE = ("No space left on device", "Disk quota exceeded", "File too large", "File size limit exceeded",
            "os error 28", "os error 122", "os error 27")


def out_of_space(e: BaseException | str) -> str | None:
    """The words saying a disk is full, when the error (any line of its message, or a tool's output)
    says so."""
    said = str(e)
    return next((m for m in NO_SPACE if m in said), None)
