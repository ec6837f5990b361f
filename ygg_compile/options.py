"""What a user chooses when compiling: `ygg compile`'s options and their defaults, in one place for
the `ygg` command and the Python API (`ygg bench`'s are `ygg_bench.options`).

Imports nothing heavy (no torch): the command line builds its options from this module before it
loads anything, and each options type refuses bad values when it is made, so bad input is refused
at once, by the command line and the Python API alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ygg_runtime.errors import YggError
from ygg_runtime.options import DEFAULT_DIR, SAMPLING, check_sampling
from ygg_runtime.schema.plan import PLAN_FILE

WEIGHTS = ("bf16", "int8", "int4", "int3", "int2")  # what --weights takes besides "auto" (bf16: the artifact's dtype)
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # what --dtype takes (ygg_compile.hardware)


def check_output(out: Path) -> None:
    """An output directory may be new, empty or a previous artifact: anything else is the user's."""
    out = Path(out)
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / PLAN_FILE).exists()):
        raise YggError(f"refusing to overwrite {out}: it exists and is not a Yggdrasil artifact")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise YggError(f"unknown dtype '{dtype}' (use auto, float32, bfloat16 or float16)")


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise YggError(f"--limit must be at least 1, not {limit}")


@dataclass
class CompileOptions:
    draft: str
    target: str
    output: Path = DEFAULT_DIR
    device: str = "cpu"
    dtype: str = "auto"
    weights: str = "auto"  # auto, bf16 (the float dtype), int8, int4, int3 or int2: both models' (ygg_compile.quantize)
    draft_weights: str | None = None  # the drafter's, when it differs (None: as `weights`)
    draft_vocab: str = "auto"  # the drafter's head rows: a number, all, or auto (ygg_compile.draft_vocab)
    method: str = "egt"
    sampling: str = SAMPLING  # the artifact's rule at temperature > 0 (ygg_runtime.options.SAMPLINGS)
    # the hand-set methods' parameters that differ from their defaults, by method (the rest as
    # ygg_runtime.decoding.proposers.default_params has them)
    methods: dict[str, dict] = field(default_factory=dict)
    max_context: int | None = None  # longest prompt + generation; None: the target's own, as memory allows
    calib: Path | None = None  # calibration prompts (None: the shipped set)
    calib_tokens: int = 48  # new tokens per calibration prompt
    reprofile: bool = False  # measure T(W) even when a matching stored profile exists
    predictor: bool = True  # train egt's depth predictor (False: egt keeps one planned depth)
    force_predictor: bool = False  # use it even when it does not beat the fixed depth (ablation)
    aot: bool = True  # compile every forward ahead of time (False: `ygg run` runs the models eager)
    quick: bool = False  # a smaller plan, sooner: QUICK_PROMPTS calibration prompts, no depth predictor
    profiles: Path | None = None  # where profiles are kept (None: profile.profiles_dir())
    # plan from another compile's calibration (an artifact, or its calibration.safetensors) instead of
    # measuring one: acceptance is the pair's, the profiles are measured here (ygg_compile.calibration_file)
    calibration_from: Path | None = None

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_sampling(self.sampling)
        for flag, asked in (("--weights", self.weights), ("--draft-weights", self.draft_weights)):
            if asked is not None and asked not in ("auto", *WEIGHTS):
                raise YggError(f"{flag} must be auto, {', '.join(WEIGHTS)}, not '{asked}'")
        if self.calib_tokens < 1:
            raise YggError("--calib-tokens must be at least 1")
        if self.max_context is not None and self.max_context < 1:
            raise YggError(f"--max-context must be at least 1, not {self.max_context}")
        check_output(self.output)
