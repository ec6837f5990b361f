"""`make gpu-check`: what only a GPU can show, in one call of at most 8 minutes on a bare machine of
the GPU image (its own torch with CUDA, Triton, transformers; no package index: the wheels it lacks
are carried, see the Makefile's `gpu-wheels`).

    python3 benchmarks/gpu_check.py [-o DIR] [--budget 460] [--calibration FILE] [--only SECTIONS] [--small]

In order, each section timed, a failing one reported in a line (its traceback in the log) while the
others still run, and none started without the time it needs. Where the AOT compile fails, the
section says so and measures the rest without it (eager forwards, still captured as CUDA graphs),
so that one call shows every failure there is:
  1. the machine: GPU, compute capability, torch, CUDA, cuBLAS, driver, Triton; its two roofs
     (a streaming read of a buffer 8x its L2; a bf16 8192^3 matmul);
  2. `ygg::attention_cuda` on the GPU: against float64, and a token's row bitwise the same in plain
     decoding and in a tree verify (bfloat16 and float32);
  3. the tiny random pair compiled with `--device cuda` (AOT, bf16): every method's greedy output
     = `ar`'s, the row check's verdict, the forwards replayed as CUDA graphs;
  4. random models of the real pair's shapes (Qwen2.5-Coder-1.5B target, 0.5B drafter, bf16, made
     on the GPU in seconds), compiled with `--device cuda --calibration-from` the real pair's committed
     calibration (`benchmarks/data/`): the roofline table (T(W) at W = 1..64 for both models beside
     the weight-stream floor), T(64)/T(1), the drafter's T(1) against the target's, T(1) over a cache
     8x larger (a forward must not cost what the cache holds), the row check, the modelled `egt`
     speed-up over `ar` on this GPU from the real pair's acceptance, and `ar` / `egt` decoding it (=,
     ms per token, host reads per step).
Results: DIR/gpu-check.json, .md and .log, DIR defaulting to benchmarks/results/cuda-<gpu>/.

On a lent machine (the device tool: `make gpu-wheels` here first, then one call carrying .whl/, with
a timeout of 590 s): `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py -o $OUT` (`make gpu-check` does the same
where make is installed).
--small runs the same on tiny shapes (on a CPU too, with --no-aot: the suite's smoke test of this script).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ygg_runtime.plan import Plan

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # tiny.py: random models and the byte tokenizer

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
        (self.out / "gpu-check.json").write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        (self.out / "gpu-check.md").write_text(markdown(self))


def machine(device: torch.device) -> dict:
    import triton  # noqa: F401  (its version: the GPU attention is a Triton kernel)
    import transformers

    from ygg_compile.roofline import measure_roofs

    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__}
    if device.type == "cuda":
        from ygg_runtime.backend import gpu

        gpu.configure()
        info = gpu.info(device)
        props = torch.cuda.get_device_properties(device)
        out |= {"gpu": info.__dict__, "multiprocessors": props.multi_processor_count,
                "l2_bytes": getattr(props, "L2_cache_size", None)}
    roofs = measure_roofs(1 << 30, repeats=5, device=device) if device.type == "cuda" else measure_roofs(256 << 20, 3)
    return out | {"read_GBps": round(roofs.bandwidth / 1e9, 1), "peak_TMACs": round(roofs.int8_peak / 1e12, 2),
                  "roofs": roofs.as_dict()}


def attention(device: torch.device) -> dict:
    """The kernel on this device: its error against float64, a row's bits in two layouts, its time."""
    from ygg_compile.roofline import cuda_ms
    from ygg_runtime.backend import cuda

    op = cuda.OPS.attention  # on a CPU: Triton's interpreter (TRITON_INTERPRET=1)
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
        for w in (1, 64):
            qw = torch.randn(1, heads, w, dim, device=device, dtype=torch.bfloat16)
            kw = torch.randn(1, kv, w, dim, device=device, dtype=torch.bfloat16)
            c = torch.randn(1, 2, kv, 1200, dim, device=device, dtype=torch.bfloat16)
            t = torch.ones(w, w, dtype=torch.bool, device=device).tril()
            args = (qw, kw, kw.clone(), c, 0, torch.arange(1000, 1000 + w, device=device),
                    torch.zeros(w, dtype=torch.long, device=device), torch.full((w,), 1000, device=device), t)
            out[f"us_per_layer_W{w}_ctx1000"] = round(1000 * cuda_ms(lambda: op(*args)), 1)
    if not ok:
        raise AssertionError(f"the kernel is off: {out}")
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


def compile_pair(check: Check, dirs: dict, out: Path, device: torch.device, **options) -> tuple["Plan", str | None]:
    """The pair's artifact, and why it has no compiled forwards though they were asked for (None if
    it has them): the compile left them out (this torch could not load them), or the AOT compile
    failed, and the pair was compiled again without it, so the section measures the rest all the same."""
    from ygg_compile.build import compile_artifact
    from ygg_compile.options import CompileOptions
    from ygg_runtime.errors import first_line
    from ygg_runtime.ui import Reporter

    opts = CompileOptions(draft=str(dirs["draft"]), target=str(dirs["target"]), output=out, device=device.type,
                          dtype=DTYPE, profiles=out.parent / "profiles", **options)  # random models' profiles stay here
    try:
        plan = compile_artifact(opts, Reporter())
        return plan, plan.aot_skipped
    except Exception as e:
        if not opts.aot:
            raise
        why = f"{type(e).__name__}: {first_line(e)}"
        check.trace(f"AOT compile of {out}")
        check.say(f"  AOT failed ({why}); compiling without it")
        return compile_artifact(dataclasses.replace(opts, aot=False), Reporter()), why


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


def tiny_pair(check: Check, device: torch.device, work: Path, aot: bool) -> dict:
    import tiny

    import ygg_runtime

    target = tiny.hf_model("llama", seed=40)
    draft = tiny.noised(target, 0.05, seed=41)
    tok = tiny.byte_tokenizer()
    dirs = {"target": tiny.save_pair_dir(work / "tiny" / "target", target, tok),
            "draft": tiny.save_pair_dir(work / "tiny" / "draft", draft, tok)}
    plan, aot_error = compile_pair(check, dirs, work / "tiny" / "artifact", device, max_context=256, quick=True,
                                   aot=aot)
    dec = ygg_runtime.load(work / "tiny" / "artifact")
    got = decode_all(dec, [list(p.encode()) for p in PROMPTS], 32)
    prompt = list(PROMPTS[0].encode())  # coupled sampling: a seed gives ar's tokens with every method
    sampled = {m: dec.generate(prompt, max_new_tokens=32, method=m, temperature=0.8, seed=7).token_ids
               for m in ("ar", "egt", "chain")}
    got["sampled_equal_ar"] = all(t == sampled["ar"] for t in sampled.values())
    exact = dec.verdict()
    out = {"compile_s": plan.compile_seconds, "phases": plan.compile_phases, "aot": plan.aot is not None,
           "aot_error": aot_error, "row_check": {k: r.min_width for k, r in plan.exactness.items()},
           "verdict": exact[1], **forwards(dec), **got}
    wrong = [f"AOT compile: {aot_error}"] if aot_error else []
    wrong += [] if got["all_equal"] else [f"{got['equal']} greedy outputs = ar's"]
    wrong += [] if got["sampled_equal_ar"] else ["seeded sampling differs from ar's"]
    wrong += [] if exact[0] else [f"verdict: {exact[1]}"]
    if wrong:
        out["failed"] = "; ".join(wrong)
    return out


def real_shapes(check: Check, device: torch.device, work: Path, shapes: dict, vocab: int, calibration: Path,
                aot: bool) -> dict:
    import ygg_runtime
    from ygg_compile import profile as prof
    from ygg_compile.roofline import model_costs, table

    dirs = random_pair(work / "real", shapes, device, vocab, tie=True)
    options = {"max_context": 1024, "quick": True, "aot": aot}
    if calibration.is_file():
        options["calibration_from"] = calibration
    tiny = check.results.get("tiny pair", {})
    if options["aot"] and tiny.get("aot_error"):  # the same export would fail again: no minute spent on it
        options["aot"] = False
    plan, aot_error = compile_pair(check, dirs, work / "real" / "artifact", device, **options)
    aot_error = aot_error or (f"not tried: it failed on the tiny pair ({tiny['aot_error']})" if aot and not options["aot"]
                              else None)
    dec = ygg_runtime.load(work / "real" / "artifact")
    roofs = plan.profile.roofline.roofs if plan.profile.roofline else None
    out = {"compile_s": plan.compile_seconds, "phases": plan.compile_phases, "calibration": plan.calibration.source,
           "aot": plan.aot is not None, "aot_error": aot_error,
           "row_check": {k: r.min_width for k, r in plan.exactness.items()}, "verdict": dec.verdict()[1], "models": {}}
    context = 64
    for role, runner in dec.runners.items():
        widths = [w for w in WIDTHS if w in plan.profile.widths]
        floor, runner.min_width = runner.min_width, 0  # each width as it is (a verify pads to the floor)
        ms = prof.forward_times(runner, tuple(widths), context=context, repeats=10)
        costs = model_costs(runner.model)
        rows = table(costs, roofs, widths, [ms[w] for w in widths], context, gpu=device.type == "cuda") if roofs else []
        graphs, runner.graphs = runner.graphs, None  # the same forwards uncaptured, for comparison
        plain = prof.forward_times(runner, (1,), context=context, repeats=5)[1]
        runner.graphs, runner.min_width = graphs, floor
        out["models"][role] = {"weight_GB": round(costs.weight_bytes / 1e9, 3), "rows": rows,
                               "T1_uncaptured_ms": round(plain, 3), "min_width": floor}
    t, d = out["models"]["target"]["rows"], out["models"]["draft"]["rows"]
    if t and d:
        by = {r["width"]: r for r in t}
        out |= {"target_T1_over_floor": by[1]["of_floor"], "target_T64_over_T1": by[64]["of_t1"] if 64 in by else None,
                "draft_T1_over_target_T1": round(d[0]["ms"] / t[0]["ms"], 3)}
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
    wrong = [f"AOT compile: {aot_error}"] if aot_error else []
    wrong += [] if out["decode"]["all_equal"] else [f"{out['decode']['equal']} greedy outputs = ar's"]
    if wrong:
        out["failed"] = "; ".join(wrong)
    return out


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
    real = r.get("real shapes", {})
    for role, m in real.get("models", {}).items():
        lines += ["", f"**{role}** ({m['weight_GB']} GB of weights; uncaptured T(1) {m['T1_uncaptured_ms']} ms):", "",
                  "| W | ms | floor ms | × floor | T(W)/T(1) |", "|---|---|---|---|---|"]
        lines += [f"| {x['width']} | {x['ms']} | {x['floor_ms']} | {x['of_floor']} | {x['of_t1']} |" for x in m["rows"]]
    if "egt_plan" in real:
        lines += ["", f"egt planned here: {real['egt_plan']}", "",
                  f"target T(1) / floor {real.get('target_T1_over_floor')}, T(64)/T(1) {real.get('target_T64_over_T1')}, "
                  f"drafter T(1) / target T(1) {real.get('draft_T1_over_target_T1')}, T(1) over an 8x cache "
                  f"{real.get('target_T1_cache_x8_over_T1')}×"]
    return "\n".join(lines) + "\n"


def main() -> None:
    global DTYPE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path)
    ap.add_argument("--budget", type=float, default=460.0, help="seconds for the whole check")
    ap.add_argument("--calibration", type=Path, default=CALIBRATION)
    ap.add_argument("--small", action="store_true", help="tiny shapes instead of the real pair's (a smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-aot", action="store_true", help="compile no forwards ahead of time (the smoke test's)")
    ap.add_argument("--only", help="run only these sections (comma-separated: machine, kernel, tiny, real)")
    ap.add_argument("--dtype", default=DTYPE, help="the artifacts' dtype")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="the random models' vocabulary (the real pair's: its "
                    "calibration's token ids must fit)")
    args = ap.parse_args()
    DTYPE = args.dtype
    device = torch.device(args.device)
    from ygg_compile import hardware

    out = args.out or REPO / "benchmarks" / "results" / hardware.device_slug(args.device)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget)
    only = set(args.only.split(",")) if args.only else {"machine", "kernel", "tiny", "real"}
    with tempfile.TemporaryDirectory(prefix="ygg-gpu-check-") as tmp:
        work = Path(tmp)
        if "machine" in only:
            check.run("machine", 30, machine, device)
        if "kernel" in only:
            check.run("attention kernel", 20, attention, device)
        if "tiny" in only:
            check.run("tiny pair", 90, tiny_pair, check, device, work, not args.no_aot)
        if "real" in only:
            check.run("real shapes", 200, real_shapes, check, device, work, SMALL if args.small else REAL, args.vocab,
                      args.calibration, not args.no_aot)
    check.say(markdown(check))
    check.say(f"wrote {out}/gpu-check.json, .md, .log")
    sys.exit(0 if all(v.get("status") == "ok" for v in check.results.values()) else 1)


if __name__ == "__main__":
    main()
