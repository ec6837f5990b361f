"""Measured latency: T(W), one forward over W new tokens after a context of C tokens, and T_other(W),
the CPU work of a step around a verify of W nodes.

These curves are what every latency-aware choice reads (docs/design.md, "The objective"). Widths are interleaved
within each repeat, so a slow drift of a shared machine hits every width alike, and the median of
the repeats is kept. One profile per (device, model, dtype) is kept under `profiles/<device>/` and
reused by every compile that matches it (same weights, dtype, torch, CPU/GPU, threads).
"""

from __future__ import annotations

import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import yaml

from ygg_compile import hardware
from ygg_compile.timing import interleaved
from ygg_runtime.ui import Reporter
from ygg_runtime import backend
from ygg_runtime.backend import native
from ygg_runtime.decoding.accept import accept_greedy
from ygg_runtime.errors import first_line
from ygg_runtime.files import cache_dir, write_atomic
from ygg_runtime.schema.plan import ModelInfo
from ygg_runtime.decoding.objective import _interp
from ygg_runtime.schema.params import WIDTHS
from ygg_runtime.model.runner import Call, ModelRunner, forward_many
from ygg_runtime.decoding.tree import TokenTree

DEFAULT_CONTEXTS = (64, 512, 2048, 8192)
PROFILE_FORMAT = 1
# A stored profile is reused only when a few of its forwards, timed again here, agree within this
# share of the stored time (or this many ms, for forwards so short that timer noise dominates):
# two 2-core EPYCs of one device name differ by 1.4-1.9x, this machine's own run-to-run noise is
# within ~15 %. A forward of 1-5 ms (the suite's tiny models) swings by 1-2 ms when the other core
# is busy (1.9 vs 1.3 ms at T(1) under the suite's second worker, on the AVX2 EPYC): the floor is
# 2 ms, below any real model's 25 %.
SPOT_TOLERANCE, SPOT_FLOOR_MS = 0.25, 2.0
SPOT_WIDTHS = (1, 4, 16)
# Sequences per batched forward measured for `ygg serve` (CAST's f(B, c, n)).
BATCH_SEQUENCES = (2, 4, 8)
BATCH_CONTEXT = 512


def fitting_widths(context: int, max_len: int, widths: tuple[int, ...] = WIDTHS) -> tuple[int, ...]:
    """The widths whose forward still fits a cache of max_len after `context` tokens."""
    return tuple(w for w in widths if context + w <= max_len)


def plan_grid(max_context: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The widths and context lengths to measure for an artifact serving max_context tokens: the
    default contexts that fit, and the longest a request reaches where it lies more than twice past
    them (a forward's attention grows with the context: the plan reads times there, not guesses)."""
    widths = fitting_widths(min(DEFAULT_CONTEXTS), max_context) or (1,)
    contexts = tuple(c for c in DEFAULT_CONTEXTS if c + widths[-1] <= max_context)
    longest = max(0, max_context - widths[-1])
    if contexts and longest > 2 * contexts[-1]:
        contexts += (longest,)
    return widths, contexts or (longest,)


def forward_times(
    runner: ModelRunner,
    widths: tuple[int, ...] = WIDTHS,
    context: int = 256,
    repeats: int = 3,
    warmup: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, float]:
    """Median ms of one causal forward over W new tokens at `context` committed tokens, per width:
    each at its own width, or at the exactness floor where that is wider (as every forward of the
    model runs). The runner is left reset (nothing committed)."""
    compiled, runner.widths = runner.widths, ()  # time each width as it is, unpadded
    context = max(0, min(context, runner.max_len - runner.padded(max(widths))))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (max(widths),), generator=gen).tolist()
    def setup(w: int) -> None:
        runner.reset(context)
        runner.synchronize()

    def forward(w: int) -> Callable[[], None]:
        def call() -> None:  # synchronised inside the timed call: a GPU's host time counts too
            runner.forward_chain(tokens[:w])
            runner.synchronize()
        return call

    try:
        samples = interleaved({w: forward(w) for w in widths}, repeats, warmup=warmup, setup=setup, progress=progress)
    finally:
        runner.reset()
        runner.widths = compiled
    return {w: statistics.median(v) for w, v in samples.items()}


def batch_context(contexts: tuple[int, ...] | list[int]) -> int:
    """The measured context the batch factors are taken at: the nearest to BATCH_CONTEXT (a
    factor is a ratio of times at one context; eight sequences at the longest would take minutes)."""
    return min(contexts, key=lambda c: (abs(c - BATCH_CONTEXT), c))


def batch_times(runner: ModelRunner, widths: tuple[int, ...], context: int, sequences: tuple[int, ...] = BATCH_SEQUENCES,
                repeats: int = 3, warmup: int = 1) -> dict:
    """CAST's f(B, c, n): median ms of one forward carrying n new tokens spread evenly over B
    sequences (n / B each, a causal chain), each in its own cache region after `context` tokens,
    for every measured width n >= B (`ygg_runtime.decoding.batch` runs such forwards). The cache
    is laid out as a served batch lays it out: first the slots a forward's padding rows write
    when no region has room past its tree (`Batch.scratch`: here as many as the widest padding a
    measured forward gets, up to the exactness floor), then one region per sequence holding the
    context and the most one sequence of a batch gets (widest / min B). The context is lowered
    where that would not fit the cache (the smallest a compile makes, max_context 1 plus a probe
    tree's room, holds 63 padding slots and eight regions of 2 + 64 / 2). Returns {"context",
    "sequences", "widths", "ms": [per B: ms per width, None below B]}; every entry None where no
    width holds two sequences."""
    keys = [(b, w) for b in sequences for w in widths if w >= b]
    if not keys:
        return {"context": context, "sequences": list(sequences), "widths": list(widths),
                "ms": [[None] * len(widths) for _ in sequences]}
    compiled, runner.widths = runner.widths, ()
    try:
        spare = max(runner.padded(w) - w for _, w in keys)
        scratch = range(runner.base, runner.base + spare)
        most = max(widths) // min(sequences)  # the most tokens one sequence of a batched forward gets
        context = max(1, min(context, (runner.max_len - spare) // max(sequences) - most))
        length = context + most
        regions = [runner.region(scratch.stop + i * length, length) for i in range(max(sequences))]
        for region in regions:
            region.scratch = scratch
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, runner.vocab_size, (max(widths),), generator=gen).tolist()
        calls: list[Call] = []  # the next timed forward's, built untimed

        def setup(key: tuple[int, int]) -> None:
            b, w = key
            each = w // b
            causal = torch.ones(each, each, dtype=torch.bool).tril_()
            calls.clear()
            for region in regions[:b]:
                region.reset(context)
                calls.append(Call(region, tokens[:each], list(range(each)), list(range(each)), causal))
            runner.synchronize()

        def forward() -> None:
            forward_many(calls)
            runner.synchronize()

        samples = interleaved(dict.fromkeys(keys, forward), repeats, warmup=warmup, setup=setup)
    finally:
        runner.widths = compiled
        runner.reset()
    ms = [[round(statistics.median(samples[(b, w)]), 3) if (b, w) in samples else None for w in widths]
          for b in sequences]
    return {"context": context, "sequences": list(sequences), "widths": list(widths), "ms": ms}


def step_overhead(runner: ModelRunner, widths: tuple[int, ...], repeats: int = 5) -> dict[int, float]:
    """Median ms of a step's CPU work around a W-node verify with this model: building the tree and
    its ancestor mask, picking the drafter's top children, the acceptance walk over [W, vocab]
    logits, and compacting an accepted path in every layer's cache."""
    gen = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    out = {}
    for w in widths:
        logits = torch.randn(w, vocab, generator=gen)
        samples = []
        for _ in range(repeats):
            runner.reset(64)
            start = time.perf_counter()
            tree = TokenTree(0)
            for i in range(1, w):
                tree.add((i - 1) // 2, i, 0.5)  # a binary tree: paths of depth log2(W)
            tree.ancestor_mask()
            torch.softmax(logits[: min(w, 8)], dim=-1).topk(min(8, vocab))
            accept_greedy(tree, logits)
            runner.commit(tree.path_to(w - 1))
            samples.append(1000.0 * (time.perf_counter() - start))
        out[w] = statistics.median(samples)
    runner.reset()
    return out


def measure(
    runner: ModelRunner,
    widths: tuple[int, ...],
    contexts: tuple[int, ...],
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """T(W) at every context and T_other(W) of one model: the measured part of a profile file."""
    rounds = len(contexts)
    rows = []
    for i, context in enumerate(contexts):
        sub = (lambda done, total, i=i: progress(i * total + done, rounds * total)) if progress else None
        times = forward_times(runner, widths, context, repeats, progress=sub)
        rows.append([round(times[w], 3) for w in widths])
    other = step_overhead(runner, widths)
    return {
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "widths": list(widths),
        "contexts": list(contexts),
        "forward_ms": rows,
        "other_ms": [round(other[w], 3) for w in widths],
        "batch_ms": batch_times(runner, widths, batch_context(contexts), repeats=repeats),
    }


def combine(target: dict, draft: dict | None, widths: tuple[int, ...], contexts: tuple[int, ...]) -> dict:
    """The plan's profile section (what `objective.Curves` reads) from per-model profiles, taking
    the widths and contexts asked for. A step's CPU work counts both models' share."""

    def pick(p: dict, key: str) -> list:
        cols = [p["widths"].index(w) for w in widths]
        if key == "other_ms":
            return [p[key][c] for c in cols]
        return [[p[key][p["contexts"].index(ctx)][c] for c in cols] for ctx in contexts]

    out = {"threads": target["threads"], "repeats": target["repeats"], "widths": list(widths), "contexts": list(contexts),
           "target_ms": pick(target, "forward_ms")}
    other = pick(target, "other_ms")
    if draft is not None:
        out["draft_ms"] = pick(draft, "forward_ms")
        other = [a + b for a, b in zip(other, pick(draft, "other_ms"))]
    out["other_ms"] = [round(o, 3) for o in other]
    # f(B, c, n) as a factor over one sequence's T(n) at the same context (`Curves.t_batch`)
    for role, p in (("target", target), ("draft", draft)):
        if p is not None and p.get("batch_ms"):
            out[f"{role}_batch"] = batch_factors(p)
    return out


def batch_factors(p: dict) -> dict:
    """T(B sequences, n) / T(1 sequence, n) at the batch measurement's context, per B and width:
    the profile's single-sequence rows interpolated to that context."""
    b = p["batch_ms"]
    single = [_interp(p["contexts"], [row[i] for row in p["forward_ms"]], b["context"]) for i in range(len(p["widths"]))]
    factors = []
    for row in b["ms"]:
        factors.append([None if ms is None or w not in p["widths"] else round(ms / single[p["widths"].index(w)], 4)
                        for w, ms in zip(b["widths"], row)])
    return {"sequences": b["sequences"], "widths": b["widths"], "factors": factors}


def profile_models(
    runners: dict[str, ModelRunner],
    widths: tuple[int, ...] = WIDTHS,
    context: int = 256,
    repeats: int = 3,
    ui: Reporter | None = None,
) -> dict:
    """T(W) of both loaded models at one context, as a plan/result profile section (`ygg bench`)."""
    measured = {}
    for role, runner in runners.items():
        label = f"timing {role} forwards (W = {widths[0]}..{widths[-1]})"
        report = (lambda done, total, label=label: ui.progress(label, done, total, unit="rounds")) if ui else None
        measured[role] = measure(runner, widths, (context,), repeats, progress=report)
    return combine(measured["target"], measured.get("draft"), widths, (context,))


# --- the committed profile files -------------------------------------------------------------


def profiles_dir() -> Path:
    """$YGG_PROFILES, else the checkout's `profiles/` (committed), else the user cache."""
    if os.environ.get("YGG_PROFILES"):
        return Path(os.environ["YGG_PROFILES"])
    repo = Path(__file__).resolve().parents[1] / "profiles"
    if repo.is_dir():
        return repo

    return cache_dir() / "profiles"


def fingerprint(device: str, forward: str, formats: dict[str, int] | None = None) -> dict:
    """What a profile's numbers depend on besides the model: the same fingerprint means reusable.
    forward: "aot" (the ahead-of-time compiled forwards) or "eager"; formats: the code formats of
    quantized weights (`WeightsInfo.formats`), whose kernel source and path then count too — the
    same file held as other codes, or run on another of the kernel's paths (YGG_QLINEAR=amx on a
    Xeon), runs at other speeds."""
    info = {"device": device, "forward": forward, "attention": backend.version(device),
            "torch_version": str(torch.__version__), "threads": torch.get_num_threads()}
    if formats:
        info |= {"qlinear": native.qlinear_version(), "qlinear_path": native.qlinear_path(),
                 "formats": dict(sorted(formats.items()))}
    if device.startswith("cuda"):
        return info | {"gpu": torch.cuda.get_device_name()}
    cpu = hardware.cpu_info()
    return info | {"cpu": cpu.model, "isa": cpu.isa}


def weights_label(dtype: str, model: ModelInfo) -> str:
    """The dtype a profile is filed under: the float dtype, with the weights' kind when quantized
    (bfloat16-int4): other weights, other timings."""
    return dtype if model.weights.kind == "float" else f"{dtype}-{model.weights.kind}"


def profile_path(root: Path, device: str, model: ModelInfo, dtype: str, forward: str) -> Path:
    return Path(root) / hardware.device_slug(device) / profile_name(model.spec, model.sha256, dtype, forward)


def profile_name(spec: str, sha256: str, dtype: str, forward: str) -> str:
    """A profile's file name under its machine's folder: <model>-<sha256[:8]>-<dtype>-<aot|eager>.yaml."""
    name = Path(spec.rstrip("/")).name.lower()
    name = re.sub(r"[^a-z0-9.]+", "-", name).strip("-") or "model"
    return f"{name}-{sha256[:8]}-{dtype}-{forward}.yaml"


def load_matching(path: Path, model: ModelInfo, dtype: str, device: str, forward: str, widths, contexts) -> tuple[dict | None, str]:
    """The stored profile at `path` when it was measured for these weights on this machine and
    covers the widths and contexts asked for; else None and why not."""
    if not path.is_file():
        return None, "no stored profile"
    try:
        stored = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, OSError) as e:
        return None, f"unreadable ({first_line(e)})"
    if not isinstance(stored, dict) or stored.get("format") != PROFILE_FORMAT:
        return None, "another profile format"
    if stored.get("model", {}).get("sha256") != model.sha256 or stored.get("dtype") != dtype:
        return None, "other weights or dtype"
    if stored.get("fingerprint") != fingerprint(device, forward, model.weights.formats):
        return None, "measured on another machine, torch, thread count, forward kind or weight codes"
    if not set(widths) <= set(stored["widths"]) or not set(contexts) <= set(stored["contexts"]):
        return None, "does not cover the widths and contexts needed"
    return stored, ""


def spot_check(runner: ModelRunner, stored: dict, repeats: int = 3, tries: int = 3) -> tuple[bool, dict]:
    """Time a few of a stored profile's forwards again on this machine (at its first context);
    (agrees, the record: widths, stored and measured ms). A profile filed under this device's name
    may come from another machine of the same name with other memory or clocks. One that disagrees
    is timed again (up to `tries` times), each width keeping its fastest time: another machine
    disagrees every time, while a burst of another process's work on this one only slows some
    of the timings (the suite's other worker slowed a tiny drafter's twice in a row)."""
    context = stored["contexts"][0]
    widths = tuple(w for w in SPOT_WIDTHS if w in stored["widths"]) or (stored["widths"][0],)
    row = stored["forward_ms"][0]
    was = [row[stored["widths"].index(w)] for w in widths]
    now = [float("inf")] * len(widths)
    for _ in range(tries):
        measured = forward_times(runner, widths, context, repeats)
        now = [min(n, round(measured[w], 3)) for n, w in zip(now, widths)]
        ok = all(abs(n - w) <= max(SPOT_TOLERANCE * w, SPOT_FLOOR_MS) for n, w in zip(now, was))
        if ok:
            break
    return ok, {"context": context, "widths": list(widths), "stored_ms": was, "measured_ms": now, "agrees": ok}


def spot_line(record: dict) -> str:
    """A spot check in a line: "T(1) 39.5 vs 27.1 ms stored, T(4) ..."."""
    return ", ".join(f"T({w}) {n:.1f} vs {s:.1f} ms stored" for w, n, s in
                     zip(record["widths"], record["measured_ms"], record["stored_ms"]))


def save(path: Path, measured: dict, model: ModelInfo, dtype: str, device: str, forward: str) -> dict:
    stored = {
        "format": PROFILE_FORMAT,
        "model": {k: getattr(model, k) for k in ("spec", "sha256", "arch", "parameters", "layers")},
        "dtype": dtype,
        "fingerprint": fingerprint(device, forward, model.weights.formats),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **measured,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(stored, sort_keys=False, width=200).encode())
    return stored
