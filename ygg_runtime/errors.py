"""The one exception type whose message is shown to the user as a single line."""


class YggError(Exception):
    """Bad input or a refused artifact: the CLI prints `error: <message>` and exits non-zero."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, cut to `limit` characters, or its type's
    name when the message is empty (a library's multi-line message inside our one-line errors)."""
    line = next((s.strip() for s in str(e).splitlines() if s.strip()), "")
    return (line[:limit] + "…" if len(line) > limit else line) or type(e).__name__
