"""plan.yaml as types: what `ygg compile` decided and measured, read by everything else as attributes.

The file is the artifact's contract (docs/design.md, "The artifact"): compile builds a `Plan` and
writes it with `to_yaml`; `ygg run`, bench and inspect read it with `from_yaml`, which refuses, in
one line, a plan of another format version or one that lacks a field or holds a value of the wrong
kind. Typed all the way down: `methods` holds each method's `Params` (`ygg_runtime.schema.params`),
`profile` the measured latency curves (`Profile`, which `objective.Curves` reads), `planning`
compile's tables of what it weighed (`Planning`, shown by `ygg inspect`). Nothing outside this
module and `ygg_runtime.schema.params` reads the plan by string keys (a test holds it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ygg_runtime.errors import YggError, first_line
from ygg_runtime.machine import CPUInfo, GPUInfo
from ygg_runtime.options import SAMPLING, SAMPLINGS
from ygg_runtime.schema.params import Params, Stages, parse
from ygg_runtime.schema.typed import RECOMPILE, build, plain

# 2: profiles, calibration, egt/sequoia plans; 3: depth predictor; 4: AOT forwards, sha256 checks;
# 5: the row-invariant attention kernel and the exactness check; 6: retrieval (egt's graft, pld,
# the seeded adjacency table); 7: quantized weights (`ModelInfo.weights`, ygg::qlinear), one native
# library for every kernel; 8: qlinear's segmented tile records (each part of a fused layer in its
# own format, float16 factors, activations per super-block), the roofline in the profile; 9: the
# compiled forward takes the rows whose logits are wanted (a prompt's rows skip the output head);
# 10: the KV cache is an input of the compiled forward, and rows see a prefix range and a tree window
FORMAT_VERSION = 10
PLAN_FILE = "plan.yaml"  # in the artifact's directory


def plan_bytes(directory: Path, expect_plan: str | None = None) -> bytes:
    """plan.yaml's bytes, refusing a directory that is not an artifact and, with expect_plan (a plan
    sha256), any other plan. Light on purpose: the command line calls it before it imports torch."""
    directory = Path(directory)
    if not directory.is_dir():
        raise YggError(f"artifact directory {directory} does not exist (run `ygg compile` first)")
    path = directory / PLAN_FILE
    if not path.is_file():
        raise YggError(f"{directory} is not a Yggdrasil artifact: it has no {PLAN_FILE}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise YggError(f"cannot read {path}: {e.strerror or e}") from e
    if expect_plan is not None:
        expected = expect_plan.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", expected):
            raise YggError(f"--expect-plan takes a 64-digit hex sha256 (as `ygg compile` prints it), not {expect_plan!r}")
        found = hashlib.sha256(raw).hexdigest()
        if found != expected:
            raise YggError(f"{path} has sha256 {found}, not the expected {expected}: this is not the artifact "
                           "you pinned; refusing to load it")
    return raw


@dataclass
class WeightsInfo:
    """How a model's weights are held: in the artifact's float dtype, or as integer codes
    (`ygg_runtime.model.quant`) that the native kernel multiplies."""
    kind: str  # "float" (the plan's dtype) or "int4" / "int8" (codes, at most that many bits)
    numbers: str  # "checkpoint": as converted; "gguf": the file's own quantization; "quantized": by compile (lossy)
    formats: dict[str, int] = field(default_factory=dict)  # stored format -> tensors ("Q4_K 4-bit": 113)
    fallbacks: list[str] = field(default_factory=list)  # tensors not held as the file has them, and what they became
    bytes: int = 0  # of the quantized tensors
    max_rel_error: float = 0.0  # decoded codes against the converted checkpoint: max |Δ| / max |w|


@dataclass
class ModelInfo:
    spec: str  # what the user named: alias, directory, .gguf or Hub id
    source: str  # how it was found: package, local, gguf, hub
    path: str  # the checkpoint directory it came from; a GGUF model's cached conversion, which may
    # be absent (`ygg bench` converts it again for its transformers peers)
    sha256: str
    arch: str
    parameters: int
    layers: int
    vocab_size: int
    max_position: int
    eos_token_ids: list[int]
    weights: WeightsInfo = field(default_factory=lambda: WeightsInfo("float", "checkpoint"))
    gguf: str | None = None  # the GGUF file it came from (llama.cpp, a peer in `ygg bench`, reads it)


@dataclass
class AOTInfo:
    """The ahead-of-time compiled forwards: one package per model, every width min_width..max_width."""
    package: str
    max_width: int
    seconds: dict[str, float]
    isa: str | None
    cpu_flags: list[str]  # what the compiled code needs of a CPU (`integrity.check_machine`)
    # the narrowest width compiled: 1, or 2 where export could only specialise away one row (a
    # one-row forward then runs eager); per model
    min_width: dict[str, int] = field(default_factory=dict)


@dataclass
class KernelInfo:
    """The native kernels' library (`ygg_runtime.backend.native`) copied into the artifact."""
    file: str
    isa: str | None
    cpu_flags: list[str]


@dataclass
class TritonKernels:
    """The CUDA backend's kernels as compiled for the artifact's GPU (Triton's cache, in the artifact)."""
    directory: str
    triton_version: str


@dataclass
class ExactnessRecord:
    """The compile-time row-invariance check of one forward kind (`ygg_compile.invariance`)."""
    min_width: int | None  # every target forward is padded to it; None: no width agreed
    widths: list[int]
    agree: dict[int, bool]
    max_abs_logit_diff: dict[int, float]
    contexts: list[int]
    threads: int
    seconds: float


@dataclass
class CalibrationInfo:
    source: str
    prompts: int
    tokens: int
    steps: int
    seconds: float
    probe_tokens_per_step: float


@dataclass
class TokenizerInfo:
    file: str
    chat_prefix: str | None
    chat_suffix: str | None
    eos_token_ids: list[int]


@dataclass
class FileEntry:
    sha256: str
    bytes: int


@dataclass
class Roofs:
    """This machine's two roofs, measured at compile (`ygg_compile.roofline`)."""
    bandwidth: float  # bytes per second, streaming reads on the torch threads
    int8_peak: float  # int8 multiply-adds per second on the torch threads
    threads: int

    def as_dict(self) -> dict:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


@dataclass
class Costs:
    """What one model's forward must move and compute (`ygg_compile.roofline.model_costs`)."""
    weight_bytes: int  # read by every forward (embedding table excluded)
    kv_bytes_per_token: int  # cache bytes one attended position costs, all layers
    macs_per_row: int  # of the linear layers, head included
    quantized: bool  # the linears run on int8 dot products (else: floats, memory roof only)

    def bytes(self, context: int) -> int:
        return self.weight_bytes + self.kv_bytes_per_token * context


@dataclass
class Roofline:
    roofs: Roofs
    target: Costs | None = None
    draft: Costs | None = None


@dataclass
class BatchFactors:
    """f(B, c, n) / T(n): a forward over B sequences against one sequence's (`ygg_compile.latency.batch_factors`)."""
    sequences: list[int]
    widths: list[int]
    factors: list[list[float | None]]  # [B][width]; None: not measured (n < B)


@dataclass
class Profile:
    """The measured forward times the objective prices steps with (`objective.Curves`), per model:
    ms[context][width] at the profile's widths and contexts."""
    widths: list[int]
    contexts: list[int]
    target_ms: list[list[float]]
    draft_ms: list[list[float]] = field(default_factory=list)  # none without a drafter
    other_ms: list[float] = field(default_factory=list)  # a step's CPU work around a verify, per width
    threads: int = 1
    repeats: int = 1
    target_batch: BatchFactors | None = None  # None: measured before batching was (factor 1)
    draft_batch: BatchFactors | None = None
    target_widths: list[int] = field(default_factory=list)  # each model's compiled widths (empty: all)
    draft_widths: list[int] = field(default_factory=list)
    roofline: Roofline | None = None  # off the CPU, none
    files: dict[str, str] = field(default_factory=dict)  # the stored per-model profiles it came from, under the store
    spot_checks: dict[str, Any] = field(default_factory=dict)  # a stored profile's spot check on this machine

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> "Profile":
        return build(cls, data, where, "", "")

    def ms(self, role: str) -> list[list[float]]:
        return self.target_ms if role == "target" else self.draft_ms

    def compiled_widths(self, role: str) -> list[int]:
        return (self.target_widths if role == "target" else self.draft_widths) or self.widths

    def batch(self, role: str) -> BatchFactors | None:
        return self.target_batch if role == "target" else self.draft_batch


@dataclass
class EGTCandidate:
    """One fixed egt shape, replayed on the calibration steps (`ygg_compile.calibrate.plan_egt`)."""
    depth: int
    draft_width: int
    tokens_per_step: float
    step_ms: float
    speedup: float
    verify_width: int


@dataclass
class SequoiaCandidate:
    """One Sequoia tree of a node budget and depth, timed by the objective."""
    budget: int
    depth: int
    expected_accepted: float
    speedup: float


@dataclass
class HeadReport:
    """One head of the depth predictor on held-out prompts: P(accepted length >= depth)."""
    depth: int
    positives: float
    auc: float | None  # None: one class only
    brier: float


@dataclass
class PredictorReport:
    """Whether egt's depth predictor is used, why, and how it did on held-out prompts (the rest is
    None when none was trained)."""
    used: bool
    why: str | None = None
    draft_width: int | None = None
    validation_speedup: float | None = None
    fixed_validation_speedup: float | None = None
    validation_steps: int | None = None
    depths: dict[int, int] | None = None  # depth -> held-out steps it was picked at
    by_draft_width: dict[int, float] | None = None  # modelled speed-up per draft width
    heads: list[HeadReport] | None = None
    depth_mae: float | None = None
    baseline_depth_mae: float | None = None
    label_top: int | None = None
    label_probe_corr: float | None = None
    rows: int | None = None
    prompts: int | None = None
    folds: int | None = None
    alpha: float | None = None


@dataclass
class StageAlternative:
    """One order of egt's drafter stages, timed on calibration prompts (`ygg_compile.stage_order`)."""
    tail: str
    head: str
    stage_ms: dict[str, float]
    step_ms: float
    tokens_per_step: float
    head_hit_rate: float
    ms_per_token: float
    measured_ms_per_token: float


@dataclass
class StagesReport:
    chosen: Stages
    why: str
    prompts: int = 0
    tokens: int = 0
    alternatives: list[StageAlternative] = field(default_factory=list)


@dataclass
class GraftReport:
    labelled_tokens: int  # retrieved tokens labelled along the target's continuations
    target_tokens: int  # of them, the target's own next token
    adjacency_rows: int  # tokens the seeded adjacency table holds successors for


@dataclass
class AdaptReport:
    """How compile fitted the request's acceptance estimate (`ygg_compile.calibrate.fit_strength`)."""
    strength: float | None  # the prior's strength in expected acceptances (None: too little calibration)
    weight: float = 1.0  # the robust prior's weight on that strength (the rest: one acceptance's)
    half_life: float | None = None  # steps over which evidence keeps half its weight
    tries: int = 0  # held-out tries it was scored on
    folds: int = 0
    loglik_per_try: dict[str, float] = field(default_factory=dict)  # by strength tried, at the fitted weight
    weight_loglik_per_try: dict[str, float] = field(default_factory=dict)  # by weight tried, at the fitted strength
    prior_loglik_per_try: float | None = None  # calibration's prices alone, no estimate
    reach_strength: float | None = None  # the reach's prior strength
    reach_weight: float = 1.0  # the robust prior's weight on it (the rest: one try's)
    reach_tries: int = 0
    reach_loglik_per_try: dict[str, float] = field(default_factory=dict)
    reach_weight_loglik_per_try: dict[str, float] = field(default_factory=dict)
    prior_reach_loglik_per_try: float | None = None
    why: str | None = None  # why there is none


@dataclass
class DraftVocabCandidate:
    rows: int
    tokens_per_forward: float
    top1_agreement: float
    draft_ms: float
    chain_speedup: float


@dataclass
class DraftVocabReport:
    """The drafter's head: the rows kept of the vocabulary and why (`ygg_compile.draft_vocab`)."""
    rows: int
    vocab: int
    why: str
    candidates: list[DraftVocabCandidate] = field(default_factory=list)


@dataclass
class DraftWindow:
    """How much of the drafter's acceptance a window of the prompt keeps, measured at compile
    (`ygg_compile.calibrate.window_acceptance`): teacher-forced over a long text, the share of the
    last `positions` tokens at which the drafter's greedy guess is the target's, reading the last
    `windows[i]` tokens before them against reading the whole text. The runtime weighs a window's
    `kept` acceptance against the drafter's prefill it saves, per request (`Decoder.choose`)."""
    windows: list[int]
    kept: list[float]  # acceptance with that window / acceptance with the whole text
    acceptance: float  # the drafter's top-1 agreement with the target reading the whole text
    text_tokens: int  # the text's length: windows[i] < text_tokens - positions
    positions: int
    source: str  # what the text was
    seconds: float


@dataclass
class OutputLength:
    """How long the target's answers run, learnt from calibration: each calibration prompt's
    continuation up to its first end-of-sequence token (`ended` of the `answers` did end, after
    `tokens` answer tokens in all), the rest cut off at the `budget` calibration decodes. The
    runtime prices a request at its expected output rather than its budget
    (`objective.expected_tokens`): a drafter's prefill repays only over tokens actually made."""
    answers: int
    ended: int
    tokens: int  # answer tokens over all answers, each up to its end or to the budget
    budget: int  # new tokens calibration decodes per prompt: an answer that runs on is seen only so far


@dataclass
class Planning:
    """What compile weighed to choose the plan (`ygg inspect` shows it; nothing that decodes reads it)."""
    context: int  # the calibration steps' median context, where the candidates were timed
    rank_acceptance: list[float]  # P(the drafter's rank-r child is accepted)
    egt: list[EGTCandidate]
    sequoia: list[SequoiaCandidate]
    predictor: PredictorReport
    graft: GraftReport | None = None
    draft_vocab: DraftVocabReport | None = None
    stages: StagesReport | None = None
    adapt: AdaptReport | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str = "planning") -> "Planning":
        return build(cls, data, where, "", "")


@dataclass
class Plan:
    format_version: int
    yggdrasil_version: str
    created: str
    compile_seconds: float
    compile_phases: dict[str, float]
    quick: bool
    models: dict[str, ModelInfo]  # "target", "draft"
    device: str
    dtype: str
    torch_version: str
    cpu: CPUInfo
    max_context: int  # the longest prompt + generation served
    cache_slots: int  # the KV cache's length: max_context plus room for a step's tree
    aot: AOTInfo | None
    kernel: KernelInfo | None  # None: PyTorch's attention (on CUDA)
    exactness: dict[str, ExactnessRecord]  # by forward kind: "compiled", "eager"
    method: str  # the default method
    methods: dict[str, Params]
    profile: Profile
    calibration: CalibrationInfo
    planning: Planning
    tokenizer: TokenizerInfo
    files: dict[str, FileEntry] = field(default_factory=dict)
    # the rule a sampled generation uses unless told (`ygg_runtime.options.SAMPLINGS`); a plan from
    # before the field gets the default (nothing compiled depends on the rule)
    sampling: str = SAMPLING
    gpu: GPUInfo | None = None  # the GPU of a --device cuda artifact (None: a CPU artifact)
    # why the compile left out the compiled forwards it was asked for (this torch could not load them)
    aot_skipped: str | None = None
    # on CUDA: the directory of Triton kernels the compile compiled (`backend.gpu.compiling_into`) and
    # the Triton that compiled them; `ygg run` on that GPU kind with that Triton compiles nothing
    triton: TritonKernels | None = None
    # the acceptance a drafter keeps reading only a window of a long prompt (None: not measured, as
    # in plans from before it: the drafter reads every prompt whole)
    draft_window: DraftWindow | None = None
    # how long calibration's answers ran (None: not measured, as in plans from before it: a request
    # is priced at its whole budget)
    output_length: OutputLength | None = None

    def to_dict(self) -> dict:
        return plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> "Plan":
        """A plan from its mapping, refusing another format version or a malformed field in one line."""
        if not isinstance(data, dict) or "format_version" not in data:
            raise YggError(f"{where} is not a Yggdrasil plan (no format_version)")
        if data["format_version"] != FORMAT_VERSION:
            raise YggError(f"artifact format version {data['format_version']} is not supported by this runtime "
                           f"(it reads version {FORMAT_VERSION}): recompile with `ygg compile`")
        methods = data.get("methods")
        if not isinstance(methods, dict):
            raise YggError(f"{where}: `methods` should be a mapping, not {type(methods).__name__}{RECOMPILE}")
        plan = build(cls, data | {"methods": {}}, where)
        if plan.sampling not in SAMPLINGS:
            raise YggError(f"{where}: `sampling` should be one of {', '.join(SAMPLINGS)}, not {plan.sampling!r}{RECOMPILE}")
        plan.methods = {name: _method(name, values, where) for name, values in methods.items()}
        return plan

    @classmethod
    def from_yaml(cls, text: str, where: str = "plan.yaml") -> "Plan":
        """Parsed with YAML's safe loader: a tag that would construct an object is an error."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise YggError(f"{where} is corrupt: {first_line(e)}") from None
        return cls.from_dict(data, where)


def _method(name: str, values: Any, where: str) -> Params:
    """One method's parameters from the plan, refused in one line (and how to fix it) when wrong."""
    if not isinstance(values, dict):
        raise YggError(f"{where}: `methods.{name}` should be a mapping, not {type(values).__name__}{RECOMPILE}")
    try:
        return parse(name, values, f"{where}: method {name}")
    except YggError as e:
        raise YggError(f"{e}{RECOMPILE}") from None
