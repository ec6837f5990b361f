"""Does this machine's torch load an AOTInductor package at all, in a process that did not compile it?
Each case is compiled in a child process, then loaded in a *fresh* child, stage by stage, each
stage's line printed before the next starts, so a crash names the stage it died in:

  metadata         the package read as the zip archive it is (its files, the AOTI metadata)
  raw runner       the extracted .so loaded by torch's container runner directly
  package loader   torch's C++ AOTIModelPackageLoader, as `ygg run` loaded packages (ygg_runtime.model.compiled)
  first run        the user-managed weights handed over, one forward, compared with eager

    python3 benchmarks/aoti_load_probe.py [-o FILE.json] [--cases a,b]

Cases: `mlp` (two linear layers, nothing of ours; weights in the .so, or left out and handed over
as user-managed constants) and `ygg` (a two-layer `Transformer` exported with the CPU's composition
of ops, `ygg::attention` an opaque operator whose kernel on the device is ours, weights user-managed:
how ygg's packages were built). On the H200 image (torch 2.11.0+cu130) every case segfaulted, each
time loaded in the process that had just compiled it (benchmarks/results/cuda-nvidia-h200/); a CUDA
artifact therefore ships no model.pt2 and its forwards are our Triton kernels replayed as CUDA graphs
(`ygg_compile.build.aot_left_out`). Where the ygg case runs, its forward's time is printed beside
the same forward on our Triton kernels. On torch 2.13.0+cpu every case loads and matches eager.
About 40 s a case on an H200.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {"mlp-weights-in-so": ("mlp", True), "mlp-user-managed": ("mlp", False), "ygg-user-managed": ("ygg", False)}
STAGES = ("metadata", "raw runner", "package loader", "first run")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _ygg_model():
    from ygg_runtime.backend import cpu, schema  # noqa: F401  (schema: ygg::attention, the opaque operator)
    from ygg_runtime.model.transformer import ModelArgs, Transformer

    class Exported(cpu.CpuOps):
        """The CPU's composition, attention left to the operator (its kernel: the device's)."""

        def attention(self, *args):
            return torch.ops.ygg.attention(*args)

    if DEVICE == "cuda":
        from ygg_runtime.backend import cuda  # noqa: F401  (ygg::attention's CUDA kernel)
    else:
        from ygg_runtime.backend import native

        native.load()
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                  intermediate_size=128, norm_eps=1e-5, tie_embeddings=True)).to(DEVICE).eval()
    model.setup_cache(64)
    return model, Exported()


def model_and_inputs(kind: str):
    """The case's model (seeded: the same in every process), its example inputs, its ops to export with."""
    if kind == "mlp":
        torch.manual_seed(0)
        return MLP().to(DEVICE).eval(), (torch.randn(8, 64, device=DEVICE),), None
    from ygg_compile import aot

    model, ops = _ygg_model()
    return model, aot.example_args(model, 4, 12), ops


def compile_case(case: str, out: Path) -> None:
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    kind, in_so = CASES[case]
    model, args, ops = model_and_inputs(kind)
    model.ops = ops if ops is not None else None
    with torch.no_grad():
        dims = {0: torch.export.Dim("rows", min=2, max=64)} if kind == "mlp" else None
        program = torch.export.export(model, args, dynamic_shapes=(dims,) if dims else None, strict=False)
        compiled = aot_compile(program.module(), args, options={"aot_inductor.package": True,
                                                                "aot_inductor.package_constants_in_so": in_so})
    package_aoti(str(out), {"model": compiled})
    print(f"compiled {out.stat().st_size} bytes", flush=True)


def load_case(case: str, path: Path) -> None:
    kind, in_so = CASES[case]
    model, args, ops = model_and_inputs(kind)  # (the ygg case: its operators registered before the package loads)
    stage = iter(STAGES)
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = [n for n in names if n.endswith("metadata.json")]
        print(f"{next(stage)}: ok ({len(names)} files, {z.read(meta[0]).decode()[:80] if meta else 'no metadata'})",
              flush=True)
        so = [n for n in names if n.endswith(".so")]
        unpacked = Path(tempfile.mkdtemp())
        z.extractall(unpacked)
    if DEVICE == "cuda":
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(unpacked / so[0]), 1, "cuda", str((unpacked / so[0]).parent))
    else:
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(unpacked / so[0]), 1)
    print(f"{next(stage)}: ok", flush=True)
    del runner
    graph = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    print(f"{next(stage)}: ok", flush=True)
    if not in_so:
        weights = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        graph.load_constants({n: weights[n] for n in graph.get_constant_fqns()}, False, True, user_managed=True)
    with torch.no_grad():
        model.ops = ops
        eager = model(*args)
        eager = (eager[0] if isinstance(eager, tuple) else eager).float()
        compiled = graph.run(list(args))[0].float()
        said = f"max |compiled - eager| {(compiled - eager).abs().max().item():.3g}"
        if kind == "ygg" and DEVICE == "cuda":  # the same forward on our Triton kernels (both uncaptured)
            from ygg_bench import harness
            from ygg_runtime.backend import cuda

            def ours() -> None:
                model.ops = cuda.OPS
                model(*args)

            ms = harness.medians(harness.interleaved({"aoti": lambda: graph.run(list(args)), "ours": ours}, 20,
                                                     device="cuda"))
            said += f"; {ms['aoti']:.3f} ms a forward, ours {ms['ours']:.3f} ms"
    print(f"{next(stage)}: ok, {said}", flush=True)


def _child(*argv: str, timeout: int = 300) -> tuple[int, list[str], str]:
    proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, *argv], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, [line for line in proc.stdout.splitlines() if line], proc.stderr


def main() -> None:
    from ygg_bench import harness

    ap = harness.parser(__doc__, repeats=None)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--compile", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)  # in a child
    ap.add_argument("--load", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)  # in a fresh child
    args = harness.parse(ap)
    if args.compile:
        return compile_case(args.compile[0], Path(args.compile[1]))
    if args.load:
        return load_case(args.load[0], Path(args.load[1]))
    lines = [f"torch {torch.__version__} on {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'a CPU'}"]
    print(lines[0], flush=True)
    for case in args.cases.split(","):
        start = time.time()
        path = Path(tempfile.mkdtemp()) / "model.pt2"
        code, said, err = _child("--compile", case, str(path))
        if code != 0:
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            lines.append(f"{case}: the compile died ({how}): {(err.strip().splitlines() or ['(nothing)'])[-1]}")
        else:
            code, said, err = _child("--load", case, str(path))
            done = [line for line in said if line.split(":")[0] in STAGES]
            died = STAGES[len(done)] if code != 0 and len(done) < len(STAGES) else None
            how = "loads and runs" if code == 0 else (f"died in '{died}' (" + (f"signal {-code}" if code < 0 else f"exit {code}")
                                                      + f"): {(err.strip().splitlines() or ['(nothing)'])[-1]}")
            lines.append(f"{case}: {how}, {time.time() - start:.0f} s" + (f"; {done[-1]}" if done else ""))
        print(lines[-1], flush=True)
    if args.out:
        harness.write_json(args.out, {"torch": torch.__version__, "cases": lines[1:]})


if __name__ == "__main__":
    main()
