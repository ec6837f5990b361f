"""OpenVINO GenAI as `ygg bench` peers — the runtime Intel CPU users reach for: plain decoding
(`openvino`), speculative decoding with the same draft model (`openvino-sd`), prompt lookup
(`openvino-pld`), all on the target exported as an OpenVINO user would (optimum-intel's int4 default:
4-bit asymmetric in groups of 128, the embedding table and head 8-bit), and plain decoding on the very
GGUF file ours came from, read by GenAI itself (`openvino-gguf`).

OpenVINO lives in a venv of its own (`make install-openvino`: .venv-openvino, or
$YGG_OPENVINO_PYTHON): optimum-intel needs a transformers ours is not. Each model is exported once,
from the GGUF file's cached conversion, into the cache (`ygg cache ls`: kind `openvino`). The
speculative settings are tuned fairly, as our plan is: the draft length and the confidence threshold
(and prompt lookup's draft length) swept on our calibration prompts, once per machine, the fastest
kept (cached beside the target's IR).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from ygg_compile import sources
from ygg_compile.sources import SOURCE_FILE  # an export's record too (`ygg cache ls` shows it)
from ygg_compile.cache import KINDS
from ygg_compile.hardware import device_slug
from ygg_compile.prompts import CALIBRATION_PROMPTS, read_jsonl
from ygg_runtime.errors import YggError
from ygg_runtime.files import cache_dir, locked

CHILD = Path(__file__).with_name("openvino_child.py")
VENV = Path(__file__).resolve().parents[1] / ".venv-openvino"
MISSING = "peer {peer} needs OpenVINO GenAI in a venv of its own: make install-openvino (or set YGG_OPENVINO_PYTHON)"
WEIGHTS = "int4"  # optimum-cli's --weight-format: what an OpenVINO user exports a CPU model with

# The settings swept (each the whole GenerationConfig change): the draft length GenAI's samples use (5)
# and around it; its confidence-threshold mode (a draft stops below it); prompt lookup's draft length
# at max_ngram_size 3 (its samples'), up to ours (10, `peers.PLD_TOKENS`).
SWEEP = {
    "openvino-sd": [{"num_assistant_tokens": k} for k in (2, 3, 5, 7)]
                   + [{"assistant_confidence_threshold": t} for t in (0.2, 0.4, 0.6)],
    "openvino-pld": [{"num_assistant_tokens": k, "max_ngram_size": 3} for k in (2, 3, 5, 10)],
}
TUNE_PROMPTS = 4  # calibration prompts a setting is timed on (spread over the set's categories)
TUNE_TOKENS = 96


def python() -> Path | None:
    """The OpenVINO venv's interpreter, when installed."""
    given = os.environ.get("YGG_OPENVINO_PYTHON")
    path = Path(given) if given else VENV / "bin" / "python"
    return path if path.is_file() else None


def require(peer: str) -> Path:
    """The interpreter, or YggError in one line saying how to get it (before any work)."""
    found = python()
    if found is None:
        raise YggError(MISSING.format(peer=peer))
    return found


def ir_dir(sha: str) -> Path:
    return cache_dir() / KINDS["openvino"][0] / f"{sha[:32]}-{WEIGHTS}"


def export(model, dtype, ui=None) -> Path:
    """The model's OpenVINO IR (int4), exported once from its GGUF file's cached conversion (made
    again when cleared) with the OpenVINO venv's optimum-cli."""
    out = ir_dir(model.sha256)
    if (out / SOURCE_FILE).exists():
        return out
    with locked(out):
        if (out / SOURCE_FILE).exists():
            return out
        checkpoint = Path(model.path)
        if not (checkpoint / "config.json").exists():
            checkpoint = sources.resolve(model.gguf or model.spec, dtype=dtype).path
        cli = require("openvino").with_name("optimum-cli")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
        try:
            what = f"exporting {Path(model.gguf or model.spec).name} to OpenVINO IR ({WEIGHTS}; once, then cached)"
            with ui.step(what) if ui else contextlib.nullcontext():
                done = subprocess.run([str(cli), "export", "openvino", "--model", str(checkpoint), "--task",
                                       "text-generation-with-past", "--weight-format", WEIGHTS, str(tmp)],
                                      capture_output=True, text=True)
            if done.returncode != 0 or not (tmp / "openvino_model.xml").exists():
                last = next((x for x in reversed(done.stderr.splitlines()) if x.strip()), "no message")
                raise YggError(f"optimum-cli could not export {checkpoint} to OpenVINO IR: {last.strip()}")
            (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": model.gguf, "sha256": model.sha256,
                                                       "weights": weights_format(tmp)}))
            tmp.replace(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def weights_format(ir: Path) -> str:
    """What NNCF made of the weights, as its record in the IR says (e.g. 'int4_asym g128, embeddings
    and head int8_asym')."""
    text = (ir / "openvino_model.xml").read_text(errors="replace")
    tail = text[text.rfind("<weight_compression>"):] if "<weight_compression>" in text else ""

    def field(name: str) -> str | None:
        at = tail.find(f"<{name} value=\"")
        return tail[at + len(name) + 9 : tail.find('"', at + len(name) + 9)] if at >= 0 else None

    mode, group, backup = field("mode"), field("group_size"), field("backup_mode")
    if mode is None:
        return "as exported"
    return f"{mode} g{group}" + (f", embeddings and head {backup}" if backup else "")


def tuning_key(target_sha: str, draft_sha: str | None) -> str:
    """Settings are a machine's (its CPU, flags and torch's threads: `device_slug`) and a pair's."""
    raw = f"{device_slug('cpu')}|{target_sha}|{draft_sha}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def settings_text(settings: dict) -> str:
    """GenerationConfig changes as a user would type them: 'num_assistant_tokens=3'."""
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))


def best(times: dict[str, list[float]]) -> str:
    """The setting (a JSON key) with the lowest median ms a token over the tuning prompts; ties to
    the first swept."""
    return min(times, key=lambda k: statistics.median(times[k]))


def tune(peers: list[str], generate, encode, tuned: Path, key: str, ui=None) -> dict[str, dict]:
    """Each speculative peer's settings: swept on calibration prompts (`SWEEP`) the first time on this
    machine, then read back. generate(peer, ids, max_new_tokens, settings) -> ms a token. Returns
    {peer: {"settings": ..., "swept": {setting: median ms}}}."""
    known = json.loads(tuned.read_text()) if tuned.exists() else {}
    mine = known.get(key, {})
    todo = [p for p in peers if p in SWEEP and p not in mine]
    if todo:
        prompts = read_jsonl(CALIBRATION_PROMPTS)
        picked = [encode(p.text) for p in prompts[:: max(1, len(prompts) // TUNE_PROMPTS)][:TUNE_PROMPTS]]
        for peer in todo:
            times: dict[str, list[float]] = {}
            label = f"tuning {peer} on {len(picked)} calibration prompts ({len(SWEEP[peer])} settings, once on this machine)"
            with ui.step(label) if ui else contextlib.nullcontext():
                for count, settings in enumerate(SWEEP[peer], 1):
                    k = json.dumps(settings, sort_keys=True)
                    times[k] = [generate(peer, ids, TUNE_TOKENS, settings) for ids in picked]
                    if ui:
                        ui.progress(label, count, len(SWEEP[peer]), unit="settings")
            chosen = best(times)
            mine[peer] = {"settings": json.loads(chosen),
                          "swept": {settings_text(json.loads(k)): round(statistics.median(v), 2) for k, v in times.items()}}
        known[key] = mine
        tmp = tuned.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(tuned)
    return {p: mine[p] for p in peers if p in mine}
