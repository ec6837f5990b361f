"""The step loop: propose a tree, verify it in one target forward, accept, compact, repeat."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from ygg_runtime.decoding.accept import Verdict, accept_coupled, accept_greedy, accept_sampling, warp
from ygg_runtime.decoding import estimate
from ygg_runtime.decoding.coupling import Noise
from ygg_runtime.errors import YggError
from ygg_runtime.decoding.metrics import Metrics, Step
from ygg_runtime.options import SAMPLING
from ygg_runtime.decoding.proposers import Proposer, Sampling, StepState
from ygg_runtime.model.runner import Call, ModelRunner
from ygg_runtime.transfer import Stopwatch, to_host
from ygg_runtime.decoding.tree import TokenTree


def step_room(target: ModelRunner, proposer: Proposer) -> int:
    """Cache slots a step needs past the sequence: the largest tree, padded to a compiled width
    and at least to the target's min_width."""
    return target.padded(proposer.max_tree_size)


class Generation:
    """One sequence's decoding, a step at a time: what `generate` loops over alone and what
    `ygg_runtime.decoding.batch` steps together with other sequences (one target forward verifying every
    sequence's tree). `propose` drafts a tree; the caller runs the target over it (`call`), or over
    the part of it the batch's allocation kept (`tree`, whose `origin` maps into the proposed one);
    `accept` takes the logits, commits, hands the proposer its verdict in the numbering of the tree
    it proposed, and returns the new tokens. Greedy when temperature == 0, else lossless sampling
    from the target's distribution at that temperature and top_p, by the `sampling` rule
    (`ygg_runtime.options.SAMPLINGS`): coupled gives `ar`'s tokens for the same seed."""

    def __init__(self, target: ModelRunner, proposer: Proposer, prompt: list[int], *, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 sampling: str = SAMPLING, eos_ids: frozenset[int] = frozenset(),
                 on_step: Callable[[TokenTree, Verdict], None] | None = None,
                 on_event: Callable[[Step], None] | None = None, context: int | None = None, adapt: bool = True):
        """context: the slots the sequence may come to hold (a batch's member, whose region grows
        as it goes: what the batch checked); None: the target runner's. adapt: keep the request's
        acceptance estimate, which reshapes every step of a method that adapts (`--no-adapt`: off).
        The settings come checked from where the request entered (`RunOptions`, the server's request
        check); what depends on this runner and proposer is checked here (`check`)."""
        check(target, proposer, prompt, max_new_tokens, context)
        self.target, self.proposer, self.prompt = target, proposer, prompt
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.eos_ids, self.on_step, self.on_event = eos_ids, on_step, on_event
        self.sampling = None
        if temperature > 0 and sampling == "coupled":
            self.sampling = Sampling(temperature, top_p, noise=Noise(seed))
        elif temperature > 0:
            gen = torch.Generator(device=target.device)  # private: the caller's generators stay as they were
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed(seed)
            self.sampling = Sampling(temperature, top_p, gen)
        rule = "greedy" if self.sampling is None else self.sampling.rule
        self.metrics = Metrics(method=proposer.name, prompt_tokens=len(prompt), sampling=rule)
        self.estimate = estimate.of(proposer.params) if adapt else None  # this request's acceptance, step by step
        self.seq, self.out = list(prompt), []
        self.hidden: Tensor | None = None  # the target's at the last accepted position
        self.extra: list[float] | None = None  # what the proposer read with the last verdict (`Verdict.extra`)
        self.sequences = 1  # sequences sharing the step's forwards (a batch sets it before each step)
        self.done = False
        self.proposed: TokenTree | None = None  # the tree the proposer built this step
        self.tree: TokenTree | None = None  # the tree the step verifies: the proposed one, or part of it
        self._t0 = self._t1 = self._ts = self._td = 0.0

    def prefill(self) -> None:
        """Run the prompt (all but its last token, the first root) through both models."""
        self.begin_prefill()
        self.target.prefill(self.owed())
        self.end_prefill()

    # A batch prefills in chunks that share its forwards (`ygg_runtime.decoding.batch`): begin, run what is
    # owed a chunk at a time (committing each), end. `prefill` is the same three alone. A batch
    # that preempted the generation (its cache rows taken back) prefills it again the same way:
    # its "prompt" is then all it has, prompt and output so far, and it goes on as before.

    def begin_prefill(self) -> None:
        """Start the prompt: forget the last sequence, take the prefix cache's rows, start the
        proposer (a lazy drafter then owes the prompt; an eager one reads it now)."""
        self._t0 = time.perf_counter()
        self.target.reset()
        self.target.take_prefix(self.seq[:-1])
        self.proposer.start(self.seq[:-1])

    def owed(self) -> list[int]:
        """The prompt tokens the target has yet to commit."""
        return self.seq[self.target.committed : len(self.seq) - 1]

    def end_prefill(self) -> None:
        """The prompt is in: the first step may draft."""
        self.hidden = self.target.hidden[-1] if self.target.hidden is not None else None
        self.extra = None  # the first step reads what it needs from the prompt's last row itself
        now = time.perf_counter()
        self.metrics.prefill_s += now - self._t0  # a recomputation after a preemption counts as prefill
        if not self.out:
            self._t1 = now

    def propose(self) -> TokenTree:
        """Draft this step's tree (the proposer's drafter forwards run here)."""
        self._ts = time.perf_counter()
        state = StepState(self.seq, self.hidden, self.sampling, self.sequences, self.estimate,
                          self.max_new_tokens - len(self.out), self.extra)
        self.proposed = self.tree = self.proposer.propose(state)
        self._td = time.perf_counter()
        return self.tree

    def call(self) -> Call:
        """The target's forward over this step's tree."""
        tree = self.tree
        return Call(self.target, tree.tokens, list(range(len(tree))), tree.depths, tree.ancestor_mask())

    def accept(self, logits: Tensor, verify: Stopwatch) -> list[int]:
        """Accept from the tree's target logits, commit, and return the step's new tokens
        (verify: what timed its target forward, for the metrics)."""
        tree = self.tree
        tv = time.perf_counter()
        hidden = self.target.hidden
        extra = self.proposer.with_verdict(hidden[: len(tree)]) if hidden is not None else None
        if self.sampling is None:
            verdict = accept_greedy(tree, logits, extra)
        elif self.sampling.noise is not None:
            verdict = accept_coupled(tree, logits, self.sampling.noise, len(self.seq), self.temperature, self.top_p,
                                     extra)
        else:
            verdict = accept_sampling(tree, warp(logits, self.temperature, self.top_p), self.sampling.generator)
            verdict.extra = to_host(extra[verdict.path[-1]]) if extra is not None else None
        if verify.waits:  # the verdict's read waited for the forward: the step's own host work starts now
            tv = time.perf_counter()
        if self.on_step is not None:
            self.on_step(tree, verdict)
        if self.estimate is not None:
            self.estimate.observe(tree, verdict.path)
        self.target.commit(verdict.path)
        if tree is not self.proposed:  # the batch verified part of the proposed tree: its nodes there
            info = self.proposer.update(Verdict([tree.origin[v] for v in verdict.path], verdict.bonus))
        else:
            info = self.proposer.update(verdict)
        self.hidden = self.target.hidden[verdict.path[-1]]
        self.extra = verdict.extra
        new = [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]
        new = new[: self.max_new_tokens - len(self.out)]
        stop = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        # The metrics describe the output: drafted tokens the budget or an eos cut are not counted.
        kept = min(verdict.accepted, len(new))
        tried = kept + bool(tree.children[verdict.path[kept]]) if kept == verdict.accepted else kept
        if new and not self.out:
            self.metrics.first_token_s = time.perf_counter() - self._t1
        self.seq += new
        self.out += new
        if self.sampling is not None and self.sampling.noise is not None:
            self.sampling.noise.forget(len(self.seq))  # those positions are decided
        step = Step(len(tree) - 1, kept, len(new), tried, max(tree.depths), tuple(tree.sources[1:]),
                    tuple(tree.sources[v] for v in verdict.path[1 : kept + 1]), tree.verify_width or len(tree),
                    draft_s=self._td - self._ts,
                    verify_s=verify.seconds, other_s=time.perf_counter() - tv, retrieval_s=info.retrieval_s,
                    ahead_hit=info.ahead_hit)
        self.metrics.record(step)
        if self.on_event is not None:
            self.on_event(step)
        self.done = stop is not None or len(self.out) >= self.max_new_tokens
        if self.done:
            self.finish()
        return new

    def finish(self) -> None:
        """Close the metrics (also when a caller stops the generation early)."""
        self.done = True
        self.metrics.decode_s = time.perf_counter() - self._t1
        self.metrics.generated_tokens = len(self.out)
        if self.estimate is not None:
            self.metrics.adapt = self.estimate.to_dict()


def check(target: ModelRunner, proposer: Proposer, prompt: list[int], max_new_tokens: int,
          context: int | None = None) -> None:
    """Refuse a request in one line before any work: what only this runner and proposer can tell —
    an empty prompt, a token the target has no row for, or more tokens than the runner's cache (or
    `context` slots) holds with a step's room. The settings were checked where the request entered
    (`ygg_runtime.options.RunOptions`, the server's request check); they are not checked twice."""
    if not prompt:
        raise YggError("the prompt is empty")
    if (past := next((t for t in prompt if not 0 <= t < target.vocab_size), None)) is not None:
        raise YggError(f"the prompt holds token id {past}, which the target has no embedding row for (it has "
                       f"{target.vocab_size}; a tokenizer token the model never learned): remove it from the prompt")
    room = step_room(target, proposer)
    context = target.max_len if context is None else context
    if len(prompt) + max_new_tokens + room > context:
        raise YggError(
            f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens does not fit the context of "
            f"{context - room} tokens; shorten the prompt or lower --max-new-tokens"
        )


def generate(
    target: ModelRunner,
    proposer: Proposer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    sampling: str = SAMPLING,
    eos_ids: frozenset[int] = frozenset(),
    on_tokens: Callable[[list[int]], None] | None = None,
    on_step: Callable[[TokenTree, Verdict], None] | None = None,
    adapt: bool = True,
    context: int | None = None,
) -> tuple[list[int], Metrics]:
    """Decode up to max_new_tokens after `prompt` (stopping after an eos id); returns the new
    tokens and the metrics. on_step sees every verified tree and its verdict (`ygg inspect` draws
    one); adapt=False shapes every step as planned (`--no-adapt`); context: the slots the sequence
    may hold, its step's room included (None: the runner's)."""
    g = Generation(target, proposer, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                   seed=seed, sampling=sampling, eos_ids=eos_ids, on_step=on_step, adapt=adapt, context=context)
    g.prefill()
    while not g.done:
        tree = g.propose()
        c = g.call()
        watch = Stopwatch(target.device).start()
        logits = target.forward(c.tokens, c.offsets, c.depths, c.tree_mask, tree.verify_width)
        new = g.accept(logits, watch.stop())
        if on_tokens is not None:
            on_tokens(new)
    return g.out, g.metrics
