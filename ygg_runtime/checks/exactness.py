"""Whether a generation's greedy output is guaranteed to be this artifact's plain decoding, and
the one sentence that says so.

The guarantee rests on the compile-time row-invariance check (`ygg_compile.invariance`), kept in
plan.yaml's `exactness` per forward kind ("compiled", "eager"): from `min_width` on, a token's row
has the same bits in every forward, so a tree verify scores it as plain decoding does. It holds for
a generation when a width was found for the forward kind it ran, every target forward ran that
kind (a compiled graph and the eager model round differently), and it runs on the machine the check
ran on: the same torch (its kernels), the same CPU model and vector instruction flags (oneDNN and
torch pick other kernels on a CPU with AMX, say), and the same thread count (a matmul may split its
work differently on other counts); on a GPU, the same GPU model and compute capability (cuBLAS picks
kernels by the GPU), CUDA, cuBLAS and driver (the host CPU then does not matter). Anything else is
"not checked on this machine", and `ygg compile` there checks it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ygg_runtime.backend import gpu_identity as gpu
from ygg_runtime.checks.integrity import cpu_info
from ygg_runtime.machine import GPUInfo
from ygg_runtime.schema.plan import ExactnessRecord, Plan

LOST = "greedy output can differ from plain decoding at float near-ties"


@dataclass(frozen=True)
class Machine:
    """What the row check's result depends on besides the artifact: torch, and the CPU (model,
    vector flags, threads) or the GPU that runs the forwards."""

    torch: str
    cpu: str
    isa: tuple[str, ...]
    threads: int
    gpu: GPUInfo | None = None

    @classmethod
    def here(cls, device: torch.device | str = "cpu") -> "Machine":
        if torch.device(device).type == "cuda":
            return cls(str(torch.__version__), "", (), 0, gpu.info(device))
        info = cpu_info()
        return cls(str(torch.__version__), info.model, tuple(info.isa), torch.get_num_threads())

    @classmethod
    def checked(cls, plan: Plan, record: ExactnessRecord) -> "Machine":
        """The machine `record` was measured on: the compiling one (plan.yaml's torch, and its cpu or gpu)."""
        if plan.gpu is not None:
            return cls(plan.torch_version, "", (), 0, plan.gpu)
        return cls(plan.torch_version, plan.cpu.model, tuple(plan.cpu.isa), record.threads)


GPU_FIELDS = (("name", "GPU"), ("capability", "compute capability"), ("cuda", "CUDA"), ("cublas", "cuBLAS"),
              ("driver", "driver"))


def differences(checked: Machine, here: Machine) -> list[str]:
    """How this machine differs from the checked one, each in a few words (empty: it is the same)."""
    out = []
    if checked.torch != here.torch:
        out.append(f"torch {here.torch}, not {checked.torch}")
    if (checked.gpu is None) != (here.gpu is None):
        out.append(f"a CPU, not the GPU {checked.gpu.label()}" if here.gpu is None else
                   f"the GPU {here.gpu.label()}, not a CPU")
        return out
    if checked.gpu is not None:
        return out + [f"{label} {getattr(here.gpu, f)}, not {getattr(checked.gpu, f)}" for f, label in GPU_FIELDS
                      if getattr(here.gpu, f) != getattr(checked.gpu, f)]
    if checked.cpu != here.cpu:
        out.append(f"CPU {here.cpu!r}, not {checked.cpu!r}")
    gained, lost = sorted(set(here.isa) - set(checked.isa)), sorted(set(checked.isa) - set(here.isa))
    if gained or lost:
        out.append("CPU flags " + ", ".join([f"+{f}" for f in gained] + [f"-{f}" for f in lost]))
    if checked.threads != here.threads:
        out.append(f"{here.threads} threads, not {checked.threads} (set OMP_NUM_THREADS={checked.threads})")
    return out


def min_width(record: ExactnessRecord | None) -> int:
    """The width every target forward is padded to (0: no invariant width was found)."""
    return (record.min_width if record else None) or 0


def verdict(record: ExactnessRecord | None, checked: Machine | None = None, mixed: bool = False,
            kind: str = "compiled", here: Machine | None = None) -> tuple[bool, str]:
    """(exact, sentence) for a generation run under `record`, measured on the `checked` machine
    (None: this one), on the `kind` forwards ("compiled" or "eager", each exact against its own
    plain decoding: they round differently); mixed: its target forwards ran both."""
    lost = LOST
    if not record:
        return False, f"{lost}: this forward kind was not checked when the artifact was compiled"
    if record.min_width is None:
        return False, (f"{lost}: at compile time no forward width gave a token's row the same bits in every layout "
                       f"(checked widths {', '.join(map(str, record.widths))})")
    if mixed:
        return False, f"{lost}: this generation ran the target both compiled and eager"
    here = here or Machine.here()
    checked = checked or (here if here.gpu else dataclasses.replace(here, threads=record.threads))
    if diff := differences(checked, here):
        return False, (f"not checked on this machine ({'; '.join(diff)}): {lost}; `ygg compile` on this machine "
                       "checks it again")
    off = [w for w in record.widths if w < record.min_width]
    unused = ""
    if off:
        diff = max(record.max_abs_logit_diff[w] for w in off)
        unused = (f"; width{'s' if len(off) > 1 else ''} {', '.join(map(str, off))} "
                  f"differ{'' if len(off) > 1 else 's'} (|Δlogit| up to {diff:.3g}) and {'are' if len(off) > 1 else 'is'} never used")
    rule = (f"every target forward runs at width {record.min_width}, where a token's row has the same bits"
            if record.min_width == record.widths[-1] else
            f"a token's row has the same bits in every target forward of width {record.min_width} to {record.widths[-1]}")
    return True, (f"greedy output is identical to this artifact's plain decoding on its {kind} forwards: {rule}, "
                  f"alone or in a tree{unused}")
