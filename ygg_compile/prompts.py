"""Prompt files: the benchmark's Spec-Bench-style JSONL and the calibration texts compile learns from."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ygg_compile.options import check_limit
from ygg_runtime.errors import YggError

DATA = Path(__file__).parent / "data"
BENCH_PROMPTS = DATA / "bench_prompts.jsonl"
CALIBRATION_PROMPTS = DATA / "calib_prompts.jsonl"


@dataclass
class Prompt:
    key: str  # question_id, or the line number
    category: str
    text: str


def read_jsonl(path: Path | None, categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Spec-Bench's JSONL (`question_id`, `category`, `turns`; the first turn is the prompt; a
    `prompt` field is read too), in file order, at most `limit` per category; default: the
    benchmark's built-in set."""
    path = Path(path) if path is not None else BENCH_PROMPTS
    if path.is_dir():
        raise YggError(f"prompt file {path} is a directory: give a JSONL file")
    if not path.is_file():
        raise YggError(f"prompt file {path} does not exist")
    check_limit(limit)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise YggError(f"{path}:{line} is not UTF-8 text") from None
    if not any(line.strip() for line in lines):
        raise YggError(f"prompt file {path} is empty")
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    found: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["turns"][0] if "turns" in row else row["prompt"]
            if not isinstance(text, str) or not text.strip():
                raise TypeError
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise YggError(f"{path}:{n} is not a prompt record (a JSON object with a non-empty `turns` or "
                           "`prompt`)") from None
        cat = str(row.get("category", "default"))
        found.add(cat)
        if categories and cat not in categories:
            continue
        if limit and seen.get(cat, 0) >= limit:
            continue
        seen[cat] = seen.get(cat, 0) + 1
        out.append(Prompt(str(row.get("question_id", n)), cat, text))
    if not out:
        raise YggError(f"no prompts in {path} for categories {', '.join(categories or [])} (it has: {', '.join(sorted(found))})")
    return out


# Long prompts (`ygg bench --long`): code to summarise, cut from modules every Python install
# ships (the standard library's), so the same text is on any machine without a download; as
# many modules as a length needs, in this order.
LONG_SOURCES = ("argparse", "dataclasses", "inspect", "typing", "pathlib")
LONG_ASK = "Summarise what the following Python code does, part by part.\n\n"


def long_category(tokens: int) -> str:
    return f"long-{tokens // 1000}k" if tokens % 1000 == 0 else f"long-{tokens}"


def long_prompts(lengths: list[int], encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> list[Prompt]:
    """One prompt of about each length in tokens (as `encode` counts them, before a chat template
    adds its own): LONG_ASK, then the standard library's source cut to fit."""
    ask = len(encode(LONG_ASK))
    ids = stdlib_text(LONG_SOURCES, max(lengths) - ask, encode, f"--long {max(lengths)}")
    return [Prompt(f"long-{n}", long_category(n), LONG_ASK + decode(ids[: n - ask])) for n in lengths]


# The long text compile measures the drafter's window on (`ygg_compile.calibrate.window_acceptance`):
# other modules than the benchmark's, so the plan is not fitted to the text it is timed on.
WINDOW_SOURCES = ("functools", "enum", "textwrap", "shutil", "tarfile")


def stdlib_text(names: tuple[str, ...], need: int, encode: Callable[[str], list[int]], what: str) -> list[int]:
    """At least `need` tokens of the named standard-library modules' source, in order (only as many
    modules as it takes); one line naming `what` asked for more when they hold fewer."""
    text, ids = "", []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        text += f"# {name}.py\n\n" + Path(spec.origin).read_text(encoding="utf-8") + "\n\n"
        ids = encode(text)
        if len(ids) >= need:
            return ids
    raise YggError(f"the standard library's {', '.join(names)} give {len(ids)} tokens, fewer than {what} needs")


def calibration(path: Path | None) -> list[str]:
    """Calibration prompts: a JSONL file (`turns` or `prompt` fields), a text file (prompts
    separated by lines holding only `---`), or a directory of such files; default: our own set."""
    path = Path(path) if path is not None else CALIBRATION_PROMPTS
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".txt", ".md") and p.is_file())
        prompts = [t for f in files for t in calibration(f)]
    elif path.is_file():
        if path.suffix == ".jsonl":
            prompts = [p.text for p in read_jsonl(path)]
        else:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise YggError(f"calibration file {path} is not UTF-8 text") from None
            prompts = [part.strip() for part in _split(text)]
    else:
        raise YggError(f"calibration path {path} does not exist")
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise YggError(f"no calibration prompts in {path}")
    return prompts


def _split(text: str) -> list[str]:
    parts, cur = [], []
    for line in text.splitlines():
        if line.strip() == "---":
            parts.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    return parts + ["\n".join(cur)]
