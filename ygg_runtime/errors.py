"""The one exception type whose message is shown to the user as a single line."""


class YggError(Exception):
    """Bad input or a refused artifact: the CLI prints `error: <message>` and exits non-zero."""
