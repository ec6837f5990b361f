"""Yggdrasil's thin runtime: load a compiled artifact and decode with it.

    import ygg_runtime
    dec = ygg_runtime.load("artifacts/default")
    print(dec.generate("Write a haiku about trees", max_new_tokens=64).text)

Imports torch, safetensors, tokenizers and pyyaml only: never transformers, scikit-learn or
ygg_compile. `load`, `Decoder` and `Result` are imported on first use (PEP 562), so that importing a
light module of this package (`errors`, `options`, `plan`) does not import torch: the command line
refuses bad input before it loads anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ygg_runtime.errors import YggError

if TYPE_CHECKING:
    from ygg_runtime.artifact.load import load
    from ygg_runtime.decoding.decoder import Decoder, Result

__all__ = ["load", "Decoder", "Result", "YggError"]


def __getattr__(name: str) -> Any:
    if name == "load":
        from ygg_runtime.artifact.load import load

        return load
    if name in ("Decoder", "Result"):
        from ygg_runtime.decoding import decoder

        return getattr(decoder, name)
    raise AttributeError(f"module 'ygg_runtime' has no attribute {name!r}")
