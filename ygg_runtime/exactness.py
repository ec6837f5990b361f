"""Whether a generation's greedy output is guaranteed to be this artifact's plain decoding, and
the one sentence that says so.

The guarantee rests on the compile-time row-invariance check (`ygg_compile.invariance`), kept in
plan.yaml's `exactness` per forward kind ("compiled", "eager"): from `min_width` on, a token's row
has the same bits in every forward, so a tree verify scores it as plain decoding does. It holds for
a generation when a width was found for the forward kind it ran, every target forward ran that
kind (a compiled graph and the eager model round differently), and the process has the thread
count the check ran with (a matmul may split its work differently on other counts).
"""

from __future__ import annotations

import torch

from ygg_runtime.plan import ExactnessRecord


def min_width(record: ExactnessRecord | None) -> int:
    """The width every target forward is padded to (0: no invariant width was found)."""
    return (record.min_width if record else None) or 0


def verdict(record: ExactnessRecord | None, mixed: bool = False, kind: str = "compiled") -> tuple[bool, str]:
    """(exact, sentence) for a generation run under `record`, on the `kind` forwards ("compiled"
    or "eager", each exact against its own plain decoding: they round differently); mixed: its
    target forwards ran both."""
    lost = "greedy output can differ from plain decoding at float near-ties"
    if not record:
        return False, f"{lost}: this forward kind was not checked when the artifact was compiled"
    if record.min_width is None:
        return False, (f"{lost}: at compile time no forward width gave a token's row the same bits in every layout "
                       f"(checked widths {', '.join(map(str, record.widths))})")
    if mixed:
        return False, f"{lost}: this generation ran the target both compiled and eager"
    if record.threads != torch.get_num_threads():
        return False, (f"{lost}: rows were checked with {record.threads} threads and this process runs "
                       f"{torch.get_num_threads()} (set OMP_NUM_THREADS={record.threads})")
    off = [w for w in record.widths if w < record.min_width]
    unused = ""
    if off:
        diff = max(record.max_abs_logit_diff[w] for w in off)
        unused = (f"; width{'s' if len(off) > 1 else ''} {', '.join(map(str, off))} "
                  f"differ{'' if len(off) > 1 else 's'} (|Δlogit| up to {diff:.3g}) and {'are' if len(off) > 1 else 'is'} never used")
    return True, (f"greedy output is identical to this artifact's plain decoding on its {kind} forwards: a token's row "
                  f"has the same bits in every target forward of width {record.min_width} to {record.widths[-1]}, "
                  f"alone or in a tree{unused}")
