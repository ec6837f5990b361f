"""The host work a decoding step costs beside its forwards, and its host reads (issue 74).

    .venv/bin/python benchmarks/step_overhead.py [ARTIFACT] [--prompt FILE] [--tokens 128]
        [--methods ar,chain,...] [--batch 1,4,8] [--repeats 3] [-o FILE.json]

On a GPU a 1.5B target's forward is worth about 1 ms, so a step's host work — building the tree, its
mask and positions, filling the forward's inputs, acceptance, KV compaction, the drafter's rounds read
back — decides whether speculation can pay there at all. This measures it on any machine with the
real decoding loop over forwards that cost nothing: each method (at the plan's own shapes) first
decodes the prompt for real while every forward of both models (eager or compiled) records its
outputs; then the same request is decoded again with each forward handing its recorded outputs back
at once (a replay that leaves the recorded run — another width, another input shape — stops with one
line). What a replayed step still takes is host work: `Result.metrics.decode_s` over its steps, medians of
the harness's interleaved rounds. `ygg serve`'s batched step (`Decoder.batch`, CAST) is measured the
same way at each `--batch` size, per `Batch.step`. Beside them, what a generation sets up before its
prefill (`Decoder.setup`: views of the runners, its drafter and proposer), the median of 200 calls.

Host reads: every point where the host waits for a tensor's value (`item`, `tolist`, `bool`, `int`,
`float`, `numpy`, `cpu`, ...; on a GPU each is a device→host sync), counted by a torch function mode
in one more replay, per step (the median over the steps; the first, which holds the prefill, left
out). Work the replay still runs on tensors — the depth predictor's small MLP, KV compaction, top-k
over the logits — is counted as the step's: on a GPU it is device work between the forwards, but it
is what the step adds to them. The same replay counts the step's device ops (aten operators that are
not views, by a dispatch mode): uncaptured, each is a kernel launch on a GPU, which costs the host
microseconds whatever the kernel does — what a step's graph capture would take off the host.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ygg_runtime
from ygg_bench import harness
from ygg_runtime import transfer
from ygg_runtime.errors import YggError

# Where a replayed step's time goes (`Metrics`): the proposer's work with the drafter's forwards (here
# free), the target forward's input building and replay, acceptance and the rest of the step.
PARTS = ("draft_s", "verify_s", "other_s")
# Tensor methods whose result is a host value: each waits for the device.
HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
                        "__array__"})


class Tape:
    """Every forward's outputs of one recorded run, in order, and where a replay of it stands."""

    def __init__(self):
        self.calls: list[tuple[tuple, tuple[torch.Tensor, ...]]] = []
        self.at: int | None = None  # None: recording

    def rewind(self) -> None:
        self.at = 0


class Taped:
    """A model's forward (eager or compiled) that records its outputs onto the current tape, or
    hands them back from it without computing. Everything else is the model's own."""

    tape: Tape | None = None  # the one every Taped forward writes to or reads from now

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def __call__(self, *args):
        tape = Taped.tape
        if tape is None:
            return self._real(*args)
        key = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        if tape.at is None:
            out = self._real(*args)
            tape.calls.append((key, tuple(x.clone() for x in out)))
            return out
        if tape.at >= len(tape.calls) or tape.calls[tape.at][0] != key:
            raise YggError(f"the replay left the recorded run at forward {tape.at} (inputs {key}): "
                           "the decoding is not deterministic, or a cost depends on the clock")
        out = tape.calls[tape.at][1]
        tape.at += 1
        return out


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that hand the host a value."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class DeviceOps(TorchDispatchMode):
    """Counts the aten operators that run a kernel (views and other aliases left out)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def tape_models(decoder) -> None:
    """Put every forward of the decoder's models behind `Taped`, and run them uncaptured: a captured
    graph replays its kernels without calling the forward, which a replay must hand back instead."""
    for runner in decoder.runners.values():
        runner.model = Taped(runner.model)
        if runner.compiled is not None:
            runner.compiled = Taped(runner.compiled)
        runner.graphs = None


def counted(run) -> tuple[tuple[int, int, int], list[tuple[int, int, int]]]:
    """Host reads over one more replay — every one (`HostReads`), and those the runtime makes on
    purpose through `transfer.to_host` — and device ops (`DeviceOps`), in all and at each verified
    step's end (`on_step`)."""
    marks: list[tuple[int, int, int]] = []
    declared = transfer.host_reads()
    with HostReads() as reads, DeviceOps() as ops:
        run(lambda *_: marks.append((reads.count, transfer.host_reads() - declared, ops.count)))
    return (reads.count, transfer.host_reads() - declared, ops.count), marks


def per_step(marks: list[tuple[int, ...]], which: int) -> float:
    """The median count between two verified steps (the first, which holds the prefill, left out)."""
    per = [b[which] - a[which] for a, b in zip(marks, marks[1:])]
    return float(statistics.median(per)) if per else float("nan")


def methods_overhead(decoder, prompt: list[int], tokens: int, methods: list[str], repeats: int) -> dict:
    """Each method's host work and host reads a step on `prompt` (`tape_models` done): recorded
    once, replayed in the harness's interleaved rounds (the last `repeats` of each, medians), then
    once more counting reads. Prints a line a method."""

    def request(method: str, on_step=None):
        return decoder.generate(prompt, max_new_tokens=tokens, method=method, on_step=on_step)

    for m in methods:  # both models' prompt-prefix rows in their caches (`PrefixCache`), as every later run finds them
        decoder.generate(prompt, max_new_tokens=8, method=m)
    tapes, texts, samples, last = {}, {}, {m: [] for m in methods}, {}
    for m in methods:  # the recorded runs
        tapes[m] = Taped.tape = Tape()
        texts[m] = request(m).token_ids

    def setup(m) -> None:
        Taped.tape = tapes[m]
        tapes[m].rewind()

    def replay(m: str):
        def call():
            r = last[m] = request(m)
            if r.token_ids != texts[m]:
                raise YggError(f"{m}: the replay decoded other tokens than the recorded run")
            steps = max(1, r.metrics.steps)
            samples[m].append([r.metrics.decode_s * 1000 / steps] + [getattr(r.metrics, f) * 1000 / steps for f in PARTS])
        return call

    harness.interleaved({m: replay(m) for m in methods}, repeats, setup=setup)
    # what a generation sets up before its prefill: its own runner views, drafter and proposer
    made = harness.interleaved({m: lambda m=m: decoder.setup(m) for m in methods}, 200)
    rows = {}
    for m in methods:
        setup(m)
        _, marks = counted(lambda on_step, m=m: request(m, on_step))
        r = last[m]
        kept = samples[m][-repeats:]
        rows[m] = {"host_ms_per_step": round(statistics.median(x[0] for x in kept), 3),
                   "of_it_ms": {f: round(statistics.median(x[i + 1] for x in kept), 3) for i, f in enumerate(PARTS)},
                   "host_reads_per_step": per_step(marks, 0), "to_host_per_step": per_step(marks, 1),
                   "device_ops_per_step": per_step(marks, 2),
                   "setup_us": round(statistics.median(made[m]) * 1000, 1),
                   "steps": r.metrics.steps,
                   "tokens_per_step": round(len(r.token_ids) / max(1, r.metrics.steps), 2),
                   "forwards_per_step": round(len(tapes[m].calls) / max(1, r.metrics.steps), 2),
                   "shapes": r.metrics.shapes}
        parts = ", ".join(f"{f.removesuffix('_s')} {v:.3f}" for f, v in rows[m]["of_it_ms"].items())
        print(f"{m:10s} {rows[m]['host_ms_per_step']:7.3f} ms of host work a step ({parts}), "
              f"{rows[m]['host_reads_per_step']:5.1f} host reads a step (through to_host "
              f"{rows[m]['to_host_per_step']:g}), {rows[m]['device_ops_per_step']:g} device ops ({r.metrics.steps} steps, "
              f"{rows[m]['tokens_per_step']} tokens a step; {rows[m]['setup_us']:g} µs to set up a generation)", flush=True)
        tapes[m] = Tape()  # free the recorded outputs
    Taped.tape = None
    return rows


def main() -> None:
    ap = harness.parser(__doc__, artifact="artifacts/default", repeats=3)
    ap.add_argument("--prompt", type=Path, default=Path("demo/code.txt"), help="the prompt file each method decodes")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    ap.add_argument("--methods", default="", help="comma-separated (default: every method of the artifact)")
    ap.add_argument("--batch", type=harness.ints, default=[1, 4, 8], help="ygg serve's batch sizes (egt)")
    ap.add_argument("--batch-prompts", type=Path, default=Path("benchmarks/data/unseen_prompts.jsonl"),
                    help="JSONL prompts the batch takes in turn")
    args = harness.parse(ap)
    decoder = ygg_runtime.load(args.artifact)
    methods = [m for m in args.methods.split(",") if m] or list(decoder.methods)
    for m in methods:
        if m not in decoder.methods:
            raise YggError(f"method '{m}' is not in {args.artifact} (it has: {', '.join(decoder.methods)})")
    tape_models(decoder)
    rows = methods_overhead(decoder, decoder.encode(args.prompt.read_text()), args.tokens, methods, args.repeats)

    batch_rows = {}
    lines = [json.loads(x) for x in args.batch_prompts.read_text().splitlines() if x.strip()]
    method = "egt" if "egt" in decoder.methods else methods[0]
    for n in args.batch:
        prompts = [decoder.encode(lines[i % len(lines)]["turns"][0]) for i in range(n)]
        tape = Taped.tape = Tape()
        steps = []

        def run_batch(on_step=None) -> None:
            batch = decoder.batch(max_batch=n)
            for p in prompts:
                if batch.join(p, method, max_new_tokens=args.tokens, on_step=on_step) is None:
                    raise YggError(f"a batch of {n} has no room for its requests here")
            count = 0
            while batch.members:
                for m in batch.step():
                    if m.error is not None:
                        raise YggError(f"a member of the batch failed: {m.error}")
                count += 1
            steps.append(count)

        run_batch()
        samples_ms = harness.interleaved({n: run_batch}, args.repeats, setup=lambda _: tape.rewind())[n]
        tape.rewind()
        (total, declared, ops), _ = counted(run_batch)
        batch_rows[n] = {"host_ms_per_step": round(statistics.median(samples_ms) / steps[0], 3), "steps": steps[0],
                         "host_reads_per_step": round(total / steps[0], 1),
                         "to_host_per_step": round(declared / steps[0], 1),
                         "device_ops_per_step": round(ops / steps[0], 1)}
        print(f"batch {n:3d} {batch_rows[n]['host_ms_per_step']:7.3f} ms of host work a batched step, "
              f"{batch_rows[n]['host_reads_per_step']} host reads a step, {batch_rows[n]['device_ops_per_step']} "
              f"device ops ({steps[0]} steps)", flush=True)
        Taped.tape = None
    out = {"artifact": str(args.artifact), "prompt": str(args.prompt), "tokens": args.tokens,
           "methods": rows, "batch": {"method": method, "sizes": batch_rows}}
    if args.out:
        harness.write_json(args.out, out)


if __name__ == "__main__":
    main()
