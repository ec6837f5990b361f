"""Yggdrasil's thin runtime: load a compiled artifact and decode with it.

    import ygg_runtime
    dec = ygg_runtime.load("artifacts/default")
    print(dec.generate("Write a haiku about trees", max_new_tokens=64).text)

Imports torch, safetensors, tokenizers and pyyaml only: never transformers, scikit-learn or
ygg_compile.
"""

from ygg_runtime.artifact import load
from ygg_runtime.decoder import Decoder, Result
from ygg_runtime.errors import YggError

__all__ = ["load", "Decoder", "Result", "YggError"]
