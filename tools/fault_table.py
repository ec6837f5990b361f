"""docs/faults.md's table, from what tests/test_faults.py recorded in a run:

    YGG_FAULT_TABLE=/tmp/faults.jsonl python -m pytest tests/test_faults.py
    python tools/fault_table.py /tmp/faults.jsonl > docs/faults.md

Each record is a case's last line on stderr and its exit code, as the test saw them (the test
asserts the rest: one line, no traceback, nothing changed). Temporary paths are shortened."""

import json
import re
import sys

ORDER = ["run", "serve", "compile", "bench", "inspect"]
SHORTEN = [
    (re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/(popen-gw\d+/)?[^/\s]+"), "…"),  # a test's temporary directory
    (re.compile(r"\S*/\.cache/ygg-test"), "$YGG_CACHE"),
    (re.compile(r"\S*/(ygg_compile/data/)"), r"\1"),
]

HEADER = """# What each fault prints

Every bad input, damaged artifact, full disk, signal and race that `tests/test_faults.py` pins: the
last line `ygg` printed on stderr in a run of those tests, and its exit code. For each refusal the
test checks that this line is all of stderr (no traceback) and that nothing under the case's
directory changed: no partial file at `-o`, a previous artifact byte for byte as it was. A signal's
line ends the compile's progress output, and the previous artifact stays as it was. The cases that
exit 0 are not errors: a reader of `ygg run`'s output that goes away, a warning, the compile after
a `kill -9` (what happened is in parentheses). Exit code 2 is a usage error (the command's syntax), 130 an interrupt. The tests write
this file's records when `YGG_FAULT_TABLE` names one; `tools/fault_table.py` formats them.

| # | command | case | the line printed (temporary paths shortened to …) | exit |
|---|---|---|---|---|"""


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    rows.sort(key=lambda r: ORDER.index(r["command"]))  # stable: cases keep the test's order
    print(HEADER)
    for i, r in enumerate(rows, 1):
        line = r["line"]
        for pattern, short in SHORTEN:
            line = pattern.sub(short, line)
        shown = f"_{line}_" if line.startswith("(") else f"`` {line} ``"  # what happened; or the line (backticks in it)
        cells = [str(i), r["command"], r["case"], shown, str(r["code"])]
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    print(f"\n{len(rows)} cases.")


if __name__ == "__main__":
    main(sys.argv[1])
