"""plan.yaml as types: what `ygg compile` decided and measured, read by everything else as attributes.

The file is the artifact's contract (docs/design.md, "The artifact"): compile builds a `Plan` and
writes it with `to_yaml`; `ygg run`, bench and inspect read it with `from_yaml`, which refuses, in
one line, a plan of another format version or one that lacks a field or holds a value of the wrong
kind. Three parts stay mappings on purpose: `methods` (each method's parameters, which its proposer
reads and validates), `profile` (the measured latency curves, `objective.Curves`) and `planning`
(compile's diagnostic tables, shown by `ygg inspect`, read by nothing that decodes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ygg_runtime.errors import YggError, first_line

# 2: profiles, calibration, egt/sequoia plans; 3: depth predictor; 4: AOT forwards, sha256 checks;
# 5: the row-invariant attention kernel and the exactness check; 6: retrieval (egt's graft, pld,
# the seeded adjacency table); 7: quantized weights (`ModelInfo.weights`, ygg::qlinear), one native
# library for every kernel; 8: qlinear's segmented tile records (each part of a fused layer in its
# own format, float16 factors, activations per super-block), the roofline in the profile
FORMAT_VERSION = 8
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
    (`ygg_runtime.quant`) that the native kernel multiplies."""
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
class CPUInfo:
    model: str
    threads: int
    isa: list[str]  # vector instruction flags of the compiling CPU (what /proc/cpuinfo lists)


@dataclass
class AOTInfo:
    """The ahead-of-time compiled forwards: one package per model, every width 1..max_width."""
    package: str
    max_width: int
    seconds: dict[str, float]
    isa: str | None
    cpu_flags: list[str]  # what the compiled code needs of a CPU (`integrity.check_machine`)


@dataclass
class KernelInfo:
    """The native kernels' library (`ygg_runtime.kernels`) copied into the artifact."""
    file: str
    isa: str | None
    cpu_flags: list[str]


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
    methods: dict[str, dict]
    profile: dict
    calibration: CalibrationInfo
    planning: dict
    tokenizer: TokenizerInfo
    files: dict[str, FileEntry] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
        return _build(cls, data, where, "")

    @classmethod
    def from_yaml(cls, text: str, where: str = "plan.yaml") -> "Plan":
        """Parsed with YAML's safe loader: a tag that would construct an object is an error."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise YggError(f"{where} is corrupt: {first_line(e)}") from None
        return cls.from_dict(data, where)


def _build(tp: Any, value: Any, where: str, path: str) -> Any:
    """`value` checked against the annotation `tp` and built into it (dataclasses recursively).
    Keys a dataclass does not declare are ignored: a plan of this format written by an older
    build may carry a field since dropped."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _bad(where, path, "a mapping", value)
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            sub = f"{path}.{f.name}" if path else f.name
            if f.name not in value:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise YggError(f"{where} lacks `{sub}`: recompile with `ygg compile`")
            kwargs[f.name] = _build(hints[f.name], value[f.name], where, sub)
        return tp(**kwargs)
    if tp is dict or origin is dict:  # a bare dict is kept as it is (methods, profile, planning)
        if not isinstance(value, dict):
            _bad(where, path, "a mapping", value)
        if not args:
            return value
        return {_build(args[0], k, where, f"{path}.{k}"): _build(args[1], v, where, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            _bad(where, path, "a list", value)
        return [_build(args[0], v, where, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _bad(where, path, "a number", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _bad(where, path, "an integer", value)
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            _bad(where, path, f"a {tp.__name__}", value)
        return value
    raise TypeError(f"plan field {path} has an annotation {tp!r} the reader does not know")


def _bad(where: str, path: str, kind: str, value: Any) -> typing.NoReturn:
    raise YggError(f"{where}: `{path}` should be {kind}, not {type(value).__name__}: recompile with `ygg compile`")
