"""The roofline of a forward: it cannot beat max(bytes it reads / read bandwidth, rows x multiply-adds
per row / compute peak). Both roofs are measured on the machine by the kernel library
(`ygg_runtime.backend.native.read_bandwidth` and `int8_peak`, on the torch threads); a model's bytes and
multiply-adds per row are counted from its layers. `ygg compile` records the roofs in the plan's
profile, `ygg inspect` shows each forward width beside its floor, and `benchmarks/roofline.py`
times both models against it.

What counts: the bytes a forward reads are every weight but the embedding table (a forward reads
W rows of it) plus the KV cache rows it attends to; the multiply-adds are the linear layers'
(attention's are counted in the bytes' spirit: they are small next to the weights at the contexts
planned for). The compute roof is the int8 dot-product peak on a CPU, what quantized linears run on (a model held
in floats there is compared with the memory roof only: its float peak is not measured), and the
bf16 matmul peak on a GPU (measured with torch: `gpu_read_bandwidth`, `gpu_matmul_peak`).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ygg_compile.timing import cuda_ms
from ygg_runtime.backend import native
from ygg_runtime.model.transformer import Transformer
from ygg_runtime.schema.plan import Costs, Roofs  # the plan's profile records them
from ygg_runtime.model.quant import QLinear


def measure_roofs(bandwidth_bytes: int = 1 << 30, repeats: int = 5, device: torch.device | str = "cpu") -> Roofs:
    """Both roofs of this machine (about a second: the buffer read is far larger than the caches).
    On a GPU: a streaming read of a buffer far larger than its L2, and bf16 tensor-core matmul
    multiply-adds (its linears' roof; the field keeps the CPU's name, int8_peak)."""
    if torch.device(device).type == "cuda":
        return Roofs(gpu_read_bandwidth(device, bandwidth_bytes, repeats), gpu_matmul_peak(device, repeats),
                     torch.get_num_threads())
    return Roofs(native.read_bandwidth(bandwidth_bytes, repeats), native.int8_peak(0.1, repeats), torch.get_num_threads())


def gpu_read_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum) of a buffer of `nbytes`, at least 8 times the L2."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    n = max(nbytes, 8 * l2) // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    ms = cuda_ms(lambda: x.sum(), repeats)
    return 4 * n / (ms / 1000.0)


def gpu_matmul_peak(device, repeats: int = 5, n: int = 8192) -> float:
    """bf16 multiply-adds per second of an n x n x n matmul on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = cuda_ms(lambda: a @ b, repeats)
    return n**3 / (ms / 1000.0)


def model_costs(model: Transformer) -> Costs:
    """What one forward of `model` reads and computes per row."""
    skip = {id(t) for t in model.tok_embeddings.buffers()} | {id(t) for t in model.tok_embeddings.parameters()}
    skip.add(id(model.inv_freq))
    seen, nbytes = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in skip or id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        nbytes += t.numel() * t.element_size()
    if model.args.tie_embeddings:  # the head reads the embedding table whole
        nbytes += model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, QLinear))]
    macs = sum(m.in_features * m.out_features for m in linears)
    quantized = any(isinstance(m, QLinear) for m in linears)
    return Costs(nbytes, model.args.kv_bytes_per_token(model.dtype.itemsize), macs, quantized)


def section(runners: dict) -> dict:
    """The plan's `profile.roofline`: this machine's roofs and each model's costs (`ygg inspect`
    sets them beside the profile's T(W))."""
    roofs = measure_roofs(512 << 20, repeats=3, device=next(iter(runners.values())).device)
    return {"roofs": roofs.as_dict(), **{role: asdict(model_costs(r.model)) for role, r in runners.items()}}


def floor_ms(costs: Costs, roofs: Roofs, width: int, context: int, gpu: bool = False) -> dict:
    """The two floors of a forward of `width` rows after `context` positions, in ms, and which binds
    (gpu: `roofs` are a GPU's, whose compute roof is its float matmul peak)."""
    memory = 1000.0 * costs.bytes(context) / roofs.bandwidth
    compute = 1000.0 * width * costs.macs_per_row / roofs.int8_peak if costs.quantized or gpu else None
    bound = "compute" if compute is not None and compute > memory else "memory"
    return {"memory_ms": round(memory, 4), "compute_ms": round(compute, 4) if compute is not None else None,
            "floor_ms": round(max(memory, compute or 0.0), 4), "bound": bound}


def table(costs: Costs, roofs: Roofs, widths: list[int], times_ms: list[float], context: int,
          gpu: bool = False) -> list[dict]:
    """Each width's measured time beside its floors: the rows `ygg inspect` and the benchmarks print."""
    rows = []
    for w, t in zip(widths, times_ms):
        f = floor_ms(costs, roofs, w, context, gpu)
        rows.append({"width": w, "ms": round(t, 2), **f, "of_floor": round(t / max(f["floor_ms"], 1e-9), 2),
                     "of_t1": round(t / times_ms[0], 2)})
    return rows
