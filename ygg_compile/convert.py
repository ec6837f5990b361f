"""Convert a transformers Llama-family model into the runtime's weights (ygg_runtime/model/transformer.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ygg_runtime.errors import YggError
from ygg_runtime.model.transformer import ModelArgs, Transformer, from_state

SUPPORTED = ("llama", "mistral", "qwen2")


def model_args(config) -> ModelArgs:
    arch = config.model_type
    if arch not in SUPPORTED:
        raise YggError(f"model type '{arch}' is not supported (supported: {', '.join(SUPPORTED)})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise YggError(f"activation '{config.hidden_act}' is not supported (only silu)")
    if getattr(config, "mlp_bias", False) or (arch == "llama" and getattr(config, "attention_bias", False)):
        raise YggError("Llama checkpoints with attention/MLP output biases are not supported")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        raise YggError(f"RoPE type '{rope['rope_type']}' depends on the sequence length and is not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    max_position = config.max_position_embeddings
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window:
        max_position = min(max_position, window)  # full attention equals the window inside it
    return ModelArgs(
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        qkv_bias=arch == "qwen2",
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position=max_position,
        arch=arch,
    )


def convert_state(hf_model, dtype: torch.dtype) -> tuple[ModelArgs, dict[str, Tensor]]:
    """Our state dict from a loaded transformers model: fused qkv and gate/up, our names, RoPE
    inverse frequencies (and their attention scaling) taken from the model's own rotary module."""
    args = model_args(hf_model.config)
    rotary = hf_model.model.rotary_emb
    args = replace(args, rope_attention_scaling=float(rotary.attention_scaling))
    sd = hf_model.state_dict()
    out: dict[str, Tensor] = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "inv_freq": rotary.inv_freq.float().clone(),
    }
    if not args.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(args.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        out[q + "attention.wqkv.weight"] = torch.cat([sd[att + f"{n}_proj.weight"] for n in "qkv"])
        if args.qkv_bias:
            out[q + "attention.wqkv.bias"] = torch.cat([sd[att + f"{n}_proj.bias"] for n in "qkv"])
        out[q + "attention.wo.weight"] = sd[att + "o_proj.weight"]
        mlp = p + "mlp."
        out[q + "feed_forward.w13.weight"] = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
        out[q + "feed_forward.w2.weight"] = sd[mlp + "down_proj.weight"]
        out[q + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    out = {k: (v if k == "inv_freq" else v.to(dtype)).contiguous() for k, v in out.items()}
    return args, out


def to_runtime(hf_model, dtype: torch.dtype = torch.float32) -> Transformer:
    """An in-memory runtime model from a transformers model (tests and calibration use this)."""
    return from_state(*convert_state(hf_model, dtype))
