"""The tools users already have, on the same models, prompts and token budget: Hugging Face
`generate` plain (`hf`), with the draft model as assistant (`hf-assisted`, transformers' default
assistant schedule) and with prompt lookup (`hf-pld`, no draft model).

Timing matches ours (`Metrics.tpot_ms`: decode time per generated token, prompt processing
excluded): a streamer timestamps every chunk generate emits; the first chunk comes out of the
forward that also read the prompt, so TPOT is the time from the first chunk to the last over the
tokens after the first chunk. Tokens per target forward = tokens / chunks (one chunk per forward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ygg_compile.sources import quiet_transformers
from ygg_runtime.errors import YggError, first_line

PEERS = ("hf", "hf-assisted", "hf-pld")
PLD_TOKENS = 10  # prompt_lookup_num_tokens, the value transformers' documentation uses


@dataclass
class PeerRun:
    tokens: list[int]
    tpot_ms: float
    wall_s: float
    prefill_s: float  # until the first chunk
    chunks: int  # target forwards

    @property
    def mean_accepted_length(self) -> float:
        return len(self.tokens) / max(1, self.chunks)


class _Clock:
    """A transformers streamer that only records when each chunk of tokens arrived."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []  # (time, tokens in the chunk)
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:  # generate hands the prompt over first
            self._prompt_seen = True
            return
        self.marks.append((now, int(value.numel())))

    def end(self) -> None:
        pass


class HFPeers:
    """The target (and, for `hf-assisted`, the drafter) loaded by transformers, ready to generate."""

    def __init__(self, target_dir: Path, draft_dir: Path | None, dtype: torch.dtype, device: str, eos_ids: list[int]):
        quiet_transformers()
        from transformers import AutoModelForCausalLM

        def load(path: Path):
            try:
                return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            except Exception as e:
                raise YggError(f"peers: cannot load {path} with transformers: {first_line(e)}") from e

        self.target = load(target_dir)
        self.draft = load(draft_dir) if draft_dir is not None else None
        self.device = device
        self.eos_ids = list(eos_ids)
        self.pad_id = self.eos_ids[0] if self.eos_ids else 0  # one prompt per call: padding never shows

    def config(self, peer: str, max_new_tokens: int, temperature: float, top_p: float):
        """A clean generation config: the checkpoint's own defaults (a repetition penalty, top-k)
        would change what is generated and make the comparison with the target's output unfair."""
        from transformers import GenerationConfig

        kw: dict = dict(max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kw.update(do_sample=False)
        if peer == "hf-pld":
            kw["prompt_lookup_num_tokens"] = PLD_TOKENS
        return GenerationConfig(**kw)

    @torch.inference_mode()
    def generate(self, peer: str, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> PeerRun:
        if peer not in PEERS:
            raise YggError(f"unknown peer '{peer}' (choose from {', '.join(PEERS)})")
        extra = {}
        if peer == "hf-assisted":
            if self.draft is None:
                raise YggError("peer hf-assisted needs the draft model")
            self.draft.generation_config = self.config("hf", max_new_tokens, temperature, top_p)
            extra["assistant_model"] = self.draft
        cfg = self.config(peer, max_new_tokens, temperature, top_p)
        self.target.generation_config = cfg
        if seed is not None:
            torch.manual_seed(seed)
        x = torch.tensor([ids], device=self.device)
        clock = _Clock()
        start = time.perf_counter()
        out = self.target.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg, streamer=clock, **extra)
        end = time.perf_counter()
        tokens = out[0, len(ids):].tolist()
        if not clock.marks:
            return PeerRun(tokens, 1000.0 * (end - start) / max(1, len(tokens)), end - start, end - start, 0)
        first_t, first_n = clock.marks[0]
        rest = len(tokens) - first_n
        last_t = clock.marks[-1][0]
        tpot = 1000.0 * (last_t - first_t) / rest if rest > 0 else 1000.0 * (first_t - start) / max(1, first_n)
        return PeerRun(tokens, tpot, end - start, first_t - start, len(clock.marks))
