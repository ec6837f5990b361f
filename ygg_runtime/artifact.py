"""Load and validate a compiled artifact directory (DESIGN.md §7). Nothing here unpickles."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from ygg_runtime.decoder import Decoder
from ygg_runtime.errors import YggError
from ygg_runtime.model import load_model
from ygg_runtime.predictor import DepthPredictor
from ygg_runtime.runner import ModelRunner
from ygg_runtime.text import TextCodec

FORMAT_VERSION = 3  # 2: multi-context profiles, calibration, egt and sequoia plans; 3: depth predictor
PLAN_FILE = "plan.yaml"
DEFAULT_DIR = Path("artifacts/default")


def read_plan(directory: Path) -> dict:
    """The plan of an artifact, refusing anything that is not a complete artifact of this format."""
    directory = Path(directory)
    if not directory.is_dir():
        raise YggError(f"artifact directory {directory} does not exist (run `ygg compile` first)")
    path = directory / PLAN_FILE
    if not path.is_file():
        raise YggError(f"{directory} is not a Yggdrasil artifact: it has no {PLAN_FILE}")
    try:
        plan = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise YggError(f"{path} is corrupt: {str(e).splitlines()[0]}") from e
    if not isinstance(plan, dict) or "format_version" not in plan:
        raise YggError(f"{path} is not a Yggdrasil plan (no format_version)")
    if plan["format_version"] != FORMAT_VERSION:
        raise YggError(
            f"artifact format version {plan['format_version']} is not supported by this runtime "
            f"(it reads version {FORMAT_VERSION}): recompile with `ygg compile`"
        )
    for rel, meta in plan.get("files", {}).items():
        f = directory / rel
        if not f.is_file():
            raise YggError(f"artifact file {rel} is missing from {directory}: recompile")
        if f.stat().st_size != meta["bytes"]:
            raise YggError(f"artifact file {rel} has changed since compile (size differs): recompile")
    return plan


def load(directory: str | Path = DEFAULT_DIR, device: str | None = None, predictor: bool = True) -> Decoder:
    """Load an artifact written by `ygg compile` into a ready Decoder; predictor=False leaves egt's
    depth predictor out (egt then keeps its planned fixed depth)."""
    directory = Path(directory)
    plan = read_plan(directory)
    device = device or plan["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise YggError(f"artifact was compiled for {plan['device']} but CUDA is not available here")
    max_len = int(plan["max_context"])
    target = ModelRunner(load_model(directory / "target", device), max_len)
    drafter = ModelRunner(load_model(directory / "draft", device), max_len) if (directory / "draft").is_dir() else None
    prof = plan.get("profile", {})
    target.widths = tuple(prof.get("target_widths", ()))
    if drafter is not None:
        drafter.widths = tuple(prof.get("draft_widths", ()))
    policy = plan["methods"].get("egt", {}).get("depth_policy")
    pred = DepthPredictor.load(directory / policy["file"]) if predictor and policy else None
    tok = plan["tokenizer"]
    codec = TextCodec(directory / tok["file"], tok.get("chat_prefix"), tok.get("chat_suffix"))
    return Decoder(
        target,
        drafter,
        codec,
        methods=plan["methods"],
        default_method=plan["method"],
        eos_ids=frozenset(tok.get("eos_token_ids", [])),
        info=plan,
        predictor=pred,
    )
