"""A compile's calibration kept in its artifact (`calibration.safetensors`), so that another compile
plans from it: `ygg compile --calibration-from ARTIFACT`.

Acceptance is a property of the model pair; T(W) is the device's. A CI job that builds one artifact
per GPU kind calibrates once and plans each device from the same statistics, re-measuring only the
profiles (and the row check); a GPU machine without the real weights plans for them with a random
model of their shapes. What is kept: every probe step (the drafted tree, the target's choices at
the verified nodes, the accepted length, the target's hidden state before it), the calibration texts
(prompts and the target's continuations: retrieval's values and the drafter's head cut are measured
on them), and the teacher-forced agreement the depth predictor learns from (hidden states and the
rank of the target's token among the drafter's). Hidden states are stored in the compile's dtype
(the model computed them in it: no bits are lost); a file without them (`save(..., hidden=False)`,
what the repository commits for the real pair) plans egt at a fixed depth, without a predictor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ygg_compile.calibrate import Agreement, Calibration, ProbeStep
from ygg_runtime.errors import YggError
from ygg_runtime.schema.plan import ModelInfo

FILE = "calibration.safetensors"  # in an artifact
FORMAT = 1


@dataclass
class Stored:
    """A calibration read back, and what it was measured on."""

    calib: Calibration
    agreement: Agreement | None  # None: kept without hidden states
    models: dict[str, dict]  # role -> spec, sha256, vocab_size, dim
    path: Path


def describe(models: dict[str, ModelInfo], dims: dict[str, int]) -> dict[str, dict]:
    """What a calibration records of the pair it was measured on (`Stored.models`)."""
    return {role: {"spec": m.spec, "sha256": m.sha256, "vocab_size": m.vocab_size, "dim": dims[role]}
            for role, m in models.items()}


def save(path: Path, calib: Calibration, agreement: Agreement | None, models: dict[str, dict], dtype: torch.dtype,
         hidden: bool = True) -> None:
    """Write the calibration of the pair `models` describes (`describe`); hidden=False: without
    hidden states or the agreement, a few MB."""
    hidden = hidden and agreement is not None
    tensors: dict[str, torch.Tensor] = {}
    with_hidden = [i for i, s in enumerate(calib.steps) if s.hidden is not None] if hidden else []
    if with_hidden:
        tensors["step_hidden"] = torch.stack([calib.steps[i].hidden for i in with_hidden]).to(dtype).contiguous()
    if hidden:
        tensors["agreement_hidden"] = agreement.hidden.to(dtype).contiguous()
        tensors["agreement_rank"] = agreement.rank.to(torch.int32).contiguous()
        tensors["agreement_prompt"] = torch.tensor(agreement.prompt, dtype=torch.int32)
        tensors["agreement_position"] = torch.tensor(agreement.position, dtype=torch.int32)
    meta = {
        "format": FORMAT,
        "models": models,
        "prompts": calib.prompts, "tokens": calib.tokens, "seconds": calib.seconds,
        "texts": {str(k): v for k, v in calib.texts.items()},
        "prompt_lengths": {str(k): v for k, v in calib.prompt_lengths.items()},
        "steps": [{"parents": s.parents, "tokens": s.tokens, "probs": s.probs,
                   "children": {str(k): v for k, v in s.children.items()},
                   "argmax": {str(k): v for k, v in s.argmax.items()}, "accepted": s.accepted, "context": s.context,
                   "prompt": s.prompt} for s in calib.steps],
        "hidden_steps": with_hidden,
        "agreement_ends": {str(k): v for k, v in agreement.ends.items()} if hidden else None,
    }
    if not tensors:  # safetensors wants at least one tensor
        tensors["none"] = torch.zeros(1)
    tmp = path.with_name(path.name + ".part")
    save_file(tensors, str(tmp), metadata={"calibration": json.dumps(meta, separators=(",", ":"))})
    tmp.replace(path)


def load(path: Path) -> Stored:
    """A calibration written by `save`, from the file or from an artifact directory holding one;
    anything else is refused in one line."""
    path = Path(path)
    file = path / FILE if path.is_dir() else path
    if not file.is_file():
        raise YggError(f"--calibration-from {path}: no {FILE} there (an artifact compiled before calibrations were "
                       "kept: recompile it, or name a calibration file)")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("calibration", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError, ValueError) as e:
        raise YggError(f"--calibration-from {file}: cannot read it ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise YggError(f"--calibration-from {file}: not a calibration of this version (format {FORMAT})")
    try:
        return _stored(meta, tensors, file)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise YggError(f"--calibration-from {file}: a damaged calibration ({type(e).__name__}: {e})") from None


def _stored(meta: dict, tensors: dict[str, torch.Tensor], file: Path) -> Stored:
    hidden = dict(zip(meta["hidden_steps"], tensors["step_hidden"].float())) if "step_hidden" in tensors else {}
    steps = [ProbeStep(s["parents"], s["tokens"], s["probs"], {int(k): v for k, v in s["children"].items()},
                       {int(k): v for k, v in s["argmax"].items()}, s["accepted"], s["context"], s["prompt"],
                       hidden.get(i)) for i, s in enumerate(meta["steps"])]
    calib = Calibration(steps, meta["prompts"], meta["tokens"], meta["seconds"],
                        {int(k): v for k, v in meta["texts"].items()},
                        {int(k): v for k, v in meta["prompt_lengths"].items()})
    agreement = None
    if "agreement_hidden" in tensors:
        agreement = Agreement(tensors["agreement_hidden"].float(), tensors["agreement_rank"].long(),
                              tensors["agreement_prompt"].tolist(), tensors["agreement_position"].tolist(),
                              {int(k): v for k, v in meta["agreement_ends"].items()})
    return Stored(calib, agreement, meta["models"], file)


def check_fits(stored: Stored, models: dict[str, ModelInfo], dims: dict[str, int]) -> list[str]:
    """Refuse a calibration this pair cannot be planned from (token ids past its vocabulary); the
    notes to print otherwise: another pair's statistics (planned from all the same, as asked), or
    hidden states of another width (the depth predictor is then left out)."""
    vocab = models["target"].vocab_size
    past = max((t for s in stored.calib.steps for t in s.tokens), default=0)
    past = max([past] + [t for text in stored.calib.texts.values() for t in text])
    if past >= vocab:
        raise YggError(f"--calibration-from {stored.path}: it holds token id {past}, past the target's vocabulary of "
                       f"{vocab}: a calibration of another tokenizer cannot plan this pair")
    notes = []
    theirs = stored.models
    if any(theirs.get(role, {}).get("sha256") != m.sha256 for role, m in models.items()):
        pair = " -> ".join(theirs.get(r, {}).get("spec", "?") for r in ("draft", "target"))
        notes.append(f"calibration from another pair ({pair}): this plan assumes its acceptance")
    if stored.agreement is None:
        notes.append("the calibration holds no hidden states: egt plans one fixed depth, without a depth predictor")
    elif theirs.get("target", {}).get("dim") != dims["target"]:
        notes.append(f"the calibration's hidden states are {theirs['target'].get('dim')} wide and this target's "
                     f"{dims['target']}: egt plans one fixed depth, without a depth predictor")
        stored.agreement = None
        for s in stored.calib.steps:
            s.hidden = None
    return notes


def slim(source: Path, out: Path) -> None:
    """A copy of an artifact's (or a file's) calibration without hidden states: the few MB the
    repository keeps for a pair (`python -m ygg_compile.calibration_file ARTIFACT OUT`)."""
    stored = load(source)
    save(out, stored.calib, None, stored.models, torch.float32, hidden=False)


if __name__ == "__main__":
    import sys

    slim(Path(sys.argv[1]), Path(sys.argv[2]))
