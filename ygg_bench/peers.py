"""The tools users already have, on the same models, prompts and token budget: Hugging Face
`generate` plain (`hf`), with the draft model as assistant (`hf-assisted`, transformers' default
assistant schedule) and with prompt lookup (`hf-pld`, no draft model); llama.cpp through
llama-cpp-python on the very GGUF file the target came from, with the same threads (`llama.cpp`),
and with the binding's one speculative mode, prompt lookup (`llama.cpp-pld`).

Timing is ours (`metrics.tpot_ms`, the one definition: from the first output token to the last,
over the tokens after the first): a streamer timestamps every chunk generate emits (llama.cpp: every
token); the first chunk comes out of the forward that also read the prompt. Tokens per target
forward = tokens / chunks (one chunk per forward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ygg_bench.options import HF_PEERS, LLAMA_PEERS
from ygg_compile.sources import quiet_transformers
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.machine import cpu_flags
from ygg_runtime.decoding.metrics import tpot_ms

# ggml's build switches by the /proc/cpuinfo flag that says the CPU has it
GGML_FLAGS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
              "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
              "avx512vbmi": "GGML_AVX512_VBMI", "avx_vnni": "GGML_AVX_VNNI"}
REBUILD_LLAMA = "rm .venv/.installed-llama && .venv/bin/pip uninstall -y llama-cpp-python && make install-llama"


def llama_cmake_args(flags: set[str]) -> str:
    """CMAKE_ARGS that `make install-llama` builds llama.cpp (llama-cpp-python 0.3.36) with on a CPU
    with these flags: none (ggml's native detection) unless the CPU has AMX. There ggml repacks
    Q4_K/Q6_K for its AMX backend and dies in the first decode (SIGSEGV, in a process that imports
    nothing of ours); its AMX switches alone do not turn that off (native detection wins), so native
    detection goes off, the CPU's vector extensions are named one by one, and AMX is off. The build
    then runs ggml's CPU repack path (q4_K_8x8) with AVX-512 VNNI/BF16 where the CPU has them."""
    if "amx_tile" not in flags:
        return ""
    on = [f"-D{switch}=ON" for flag, switch in GGML_FLAGS.items() if flag in flags]
    return " ".join(["-DGGML_NATIVE=OFF", *on, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


LLAMA_MISSING = ("peer llama.cpp needs llama-cpp-python: pip install -e '.[llama]' "
                 "(it builds llama.cpp from source, a few minutes)")
PLD_TOKENS = 10  # prompt_lookup_num_tokens, the value transformers' documentation uses


def llama_gguf(plan, peer: str, modules: tuple[str, ...], missing: str) -> Path:
    """The target's GGUF file, which a llama.cpp peer reads; YggError in one line when that peer
    cannot run here (no GGUF file, not a CPU, or `modules` not installed: `missing` says how)."""
    import importlib.util

    target = plan.models["target"]
    if not target.gguf or not Path(target.gguf).is_file():
        raise YggError(f"peer {peer} reads GGUF files, and this artifact's target ({target.spec}) "
                       + ("came from a checkpoint directory" if not target.gguf else f"was compiled from {target.gguf}, which is gone"))
    if plan.device != "cpu":
        raise YggError(f"peer {peer} is measured on CPUs only here (llama-cpp-python's CPU build)")
    if any(importlib.util.find_spec(m) is None for m in modules):
        raise YggError(missing)
    return Path(target.gguf)


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

    def config(self, peer: str, max_new_tokens: int, temperature: float, top_p: float, ignore_eos: bool = False):
        """A clean generation config: the checkpoint's own defaults (a repetition penalty, top-k)
        would change what is generated and make the comparison with the target's output unfair.
        ignore_eos: no end-of-sequence token, so every run generates max_new_tokens."""
        from transformers import GenerationConfig

        eos = None if ignore_eos else self.eos_ids or None
        kw: dict = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=self.pad_id)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kw.update(do_sample=False)
        if peer == "hf-pld":
            kw["prompt_lookup_num_tokens"] = PLD_TOKENS
        return GenerationConfig(**kw)

    @torch.inference_mode()
    def generate(self, peer: str, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False) -> PeerRun:
        if peer not in HF_PEERS:
            raise YggError(f"unknown peer '{peer}' (choose from {', '.join(HF_PEERS)})")
        extra = {}
        if peer == "hf-assisted":
            if self.draft is None:
                raise YggError("peer hf-assisted needs the draft model")
            self.draft.generation_config = self.config("hf", max_new_tokens, temperature, top_p, ignore_eos)
            extra["assistant_model"] = self.draft
        cfg = self.config(peer, max_new_tokens, temperature, top_p, ignore_eos)
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
        first_t, last_t = clock.marks[0][0], clock.marks[-1][0]
        return PeerRun(tokens, tpot_ms(start, first_t, last_t, len(tokens)), end - start, first_t - start, len(clock.marks))


class LlamaCppPeers:
    """The target's GGUF file loaded by llama.cpp (llama-cpp-python), plain and with prompt lookup.

    Prompts arrive as our token ids (chat template applied), so both tools read the same tokens.
    Greedy is llama.cpp's own argmax sampler (temperature 0); no repetition penalty, no top-k/min-p
    truncation. TPOT as for the other peers: from the first generated token (which the prompt's
    evaluation produced) to the last. Target forwards are counted by wrapping the binding's `eval`.
    """

    def __init__(self, gguf: Path, threads: int, n_ctx: int, eos_ids: list[int]):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise YggError(LLAMA_MISSING) from None
        self._make = lambda **kw: Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                        n_batch=512, verbose=False, **kw)
        self.gguf, self.threads, self.eos_ids = gguf, threads, set(eos_ids)
        self._models: dict[str, object] = {}

    def model(self, peer: str):
        if peer not in self._models:
            kw = {}
            if peer == "llama.cpp-pld":
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS)
                # speculation keeps every row's logits; the binding sizes that buffer from this
                # argument (n_batch rows without it: a prompt over 512 tokens overflows it)
                kw["logits_all"] = True
            try:
                self._models[peer] = self._make(**kw)
            except Exception as e:
                raise YggError(f"peer {peer}: llama.cpp cannot load {self.gguf}: {first_line(e)}") from e
        return self._models[peer]

    def generate(self, peer: str, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False) -> PeerRun:
        if peer not in LLAMA_PEERS:
            raise YggError(f"unknown peer '{peer}' (choose from {', '.join(LLAMA_PEERS)})")
        llm = self.model(peer)
        if seed is not None:
            llm.set_seed(seed)
        evals = 0
        original = llm.eval

        def counted(tokens):
            nonlocal evals
            evals += 1
            return original(tokens)

        llm.eval = counted
        # Forget the last prompt: llama.cpp reuses the longest prefix its cache shares with the new
        # one, and a prompt repeated in the next round would be read from there (a 4k-token prompt's
        # second round: 0.1 s against 95 s), while ours keeps only the chat template's system turn.
        llm.reset()
        tokens, marks = [], []
        start = time.perf_counter()
        try:
            for tok in llm.generate(ids, temp=temperature, top_p=top_p if temperature > 0 else 1.0, top_k=0, min_p=0.0,
                                    typical_p=1.0, repeat_penalty=1.0, reset=True):
                marks.append(time.perf_counter())
                tokens.append(int(tok))
                if (tok in self.eos_ids and not ignore_eos) or len(tokens) >= max_new_tokens:
                    break
        finally:
            llm.eval = original
        end = time.perf_counter()
        if not marks:
            return PeerRun(tokens, 0.0, end - start, end - start, max(1, evals - 1))
        # the first eval read the prompt and gave the first token; the others are decode forwards
        return PeerRun(tokens, tpot_ms(start, marks[0], marks[-1], len(tokens)), end - start, marks[0] - start, max(1, evals))


if __name__ == "__main__":  # `python -m ygg_bench.peers --cmake-args`: what make install-llama builds with
    import sys

    if sys.argv[1:] != ["--cmake-args"]:
        sys.exit("usage: python -m ygg_bench.peers --cmake-args")
    print(llama_cmake_args(cpu_flags()))
