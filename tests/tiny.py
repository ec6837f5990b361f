"""Tiny random-weight Llama-family models and a byte-level tokenizer, built in seconds."""

from __future__ import annotations

from pathlib import Path

import torch

BYTE_VOCAB = 256 + 2  # every byte, then <s> and </s>


def hf_config(arch: str, vocab_size: int = BYTE_VOCAB, **over):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,  # peaked logits: greedy near-ties would make equality tests flaky
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    common.update(over)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    return cls(**common)


def hf_model(arch: str, seed: int, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch, **over)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def noised(model, scale: float, seed: int):
    """A copy of `model` with relative gaussian noise on every weight: a drafter that mostly agrees."""
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return m


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: ids 0..255 are bytes, 256 <s>, 257 </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab["<s>"], vocab["</s>"] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte, which ByteLevel pre-tokenizers use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def set_eos(model, eos_token_id: int | None = 257) -> None:
    """The model's eos in its config and its generation config (257: the byte tokenizer's </s>)."""
    model.config.eos_token_id = eos_token_id
    model.generation_config.eos_token_id = eos_token_id


def save_pair_dir(path: Path, model, tokenizer, eos_token_id: int | None = 257) -> Path:
    """A local HF model directory (config, safetensors, tokenizer) as a user would have it."""
    path.mkdir(parents=True, exist_ok=True)
    set_eos(model, eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
