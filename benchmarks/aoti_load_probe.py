"""Does this machine's torch load an AOTInductor package at all? Each case compiled and loaded in a
child process of its own (a segfault ends the child, not the probe), on the GPU when there is one.

    python3 benchmarks/aoti_load_probe.py [-o FILE]

Cases: `mlp` (two linear layers, nothing of ours; the weights in the .so, or left out and handed
over as user-managed constants, as ygg's packages are), loaded by `load_package`, Inductor's Python
wrapper; and `ygg` (a two-layer `Transformer` through `ygg_compile.aot.compile_model` and
`ygg_runtime.compiled.CompiledForward`, its weights left out or in the .so), loaded by torch's C++
`AOTIModelPackageLoader` directly, as `ygg run` loads since the wrapper's imports were found to cost
~3 s a start (the wrapper also reads the device's information first). On the H200 image (torch
2.11.0+cu130) every case compiled and then segfaulted, when all of them loaded through `load_package`
(DESIGN.md §11); whether the C++ loader alone does too is not measured yet: this probe's two kinds of
case now tell them apart. On torch 2.13.0+cpu every case loads and matches eager. Run it on a
GPU of a new torch before trusting `ygg compile --device cuda` with AOT (which tries the loader in a
child too: `ygg_compile.aot.load_failure`). About 40 s a case on an H200.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {"mlp-weights-in-so": ("mlp", True), "mlp-user-managed": ("mlp", False),
         "ygg-user-managed": ("ygg", False), "ygg-weights-in-so": ("ygg", True)}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def mlp(in_so: bool) -> None:
    from torch._inductor import aot_compile
    from torch._inductor.package import load_package, package_aoti

    model = MLP().to(DEVICE).eval()
    x = torch.randn(8, 64, device=DEVICE)
    with torch.no_grad():
        program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("rows", min=2, max=64)},))
        compiled = aot_compile(program.module(), (x,), options={"aot_inductor.package": True,
                                                                "aot_inductor.package_constants_in_so": in_so})
    path = str(Path(tempfile.mkdtemp()) / "model.pt2")
    package_aoti(path, {"forward": compiled})
    print("compiled; loading", flush=True)
    graph = load_package(path, model_name="forward")
    print("loaded", flush=True)
    if not in_so:
        weights = dict(model.named_parameters())
        graph.load_constants({n: weights[n] for n in graph.get_constant_fqns()}, check_full_update=True,
                             user_managed=True)
    with torch.no_grad():
        print(f"ran: max |compiled - eager| {(graph(x) - model(x)).abs().max().item():.3g}", flush=True)


def ygg(in_so: bool) -> None:
    import torch._inductor as inductor

    from ygg_compile import aot
    from ygg_runtime.compiled import CompiledForward
    from ygg_runtime.model import ModelArgs, Transformer

    original = inductor.aot_compile
    inductor.aot_compile = lambda gm, args, options=None: original(
        gm, args, options={**(options or {}), "aot_inductor.package_constants_in_so": in_so})
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                  intermediate_size=128, norm_eps=1e-5, tie_embeddings=True)).to(DEVICE).eval()
    model.setup_cache(64)
    path = Path(tempfile.mkdtemp()) / aot.PACKAGE
    aot.compile_model(model, path)
    print("compiled; loading", flush=True)
    forward = CompiledForward(path, model)
    print("loaded", flush=True)
    args = aot.example_args(model, 4, 12)
    with torch.no_grad():
        eager = model(*args)[0].float()
        print(f"ran: max |compiled - eager| {(forward(*args)[0].float() - eager).abs().max().item():.3g}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, help="also write the report here")
    ap.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in the child
    args = ap.parse_args()
    if args.case:
        kind, in_so = CASES[args.case]
        (mlp if kind == "mlp" else ygg)(in_so)
        return
    lines = [f"torch {torch.__version__} on {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'a CPU'}"]
    print(lines[0], flush=True)
    for case in CASES:
        start = time.time()
        proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--case", case], capture_output=True,
                              text=True, timeout=300)
        said = [line for line in proc.stdout.splitlines() if line]
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        last = said[-1] if said else (proc.stderr.strip().splitlines() or ["(nothing)"])[-1]
        lines.append(f"{case}: {how}, {time.time() - start:.0f} s; last: {last}")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
