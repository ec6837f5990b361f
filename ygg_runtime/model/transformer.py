"""One decoder for the Llama family (Llama 1/2/3, Mistral, Qwen2/2.5, SmolLM), gpt-fast style.

Every forward takes explicit token positions, the cache slots to write and what each row sees (its
sequence's prefix and its tree window: `Ops.attention`), and the cache itself as an input, so the
same code runs plain decoding, a prefill, a draft level of a token tree or a whole tree
verification of several sequences, over a cache of any size. RoPE frequencies come precomputed
from the checkpoint converter, so every static RoPE variant (default, linear, llama3, yarn) is the
same code here. The modules hold the weights; what a forward computes with them are the ops of the
device they are on (`ygg_runtime.backend`): the decoder never asks which device that is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from ygg_runtime import backend
from ygg_runtime.backend.ops import Ops
from ygg_runtime.model.kv import KVCache, LayerKV
from ygg_runtime.model.quant import QEmbedding, QLinear


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    qkv_bias: bool = False
    tie_embeddings: bool = False
    rope_attention_scaling: float = 1.0
    max_position: int = 4096
    arch: str = "llama"
    # Rows of the output head: 0, the whole vocabulary; fewer, a drafter's head cut to the tokens
    # it may propose (`head_ids` maps each row to its token id; `ygg_compile.draft_vocab`).
    head_rows: int = 0

    @classmethod
    def load(cls, path: Path) -> "ModelArgs":
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """What one position costs the KV cache, every layer's key and value, at `itemsize` bytes
        a number."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


class RMSNorm(nn.Module):
    """Its weight and epsilon; the norm itself is the backend's (`Ops.rmsnorm`: float32 norm, cast,
    weight, exactly as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.layer = a.n_heads, a.n_kv_heads, a.head_dim, layer
        qkv_out = (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
        self.wqkv = nn.Linear(a.dim, qkv_out, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, h: Tensor, x: Tensor, rope: tuple[Tensor, Tensor], view: "View", ops: Ops) -> Tensor:
        """x + the attention of its normed h."""
        b, w, _ = h.shape
        q, k, v = ops.qkv(h, self.wqkv, rope, self.n_heads, self.n_kv_heads, self.head_dim)
        # writes k, v to the cache's slots, then attends (each row independently of the rows beside it)
        y = ops.attention(q, k, v, view.cache, self.layer, view.slots, view.lo, view.hi, view.tree)
        return ops.linear(y.transpose(1, 2).reshape(b, w, self.n_heads * self.head_dim), self.wo, x)


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(a.dim, 2 * a.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)

    def forward(self, h: Tensor, x: Tensor, ops: Ops) -> Tensor:
        """x + w2(silu(gate) · up) of its normed h."""
        return ops.linear(ops.gated(h, self.w13), self.w2, x)


class View(NamedTuple):
    """Where a forward's rows go in the cache and what each sees (`Ops.attention`)."""

    cache: Tensor  # [layers, 2, kv_heads, slots, head_dim]
    slots: Tensor  # [W] the cache slot each row's key and value are written to
    lo: Tensor  # [W] a row sees slots [lo, hi): its sequence's committed prefix
    hi: Tensor  # [W]
    tree: Tensor  # [W, T] bool: and slot hi + j where set (its tree window)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a, layer)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], view: View, ops: Ops) -> Tensor:
        x = self.attention(ops.rmsnorm(x, self.attention_norm), x, rope, view, ops)
        return self.feed_forward(ops.rmsnorm(x, self.ffn_norm), x, ops)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        # Drawn as nn.Embedding draws it, but not on the meta device (`from_state`, whose weights
        # replace it): normal_ there imports torch._dynamo, ~2.5 s of every `ygg` process's start.
        weight = torch.empty(a.vocab_size, a.dim)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim, _weight=weight)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.head_rows or a.vocab_size, bias=False)
        if a.tie_embeddings and not a.head_rows:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", torch.zeros(a.head_dim // 2), persistent=True)
        # the token id of each head row, when the head covers part of the vocabulary
        if a.head_rows:
            self.register_buffer("head_ids", torch.zeros(a.head_rows, dtype=torch.long))
        else:
            self.head_ids: Tensor | None = None
        self.max_len = 0
        self.kv: KVCache | None = None  # not a buffer: the forward takes its tensor as an input
        self._ops: Ops | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (quantized layers keep their own storage types)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def setup_cache(self, max_len: int) -> None:
        """Allocate the static, slot-addressed KV cache of every layer: `max_len` slots (its
        pages are only touched as rows are written)."""
        self.max_len = max_len
        a = self.args
        self.kv = KVCache(a.n_layers, max_len, a.n_kv_heads, a.head_dim, self.dtype, self.device)

    def caches(self) -> list[LayerKV]:
        """Every layer's keys and values (views of the cache)."""
        assert self.kv is not None, "call Transformer.setup_cache first"
        return self.kv.layers()

    @property
    def ops(self) -> Ops:
        """The ops its forward runs: its device's (`backend.for_device`), unless set (tests run the
        CUDA ops on CPU tensors under Triton's interpreter)."""
        return self._ops if self._ops is not None else backend.for_device(self.device)

    @ops.setter
    def ops(self, ops: Ops | None) -> None:
        self._ops = ops

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, lo: Tensor, hi: Tensor, tree: Tensor,
                cache: Tensor, heads: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """tokens [1, W], positions [W], slots [W] (cache rows to write), lo and hi [W], tree [W, T]
        (row i sees slots [lo_i, hi_i) and hi_i + j where tree[i, j]), cache (the KV cache's
        tensor, `kv.KVCache.data`, written in place), heads [H] (optional): the rows whose logits are
        wanted. Returns float32 logits [1, H, head rows] (every row's when heads is None; the
        vocabulary, or the tokens of `head_ids`) and the final (normed) hidden states [1, W, dim],
        which the depth predictor reads. A prompt's rows need no logits: the output head is about
        a sixth of a 1.5B model's multiply-adds per row."""
        ops = self.ops
        x = ops.embed(tokens, self.tok_embeddings)
        rope = ops.rope(positions, self.inv_freq, self.args.rope_attention_scaling, x.dtype)
        view = View(cache, slots, lo, hi, tree)
        for layer in self.layers:
            x = layer(x, rope, view, ops)
        h = ops.rmsnorm(x, self.norm)
        return ops.logits(h, self.output, heads), h


def from_state(args: ModelArgs, state: dict[str, Tensor], where: str = "the state dict") -> Transformer:
    """A model whose parameters are `state`'s tensors themselves (built on the meta device, so no
    memory is allocated twice), the head tied to the embeddings where the model ties them. A layer
    whose weights the state holds as codes (`ygg_runtime.model.quant`: "<layer>.data" tiles for a linear,
    "<layer>.codes" rows for an embedding) is built quantized."""
    with torch.device("meta"):
        model = Transformer(args)
        dtype = state["norm.weight"].dtype if "norm.weight" in state else torch.float32
        for name, module in list(model.named_modules()):
            if name + ".codes" in state and isinstance(module, nn.Embedding) and not args.tie_embeddings:
                model.set_submodule(name, QEmbedding.like(state, name + ".", args.dim, dtype))
            elif name + ".data" in state and isinstance(module, nn.Linear):
                model.set_submodule(name, QLinear.like(state, name + "."))
            elif name + ".codes" in state or name + ".data" in state:
                raise ValueError(f"{where} holds {name} as codes, which this model cannot take")
    missing = set(model.state_dict()) - set(state)
    model.load_state_dict(state, assign=True, strict=False)
    if args.tie_embeddings and not args.head_rows:
        model.output.weight = model.tok_embeddings.weight
        missing.discard("output.weight")
    if missing or "inv_freq" not in state:
        raise ValueError(f"weights in {where} lack {sorted(missing) or ['inv_freq']}")
    return model.eval().requires_grad_(False)


def load_model(directory: Path, device: str | torch.device = "cpu", invariant: bool = True) -> Transformer:
    """Load a converted model (config.json + model.safetensors) without unpickling anything, each
    tensor where its device's ops keep what every forward streams (`Ops.place`: on a CPU, huge
    pages). invariant=False: a drafter, whose rows need not keep their bits across widths
    (`backend.for_device`)."""
    directory = Path(directory)
    args = ModelArgs.load(directory / "config.json")
    ops = backend.for_device(device, invariant)
    state = {name: ops.place(t) for name, t in load_file(str(directory / "model.safetensors"), device=str(device)).items()}
    model = from_state(args, state, str(directory))
    if not invariant:
        model.ops = ops
    return model
