"""`make gpu-check`: what only a GPU can show, in one call of at most 8 minutes on a bare machine of
the GPU image (its own torch with CUDA, Triton, transformers; no package index: the wheels it lacks
are carried, see the Makefile's `gpu-wheels`).

    python3 benchmarks/gpu_check.py [-o DIR] [--budget 460] [--calibration FILE] [--only SECTIONS] [--small]

In order, each section timed, a failing one reported in a line (its traceback in the log) while the
others still run, and none started without the time it needs:
  1. machine: GPU, compute capability, torch, CUDA, cuBLAS, driver, Triton; its two roofs (a
     streaming read of a buffer 8x its L2; a bf16 8192^3 matmul);
  2. kernels: the CUDA backend's kernels on their own — attention against float64 and a token's
     row bitwise the same in plain decoding and a tree verify, its time at contexts 64, 1 000 and
     4 000; the GEMM's rows bitwise the same at 1..64 rows wherever they sit, each 1.5B/0.5B linear's
     time and read rate at 1, 8 and 64 rows, and the drafter's linears on cuBLAS beside ours;
  3. tiny pair: the tiny random pair compiled with `--device cuda`: every method's greedy output =
     `ar`'s, seeded sampling = `ar`'s, the row check's verdict, the forwards replayed as CUDA graphs;
  4. real shapes: random models of the real pair's shapes (Qwen2.5-Coder-1.5B target, 0.5B drafter,
     bf16, made on the GPU in seconds), compiled with `--calibration-from` the real pair's committed
     calibration: T(W) at W = 1..64 beside the weight-stream floor and the modelled time
     (benchmarks/gpu_model.py), one replayed forward taken apart by torch.profiler at W = 1, 8, 64
     (each kernel's time, each GEMM's read rate, kernels a forward and a layer), the drafter's T(1)
     against the target's, T(1) over an 8x cache, the row check, the modelled `egt` speed-up over
     `ar` from the real pair's acceptance, and `ar` / `egt` decoding it (=, ms per token), and each
     one's host work a step with its forwards replayed (benchmarks/step_overhead.py);
  5. 7B shapes: random Llama-2-7B and LLaMA-68M (the seeds' pair) made on the GPU and timed as
     forwards (no compile): T(W) beside the floor and the model;
  6. start: `ygg_runtime.load` and a first token in a fresh process, with the artifact's compiled
     Triton kernels (first and second start) and with every kernel compiled anew;
  7. aoti: benchmarks/aoti_load_probe.py (AOTInductor packages loaded in fresh processes).
On a CPU (--device cpu, the suite's smoke test with --small) the GPU-only parts say so, and a
`modelled` section prints T(W) of the four shapes on an H100 and an H200 from the CUDA forward's
own kernel list (benchmarks/gpu_model.py), so a design is weighed before a GPU is lent.
Results: DIR/gpu-check.json, .md and .log, DIR defaulting to benchmarks/results/cuda-<gpu>/.

On a lent machine (the device tool: `make gpu-wheels` here first, then one call carrying .whl/, with
a timeout of 590 s): `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py -o $OUT` (`make gpu-check` does the same
where make is installed).
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ygg_bench import harness

if TYPE_CHECKING:
    from ygg_runtime.schema.plan import Plan

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # tiny.py: random models and the byte tokenizer
sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_model.py: the modelled forward

CALIBRATION = REPO / "benchmarks" / "data" / "qwen2.5-coder-0.5b-1.5b.calibration.safetensors"
# Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (their config.json), vocabulary 151 936, tied heads
REAL = {"target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2),
        "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2)}
SMALL = {"target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2),
         "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2)}
VOCAB = 151_936
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("ar", "chain", "specinfer", "sequoia", "egt", "pld")
PROMPTS = ["def quicksort(xs):\n", "The capital of France is", "Once upon a time, in a land far away,"]


class Check:
    """The report: sections run in order within a time budget, each one's figures and verdict."""

    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.start = out, budget, time.time()
        self.results: dict[str, dict] = {}
        self.head = {"command": harness.command(), "revision": harness.revision()}  # the machine: its section
        self.log = (out / "gpu-check.log").open("w")

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def run(self, name: str, needs: float, fn, *args) -> dict | None:
        """Run section `name` if `needs` seconds are left; its dict of results, or None."""
        if self.left() < needs:
            self.results[name] = {"status": f"not run: {self.left():.0f} s left of the budget, it needs ~{needs:.0f}"}
            self.say(f"[{name}] {self.results[name]['status']}")
            return None
        self.say(f"[{name}] ...")
        t = time.time()
        try:
            got = fn(*args) or {}
            got = {"status": f"FAILED: {got['failed']}" if got.get("failed") else "ok", **got}
        except Exception as e:  # one line here, the traceback in the log: the next section still runs
            got = {"status": f"FAILED: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
            self.trace(name)
        got["seconds"] = round(time.time() - t, 1)
        self.results[name] = got
        self.say(f"[{name}] {got['status']} ({got['seconds']} s)")
        self.write()  # after every section: a call cut short keeps what it measured
        return got

    def trace(self, what: str) -> None:
        """The traceback being handled, into the log under `what`."""
        self.log.write(f"{what}:\n{traceback.format_exc()}")
        self.log.flush()

    def write(self) -> None:
        machine = {"machine": "not run (--only)"} if "machine" not in self.results else {}
        harness.write_json(self.out / "gpu-check.json", {**self.head, **machine, **self.results}, markdown=markdown(self))


def machine(device: torch.device) -> dict:
    """The harness's record of the machine and its roofs, with Triton's version and the GPU's
    properties the kernels are planned from."""
    import triton  # noqa: F401  (its version: the GPU attention is a Triton kernel)

    out = harness.machine(str(device)) | {"triton": triton.__version__}
    if device.type == "cuda":
        from ygg_runtime.backend import gpu_identity as gpu

        gpu.configure()
        info = gpu.info(device)
        props = torch.cuda.get_device_properties(device)
        out |= {"gpu": info.__dict__, "multiprocessors": props.multi_processor_count,
                "l2_bytes": getattr(props, "L2_cache_size", None)}
    roofs = out["roofs"]
    return out | {"read_GBps": round(roofs["bandwidth"] / 1e9, 1), "peak_TMACs": round(roofs["int8_peak"] / 1e12, 2)}


def attention_check(device: torch.device) -> dict:
    """The attention kernel on this device: its error against float64, a row's bits in two layouts
    (plain decoding, a tree verify), and its time at contexts 64, 1 000 and 4 000 (a GPU's)."""
    from ygg_runtime.backend import cuda

    op = cuda.OPS.attention  # on a CPU: Triton's interpreter (TRITON_INTERPRET=1)
    if device.type != "cuda":  # the interpreter runs programs one by one: one a row (no bit depends on how many)
        from ygg_runtime.backend import triton_attention

        triton_attention.PROGRAMS = 1
    g = torch.Generator().manual_seed(0)
    heads, kv, dim, width = 12, 2, 128, 8
    context = 700 if device.type == "cuda" else 90  # Triton's interpreter runs a CPU's in Python
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(1, 2, kv, context + 64, dim, generator=g).to(dtype).to(device)
        q = torch.randn(1, heads, width, dim, generator=g).to(dtype).to(device)
        k = torch.randn(1, kv, width, dim, generator=g).to(dtype).to(device)
        v = torch.randn(1, kv, width, dim, generator=g).to(dtype).to(device)
        tree = (torch.ones(width, width, dtype=torch.bool).tril()).to(device)
        slots = torch.arange(context, context + width, device=device)
        lo, hi = torch.zeros(width, dtype=torch.long, device=device), torch.full((width,), context, device=device)
        got = op(q, k, v, cache, 0, slots, lo, hi, tree).double().cpu()
        keys, values = cache[0, 0].double().cpu(), cache[0, 1].double().cpu()
        worst = 0.0
        for w in range(width):
            seen = list(range(context + w + 1))
            for h in range(heads):
                s = keys[h // (heads // kv), seen] @ q[0, h, w].double().cpu() / dim**0.5
                ref = torch.softmax(s, 0) @ values[h // (heads // kv), seen]
                worst = max(worst, (got[0, h, w] - ref).abs().max().item())
        # the last row again, as plain decoding runs it: one row, every key in the prefix
        plain = op(q[:, :, -1:].contiguous(), k[:, :, -1:].contiguous(), v[:, :, -1:].contiguous(), cache, 0,
                   slots[-1:], lo[:1], torch.full((1,), context + width - 1, device=device),
                   torch.ones(1, 1, dtype=torch.bool, device=device))
        same = torch.equal(plain[0, :, 0].cpu(), op(q, k, v, cache, 0, slots, lo, hi, tree)[0, :, -1].cpu())
        out[str(dtype).removeprefix("torch.")] = {"max_abs_err_vs_f64": worst, "row_bits_plain_eq_tree": same}
    ok = all(r["row_bits_plain_eq_tree"] for r in out.values()) and out["float32"]["max_abs_err_vs_f64"] < 1e-4
    if device.type == "cuda":
        times = {}
        for ctx in (64, 1000, 4000):
            for w in (1, 8, 64):
                qw = torch.randn(1, w, heads + 2 * kv, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
                c = torch.randn(1, 2, kv, ctx + w + 64, dim, device=device, dtype=torch.bfloat16)
                t = torch.ones(w, w, dtype=torch.bool, device=device).tril()
                args = (qw[:, :heads], qw[:, heads : heads + kv], qw[:, heads + kv :], c, 0,
                        torch.arange(ctx, ctx + w, device=device), torch.zeros(w, dtype=torch.long, device=device),
                        torch.full((w,), ctx, device=device), t)
                ms = harness.median_ms(lambda: op(*args), device=device)
                kv_bytes = w * kv * (ctx + w) * dim * 2 * 2  # every row reads its keys and values
                times[f"ctx{ctx}_W{w}"] = {"us": round(1000 * ms, 1), "GBps": round(kv_bytes / (ms / 1e3) / 1e9, 1)}
        out["us_per_layer"] = times
    if not ok:
        raise AssertionError(f"the kernel is off: {out}")
    return out


@contextlib.contextmanager
def split_k_allowed():
    """cuBLAS free to split K and reduce in lower precision (what `gpu.configure` turns off)."""
    from ygg_runtime.backend import gpu_identity as gpu

    matmul = torch.backends.cuda.matmul
    before = {name: getattr(matmul, name) for name in gpu.REDUCTIONS}
    try:
        gpu.split_reductions(True)
        yield
    finally:
        for name, value in before.items():
            setattr(matmul, name, value)


def linear_shapes(shapes: dict) -> dict[str, list[tuple[str, int, int, int]]]:
    """Each model's linear layers as (name, rows of the weight, its columns, epilogue)."""
    from ygg_runtime.backend.triton_linear import GATED, PLAIN, ROPE

    out = {}
    for role, d in shapes.items():
        dim, inter, h, kv = d["hidden_size"], d["intermediate_size"], d["num_attention_heads"], d["num_key_value_heads"]
        hd = dim // h
        out[role] = [("qkv", (h + 2 * kv) * hd, dim, ROPE), ("wo", dim, h * hd, PLAIN), ("w13", 2 * inter, dim, GATED),
                     ("w2", dim, inter, PLAIN), ("head", VOCAB if dim > 256 else 512, dim, PLAIN)]
    return out


def gemm_check(device: torch.device, shapes: dict, bandwidth: float | None) -> dict:
    """The GEMM on this GPU: a row's bits at 1..64 rows wherever it sits (each shape of the target),
    each linear's time and read rate at 1, 8 and 64 rows, and the drafter's on cuBLAS beside ours
    (it needs no invariance: split-K allowed there)."""
    from ygg_runtime.backend import cuda, triton_linear
    from ygg_runtime.backend.triton_linear import ROPE

    if device.type != "cuda":
        return {"skipped": "a GPU's own (on a CPU, tests/test_backend.py holds the same under Triton's interpreter)"}
    g = torch.Generator(device=device).manual_seed(0)
    out: dict = {"moved_rows": {}, "timings": {}}

    def call(role, name, n, k, epi, x):
        w = weights[(role, name)]
        kw: dict = {"epilogue": epi}
        if epi == ROPE:
            hd = k // shapes[role]["num_attention_heads"]
            m = x.shape[-2]
            kw["rope"] = (torch.randn(m, hd // 2, device=device, dtype=torch.bfloat16),
                          torch.randn(m, hd // 2, device=device, dtype=torch.bfloat16), hd // 2,
                          shapes[role]["num_attention_heads"] + shapes[role]["num_key_value_heads"])
        counters = cuda.OPS.counters(device, triton_linear.counters_needed(n, k, x.shape[-2], paired=epi != 0))
        return triton_linear.linear(x, w, counters, invariant=role == "target", **kw)  # a drafter's: free splits

    weights = {}
    for role, layers in linear_shapes(shapes).items():
        for name, n, k, epi in layers:
            weights[(role, name)] = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(torch.bfloat16)
    for role, layers in linear_shapes(shapes).items():
        for name, n, k, epi in layers:
            x = torch.randn(1, 64, k, generator=g, device=device).to(torch.bfloat16)
            if role == "target":  # a row's bits, wherever it sits among how many rows
                full = call(role, name, n, k, epi, x)
                moved = 0
                for width in (1, 2, 3, 8, 17, 64):
                    pick = [(i * 7 + width) % 64 for i in range(width)]
                    rows = torch.randn(1, width, k, generator=g, device=device).to(torch.bfloat16)
                    rows[0, :] = x[0, pick]
                    got = call(role, name, n, k, epi, rows)
                    moved += sum(not torch.equal(got[0, i], full[0, j]) for i, j in enumerate(pick))
                out["moved_rows"][f"{role}.{name}"] = moved
            for m in (1, 8, 64):
                xm = x[:, :m].contiguous()
                ms = harness.median_ms(lambda: call(role, name, n, k, epi, xm), device=device)
                rate = n * k * 2 / (ms / 1e3) / 1e9
                row = {"us": round(1000 * ms, 1), "GBps": round(rate, 1),
                       "of_bandwidth": round(rate * 1e9 / bandwidth, 2) if bandwidth else None}
                if role == "draft":  # cuBLAS, split-K allowed (the drafter needs no invariance), beside ours
                    w = weights[(role, name)]
                    with split_k_allowed():
                        row["cublas_us"] = round(1000 * harness.median_ms(lambda: torch.nn.functional.linear(xm, w), device=device), 1)
                out["timings"][f"{role}.{name} {n}x{k} M={m}"] = row
    moved = sum(out["moved_rows"].values())
    if moved:
        out["failed"] = f"{moved} rows changed bits with the rows beside them"
    return out


def kernels(device: torch.device, shapes: dict, bandwidth: float | None) -> dict:
    out = {"attention": attention_check(device)}
    out["gemm"] = gemm_check(device, shapes, bandwidth)
    if out["gemm"].get("failed"):
        out["failed"] = out["gemm"]["failed"]
    return out


def random_pair(root: Path, shapes: dict, device: torch.device, vocab: int, tie: bool) -> dict[str, Path]:
    """Random Qwen2-architecture models of `shapes`, made on `device` (seconds on a GPU), saved
    as HF directories with the byte tokenizer."""
    import tiny
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tiny.byte_tokenizer()
    dirs = {}
    for seed, (role, dims) in enumerate(shapes.items()):
        cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=32768, tie_word_embeddings=tie,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None, **dims)
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
        dirs[role] = tiny.save_pair_dir(root / role, model, tok)
        del model
    return dirs


DTYPE = "bfloat16"  # the artifacts' dtype (--dtype: the CPU smoke test's float32 is quicker there)


def compile_pair(dirs: dict, out: Path, device: torch.device, **options) -> "Plan":
    """The pair's artifact (on CUDA without model.pt2: the compile says why, `ygg_compile.build.aot_left_out`)."""
    from ygg_compile.build import compile_artifact
    from ygg_compile.options import CompileOptions
    from ygg_runtime.ui import Reporter

    opts = CompileOptions(draft=str(dirs["draft"]), target=str(dirs["target"]), output=out, device=device.type,
                          dtype=DTYPE, profiles=out.parent / "profiles", **options)  # random models' profiles stay here
    return compile_artifact(opts, Reporter())


def decode_all(dec, prompts: list, n: int, methods=METHODS) -> dict:
    """Every method's greedy tokens against `ar`'s; ms per token; host reads per step."""
    from ygg_runtime import transfer

    same, per = 0, {}
    for prompt in prompts:
        ar = dec.generate(prompt, max_new_tokens=n, method="ar")
        for m in methods:
            before = transfer.host_reads()
            r = dec.generate(prompt, max_new_tokens=n, method=m) if m != "ar" else ar
            reads = transfer.host_reads() - before if m != "ar" else None
            same += r.token_ids == ar.token_ids
            per.setdefault(m, []).append({"equal": r.token_ids == ar.token_ids, "tpot_ms": round(r.tpot_ms, 3),
                                          "reads_per_step": round(reads / max(1, r.steps), 2) if reads else None,
                                          "tokens_per_step": round(len(r.token_ids) / max(1, r.steps), 2)})
    return {"equal": f"{same}/{len(prompts) * len(methods)}", "all_equal": same == len(prompts) * len(methods),
            "methods": per}


def forwards(dec) -> dict:
    """How the artifact's forwards run here: compiled or eager, captured or not (and why not)."""
    out = {"forwards": dec.forwards}
    for role, r in dec.runners.items():
        g = r.graphs
        out[role] = "no CUDA graphs (a CPU)" if g is None else (g.failed or f"{g.captures} CUDA graphs captured")
    return out


def tiny_pair(device: torch.device, work: Path, aot: bool) -> dict:
    import tiny

    import ygg_runtime

    target = tiny.hf_model("llama", seed=40)
    draft = tiny.noised(target, 0.05, seed=41)
    tok = tiny.byte_tokenizer()
    dirs = {"target": tiny.save_pair_dir(work / "tiny" / "target", target, tok),
            "draft": tiny.save_pair_dir(work / "tiny" / "draft", draft, tok)}
    plan = compile_pair(dirs, work / "tiny" / "artifact", device, max_context=256, quick=True, aot=aot)
    dec = ygg_runtime.load(work / "tiny" / "artifact")
    got = decode_all(dec, [list(p.encode()) for p in PROMPTS], 32)
    prompt = list(PROMPTS[0].encode())  # coupled sampling: a seed gives ar's tokens with every method
    sampled = {m: dec.generate(prompt, max_new_tokens=32, method=m, temperature=0.8, seed=7).token_ids
               for m in ("ar", "egt", "chain")}
    got["sampled_equal_ar"] = all(t == sampled["ar"] for t in sampled.values())
    exact = dec.verdict()
    out = {"compile_s": plan.compile_seconds, "phases": plan.compile_phases, "aot": plan.aot is not None,
           "aot_left_out": plan.aot_skipped, "triton_kernels": plan.triton is not None,
           "row_check": {k: r.min_width for k, r in plan.exactness.items()}, "verdict": exact[1], **forwards(dec), **got}
    wrong = [] if got["all_equal"] else [f"{got['equal']} greedy outputs = ar's"]
    wrong += [] if got["sampled_equal_ar"] else ["seeded sampling differs from ar's"]
    wrong += [] if exact[0] else [f"verdict: {exact[1]}"]
    if wrong:
        out["failed"] = "; ".join(wrong)
    return out


def profile_forward(runner, width: int, context: int, modelled: list, gpu: dict, repeats: int = 5) -> dict:
    """One forward of `width` rows taken apart by torch.profiler: each kernel's time (median over
    `repeats` replays) beside the model's (`gpu_model.Kernel`, same launch order), each GEMM's read
    rate, and the kernels a forward launches. Replayed as its CUDA graph where the profiler sees the
    graph's kernels, else run uncaptured (said so)."""
    from torch.profiler import ProfilerActivity, profile

    tokens = list(range(3, 3 + width))

    def kernels_of(captured: bool) -> list:
        graphs = runner.graphs
        runner.graphs = graphs if captured else None
        try:
            runner.reset(context)
            runner.forward_chain(tokens)  # warm (and captured)
            runner.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(repeats):
                    runner.reset(context)
                    runner.forward_chain(tokens)
                runner.synchronize()
        finally:
            runner.graphs = graphs
            runner.reset()
        events = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                         and "memset" not in e.name.lower()), key=lambda e: e.time_range.start)
        return events

    events, how = kernels_of(True), "replayed as its CUDA graph"
    if not events:
        events, how = kernels_of(False), "uncaptured (the profiler saw no kernel of the graph)"
    out = {"how": how, "kernels": len(events) // repeats, "by_kernel": {}}
    for e in events:
        short = e.name.split("(")[0][:40]
        out["by_kernel"][short] = out["by_kernel"].get(short, 0.0) + e.time_range.elapsed_us() / repeats
    out["by_kernel"] = {k: round(v, 1) for k, v in sorted(out["by_kernel"].items(), key=lambda kv: -kv[1])}
    out["total_us"] = round(sum(out["by_kernel"].values()), 1)
    ours = [e for e in events if e.name in {k.name for k in modelled}]  # our Triton kernels, in launch order
    per = len(ours) // repeats
    if per != len(modelled):
        out["gemms"] = f"the profiler saw {per} of our kernels a forward, the model {len(modelled)}: not matched"
        return out
    measured = [sorted(ours[r * per + i].time_range.elapsed_us() for r in range(repeats))[repeats // 2] for i in range(per)]
    gemms: dict[str, dict] = {}
    for k, us in zip(modelled, measured):  # each GEMM's measured read rate, the model's time beside
        if k.name == "_linear":
            g = gemms.setdefault(k.tag, {"us": 0.0, "modelled_us": 0.0, "bytes": 0, "n": 0})
            g["us"] += us
            g["modelled_us"] += 1000 * k.ms(gpu)
            g["bytes"] += k.bytes
            g["n"] += 1
    out["gemms"] = {tag: {"us_each": round(g["us"] / g["n"], 1), "modelled_us_each": round(g["modelled_us"] / g["n"], 1),
                          "GBps": round(g["bytes"] / (g["us"] * 1e-6) / 1e9, 1)} for tag, g in gemms.items()}
    return out


def timed_shapes(runners: dict, roofs, device: torch.device, context: int, widths: list[int], profile_widths=(1, 8, 64)) -> dict:
    """T(W) of each model beside its floor and its modelled time (the GPU's measured roofs), the
    same one-row forward uncaptured, and one forward taken apart at `profile_widths`."""
    import gpu_model

    from ygg_compile import latency as prof
    from ygg_compile.roofline import model_costs, table

    out = {}
    gpu = {"read_GBps": roofs.bandwidth / 1e9, "TMACs": roofs.int8_peak / 1e12} if roofs else None
    for role, runner in runners.items():
        floor, runner.min_width = runner.min_width, 0  # each width as it is (a verify pads to the floor)
        ms = prof.forward_times(runner, tuple(widths), context=context, repeats=10)
        costs = model_costs(runner.model)
        rows = table(costs, roofs, widths, [ms[w] for w in widths], context, gpu=device.type == "cuda") if roofs else []
        invariant = role == "target"  # a drafter's linears split as suits its rows (`backend.for_device`)
        if gpu is not None and device.type == "cuda":  # the model of the very kernels this forward runs
            for row, m in zip(rows, gpu_model.modelled(runner.model, widths, context, gpu, invariant=invariant)):
                row |= {"modelled_ms": m["modelled_ms"], "modelled_kernels": m["kernels"]}
        graphs, runner.graphs = runner.graphs, None  # the same forward uncaptured, for comparison
        plain = prof.forward_times(runner, (1,), context=context, repeats=5)[1]
        runner.graphs, runner.min_width = graphs, floor
        out[role] = {"weight_GB": round(costs.weight_bytes / 1e9, 3), "rows": rows, "T1_uncaptured_ms": round(plain, 3),
                     "min_width": floor}
        if device.type == "cuda" and gpu is not None:
            out[role]["profile"] = {}
            for w in profile_widths:
                modelled = gpu_model.kernels(runner.model, w, context, invariant=invariant)[1:]  # ours (not aten's embedding)
                out[role]["profile"][w] = profile_forward(runner, w, context, modelled, gpu)
    return out


def ratios(models: dict, target: str, draft: str) -> dict:
    t, d = models[target]["rows"], models[draft]["rows"]
    if not (t and d):
        return {}
    by, dby = {r["width"]: r for r in t}, {r["width"]: r for r in d}
    return {"target_T1_over_floor": by[1]["of_floor"], "target_T64_over_T1": by[64]["of_t1"] if 64 in by else None,
            "draft_T1_over_target_T1": round(dby[1]["ms"] / by[1]["ms"], 3),
            "draft_worst_TW_over_T1": max(r["of_t1"] for r in d)}


def real_shapes(check: Check, device: torch.device, work: Path, shapes: dict, vocab: int, calibration: Path,
                aot: bool) -> dict:
    import ygg_runtime
    from ygg_compile import latency as prof

    dirs = random_pair(work / "real", shapes, device, vocab, tie=True)
    options = {"max_context": 1024, "quick": True, "aot": aot}
    if calibration.is_file():
        options["calibration_from"] = calibration
    plan = compile_pair(dirs, work / "real" / "artifact", device, **options)
    dec = ygg_runtime.load(work / "real" / "artifact")
    roofs = plan.profile.roofline.roofs if plan.profile.roofline else None
    out = {"compile_s": plan.compile_seconds, "phases": plan.compile_phases, "calibration": plan.calibration.source,
           "aot": plan.aot is not None, "aot_left_out": plan.aot_skipped,
           "row_check": {k: r.min_width for k, r in plan.exactness.items()}, "verdict": dec.verdict()[1]}
    context = 64
    widths = [w for w in WIDTHS if w in plan.profile.widths]
    out["models"] = timed_shapes(dec.runners, roofs, device, context, widths)
    out |= ratios(out["models"], "target", "draft")
    runner = dec.target
    base = prof.forward_times(runner, (1,), context=context, repeats=10)[1]
    runner.model.setup_cache(8 * runner.max_len)  # the same forward over a cache 8x larger
    runner.max_len = 8 * runner.max_len
    out["target_T1_cache_x8_over_T1"] = round(prof.forward_times(runner, (1,), context=context, repeats=10)[1] / base, 3)
    runner.model.setup_cache(runner.max_len // 8)
    runner.max_len //= 8
    chosen = plan.methods["egt"]
    best = max(plan.planning.egt, key=lambda r: r.speedup)
    out["egt_plan"] = {"depth": chosen.depth, "draft_width": chosen.draft_width, "verify_width": chosen.verify_width,
                       "modelled_speedup_over_ar": best.speedup, "tokens_per_step": best.tokens_per_step,
                       "step_ms": best.step_ms, "predictor": plan.planning.predictor.used}
    out["decode"] = decode_all(dec, [list(PROMPTS[0].encode())], 48, methods=("ar", "egt"))
    out |= forwards(dec)  # after the forwards ran: how many graphs they captured
    if not out["decode"]["all_equal"]:
        out["failed"] = f"{out['decode']['equal']} greedy outputs = ar's"
        return out
    # A step's host work with its forwards replayed from a recorded run (benchmarks/step_overhead.py;
    # this replaces the decoder's forwards, so it comes last)
    from step_overhead import methods_overhead, tape_models

    tape_models(dec)
    out["step_overhead"] = methods_overhead(dec, list(PROMPTS[0].encode()), 48, ["ar", "egt"], repeats=3)
    return out


def seven_b(check: Check, device: torch.device, small: bool) -> dict:
    """Random models of the seeds' pair (Llama-2-7B target, LLaMA-68M drafter) made on the device
    and timed as forwards — no compile: T(W) beside the floor and the model."""
    import gpu_model

    from ygg_runtime import backend
    from ygg_runtime.model.runner import ModelRunner

    runners = {}
    for role, name in (("target", "llama-2-7b"), ("draft", "llama-68m")):
        shape = dict(gpu_model.SHAPES[name])
        if small:
            shape |= {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 32, "intermediate_size": 256,
                      "vocab_size": 512}
        model = gpu_model.model_of(shape, torch.bfloat16 if DTYPE == "bfloat16" else torch.float32, device=str(device))
        with torch.no_grad():
            g = torch.Generator(device=device).manual_seed(7)
            for name_, t in model.named_parameters():
                if name_.endswith("norm.weight"):
                    t.fill_(1.0)
                else:
                    t.copy_(torch.randn(t.shape, generator=g, device=device) * 0.02)
            d = model.args.head_dim
            model.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, d, 2, device=device).float() / d))
        if role == "draft":
            model.ops = backend.for_device(device, invariant=False)
        runners[role] = ModelRunner(model, 1024)
    roofs = check.results.get("machine", {}).get("roofs")
    from ygg_compile.roofline import Roofs

    roofs = Roofs(**roofs) if roofs else None
    out = {"models": timed_shapes(runners, roofs, device, 64, list(WIDTHS), profile_widths=(1, 64))}
    return out | ratios(out["models"], "target", "draft")


START = """import sys, time
t0 = time.time()
import ygg_runtime, os, tempfile
dec = ygg_runtime.load(sys.argv[1])
loaded = time.time()
if sys.argv[2] == "compile":  # every kernel compiled anew: Triton's cache pointed at an empty directory
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
dec.generate(list(b"def f(x):"), max_new_tokens=1, method="ar")
print(round(loaded - t0, 2), round(time.time() - loaded, 2))
"""


def start(work: Path) -> dict:
    """`ygg_runtime.load` then a first token, each in a fresh process (the tiny pair's artifact): the
    first start on this machine (the artifact's compiled kernels copied to the user cache), the
    second, and one with every kernel compiled anew (what the artifact's kernels save)."""
    import os
    import subprocess

    artifact = work / "tiny" / "artifact"
    if not artifact.is_dir():
        return {"failed": "the tiny pair's artifact is not there (its section did not run)"}
    env = {**os.environ, "YGG_CACHE": str(work / "start-cache"), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = {}
    for case, how in (("first start", "shipped"), ("second start", "shipped"), ("kernels compiled anew", "compile")):
        t = time.time()
        proc = subprocess.run([sys.executable, "-c", START, str(artifact), how], capture_output=True, text=True, env=env,
                              timeout=300)
        if proc.returncode != 0:
            return {"failed": f"{case}: {(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1]}"}
        load_s, first_token_s = map(float, proc.stdout.split()[-2:])
        out[case] = {"process_s": round(time.time() - t, 2), "load_s": load_s, "first_token_s": first_token_s}
    return out


def aoti(work: Path) -> dict:
    """benchmarks/aoti_load_probe.py: AOTInductor packages compiled, then loaded in fresh processes."""
    import subprocess

    report = work / "aoti.txt"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "aoti_load_probe.py"), "-o", str(report)],
                          capture_output=True, text=True, timeout=400)
    lines = report.read_text().splitlines() if report.is_file() else proc.stdout.splitlines()
    return {"lines": lines, **({"failed": f"the probe itself: exit {proc.returncode}"} if proc.returncode else {})}


def modelled() -> dict:
    """T(W) of the four shapes on an H100 and an H200, modelled from the CUDA forward's own kernels
    (benchmarks/gpu_model.py): a design weighed before a GPU is lent. Labelled modelled everywhere."""
    import gpu_model

    out = {}
    for gpu in ("H100", "H200"):
        for name in gpu_model.SHAPES:
            r = gpu_model.table(name, gpu, [1, 8, 64], 64)
            out[f"{name} on {gpu}"] = {"kernels_per_layer": r["kernels_per_layer"], "weight_GB": r["weight_GB"],
                                       "rows": [{k: row[k] for k in ("width", "modelled_ms", "floor_ms", "of_floor", "kernels")}
                                                for row in r["rows"]]}
    return out


def _rows_md(role: str, m: dict) -> list[str]:
    lines = ["", f"**{role}** ({m['weight_GB']} GB of weights; uncaptured T(1) {m['T1_uncaptured_ms']} ms):", "",
             "| W | ms | floor ms | × floor | T(W)/T(1) | modelled ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {x['width']} | {x['ms']} | {x['floor_ms']} | {x['of_floor']} | {x['of_t1']} | {x.get('modelled_ms', '-')} |"
              for x in m["rows"]]
    for w, prof in m.get("profile", {}).items():
        lines += ["", f"{role}, one forward of {w} rows ({prof['how']}): {prof['kernels']} kernels, "
                  f"{prof['total_us']} us of kernel time: " + ", ".join(f"{k} {v}" for k, v in list(prof["by_kernel"].items())[:6])]
        if isinstance(prof.get("gemms"), dict):
            lines += [f"- {tag}: {g['us_each']} us (modelled {g['modelled_us_each']}), {g['GBps']} GB/s" for tag, g in prof["gemms"].items()]
    return lines


def markdown(c: Check) -> str:
    r = c.results
    env = r.get("machine", {})
    gpu = env.get("gpu", {})
    lines = [f"### gpu-check: {gpu.get('name', 'no GPU')} (compute capability {gpu.get('capability', '-')}), torch "
             f"{env.get('torch')}, CUDA {gpu.get('cuda', '-')}, cuBLAS {gpu.get('cublas', '-')}, driver "
             f"{gpu.get('driver', '-')}, Triton {env.get('triton')}", "",
             f"Read bandwidth {env.get('read_GBps')} GB/s, bf16 matmul {env.get('peak_TMACs')} T multiply-adds/s "
             "(measured here).", "", "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {v.get('status')} | {v.get('seconds', '')} |" for name, v in r.items()]
    kern = r.get("kernels", {})
    if isinstance(kern.get("attention", {}).get("us_per_layer"), dict):
        lines += ["", "attention, us a layer call (bf16, 12 heads, 2 kv heads, head dim 128): " + ", ".join(
            f"{k} {v['us']} ({v['GBps']} GB/s)" for k, v in kern["attention"]["us_per_layer"].items())]
    if isinstance(kern.get("gemm", {}).get("timings"), dict):
        lines += ["", f"GEMM rows that moved bits with the rows beside them: {kern['gemm']['moved_rows']}", "",
                  "| linear | us | GB/s | of the read bandwidth | cuBLAS us (split-K allowed) |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['us']} | {v['GBps']} | {v['of_bandwidth']} | {v.get('cublas_us', '-')} |"
                  for k, v in kern["gemm"]["timings"].items()]
    real = r.get("real shapes", {})
    for role, m in real.get("models", {}).items():
        lines += _rows_md(role, m)
    if "egt_plan" in real:
        lines += ["", f"egt planned here: {real['egt_plan']}", "",
                  f"target T(1) / floor {real.get('target_T1_over_floor')}, T(64)/T(1) {real.get('target_T64_over_T1')}, "
                  f"drafter T(1) / target T(1) {real.get('draft_T1_over_target_T1')}, drafter's worst T(W)/T(1) "
                  f"{real.get('draft_worst_TW_over_T1')}, T(1) over an 8x cache {real.get('target_T1_cache_x8_over_T1')}×"]
    if "step_overhead" in real:
        lines += ["", "host work a step, forwards replayed (benchmarks/step_overhead.py): " + ", ".join(
            f"{m} {v['host_ms_per_step']} ms ({v['host_reads_per_step']:g} host reads, "
            f"{v['device_ops_per_step']:g} device ops)" for m, v in real["step_overhead"].items())]
    seven = r.get("7B shapes", {})
    for role, m in seven.get("models", {}).items():
        lines += _rows_md(f"7B pair, {role}", m)
    started = r.get("start", {})
    if "first start" in started:
        lines += ["", "start (tiny artifact, fresh process): " + ", ".join(
            f"{k} {v['load_s']} s load + {v['first_token_s']} s first token" for k, v in started.items()
            if isinstance(v, dict))]
    for line in r.get("aoti", {}).get("lines", []):
        lines.append(f"- aoti: {line}")
    for name, m in r.get("modelled", {}).items():
        if isinstance(m, dict) and "rows" in m:
            lines += [f"- modelled, {name} ({m['weight_GB']} GB, {m['kernels_per_layer']} kernels a layer): " + ", ".join(
                f"T({x['width']}) {x['modelled_ms']} ms = {x['of_floor']}x floor" for x in m["rows"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    global DTYPE
    ap = harness.parser(__doc__, repeats=None)
    ap.add_argument("--budget", type=float, default=460.0, help="seconds for the whole check")
    ap.add_argument("--calibration", type=Path, default=CALIBRATION)
    ap.add_argument("--small", action="store_true", help="tiny shapes instead of the real pair's (a smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-aot", action="store_true", help="compile no forwards ahead of time (on a CPU: the smoke test's; "
                    "CUDA artifacts have none)")
    ap.add_argument("--only", help="run only these sections (comma-separated: machine, kernels, tiny, real, 7b, start, aoti, "
                    "modelled)")
    ap.add_argument("--dtype", default=DTYPE, help="the artifacts' dtype")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="the random models' vocabulary (the real pair's: its "
                    "calibration's token ids must fit)")
    args = harness.parse(ap)
    DTYPE = args.dtype
    device = torch.device(args.device)
    out = harness.output(args.out, "", args.device)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget)
    gpu = device.type == "cuda"
    default = {"machine", "kernels", "tiny", "real", "7b", "start"} | ({"aoti"} if gpu else {"modelled"})
    only = set(args.only.split(",")) if args.only else default
    shapes = SMALL if args.small else REAL
    with tempfile.TemporaryDirectory(prefix="ygg-gpu-check-") as tmp:
        work = Path(tmp)
        if "machine" in only:
            check.run("machine", 30, machine, device)
        bandwidth = check.results.get("machine", {}).get("roofs", {}).get("bandwidth")
        if "kernels" in only:
            check.run("kernels", 40, kernels, device, shapes, bandwidth)
        if "tiny" in only:
            check.run("tiny pair", 60, tiny_pair, device, work, not args.no_aot)
        if "real" in only:
            check.run("real shapes", 150, real_shapes, check, device, work, shapes, args.vocab, args.calibration,
                      not args.no_aot)
        if "7b" in only:
            check.run("7B shapes", 60, seven_b, check, device, args.small)
        if "start" in only:
            check.run("start", 30, start, work)
        if "aoti" in only:
            check.run("aoti", 130, aoti, work)
        if "modelled" in only:
            check.run("modelled", 20, modelled)
    check.say(markdown(check))
    check.say(f"wrote {out}/gpu-check.json, .md, .log")
    sys.exit(0 if all(v.get("status") == "ok" for v in check.results.values()) else 1)


if __name__ == "__main__":
    main()
