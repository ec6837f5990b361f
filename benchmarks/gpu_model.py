"""What a forward on the CUDA backend costs on a GPU, weighed before a GPU is lent: the forward's own
kernel list — every kernel `ygg_runtime.backend.cuda` launches, recorded by running the decoder on
meta tensors with Triton's launch replaced by a note — each kernel's bytes and multiply-adds and one
launch, against a named GPU's roofs: a *modelled* T(W), labelled so wherever it is printed. With
--compile each distinct kernel is also compiled for sm_90 by Triton with its own ptxas (registers,
spills, shared memory), so a kernel that does not compile or spills is seen on a CPU.

    python benchmarks/gpu_model.py [--gpu H200] [--models qwen2.5-1.5b,qwen2.5-0.5b] [--widths 1,8,64]
                                   [--context 64] [--compile] [-o FILE.json]

The model of a kernel: one launch (LAUNCH_US, inside a CUDA graph) plus the larger of its bytes at
the GPU's read bandwidth and its multiply-adds at its bf16 tensor-core rate; a forward is the sum
of its kernels (they run one after another). It ignores wave quantisation, the overlap of one
kernel's tail with the next one's start, and caches: a floor-like estimate, which `make gpu-check`
prints beside the measured time (benchmarks/gpu_check.py) so the model is checked where it can be.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # the kernels compile for a GPU here: Triton's interpreter must be off
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud (it warns otherwise)

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The GPUs a model is weighed for. H200: read bandwidth and bf16 matmul rate measured by `make
# gpu-check` (benchmarks/results/cuda-nvidia-h200/: 4.09 TB/s, 339 T multiply-adds/s); H100 SXM: its
# 3.35 TB/s specification at the H200's measured fraction of its own 4.8 TB/s, and the same tensor
# cores. LAUNCH_US: one kernel launched inside a CUDA graph (Hazy Research's megakernel write-up
# measured ~1.3 us on an H100).
GPUS = {"H200": {"read_GBps": 4090.0, "TMACs": 339.0, "sms": 132},
        "H100": {"read_GBps": 3350.0 * 4090.0 / 4800.0, "TMACs": 339.0, "sms": 132}}
LAUNCH_US = 1.3

# Model shapes (their config.json): the demo pair, and the seeds' own pair (Llama-2-7B, LLaMA-68M).
SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151_936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                         intermediate_size=8960, qkv_bias=True, tie_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151_936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                         intermediate_size=4864, qkv_bias=True, tie_embeddings=True),
    "llama-2-7b": dict(vocab_size=32_000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                       intermediate_size=11_008),
    "llama-68m": dict(vocab_size=32_000, dim=768, n_layers=2, n_heads=12, n_kv_heads=12, head_dim=64,
                      intermediate_size=3072),
}


DRAFTERS = {"qwen2.5-0.5b", "llama-68m"}  # modelled on the drafter's ops (free K splits: `backend.for_device`)


@dataclass
class Kernel:
    """One launch of a forward: what it moves and multiplies."""

    name: str
    grid: tuple[int, ...]
    bytes: int
    weight_bytes: int  # of them, the model's weights (what the weight-stream floor counts)
    macs: int
    tag: str = ""  # which weight or op, for a person reading the table
    compiled: dict = field(default_factory=dict)  # sm_90: registers, spills, shared bytes (--compile)

    def ms(self, gpu: dict) -> float:
        return LAUNCH_US / 1e3 + max(self.bytes / (gpu["read_GBps"] * 1e9), self.macs / (gpu["TMACs"] * 1e12)) * 1e3


def _size(t) -> int:
    return t.numel() * t.element_size()


def cost(name: str, a: dict, context: int) -> tuple[int, int, int, str]:
    """(bytes, of them weight bytes, multiply-adds, tag) of a launch of kernel `name` with bound
    arguments `a`. The GEMM multiplies 64-row tiles whatever the rows (`triton_linear.BM`): its
    multiply-adds are counted padded."""
    if name == "_linear":
        from ygg_runtime.backend.triton_linear import BM

        m, nj, k = a["M"], a["NJ"], a["K"]
        cols = nj * (2 if a["PAIRED"] else 1)
        rows = -(-m // BM) * BM
        weights = cols * k * a["w"].element_size() + (cols * a["bias"].element_size() if a["HAS_BIAS"] else 0)
        moved = weights + m * k * a["x"].element_size() + m * cols * a["out"].element_size()
        if a["SPLITS"] > 1:  # float32 partial sums of the real rows written, then read by the last split
            moved += 2 * a["SPLITS"] * m * cols * 4
        kind = ["plain", "gated", "rope"][a["EPILOGUE"]]
        return moved, weights, rows * cols * k, f"{cols}x{k} {kind}, {a['SPLITS']} splits"
    if name == "_attend":
        w, heads, d = a["q"].shape[2], a["q"].shape[1], a["D"]
        kv = a["cache"].shape[2]
        seen = context + w  # each row: the prefix and (at most) the tree window
        return w * kv * seen * d * 2 * a["cache"].element_size(), 0, w * heads * seen * d * 2, f"{w} rows x {seen} keys"
    if name == "_write_kv":  # k and v read, then written to the cache
        return 4 * _size(a["k"]), 0, 0, "k, v to the cache"
    if name == "_rmsnorm":
        return 2 * a["M"] * a["N"] * a["x"].element_size() + _size(a["weight"]), _size(a["weight"]), 0, f"{a['M']}x{a['N']}"
    if name == "_rope":
        return 2 * _size(a["cos"]) + a["W"] * 8, 0, 0, "cos, sin"
    raise KeyError(f"no cost model for the kernel {name}")


class Recorder:
    """Every Triton launch while installed, as (name, grid, bound arguments), none run (on a GPU:
    run=True records and launches). compile_for: a GPUTarget each distinct kernel is compiled for.
    Under Triton's interpreter (TRITON_INTERPRET=1) the interpreted kernels' launches are recorded."""

    def __init__(self, run: bool = False, compile_for=None):
        self.run, self.target = run, compile_for
        self.launches: list[tuple[str, tuple, dict]] = []
        self.compiled: dict[str, dict] = {}

    def __enter__(self):
        from ygg_runtime.backend import triton_linear

        self._kind = type(triton_linear._linear)  # JITFunction, or the interpreter's InterpretedFunction
        self._real = self._kind.run
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            names = list(inspect.signature(fn.fn).parameters)
            bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
            recorder.launches.append((fn.fn.__name__, tuple(grid), bound))
            if recorder.target is not None:
                recorder._compile(fn, args, kwargs)
            return recorder._real(fn, *args, grid=grid, warmup=warmup, **kwargs) if recorder.run else None

        self._kind.run = run
        return self

    def __exit__(self, *exc):
        self._kind.run = self._real

    def _compile(self, fn, args, kwargs) -> None:
        """Compile the launch for the target (as JITFunction.run would, without a device), once a
        specialization: its registers, spills and shared memory."""
        from triton import knobs
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(self.target)
        kwargs = dict(kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode,
                      fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
        bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
        key = f"{fn.fn.__name__} {specialization} {options}"
        if key in self.compiled:
            return
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=self.target, options=options.__dict__)
        self.compiled[key] = {"kernel": fn.fn.__name__, **_ptxas(kernel), "shared": kernel.metadata.shared}


def _ptxas(kernel) -> dict:
    """Registers and spill bytes of a compiled kernel, from Triton's own ptxas (-v)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next((p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()), None)
    if ptxas is None:
        return {}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        out = subprocess.run([str(ptxas), f"-arch=sm_{kernel.metadata.target.arch}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs, spills = re.findall(r"Used (\d+) registers", out), re.findall(r"(\d+) bytes spill stores", out)
    return {"registers": int(regs[0]) if regs else None, "spill_bytes": int(spills[0]) if spills else None}


def model_of(shape: dict, dtype: torch.dtype = torch.bfloat16, device: str = "meta"):
    from ygg_runtime.model.transformer import ModelArgs, Transformer

    with torch.device(device):
        model = Transformer(ModelArgs(norm_eps=1e-6, **shape)).to(dtype)
    return model.eval().requires_grad_(False)


def forward_args(model, width: int, context: int, device) -> tuple:
    """The arguments of a captured forward of `width` rows (a chain after `context` tokens)."""
    w = width
    dev = torch.device(device)
    return (torch.zeros(1, w, dtype=torch.long, device=dev), torch.arange(context, context + w, device=dev),
            torch.arange(context, context + w, device=dev), torch.zeros(w, dtype=torch.long, device=dev),
            torch.full((w,), context, device=dev), torch.ones(w, 64, dtype=torch.bool, device=dev).tril(),
            model.kv.data, torch.arange(w, device=dev))


@torch.inference_mode()
def kernels(model, width: int, context: int, recorder: Recorder | None = None, invariant: bool = True) -> list[Kernel]:
    """The kernels of one forward of `width` rows on the CUDA ops (invariant=False: a drafter's),
    in launch order: recorded on the model's own device (meta: nothing runs)."""
    from ygg_runtime.backend import cuda

    if model.kv is None or model.kv.data.shape[3] < context + width + 64:
        model.setup_cache(context + width + 64)
    recorder = recorder or Recorder()
    start = len(recorder.launches)
    ops, model.ops = model._ops, cuda.OPS if invariant else cuda.FREE
    try:
        with recorder:
            model(*forward_args(model, width, context, model.device))
    finally:
        model.ops = ops
    out = []
    for name, grid, bound in recorder.launches[start:]:
        out.append(Kernel(name, grid, *cost(name, bound, context)))
    row = model.args.dim * model.dtype.itemsize  # the embedding's gather (aten's, not a Triton kernel): W rows
    out.insert(0, Kernel("embedding", (width,), 2 * width * row, width * row, 0, "aten gather"))
    return out


def modelled(model, widths: list[int], context: int, gpu: dict, recorder: Recorder | None = None,
             invariant: bool = True) -> list[dict]:
    """Each width's modelled T(W) of `model` (meta tensors, or a GPU's: nothing is launched) on a
    GPU of roofs `gpu` ({"read_GBps", "TMACs"}), beside its weight-stream floor."""
    recorder = recorder or Recorder()
    rows = []
    for w in widths:
        ks = kernels(model, w, context, recorder, invariant)
        floor_ms = sum(k.weight_bytes for k in ks) / (gpu["read_GBps"] * 1e9) * 1e3
        ms = sum(k.ms(gpu) for k in ks)
        by: dict[str, float] = {}
        for k in ks:
            by[k.name] = by.get(k.name, 0.0) + k.ms(gpu)
        rows.append({"width": w, "modelled_ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
                     "of_floor": round(ms / floor_ms, 2), "kernels": len(ks), "launch_ms": round(len(ks) * LAUNCH_US / 1e3, 4),
                     "weight_GB": round(sum(k.weight_bytes for k in ks) / 1e9, 3),
                     "by_kernel_ms": {k: round(v, 4) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}})
    return rows


def table(name: str, gpu_name: str, widths: list[int], context: int, compile_for=None) -> dict:
    """Modelled T(W) of model shape `name` on GPU `gpu_name` (and, with compile_for, each distinct
    kernel's sm_90 registers, spills and shared memory)."""
    gpu = GPUS[gpu_name]
    model = model_of(SHAPES[name])
    recorder = Recorder(compile_for=compile_for)
    rows = modelled(model, widths, context, gpu, recorder, invariant=name not in DRAFTERS)
    one_layer = len(kernels(model_of({**SHAPES[name], "n_layers": 1}), 1, context))
    per_layer = (len(kernels(model, 1, context)) - one_layer) // (model.args.n_layers - 1)
    return {"model": name, "gpu": gpu_name, "gpu_roofs": gpu, "context": context, "weight_GB": rows[0]["weight_GB"],
            "layers": model.args.n_layers, "kernels_per_layer": per_layer, "rows": rows,
            "compiled": list(recorder.compiled.values())}


def markdown(result: dict) -> str:
    g = result["gpu_roofs"]
    lines = [f"**{result['model']}** on an {result['gpu']} (modelled: {g['read_GBps']:.0f} GB/s, {g['TMACs']:.0f} T "
             f"multiply-adds/s, {LAUNCH_US} us a launch), {result['weight_GB']} GB of weights, context {result['context']}, "
             f"{result['kernels_per_layer']} kernels a layer:", "",
             "| W | modelled ms | floor ms | x floor | kernels | of it launches ms | largest |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        top = ", ".join(f"{k} {v:.3f}" for k, v in list(r["by_kernel_ms"].items())[:3])
        lines.append(f"| {r['width']} | {r['modelled_ms']:.3f} | {r['floor_ms']:.3f} | {r['of_floor']} | {r['kernels']} | "
                     f"{r['launch_ms']:.3f} | {top} |")
    if result["compiled"]:
        lines += ["", "| kernel (sm_90) | registers | spill bytes | shared KB |", "|---|---|---|---|"]
        lines += [f"| {c['kernel']} | {c.get('registers')} | {c.get('spill_bytes')} | {c['shared'] / 1024:.0f} |"
                  for c in result["compiled"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    from ygg_bench import harness

    ap = harness.parser(__doc__, repeats=None, widths="1,2,4,8,16,32,64")
    ap.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    ap.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-0.5b,llama-2-7b,llama-68m")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="compile each kernel for sm_90 (Triton's ptxas): registers, spills")
    args = harness.parse(ap)
    target = None
    if args.compile:
        from triton.backends.compiler import GPUTarget

        target = GPUTarget("cuda", 90, 32)
    results = []
    for name in args.models.split(","):
        if name not in SHAPES:
            sys.exit(f"unknown model shape {name!r}: one of {', '.join(SHAPES)}")
        results.append(table(name, args.gpu, args.widths, args.context, target))
        print(markdown(results[-1]), flush=True)
    if args.out:  # modelled, not measured: the machine it ran on only names where the model was drawn
        harness.write_json(args.out, {"gpu": args.gpu, "modelled": results})


if __name__ == "__main__":
    main()
