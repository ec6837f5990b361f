"""The step loop: propose a tree, verify it in one target forward, accept, compact, repeat."""

from __future__ import annotations

import time
from typing import Callable

import torch

from ygg_runtime.accept import Verdict, accept_greedy, accept_sampling, warp
from ygg_runtime.errors import YggError
from ygg_runtime.metrics import Metrics
from ygg_runtime.proposers import Proposer, Sampling, StepState
from ygg_runtime.runner import ModelRunner, fit_width
from ygg_runtime.tree import TokenTree


def step_room(target: ModelRunner, proposer: Proposer) -> int:
    """Cache slots a step needs past the sequence: the largest tree, padded to a compiled width
    and at least to the target's min_width."""
    return fit_width(max(proposer.max_tree_size, target.min_width), target.widths)


def generate(
    target: ModelRunner,
    proposer: Proposer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_ids: frozenset[int] = frozenset(),
    on_tokens: Callable[[list[int]], None] | None = None,
    on_step: Callable[[TokenTree, Verdict], None] | None = None,
) -> tuple[list[int], Metrics]:
    """Decode up to max_new_tokens after `prompt` (stopping after an eos id); returns the new
    tokens and the metrics. Greedy when temperature == 0, else lossless sampling from the target's
    distribution at that temperature and top_p. on_step sees every verified tree and its verdict
    (`ygg inspect` draws one)."""
    if not prompt:
        raise YggError("the prompt is empty")
    if max_new_tokens < 1:
        raise YggError("--max-new-tokens must be at least 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise YggError("temperature must be >= 0 and top-p in (0, 1]")
    room = step_room(target, proposer)
    if len(prompt) + max_new_tokens + room > target.max_len:
        raise YggError(
            f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens does not fit the context of "
            f"{target.max_len - room} tokens; shorten the prompt or lower --max-new-tokens"
        )
    sampling = None
    if temperature > 0:
        gen = torch.Generator(device=target.device)  # private: the caller's generators stay as they were
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        sampling = Sampling(temperature, top_p, gen)

    m = Metrics(method=proposer.name, prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    target.reset()
    proposer.reset()
    target.prefill(prompt[:-1])
    proposer.prefill(prompt[:-1])
    state = StepState(target.hidden[-1] if target.hidden is not None else None)
    t1 = time.perf_counter()
    m.prefill_s = t1 - t0

    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        ts = time.perf_counter()
        tree = proposer.propose(seq, state, sampling)
        td = time.perf_counter()
        logits = target.forward(tree.tokens, list(range(len(tree))), tree.depths, tree.ancestor_mask(), tree.verify_width)
        tv = time.perf_counter()
        if sampling is None:
            verdict = accept_greedy(tree, logits)
        else:
            verdict = accept_sampling(tree, warp(logits, temperature, top_p), sampling.generator)
        if on_step is not None:
            on_step(tree, verdict)
        target.commit(verdict.path)
        info = proposer.update(tree, verdict)
        m.ahead_hits += info.ahead_hit
        m.retrieval_s += info.retrieval_s
        state = StepState(target.hidden[verdict.path[-1]])
        new = [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]
        new = new[: max_new_tokens - len(out)]
        stop = next((i for i, t in enumerate(new) if t in eos_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        # The metrics describe the output: drafted tokens the budget or an eos cut are not counted.
        kept = min(verdict.accepted, len(new))
        tried = kept + bool(tree.children[verdict.path[kept]]) if kept == verdict.accepted else kept
        m.record_step(len(tree) - 1, kept, len(new), tried, max(tree.depths))
        m.record_sources(tree.sources[1:], [tree.sources[v] for v in verdict.path[1 : kept + 1]])
        seq += new
        out += new
        if on_tokens is not None:
            on_tokens(new)
        te = time.perf_counter()
        m.draft_s += td - ts
        m.verify_s += tv - td
        m.other_s += te - tv
        if stop is not None:
            break
    m.decode_s = time.perf_counter() - t1
    m.generated_tokens = len(out)
    return out, m
