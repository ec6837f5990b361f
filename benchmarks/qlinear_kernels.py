"""Weight-only quantized matmul on the Qwen2.5-Coder-1.5B target's linear layers: ms per forward (the
four linears of each of its 28 layers: wqkv 2048x1536, wo 1536x1536, w13 17920x1536, w2 1536x8960)
at M = 1, 2, 4, 8, 16, 32, 64 rows, and whether each kernel is row-invariant (a row's output bitwise
the same whatever the rows beside it, what tree verification's exactness needs).

    .venv/bin/python benchmarks/qlinear_kernels.py [--repeats N] [--kernels a,b] [--dtype D] [-o FILE.json]

Kernels: `bf16` F.linear (oneDNN); `fp32` F.linear in float32 (what `--dtype auto` holds float
weights in where the CPU lacks bfloat16 arithmetic: the AVX2-only EPYC); `int8pack` aten._weight_int8pack_mm (per-channel int8);
`int4pack` aten._weight_int4pack_mm_for_cpu (group 32); `inductor-woq` torch.compile(max-autotune,
freezing) of the dequantize-then-matmul pattern, which Inductor's CPU weight-only GEMM lowering takes
over; `torchao-*` torchao's CPU layouts when torchao imports; `ygg-int4` / `ygg-int6` / `ygg-int8`
our ygg::qlinear with 4-bit codes (Q4_K's format), 6-bit codes (Q6_K's) and 8-bit codes, on activations in
--dtype (bfloat16, or float32 as an artifact of that dtype feeds it). Every layer holds its own
weights, so each forward streams them from memory as a real one does. Kernels and widths alternate
within each repeat (medians kept). YGG_QLINEAR=portable times our kernel's plain C++ path, and
YGG_QLINEAR=amx its AMX tiles on a CPU that has them (the `ygg-*` rows of a run with it against one
without: from which width AMX pays; the result names the path that ran). Run it alone on the machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ygg_bench import harness
from ygg_runtime.backend import native
from ygg_runtime.model.quant import Codes, pack

SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))  # (N, K) of one layer's linears
LAYERS = 28
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
FLOAT = {"bf16": torch.bfloat16, "fp32": torch.float32}  # F.linear, weights and activations in this dtype
Forward = Callable[[dict, int], list]  # ({K: x [M, K]}, layer) -> the layer's outputs


def random_codes(n: int, k: int, bits: int, g: torch.Generator) -> Codes:
    """Q4_K's format (4 bits: groups of 32 with their own multipliers and mins), Q6_K's (6 bits:
    groups of 16, codes offset by 32, folded) or 8-bit codes in Q6_K's groups (offset 128)."""
    group = 32 if bits == 4 else 16
    sc = torch.randint(1, 63, (n, k // group), dtype=torch.int8, generator=g)
    D = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    if bits == 4:
        mn, M = torch.randint(1, 63, (n, k // group), dtype=torch.int8, generator=g), -(torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    else:
        mn, M = sc, -(2 ** (bits - 1)) * D
    return Codes(torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g), D, M, sc, mn, bits, f"random{bits}")


def build(name: str, g: torch.Generator) -> Forward:
    """The kernel's per-layer weights, and a forward that runs every linear of one layer."""
    layers = []
    for _ in range(LAYERS):
        ws = []
        for n, k in SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
            if name in FLOAT:
                ws.append(w.to(FLOAT[name]))
            elif name in ("int8pack", "inductor-woq"):
                s = w.float().abs().amax(1) / 127
                ws.append(((w.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8), s.to(torch.bfloat16)))
            elif name == "int4pack":
                q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
                packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
                sz = torch.rand(k // 32, n, 2, generator=g).to(torch.bfloat16)
                ws.append((packed, sz))
            elif name.startswith("ygg-"):
                ws.append(pack(random_codes(n, k, {"ygg-int4": 4, "ygg-int6": 6, "ygg-int8": 8}[name], g)))
            elif name.startswith("torchao-"):
                ws.append(w)
            else:
                raise SystemExit(f"unknown kernel {name}")
        layers.append(ws)

    if name in FLOAT:
        return lambda x, i: [F.linear(x[w.shape[1]], w) for w in layers[i]]
    if name == "int8pack":
        return lambda x, i: [torch._weight_int8pack_mm(x[q.shape[1]], q, s) for q, s in layers[i]]
    if name == "int4pack":
        return lambda x, i: [torch._weight_int4pack_mm_for_cpu(x[k], p, 32, sz)
                             for (p, sz), (_, k) in zip(layers[i], SHAPES)]
    if name.startswith("ygg-"):
        return lambda x, i: [native.qlinear(x[int(p["layout"][0, 1])], p["data"], p["layout"], None) for p in layers[i]]
    if name == "inductor-woq":
        return _inductor_woq(layers)
    return _torchao(name, layers)


def _inductor_woq(layers) -> Forward:
    """The weight-only int8 pattern (int8 weights cast to the activations' dtype, matmul, channel
    scales) compiled with max-autotune: one graph per shape and width, weights as its inputs."""

    def woq(x, q, s):
        return F.linear(x, q.to(x.dtype)) * s

    torch._dynamo.config.recompile_limit = 64  # one graph per (shape, width): 4 x 7
    fn = torch.compile(woq, mode="max-autotune", dynamic=False)
    return lambda x, i: [fn(x[q.shape[1]], q, s) for q, s in layers[i]]


def _torchao(name: str, layers) -> Forward:
    """torchao's CPU paths: int4 weight-only (its CPU packing), int8 dynamic activations with int4
    or int8 weights."""
    try:
        import torchao.quantization as tq
        from torchao.quantization.granularity import PerGroup
    except Exception as e:  # not installed, or not built for this torch
        raise RuntimeError(f"torchao unavailable: {type(e).__name__}: {e}") from None
    configs = {"torchao-int4": lambda: tq.Int4WeightOnlyConfig(group_size=32),
               "torchao-8da4w": lambda: tq.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                                                weight_granularity=PerGroup(32)),
               "torchao-8da8w": lambda: tq.Int8DynamicActivationInt8WeightConfig()}
    config = configs[name]()
    mods = []
    for layer in layers:
        ms = []
        for w in layer:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            lin.weight.data = w
            tq.quantize_(lin, config)
            ms.append(lin)
        mods.append(ms)
    return lambda x, i: [m(x[m.in_features]) for m in mods[i]]


def inputs(x: torch.Tensor) -> dict[int, torch.Tensor]:
    """x's first K columns, contiguous, for every K a linear takes."""
    return {k: x[:, :k].contiguous() for k in {k for _, k in SHAPES}}


def forward(fn: Forward, x: dict) -> Callable[[], None]:
    """Every layer's linears, as one forward runs them."""
    def call() -> None:
        for i in range(LAYERS):
            fn(x, i)
    return call


def row_invariant(fn: Forward, g: torch.Generator, dtype: torch.dtype) -> bool:
    """Row 0 of every width equals the row alone, bitwise, in every linear of layer 0."""
    x = torch.randn(max(WIDTHS), 8960, generator=g).to(dtype)
    alone = fn(inputs(x[:1]), 0)
    return all(torch.equal(a[0], b[0]) for w in WIDTHS[1:] for a, b in zip(alone, fn(inputs(x[:w]), 0)))


def markdown(result: dict, title: str) -> str:
    """The table as committed: ms per forward by width, T(16)/T(1), row invariance."""
    widths = result["widths"]
    lines = [f"### {title}", "",
             f"ms per forward of the Qwen2.5-Coder-1.5B target's linears (28 layers: wqkv, wo, w13, w2), "
             f"{result['threads']} threads, torch {result['torch']}, median of {result['repeats']} interleaved repeats; "
             f"activations in {result.get('dtype', 'bfloat16')} (bf16 and fp32: their own dtype)"
             + (f"; ygg::qlinear path: {result['qlinear_path']}" if result.get("qlinear_path") else ""), "",
             "| kernel | " + " | ".join(f"M={w}" for w in widths) + " | T(16)/T(1) | row-invariant |",
             "|---|" + "---|" * (len(widths) + 2)]
    for name, row in result["ms"].items():
        lines.append(f"| {name} | " + " | ".join(f"{t:.1f}" for t in row)
                     + f" | {row[widths.index(16)] / row[0]:.2f} | {'yes' if result['row_invariant'][name] else 'no'} |")
    for name, why in result.get("skipped", {}).items():
        lines.append(f"| {name} | " + " | ".join("–" for _ in widths) + f" | – | did not run: {why} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--kernels", default="bf16,int8pack,int4pack,inductor-woq,torchao-int4,torchao-8da4w,torchao-8da8w,ygg-int4,ygg-int6,ygg-int8")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the activations' dtype for every kernel but bf16 and fp32 (which use their own)")
    args = harness.parse(ap)
    g = torch.Generator().manual_seed(0)
    dtype_of = lambda name: FLOAT.get(name, getattr(torch, args.dtype))  # noqa: E731
    fns, skipped = {}, {}
    for name in args.kernels.split(","):
        try:
            fns[name] = build(name, g)
            fns[name](inputs(torch.zeros(1, 8960, dtype=dtype_of(name))), 0)  # compile/warm up
        except Exception as e:  # a kernel this torch or CPU does not run: said in the table
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            fns.pop(name, None)
    x = torch.randn(max(WIDTHS), 8960, generator=g)
    xs = {w: {d: inputs(x[:w].to(d)) for d in {dtype_of(n) for n in fns}} for w in WIDTHS}
    ms = harness.medians(harness.interleaved({(n, w): forward(fn, xs[w][dtype_of(n)]) for w in WIDTHS
                                              for n, fn in fns.items()}, args.repeats), 2)
    result = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "qlinear_path": native.qlinear_path() if any(n.startswith("ygg-") for n in fns) else None,
        "portable": os.environ.get("YGG_QLINEAR") == "portable",
        "requested_path": os.environ.get("YGG_QLINEAR"),
        "repeats": args.repeats,
        "dtype": args.dtype,
        "widths": list(WIDTHS),
        "ms": {n: [ms[(n, w)] for w in WIDTHS] for n in fns},
        "row_invariant": {n: row_invariant(fn, g, dtype_of(n)) for n, fn in fns.items()},
        "skipped": skipped,
    }
    print(f"ms per forward of the target's linears ({LAYERS} layers), {result['threads']} threads")
    print(f"{'kernel':<16}" + "".join(f"{'M=' + str(w):>9}" for w in WIDTHS) + "  T(16)/T(1)  row-invariant")
    for n, row in result["ms"].items():
        print(f"{n:<16}" + "".join(f"{t:>9.1f}" for t in row) + f"  {row[WIDTHS.index(16)] / row[0]:>10.2f}  {result['row_invariant'][n]}")
    for n, why in skipped.items():
        print(f"{n:<16} skipped: {why}")
    if args.out:
        asked = result["requested_path"]
        title = f"ygg::qlinear's {result['qlinear_path']} path (YGG_QLINEAR={asked})" if asked else "Every kernel tried"
        harness.write_json(args.out, result, markdown=markdown(result, title))


if __name__ == "__main__":
    main()
