"""The models a user may name (`--draft`, `--target`): the packaged aliases (registry.yaml), a local
checkpoint directory, a .gguf file or a Hub id. Light (yaml, no torch): an unknown name is refused in
one line before anything heavy loads; `ygg_compile.sources` finds and converts what it names."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ygg_runtime.errors import YggError

REGISTRY = yaml.safe_load((Path(__file__).parent / "registry.yaml").read_text())
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_kind(spec: str) -> str:
    """"alias", "directory", "gguf" or "hub": what `spec` names, from the name alone (a directory's
    and a file's contents are checked when the model is located); YggError when it names none."""
    path = Path(spec).expanduser()
    if spec in REGISTRY:
        return "alias"
    if path.is_dir():
        return "directory"
    if path.suffix == ".gguf":
        return "gguf"
    if HUB_ID.match(spec) and not path.exists():
        return "hub"
    raise YggError(
        f"unknown model '{spec}': not a packaged alias ({', '.join(REGISTRY)}), "
        "a local model directory, a .gguf file or a Hugging Face Hub id"
    )
