"""Load and validate a compiled artifact directory (DESIGN.md §7). Nothing here unpickles."""

from __future__ import annotations

from pathlib import Path

import yaml

from ygg_runtime.compiled import CompiledForward
from ygg_runtime.decoder import Decoder
from ygg_runtime.errors import YggError, first_line
from ygg_runtime import kernels
from ygg_runtime.integrity import check_machine, verify_files
from ygg_runtime.model import load_model
from ygg_runtime.predictor import DepthPredictor
from ygg_runtime.runner import ModelRunner
from ygg_runtime.text import TextCodec

FORMAT_VERSION = 5  # 2: profiles, calibration, egt/sequoia plans; 3: depth predictor; 4: AOT forwards, sha256 checks;
# 5: the row-invariant attention kernel and the exactness check
PLAN_FILE = "plan.yaml"
DEFAULT_DIR = Path("artifacts/default")


def read_plan(directory: Path) -> dict:
    """The plan of an artifact, refusing anything that is not a complete, unchanged artifact of
    this format."""
    directory = Path(directory)
    if not directory.is_dir():
        raise YggError(f"artifact directory {directory} does not exist (run `ygg compile` first)")
    path = directory / PLAN_FILE
    if not path.is_file():
        raise YggError(f"{directory} is not a Yggdrasil artifact: it has no {PLAN_FILE}")
    try:
        plan = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise YggError(f"{path} is corrupt: {first_line(e)}") from e
    if not isinstance(plan, dict) or "format_version" not in plan:
        raise YggError(f"{path} is not a Yggdrasil plan (no format_version)")
    if plan["format_version"] != FORMAT_VERSION:
        raise YggError(
            f"artifact format version {plan['format_version']} is not supported by this runtime "
            f"(it reads version {FORMAT_VERSION}): recompile with `ygg compile`"
        )
    verify_files(directory, plan.get("files", {}))
    return plan


def load(directory: str | Path = DEFAULT_DIR, device: str | None = None, predictor: bool = True,
         eager: bool = False, dtype: str | None = None) -> Decoder:
    """Load an artifact written by `ygg compile` into a ready Decoder. Its compiled forwards are
    used unless eager=True; predictor=False leaves egt's depth predictor out (egt then keeps its
    planned fixed depth); device and dtype, when given, must be the artifact's."""
    directory = Path(directory)
    plan = read_plan(directory)
    device = device or plan["device"]
    aot = None if eager else plan.get("aot")
    check_machine(plan, device, dtype, compiled=aot is not None)
    if plan.get("kernel"):
        kernels.load(directory / plan["kernel"]["file"])
    runners = {}
    for role in ("target", "draft"):
        if not (directory / role).is_dir():
            continue
        runner = runners[role] = ModelRunner(load_model(directory / role, device), int(plan["cache_slots"]))
        runner.widths = tuple(plan.get("profile", {}).get(f"{role}_widths", ()))
        if aot is not None:
            runner.compiled = CompiledForward(directory / role / aot["package"], runner.model)
    policy = plan["methods"].get("egt", {}).get("depth_policy")
    pred = DepthPredictor.load(directory / policy["file"]) if predictor and policy else None
    tok = plan["tokenizer"]
    codec = TextCodec(directory / tok["file"], tok.get("chat_prefix"), tok.get("chat_suffix"))
    forwards = ("compiled ahead of time" if aot is not None else
                "eager (--eager)" if eager and plan.get("aot") else "eager (the artifact has no compiled forwards)")
    return Decoder(
        runners["target"],
        runners.get("draft"),
        codec,
        methods=plan["methods"],
        default_method=plan["method"],
        eos_ids=frozenset(tok.get("eos_token_ids", [])),
        info=plan | {"forwards": forwards},
        predictor=pred,
    )
