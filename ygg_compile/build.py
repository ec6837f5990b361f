"""`ygg compile`: resolve and convert both models, check they share a tokenizer, write the artifact.

Everything is written into a temporary directory beside the output and renamed at the very end
(`ygg_compile.staging`), so an interrupted or failed compile leaves nothing half-written at the
output path. The drafter's head is cut by `ygg_compile.draft_vocab`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import save_file

from tokenizers import Tokenizer

from ygg_compile import (aot, calibrate, calibration_file, draft_vocab, footprint, hardware, invariance, predictor_training,
                         prompts, quantize, roofline, sources, stage_order)
from ygg_compile import latency as prof
from ygg_compile.convert import convert_state
from ygg_compile.options import CompileOptions, check_output
from ygg_compile.staging import Stopping, interrupts, staged
from ygg_runtime.ui import Reporter
from ygg_runtime.checks import exactness
from ygg_runtime.schema import typed
from ygg_runtime.decoding import objective, proposers
from ygg_runtime.backend import gpu_identity as gpu, native
from ygg_runtime.artifact.load import PLAN_FILE
from ygg_runtime.model.compiled import MAX_WIDTH, CompiledForward
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.checks.integrity import available_memory, file_entry
from ygg_runtime.model.transformer import ModelArgs, load_model
from ygg_runtime.schema.params import EGTParams, Params
from ygg_runtime.schema.plan import (FORMAT_VERSION, AOTInfo, CalibrationInfo, DraftVocabReport, DraftWindow, ExactnessRecord,
                              KernelInfo, ModelInfo, OutputLength, Plan, Planning, Profile, StagesReport, TokenizerInfo,
                              TritonKernels, WeightsInfo)
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.proposers import default_params
from ygg_runtime.model.runner import ModelRunner
from ygg_runtime.text import TextCodec

CHAT_PROBE = "\x00YGG-PROMPT\x00"
QUICK_PROMPTS, QUICK_TOKENS = 6, 32  # --quick: calibration prompts and tokens per prompt
ADJACENCY_FILE = "adjacency.safetensors"  # the seeded adjacency table egt and pld retrieve from
TOKENIZER_PROBES = ["Hello, world!", "def f(x):\n    return x ** 2  # ünïcode ✓", "  leading spaces\tand tabs\n\n"]


def compile_artifact(opts: CompileOptions, ui: Reporter | None = None) -> Plan:
    """Build the artifact at opts.output; returns the plan written. Every option is checked before
    any work; then the stages run in order, each a function below, into a staging directory that
    is renamed to the output only at the end: resolve, convert, aot, invariance, profile,
    calibrate, plan, write."""
    ui = ui or Reporter()
    sources.quiet_transformers()
    opts = _checked(opts)
    device = hardware.resolve_device(opts.device)
    dtype = hardware.resolve_dtype(opts.dtype, device)
    out = Path(opts.output)
    check_output(out)  # again: the options may have been made a while ago
    calib_prompts, calib_tokens, predictor = prompts.calibration(opts.calib), opts.calib_tokens, opts.predictor
    if opts.quick:
        calib_prompts, calib_tokens, predictor = calib_prompts[:QUICK_PROMPTS], min(calib_tokens, QUICK_TOKENS), False
    stored = calibration_file.load(opts.calibration_from) if opts.calibration_from else None  # refused now, if at all
    started = time.time()
    phases: dict[str, float] = {}  # where the time went, for the summary table

    @contextlib.contextmanager
    def phase(name: str, description: str | None) -> Iterator[None]:
        """Time a part of the compile under `name`; description: its progress line (None: its
        own steps show). A Ctrl-C or SIGTERM stops the compile here, before the part and after it."""
        stopping.check()
        start = time.time()
        with stopping.step(description) if description else contextlib.nullcontext():
            yield
        phases[name] = round(phases.get(name, 0.0) + time.time() - start, 1)
        stopping.check()

    with interrupts() as interrupted, staged(out) as tmp, _kernels_into(tmp, device):
        stopping = Stopping(ui, interrupted)
        b = _Build(opts, stopping, tmp, phase, device, dtype, calib_prompts, calib_tokens, predictor, stored)
        try:
            for stage in (_resolve, _convert, _aot, _invariance, _profile, _calibrate, _plan):
                stopping.check()
                stage(b)
            plan = _write(b, started, phases)
            stopping.check()  # a signal while plan.yaml was written: still nothing at the output
            return plan
        except Exception:
            if interrupted.is_set():  # a Ctrl-C killed the compilers a library waited on: it failed its own way
                raise KeyboardInterrupt from None
            raise


TRITON_DIR = "triton"  # a CUDA artifact's compiled Triton kernels


def _kernels_into(tmp: Path, device: str) -> contextlib.AbstractContextManager:
    """On CUDA, Triton compiles the forward's kernels into the artifact (`gpu.compiling_into`)."""
    return gpu.compiling_into(tmp / TRITON_DIR) if device.startswith("cuda") else contextlib.nullcontext()


def _triton(tmp: Path) -> TritonKernels | None:
    """What plan.yaml records of the artifact's Triton kernels (None: it has none)."""
    if not (tmp / TRITON_DIR).is_dir():
        return None
    import triton  # (a CUDA build of torch brings it; a CPU compile never gets here)

    return TritonKernels(TRITON_DIR, triton.__version__)


def _checked(opts: CompileOptions) -> CompileOptions:
    """The options with every method's parameters filled in, each option refused in one line
    before any work."""
    defaults = default_params()
    opts = replace(opts, methods={k: {**v, **opts.methods.get(k, {})} for k, v in defaults.items()}
                   | {k: v for k, v in opts.methods.items() if k not in defaults})
    proposers.validate(opts.methods)
    _static_trees(opts.methods)
    planned = ("sequoia", "egt")
    if opts.method not in (*opts.methods, *planned):
        raise YggError(f"default method '{opts.method}' is not one of the compiled methods ({', '.join([*opts.methods, *planned])})")
    if opts.calib_tokens < 1:
        raise YggError("--calib-tokens must be at least 1")
    draft_vocab.parse(opts.draft_vocab)
    return opts


@dataclass
class _Build:
    """What the stages of one compile share: the settings, then what each stage makes, in order."""

    opts: CompileOptions
    ui: Reporter
    tmp: Path  # the staging directory
    phase: Callable[[str, str | None], contextlib.AbstractContextManager]
    device: str
    dtype: torch.dtype
    calib_prompts: list[str]
    calib_tokens: int
    predictor: bool  # train egt's depth predictor
    stored: calibration_file.Stored | None  # --calibration-from: the calibration planned from (None: measured here)
    # resolve
    srcs: dict[str, sources.ModelSource] = field(default_factory=dict)  # by role
    held: dict[str, str] = field(default_factory=dict)  # how each role's weights are held
    # convert
    models: dict[str, ModelInfo] = field(default_factory=dict)
    tokenizer: Any = None
    tok_info: TokenizerInfo | None = None
    max_context: int = 0
    cache_slots: int = 0
    # aot
    kernel: KernelInfo | None = None
    runners: dict[str, ModelRunner] = field(default_factory=dict)
    codec: TextCodec | None = None
    aot_info: AOTInfo | None = None
    aot_skipped: str | None = None  # why the asked-for compiled forwards were left out
    vocab: dict = field(default_factory=dict)  # the drafter's head, as cut
    # invariance, profile, calibrate, plan
    exact: dict[str, ExactnessRecord] = field(default_factory=dict)
    profile: Profile | None = None
    calib: Any = None
    agreement: Any = None
    methods: dict[str, Params] = field(default_factory=dict)
    planning: Planning | None = None
    draft_window: DraftWindow | None = None
    output_length: OutputLength | None = None


def _resolve(b: _Build) -> None:
    """Find both models, and refuse a compile that will not fit in memory or on disk before any
    conversion starts."""
    opts, phase = b.opts, b.phase
    with phase("resolve", "finding draft model"):
        draft = sources.locate(opts.draft, b.ui.progress)
    with phase("resolve", "finding target model"):
        target = sources.locate(opts.target, b.ui.progress)
    b.held = {role: _weights(opts.draft_weights or opts.weights if role == "draft" else opts.weights, src, b.device, role)
              for role, src in (("target", target), ("draft", draft))}
    with phase("resolve", "estimating memory"):  # from the files' headers, before hashing them
        footprint.check_memory(footprint.estimate({"target": target, "draft": draft}, b.held, b.dtype), b.dtype)
    with phase("resolve", None):
        target, draft = sources.identify(target, b.ui.progress), sources.identify(draft, b.ui.progress)
    with phase("resolve", "estimating disk space"):  # now that it is known which conversions are cached
        footprint.check_disk(footprint.estimate({"target": target, "draft": draft}, b.held, b.dtype), Path(opts.output))
    b.srcs = {"target": target, "draft": draft}


def _convert(b: _Build) -> None:
    """Both models' weights and the shared tokenizer into the staging directory.

    A GGUF model whose artifact holds integer codes is dequantized once and cached in the
    artifact's dtype (the next compile reuses it); one whose artifact holds the float weights is
    dequantized in memory as it is converted: the artifact is the only copy on disk."""
    with sources.reading_gguf():  # a GGUF file is parsed once for its config, weights, tokenizer and blocks
        phase, held, dtype = b.phase, b.held, b.dtype
        with phase("convert", None):  # dequantizing a GGUF model not cached yet shows its own bar
            b.srcs = {role: sources.materialize(src, dtype, b.ui.progress) if held[role] != "float" else sources.cached(src, dtype)
                      for role, src in b.srcs.items()}
        target, draft = b.srcs["target"], b.srcs["draft"]
        with phase("convert", "comparing tokenizers"):
            b.tokenizer = _shared_tokenizer(draft, target)
        for role, src in (("target", target), ("draft", draft)):
            weights = held[role]
            label = str(dtype).removeprefix('torch.') if weights == "float" else f"{weights} codes ({'from the GGUF file' if src.gguf else 'quantized'})"
            with phase("convert", f"converting {role} ({src.spec}) to {label}"):
                b.models[role] = _convert_model(src, role, dtype, b.tmp / role, weights, b.ui)
        _check_vocab(b.tokenizer, b.models, b.ui)
        if b.stored is not None:  # before any model is compiled: a calibration this pair cannot use is refused now
            dims = {role: ModelArgs.load(b.tmp / role / "config.json").dim for role in b.models}
            for note in calibration_file.check_fits(b.stored, b.models, dims):
                b.ui.note(note)
        big, small = b.models["draft"].parameters, b.models["target"].parameters
        if big > small:  # allowed (an ablation may want it), but almost surely swapped flags
            b.ui.note(f"warning: the draft ({big / 1e6:.1f}M parameters) is larger than the target "
                      f"({small / 1e6:.1f}M): speculation will not beat plain decoding; swapped --draft and --target?")
        b.max_context = _max_context(b)
        # Room past max_context for the calibration probe's wide trees (slots, not positions);
        # `ygg run` sets up the same cache, which the compiled graphs are built around.
        b.cache_slots = b.max_context + calibrate.PROBE_ROOM
        with phase("convert", "writing tokenizer"):
            b.tok_info = _write_tokenizer(b.tokenizer, target, b.tmp)
            b.tok_info.eos_token_ids = sorted(set(b.tok_info.eos_token_ids) | set(b.models["target"].eos_token_ids))


# The share of the memory left beside the weights that the two KV caches may take at full length
# (compile's own working memory, and a server's batch, need the rest), and the shortest context a
# default compile settles for where memory is short.
CACHE_SHARE = 0.5
MIN_CONTEXT = 1024


def _max_context(b: _Build) -> int:
    """The context the artifact serves: --max-context (at most the models' own), else the models'
    own wherever this machine's memory holds both caches at that length beside the weights (said
    in one line where it does not, with the length it does hold). The cache's pages are mapped as
    rows are written (`kv.lazy_zeros`): the length costs memory only once a request reaches it."""
    own = min(m.max_position for m in b.models.values())
    if b.opts.max_context is not None:
        return min(b.opts.max_context, own)
    width = b.dtype.itemsize
    per_token = sum(ModelArgs.load(b.tmp / role / "config.json").kv_bytes_per_token(width) for role in b.models)
    weights = sum(m.weights.bytes if m.weights.kind != "float" else m.parameters * width for m in b.models.values())
    have = available_memory(b.opts.device)
    if have is None:
        return own
    fits = int((have - weights) * CACHE_SHARE) // per_token - calibrate.PROBE_ROOM
    if fits >= own:
        return own
    context = max(MIN_CONTEXT, fits // 1024 * 1024)
    b.ui.note(f"context {context} tokens, not the models' {own}: both KV caches at {own} would take "
              f"{own * per_token / 2**30:.1f} GB of the {have / 2**30:.1f} GB free beside {weights / 2**30:.1f} GB "
              f"of weights (--max-context sets it)")
    return context


def _link_or_copy(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src` where both are on one file system (the cache's kernels: a
    rebuild renames a new file in, never writes this one), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy(src, dst)


def aot_left_out(device: str) -> str | None:
    """Why a device's artifact has no model.pt2 although one was asked for (None: it has). On CUDA
    the forward is our Triton kernels (`ygg_runtime.backend.cuda`), launched from Python and
    replayed as one CUDA graph a width, which torch.export does not trace; and on the H200 image
    torch 2.11's AOTInductor loader segfaults on every package (benchmarks/aoti_load_probe.py)."""
    if device.startswith("cuda"):
        return "on CUDA the forwards are our Triton kernels, replayed as CUDA graphs"
    return None


def _aot(b: _Build) -> None:
    """The native kernels, both models loaded, their forwards compiled ahead of time, and the
    drafter's head cut (between the two compiles: the drafter is compiled as it will run)."""
    tmp, phase, opts = b.tmp, b.phase, b.opts
    if b.device.startswith("cpu"):
        with phase("aot", "building the native kernels (row-invariant attention, quantized linear)"):
            _link_or_copy(native.load(), tmp / native.LIBRARY)
        b.kernel = KernelInfo(native.LIBRARY, **aot.cpu_requirements(b.device))
    b.runners = _load_runners(tmp, b.device, b.cache_slots)
    b.codec = TextCodec(tmp / b.tok_info.file, b.tok_info.chat_prefix, b.tok_info.chat_suffix)
    seconds: dict[str, float] = {}  # AOT compile time per model
    narrowest: dict[str, int] = {}  # its narrowest compiled width
    if opts.aot:
        b.aot_skipped = aot_left_out(b.device)
    if opts.aot and not b.aot_skipped:
        _compile_forward(b.runners, "target", tmp, phase, b.ui, seconds, narrowest)
    special = sorted(set(b.tokenizer.all_special_ids) | set(b.tok_info.eos_token_ids))
    b.vocab = draft_vocab.cut_drafter_head(b.runners, b.models, b.codec, b.calib_prompts, b.calib_tokens, special,
                                           opts.draft_vocab, tmp, phase, b.ui, b.stored.calib if b.stored else None)
    if opts.aot and not b.aot_skipped:
        _compile_forward(b.runners, "draft", tmp, phase, b.ui, seconds, narrowest)
    if b.aot_skipped:
        b.ui.note(f"the forwards are not compiled ahead of time: {b.aot_skipped}")
    elif opts.aot:
        b.aot_info = AOTInfo(aot.PACKAGE, MAX_WIDTH, seconds, **aot.cpu_requirements(b.device), min_width=narrowest)


def _invariance(b: _Build) -> None:
    """Which target forward widths score a row as it is alone (the exactness of tree verification)."""
    with b.phase("exactness", None):
        b.exact = _check_rows(b.runners["target"], b.max_context, b.opts.methods, b.aot_info is not None, b.ui)
    b.runners["target"].min_width = exactness.min_width(b.exact.get("compiled" if b.aot_info else "eager"))


def _profile(b: _Build) -> None:
    with b.phase("profile", None):
        b.profile = Profile.from_dict(_profiles(b.runners, b.models, b.device, str(b.dtype).removeprefix("torch."),
                                                b.max_context, b.opts, b.ui))


def _calibrate(b: _Build) -> None:
    """The probe's trees on the calibration prompts, and the agreement the depth predictor learns
    from: measured here, or another compile's (--calibration-from); kept in the artifact either way."""
    dims = {role: r.model.args.dim for role, r in b.runners.items()}
    if b.stored is not None:
        b.calib, b.agreement = b.stored.calib, b.stored.agreement if b.predictor else None
    else:
        with b.phase("calibrate", f"calibrating on {len(b.calib_prompts)} prompts ({b.calib_tokens} tokens each)"):
            b.calib = calibrate.run_probe(b.runners["target"], b.runners["draft"], b.codec, b.calib_prompts,
                                          b.calib_tokens, b.ui)
        if b.predictor and b.calib.texts:
            with b.phase("calibrate", f"reading {sum(map(len, b.calib.texts.values()))} calibration positions for the depth predictor"):
                b.agreement = calibrate.agreement(b.runners["target"], b.runners["draft"], b.calib.texts)
    found = calibrate.output_length(b.calib, b.tok_info.eos_token_ids)
    b.output_length = typed.build(OutputLength, found, "the answers' length") if found else None
    with b.phase("calibrate", "measuring the acceptance a window of a long prompt keeps the drafter"):
        b.draft_window = _draft_window(b.runners, b.codec, b.max_context)
    with b.phase("calibrate", "keeping the calibration in the artifact"):
        calibration_file.save(b.tmp / calibration_file.FILE, b.calib, b.agreement, calibration_file.describe(b.models, dims),
                              b.dtype)


def _draft_window(runners: dict, codec: TextCodec, max_context: int) -> DraftWindow | None:
    """The acceptance each of the drafter's windows keeps, measured on the standard library's source
    (`calibrate.window_acceptance`); None when the context is too short to leave anything out."""
    n = min(calibrate.WINDOW_TEXT, max_context)
    positions = min(calibrate.WINDOW_POSITIONS, n // 4)
    if n <= min(calibrate.WINDOWS) + positions:
        return None
    ids = prompts.stdlib_text(prompts.WINDOW_SOURCES, n, lambda t: codec.encode(t, raw=True), "the window's text")[:n]
    found = calibrate.window_acceptance(runners["target"], runners["draft"], ids, positions=positions)
    source = f"the standard library's {', '.join(prompts.WINDOW_SOURCES)} (first {n} tokens)"
    return typed.build(DraftWindow, found | {"source": source}, "the drafter's window") if found else None


def _plan(b: _Build) -> None:
    """egt's and sequoia's parameters by the objective, egt's stage order timed on the real models;
    the models are let go after it."""
    with b.phase("plan", "planning egt and sequoia with the objective" + (", training the depth predictor" if b.predictor else "")):
        b.methods, b.planning = _plan_methods(b.calib, b.agreement, b.profile, b.opts, b.predictor, b.tmp)
    if b.opts.quick:
        b.planning.predictor.why = "--quick"
    b.planning.draft_vocab = typed.build(DraftVocabReport, b.vocab, "the drafter's head") if b.vocab else None
    b.agreement = None
    with b.phase("stages", None):
        report = _stage_plan(b.runners, b.codec, b.calib_prompts, b.methods["egt"], b.profile, b.tmp, b.opts.quick, b.ui)
        b.planning.stages = typed.build(StagesReport, report, "the stage search")
        b.methods["egt"] = replace(b.methods["egt"], stages=b.planning.stages.chosen)
    b.runners = {}
    gc.collect()


def _write(b: _Build, started: float, phases: dict[str, float]) -> Plan:
    """Every file's hash, then plan.yaml, the file that makes the directory an artifact."""
    with b.phase("hash", "hashing artifact files"):
        files = {str(p.relative_to(b.tmp)): file_entry(p) for p in sorted(b.tmp.rglob("*")) if p.is_file()}
    opts, calib = b.opts, b.calib
    plan = Plan(
        format_version=FORMAT_VERSION,
        yggdrasil_version=_version(),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        compile_seconds=round(time.time() - started, 1),
        compile_phases=phases,
        quick=opts.quick,
        models=b.models,
        device=b.device,
        dtype=str(b.dtype).removeprefix("torch."),
        torch_version=str(torch.__version__),
        cpu=hardware.cpu_info(),
        gpu=gpu.info(b.device) if b.device.startswith("cuda") else None,
        max_context=b.max_context,
        cache_slots=b.cache_slots,
        aot=b.aot_info,
        aot_skipped=b.aot_skipped,
        triton=_triton(b.tmp),
        kernel=b.kernel,
        exactness=b.exact,
        method=opts.method,
        methods=b.methods,
        sampling=opts.sampling,
        profile=b.profile,
        calibration=CalibrationInfo(
            source=(f"calibration-from {b.stored.path}" if b.stored else str(opts.calib) if opts.calib else "builtin"),
            prompts=calib.prompts,
            tokens=calib.tokens,
            steps=len(calib.steps),
            seconds=round(calib.seconds, 1),
            probe_tokens_per_step=round(calib.tokens / max(1, len(calib.steps)), 3),
        ),
        planning=b.planning,
        tokenizer=b.tok_info,
        files=files,
        draft_window=b.draft_window,
        output_length=b.output_length,
    )
    (b.tmp / PLAN_FILE).write_text(plan.to_yaml())
    return plan


def _shared_tokenizer(draft: sources.ModelSource, target: sources.ModelSource):
    toks = []
    for src in (draft, target):
        try:
            toks.append(sources.load_tokenizer(src))
        except Exception as e:
            raise YggError(f"cannot load the tokenizer of {src.spec}: {first_line(e)}") from e
    vd, vt = toks[0].get_vocab(), toks[1].get_vocab()
    if vd != vt:
        differ = len(set(vd.items()) ^ set(vt.items())) // 2 or abs(len(vd) - len(vt))
        raise YggError(
            f"draft ({draft.spec}) and target ({target.spec}) tokenizers differ "
            f"({len(vd)} vs {len(vt)} tokens, ~{differ} entries differ): speculative decoding needs one vocabulary"
        )
    return toks[1]


def _check_vocab(tokenizer, models: dict[str, ModelInfo], ui: Reporter) -> None:
    """Tokenizer ids past the target's embedding are noted, not refused: a tokenizer class can add a
    default special token the checkpoint never had (transformers' Qwen2 tokenizer adds
    <|endoftext|> as its pad token), which the model can never emit and HF `generate` runs beside
    all the same; a prompt holding one is refused in one line (`engine.check`). The drafter may lack
    some of the target's ids (padded embeddings differ between sizes of one family): those reach it
    as a stand-in (proposers.Drafter)."""
    target, draft = models["target"], models["draft"]
    tokens = len(tokenizer)
    if tokens > target.vocab_size:
        names = [t for t, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]) if i >= target.vocab_size]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        ui.note(f"the tokenizer has {tokens} tokens and the target {target.spec} embeds {target.vocab_size}: "
                f"{shown} (id {target.vocab_size}{'+' if len(names) > 1 else ''}) has no row, so the model never "
                "emits it, and a prompt that holds it is refused")
    if draft.vocab_size != target.vocab_size:
        ui.note(f"vocabularies: target {target.vocab_size} rows, draft {draft.vocab_size}, tokenizer {tokens} "
                "tokens; the target's ids the drafter lacks reach it as a stand-in")


def _weights(asked: str, src: sources.ModelSource, device: str, role: str = "target") -> str:
    """How a model's weights are held: "float" (the artifact's dtype) or "int8" ... "int2". auto, for a
    GGUF file on a CPU where the quantized kernel has a vector path (AVX-512 VNNI or AVX2: faster
    than the float dtype at every verify width, docs/measured.md): the target's file numbers
    exactly (int8: at most 8 bits, nothing requantized) and the drafter at 4 bits (int4: lossless
    all the same, it only proposes; its acceptance moved from 0.80 to 0.79 while its forward went
    from 14 to 10 ms); the float dtype otherwise (the portable path is ~25x slower). On the AVX2-only
    EPYC the 1.5B target's linears took 155 ms at one row in 8-bit codes and 79 ms in 4-bit against
    508 ms in float32 (the dtype `auto` gives there), 2123 against 3014 ms at 64 rows."""
    if asked.startswith("int") and not device.startswith("cpu"):
        raise YggError(f"--weights {asked} runs on CPUs only (the quantized kernel is CPU code): use --weights bf16 on {device}")
    if asked == "auto":
        fast = device.startswith("cpu") and native.qlinear_path() != "portable"
        return ("int4" if role == "draft" else "int8") if src.gguf is not None and fast else "float"
    return "float" if asked == "bf16" else asked


def _convert_model(src: sources.ModelSource, role: str, dtype: torch.dtype, out: Path, weights: str = "float",
             ui: Reporter | None = None) -> ModelInfo:
    try:
        hf = sources.load_model(src, dtype, ui.progress if ui else None)
    except Exception as e:
        raise YggError(f"cannot load the {role} model {src.spec}: {first_line(e)}") from e
    args, state = convert_state(hf, dtype)
    eos = _eos_ids(hf)
    del hf
    n_params = sum(t.numel() for k, t in state.items() if k != "inv_freq")
    info = WeightsInfo("float", "checkpoint")
    if weights != "float":
        label = f"quantizing the {role}'s weights ({weights})"
        report = (lambda done, total: ui.progress(label, done, total, unit="tensors")) if ui else None
        args, state, info = quantize.quantize_state(state, args, weights, src.gguf, report)
        if ui and info.fallbacks:
            ui.note(f"{role}: {quantize.fallbacks_line(info.fallbacks)} (each listed in plan.yaml)")
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    args.save(out / "config.json")
    del state
    gc.collect()
    return ModelInfo(
        spec=src.spec,
        source=src.kind,
        path=str((src.converted(dtype) or src.path).resolve()),  # a GGUF model's: where its conversion is cached
        sha256=src.sha256,
        arch=args.arch,
        parameters=n_params,
        layers=args.n_layers,
        vocab_size=args.vocab_size,
        max_position=args.max_position,
        eos_token_ids=sorted(eos),
        weights=info,
        gguf=str(src.gguf.resolve()) if src.gguf else None,
    )


def _load_runners(tmp: Path, device: str, cache_slots: int) -> dict:
    return {role: ModelRunner(load_model(tmp / role, device, invariant=role == "target"), cache_slots)
            for role in ("target", "draft")}


def _compile_forward(runners: dict, role: str, tmp: Path, phase, ui: Reporter, seconds: dict[str, float],
                     narrowest: dict[str, int]) -> None:
    """A model's forward compiled ahead of time into <role>/model.pt2; its runner uses it from here
    on, so profiling and calibration time the forwards `ygg run` will run."""
    label = f"compiling the {role}'s forward ahead of time (AOTInductor, widths 1..{MAX_WIDTH})"
    with phase("aot", label):
        report = lambda done, total: ui.progress(label, done, total, unit="stages")  # noqa: E731
        path = tmp / role / aot.PACKAGE
        compiled = aot.compile_model(runners[role].model, path, report)
        seconds[role], narrowest[role] = compiled.seconds, compiled.narrowest
        if compiled.reused:
            ui.note(f"{role}: the same graph was compiled before on this machine: its package reused from the cache")
        if narrowest[role] > 1:
            ui.note(f"{role}: export could not keep a one-row forward in the compiled graph; one-row forwards run eager")
        runners[role].compiled = CompiledForward(path, runners[role].model, narrowest[role])


def _static_trees(methods: dict[str, dict]) -> list[int]:
    """The verify width of each hand-set method, refusing a tree no compiled forward holds."""
    out = []
    for name, params in methods.items():
        n = proposers.params(name, params).step_shape().verify_width
        if n > MAX_WIDTH:
            raise YggError(f"{name}'s tree of {n} nodes is wider than the widest forward ({MAX_WIDTH}): make it smaller")
        out.append(n)
    return out


def _check_rows(target, max_context: int, methods: dict[str, dict], aot: bool, ui: Reporter) -> dict[str, ExactnessRecord]:
    """The target's row invariance (ygg_compile.invariance) at every width a generation can use:
    the profile's widths, and the verify of a static tree wider than them. For the compiled
    forwards and for the eager ones (`ygg run --eager`)."""
    widths = list(prof.plan_grid(max_context)[0])
    widths += [n for n in _static_trees(methods) if n > widths[-1]]  # these run at their own width
    widths = sorted(set(widths))
    kinds = (["compiled"] if aot else []) + ["eager"]
    out = {}
    compiled = target.compiled
    try:
        for kind in kinds:
            target.compiled = compiled if kind == "compiled" else None
            with ui.step(f"checking the target's row invariance ({kind} forwards, widths {widths[0]}..{widths[-1]})"):
                out[kind] = invariance.check(target, widths)
    finally:
        target.compiled = compiled
    return out


def _profiles(runners: dict, models: dict[str, ModelInfo], device: str, dtype: str, max_context: int, opts: CompileOptions,
              ui: Reporter) -> dict:
    """The plan's latency profile: each model's stored profile when one matches this machine,
    else measured now and stored (see ygg_compile.latency)."""
    widths, contexts = prof.plan_grid(max_context)
    root = Path(opts.profiles) if opts.profiles else prof.profiles_dir()
    found, files, checks = {}, {}, {}
    for role in ("target", "draft"):
        forward = "aot" if runners[role].compiled is not None else "eager"
        held = prof.weights_label(dtype, models[role])
        path = prof.profile_path(root, device, models[role], held, forward)
        stored, why = (None, "--reprofile") if opts.reprofile else prof.load_matching(
            path, models[role], held, device, forward, widths, contexts)
        if stored is not None:  # filed under this device's name: measured on this machine?
            with ui.step(f"spot-checking the stored {role} profile on this machine"):
                ok, checks[role] = prof.spot_check(runners[role], stored)
            if not ok:
                stored, why = None, f"the stored profile disagrees with this machine: {prof.spot_line(checks[role])}"
        measured = None  # what to (re)write: a new profile, or a stored one with batched forwards added
        if stored is None:
            ui.note(f"{role}: measuring its latency profile ({why})")
            label = f"measuring {role} T(W) at contexts {', '.join(map(str, contexts))}"
            with ui.step(label):
                report = lambda done, total, label=label: ui.progress(label, done, total, unit="rounds")  # noqa: E731
                measured = prof.measure(runners[role], widths, contexts, progress=report)
        else:
            ui.note(f"{role}: reusing the measured profile {path} (spot check: {prof.spot_line(checks[role])})")
            if "batch_ms" not in stored:  # a profile from before batched forwards were measured
                with ui.step(f"measuring {role} batched forwards (B = {', '.join(map(str, prof.BATCH_SEQUENCES))})"):
                    stored["batch_ms"] = prof.batch_times(runners[role], tuple(stored["widths"]),
                                                          prof.batch_context(stored["contexts"]))
                measured = {k: v for k, v in stored.items() if k not in ("format", "model", "dtype", "fingerprint", "measured")}
        if measured is not None:
            try:
                stored = prof.save(path, measured, models[role], held, device, forward)
            except OSError as e:
                raise YggError(f"cannot write the profile {path}: {e.strerror or e}") from e
        found[role], files[role] = stored, path.relative_to(root).as_posix()  # no builder's directories in the plan
    out = prof.combine(found["target"], found["draft"], widths, contexts)
    compiled = {f"{role}_widths": objective.undominated(out["widths"], out[f"{role}_ms"]) for role in ("target", "draft")}
    floor = runners["target"].min_width  # the target's forwards are never narrower (exactness)
    compiled["target_widths"] = [w for w in compiled["target_widths"] if w >= floor] or [out["widths"][-1]]
    for role in ("target", "draft"):  # calibration runs the forwards as `ygg run` will
        runners[role].widths = tuple(compiled[f"{role}_widths"])
    with ui.step("measuring this machine's roofline (read bandwidth, compute peak)"):
        out["roofline"] = roofline.section(runners)
    return out | compiled | {"files": files, "spot_checks": checks}


def _stage_plan(runners: dict, codec: TextCodec, prompts: list[str], egt: EGTParams, profile: Profile, tmp: Path,
                quick: bool, ui: Reporter) -> dict:
    """egt's stage order, searched on the real models (ygg_compile.stage_order)."""
    if not egt.depth and egt.depth_policy is None:
        return {"chosen": dict(stage_order.PLAIN), "why": "plain: egt does not draft", "alternatives": []}
    n = 2 if quick else stage_order.PROMPTS
    ids = [codec.encode(p) for p in prompts]  # search times the first n that fit the context
    pred = DepthPredictor.load(tmp / egt.depth_policy.file) if egt.depth_policy is not None else None
    with ui.step(f"timing egt's stage orders: {len(stage_order.GRID)} alternatives"):  # its bar counts the prompts that fit
        return stage_order.search(runners["target"], runners["draft"], ids, egt, objective.Curves(profile), pred, ui, count=n)


def _plan_methods(calib, agreement, profile: Profile, opts: CompileOptions, use_predictor: bool,
                  tmp: Path) -> tuple[dict[str, Params], Planning]:
    """egt and sequoia parameters from calibration and the curves, with the candidates' table;
    egt's depth predictor trained and saved into `tmp` when it beats egt's fixed depth."""
    curves = objective.Curves(profile)
    verify_widths, draft_widths = tuple(profile.compiled_widths("target")), tuple(profile.compiled_widths("draft"))
    context = int(statistics.median(s.context for s in calib.steps)) if calib.steps else profile.contexts[0]
    accept = calibrate.acceptance_map(calib)
    ranks = calib.rank_acceptance()
    verify = tuple(w for w in verify_widths if w <= calibrate.PROBE_VERIFY) or verify_widths[:1]
    little = "too little calibration data (use more --calib prompts or --calib-tokens)"
    egt, egt_rows, report = {"depth": 0}, [], {"used": False, "why": little if use_predictor else "--no-predictor"}
    fit, adapt = {"strength": None, "why": little}, None
    if calib.steps:
        replays = calibrate.replay_all(calib, curves, accept, verify, draft_widths)
        egt, egt_rows = calibrate.plan_egt(replays, accept, verify)
        fit = calibrate.fit_strength(calib, replays, egt["draft_width"])
        if fit["strength"] is not None:  # the request's acceptance estimate, egt's prior reach for it
            adapt = {"strength": fit["strength"], "weight": fit["weight"], "half_life": fit["half_life"]}
            egt["adapt"] = adapt | {"reach_strength": fit["reach_strength"], "reach_weight": fit["reach_weight"],
                                    "policy": calibrate.reach_policy(calib, replays, egt["draft_width"])}
        if use_predictor:
            trained = predictor_training.train(calib, agreement) if agreement is not None else None
            if trained is not None:
                policy, report = predictor_training.plan_policy(trained, calib, agreement, replays, curves, egt, verify)
                report |= trained.metrics
                if not report["used"]:
                    report["why"] = (f"not {predictor_training.MIN_GAIN}× the fixed depth's speed-up on held-out prompts"
                                     + ("; used anyway: --force-predictor" if opts.force_predictor else ""))
                if report["used"] or opts.force_predictor:
                    predictor_training.save(trained, tmp / predictor_training.FILE)
                    egt["depth_policy"] = policy
                    report["used"] = True
    seq, seq_rows = calibrate.plan_sequoia(ranks, curves, verify_widths, context)
    # retrieval: values measured on the target's continuations, the adjacency table seeded with them
    graft = calibrate.graft_values(calib)
    graft.table.save(tmp / ADJACENCY_FILE)
    egt["graft"] = graft.values | {"file": ADJACENCY_FILE}
    methods = {**opts.methods, "sequoia": seq, "egt": egt}
    if "pld" in methods:
        methods["pld"] = methods["pld"] | {"verify_widths": list(verify_widths), "graft": egt["graft"]}
        if adapt is not None:
            methods["pld"]["adapt"] = adapt
    planning = {"context": context, "rank_acceptance": [round(x, 4) for x in ranks], "egt": egt_rows,
                "predictor": report, "sequoia": seq_rows, "adapt": fit,
                "graft": {"labelled_tokens": graft.tries, "target_tokens": graft.hits,
                          "adjacency_rows": len(graft.table.rows)}}
    return {name: proposers.params(name, values) for name, values in methods.items()}, Planning.from_dict(planning)


def _eos_ids(hf) -> set[int]:
    ids: set[int] = set()
    for value in (hf.config.eos_token_id, getattr(hf.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def _write_tokenizer(tokenizer, target: sources.ModelSource, tmp: Path) -> TokenizerInfo:
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        if not (Path(d) / "tokenizer.json").exists():
            raise YggError(f"the tokenizer of {target.spec} has no fast (tokenizer.json) form")
        shutil.copy(Path(d) / "tokenizer.json", tmp / "tokenizer.json")
    fast = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    for probe in TOKENIZER_PROBES:
        if fast.encode(probe).ids != tokenizer(probe)["input_ids"]:
            raise YggError(f"the tokenizer of {target.spec} does not round-trip through tokenizer.json")
    prefix = suffix = None
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": CHAT_PROBE}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(CHAT_PROBE) == 1:
            prefix, suffix = rendered.split(CHAT_PROBE)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return TokenizerInfo("tokenizer.json", prefix, suffix, eos)


def _version() -> str:
    try:
        return version("yggdrasil")
    except PackageNotFoundError:
        return "dev"
