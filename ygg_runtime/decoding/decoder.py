"""`Decoder`: a loaded artifact, ready to generate (the Python contract of docs/design.md)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ygg_runtime.decoding import engine, objective, proposers

from ygg_runtime.checks import exactness
from ygg_runtime.decoding.batch import Batch
from ygg_runtime.errors import YggError
from ygg_runtime.decoding.metrics import Metrics
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.options import MAX_BATCH, MIN_GAIN, SAMPLING, RunOptions
from ygg_runtime.schema.params import EGTParams, Params, Stages, StepShape
from ygg_runtime.schema.plan import ExactnessRecord, Plan
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.retrieval import AdjacencyTable
from ygg_runtime.model.runner import ModelRunner, PrefixCache
from ygg_runtime.text import StreamDecoder, TextCodec


@dataclass
class Result:
    """One generation: its text and tokens, and everything measured about it in `metrics`."""

    text: str
    token_ids: list[int]  # generated tokens only
    wall_s: float  # the whole call: encoding, prefill, decoding
    metrics: Metrics = field(repr=False)
    exact: bool = False  # greedy output guaranteed identical to this artifact's plain decoding
    exactness: str = ""  # that, or why not, in one sentence (`ygg_runtime.checks.exactness`)

    @property
    def method(self) -> str:
        return self.metrics.method

    @property
    def prompt_tokens(self) -> int:
        return self.metrics.prompt_tokens

    @property
    def steps(self) -> int:
        return self.metrics.steps

    @property
    def accepted_lengths(self) -> list[int]:
        return self.metrics.accepted_lengths

    @property
    def tpot_ms(self) -> float:
        return self.metrics.tpot_ms

    def to_json(self) -> dict:
        """What `ygg run --json` prints: the output, the headline figures and every metric."""
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "method": self.method, "choice": self.metrics.choice, "steps": self.steps,
                "accepted_lengths": self.accepted_lengths,
                "tpot_ms": self.tpot_ms, "wall_s": self.wall_s, "exact": self.exact, "exactness": self.exactness,
                "metrics": self.metrics.to_dict()}


@dataclass(frozen=True)
class Choice:
    """How a request runs: its method, the drafter's window, and why (one sentence)."""

    method: str
    window: int | None = None  # the drafter reads the last this many prompt tokens (None: all of it)
    why: str = "the plan's method"


class Decoder:
    def __init__(
        self,
        target: ModelRunner,
        drafter: ModelRunner | None,
        codec: TextCodec | None,
        methods: dict[str, Params],
        default_method: str,
        eos_ids: frozenset[int] = frozenset(),
        plan: Plan | None = None,
        forwards: str = "eager",
        predictor: DepthPredictor | None = None,
        adjacency: AdjacencyTable | None = None,
    ):
        self.target, self.codec, self.eos_ids = target, codec, eos_ids
        self.methods, self.default_method = methods, default_method
        self.plan = plan  # the artifact's, when loaded from one
        self.sampling = plan.sampling if plan else SAMPLING  # the rule at temperature > 0 unless told
        self.forwards = forwards  # how the models run, and why (`ygg run --stats` shows it)
        # The context the artifact serves (its cache has room past it for compile-time probing).
        self.max_context = plan.max_context if plan else None
        self.predictor = predictor  # egt's depth predictor, when the artifact has one
        self.adjacency = adjacency  # the adjacency table compile seeded, which egt and pld retrieve from
        # The compile-time row-invariance records by forward kind ("compiled", "eager").
        self.exactness: dict[str, ExactnessRecord] = plan.exactness if plan else {}
        self._here = exactness.Machine.here(target.device)  # this machine, to compare with the one the check ran on
        target.min_width = exactness.min_width(self.exactness.get(self.forward_kind()))
        # Chat prompts share the template's system turn: its KV rows are computed once per model.
        shared = codec.prefix_ids() if codec is not None else []
        for r in (target, drafter):
            if r is not None and shared:
                r.prefix = PrefixCache(shared)
        self._drafter = proposers.Drafter(drafter, target.vocab_size) if drafter is not None else None
        self._proposers: dict[tuple, proposers.Proposer] = {}

    def verdict(self, eager: bool = False, mixed: bool = False) -> tuple[bool, str]:
        """(exact, sentence): whether greedy output on this machine's `eager` or default forwards is
        guaranteed to be plain decoding's (`ygg_runtime.checks.exactness`); what `ygg serve`'s /health,
        `ygg inspect` and every generation's result say."""
        kind = self.forward_kind(eager)
        record = self.exactness.get(kind)
        checked = exactness.Machine.checked(self.plan, record) if self.plan is not None and record else None
        here = self._here if self._here.gpu else dataclasses.replace(self._here, threads=torch.get_num_threads())
        return exactness.verdict(record, checked, mixed=mixed, kind=kind, here=here)

    def forward_kind(self, eager: bool = False) -> str:
        """Which forwards a generation runs: "compiled" when the target has compiled ones loaded."""
        return "eager" if eager or self.target.compiled is None else "compiled"

    @property
    def runners(self) -> dict[str, ModelRunner]:
        """The loaded models by role ("target", and "draft" when there is one)."""
        return {"target": self.target} | ({"draft": self._drafter.runner} if self._drafter is not None else {})

    def proposer(self, method: str, predictor: bool = True, stages: Stages | None = None,
                 graft: bool = True) -> proposers.Proposer:
        """The method's proposer. Ablations: predictor=False runs egt at its planned fixed depth;
        stages replaces egt's planned stage order; graft=False runs egt without retrieval grafting
        (other methods do not graft)."""
        if method not in self.methods:
            raise YggError(f"method '{method}' is not in this artifact (it has: {', '.join(self.methods)})")
        use = predictor and self.predictor is not None
        graft = graft or method != "egt"
        key = (method, use, stages, graft)
        if key not in self._proposers:
            params = self.methods[method]
            if stages is not None:
                params = dataclasses.replace(params, stages=stages)
            if not graft:
                params = dataclasses.replace(params, graft=None)
            self._proposers[key] = proposers.build(method, params, self._drafter, self.curves(),
                                                   self.predictor if use else None, self.adjacency)
        return self._proposers[key]

    def curves(self) -> Curves | None:
        """The plan's measured forward times (None: no profile)."""
        profile = self.plan.profile if self.plan else None
        return Curves(profile) if profile else None

    def choose(self, prompt: int, new: int) -> Choice:
        """The method of a request that names none, the drafter's window, and why: the plan's method
        over the whole prompt, unless another way is modelled faster over the whole request — the
        prompt's prefill (the drafter's too, for a method that drafts) and the tokens a budget of
        `new` is expected to make (`objective.expected_tokens`: calibration's answers tell how often
        an answer ends before its budget; a shorter decode repays a drafter's prefill less) at the
        plan's calibrated tokens per step (`objective.request_ms`). The other ways: the plan's method with
        a drafter that reads only the last K prompt tokens, for each window K compile measured
        (`Plan.draft_window`: the acceptance it keeps scales the tokens per step); and plain
        steps, run as pld where the artifact has it (no drafter to prefill, a step of one verified
        token where the prompt offers nothing to retrieve, longer where it does). Another way must
        win by the margin a plan asks of any change (MIN_GAIN), so a close call keeps the plan's, and
        a window must beat plain steps by it as well: the drafter's acceptance over a long prompt is
        the least known figure of the three."""
        default = self.default_method
        params = self.methods.get(default)
        curves = self.curves()
        per_step = params.tokens_per_step if isinstance(params, EGTParams) else None
        fallback = "pld" if "pld" in self.methods else "ar" if "ar" in self.methods else None
        if fallback is None or curves is None or not per_step:  # ar and pld have no tokens_per_step
            return Choice(default)
        shape = params.step_shape()
        budget, new = new, objective.expected_tokens(self.plan.output_length if self.plan is not None else None, new)
        planned = objective.request_ms(shape, per_step, prompt, new, curves)
        said = [f"modelled {default} {planned.ms / 1e3:.1f} s (prefill {planned.prefill_ms / 1e3:.1f} s)"]
        windowed: tuple[float, int] | None = None  # (ms, K) of the fastest window
        window = self.plan.draft_window if self.plan is not None else None
        if window is not None and shape.draft_widths:
            for k, kept in zip(window.windows, window.kept):
                if k >= prompt:
                    break
                cost = objective.request_ms(shape, objective.windowed_tokens_per_step(per_step, kept), prompt, new,
                                            curves, window=k)
                said.append(f"reading the last {k} tokens {cost.ms / 1e3:.1f} s (prefill "
                            f"{cost.prefill_ms / 1e3:.1f} s, {kept:.0%} of the acceptance)")
                if windowed is None or cost.ms < windowed[0]:
                    windowed = (cost.ms, k)
        plain = objective.request_ms(StepShape((), 1), 1.0, prompt, new, curves)
        said.append(f"plain steps {plain.ms / 1e3:.1f} s (prefill {plain.prefill_ms / 1e3:.1f} s)")
        expected = f" (expected of a budget of {budget})" if new < budget else ""
        why = ", ".join(said) + f" for {prompt} + {new} tokens{expected}"
        # Each other way must beat the plan's by the margin; a window must beat plain steps by it too.
        windowed = windowed if windowed is not None and windowed[0] * MIN_GAIN < planned.ms else None
        steps = plain.ms * MIN_GAIN < planned.ms
        if windowed is not None and (not steps or windowed[0] * MIN_GAIN < plain.ms):
            return Choice(default, windowed[1], why)
        return Choice(fallback if steps else default, None, why)

    def kv_bytes_per_token(self) -> int:
        """What a token costs the KV caches of both models."""
        return sum(r.model.kv.bytes_per_slot for r in self.runners.values())

    def batch(self, max_batch: int = MAX_BATCH, cost_aware: bool = True, kv_slots: int | None = None,
              adapt: bool = True) -> Batch:
        """Several sequences decoding together (`ygg_runtime.decoding.batch`), each in its own region of
        this decoder's caches, every method as compiled (egt with its depth predictor), each sequence
        with its own acceptance estimate unless adapt=False (`ygg serve --no-adapt`). kv_slots:
        set both models' caches up anew with that many slots (`ygg serve` sizes them by memory:
        the compiled forwards take the cache as an input, so any size runs them); None keeps them."""
        if kv_slots is not None:
            for r in self.runners.values():
                r.model.setup_cache(kv_slots)
                r.max_len = min(r.max_len, kv_slots)
        def make(method: str, drafter: proposers.Drafter | None) -> proposers.Proposer:
            if method not in self.methods:
                raise YggError(f"method '{method}' is not in this artifact (it has: {', '.join(self.methods)})")
            return proposers.build(method, self.methods[method], drafter, self.curves(), self.predictor,
                                   self.adjacency)

        drafter = self._drafter.runner if self._drafter is not None else None
        return Batch(self.target, drafter, make, self.curves(), max_batch, cost_aware, self.sampling, adapt)

    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.codec is None:
            raise YggError("this decoder has no tokenizer: pass token ids")
        if not prompt.strip():
            raise YggError("the prompt is empty")
        return self.codec.encode(prompt, raw=raw)

    def generate(self, prompt: str | list[int], options: RunOptions | None = None, *,
                 on_text: Callable[[str], None] | None = None, on_step: Callable | None = None, **given) -> Result:
        """Generate exactly what the target alone would (greedy), or a sample from its distribution
        by the `sampling` rule (None: the plan's; coupled prints `ar`'s tokens for the same seed).
        options: how (`RunOptions`, checked when made); or its fields as keyword arguments
        (`max_new_tokens=64, method="egt"`, and the ablation's: predictor=False, stages, graft=False,
        eager=True — see proposer()). draft_window: the drafter reads only the last that many prompt
        tokens (0: all of them; None: as `choose` decides, or all when a method is named).
        adapt=False: every step shaped as planned, without the request's acceptance estimate
        (`ygg_runtime.decoding.estimate`; `--no-adapt`, for A/B)."""
        if options is None:
            options = RunOptions.of(**given)
        elif given:
            raise TypeError("Decoder.generate takes RunOptions or keyword arguments, not both")
        start = time.perf_counter()
        o, ablation = options, options.ablation
        ids = self.encode(prompt, o.raw)
        max_new_tokens, method, draft_window, eager = o.max_new_tokens, o.method, o.draft_window, ablation.eager
        sampling = o.sampling or self.sampling
        if method:
            choice = Choice(method, draft_window or None, "asked for")
        else:
            choice = self.choose(len(ids), max_new_tokens)
            if draft_window is not None:
                choice = dataclasses.replace(choice, window=draft_window or None)
        prop = self.proposer(choice.method, ablation.predictor, ablation.stages, ablation.graft)
        compiled = {role: r.compiled for role, r in self.runners.items()}
        record = self.exactness.get(self.forward_kind(eager))
        floor = self.target.min_width
        if eager:
            for r in self.runners.values():
                r.compiled = None
        self.target.min_width = exactness.min_width(record)
        if self._drafter is not None:
            self._drafter.window = choice.window
        try:
            result = self._generate(start, ids, prop, max_new_tokens, o.temperature, o.top_p, o.seed, sampling,
                                    o.ignore_eos, on_text, on_step, record, o.adapt)
            result.metrics.choice = choice.why
            drafted = isinstance(prop, proposers.DraftProposer) and self._drafter.cut > 0
            result.metrics.draft_window = choice.window if drafted else 0
            return result
        finally:
            if self._drafter is not None:
                self._drafter.window = None
            self.target.min_width = floor
            for role, r in self.runners.items():
                r.compiled = compiled[role]

    def _generate(self, start, ids, prop, max_new_tokens, temperature, top_p, seed, sampling, ignore_eos, on_text,
                  on_step, record, adapt) -> Result:
        if self.max_context and len(ids) + max_new_tokens > self.max_context:
            raise YggError(f"prompt ({len(ids)} tokens) + {max_new_tokens} new tokens does not fit the context of "
                           f"{self.max_context} tokens; shorten the prompt or lower --max-new-tokens")
        stream = StreamDecoder(self.codec) if on_text is not None and self.codec is not None else None
        runners = self.runners.values()
        before = [(r.forwards, r.compiled_forwards) for r in runners]
        on_tokens = (lambda new: on_text(stream.push(new))) if stream is not None else None
        out, m = engine.generate(
            self.target,
            prop,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            sampling=sampling,
            eos_ids=frozenset() if ignore_eos else self.eos_ids,
            on_tokens=on_tokens,
            on_step=on_step,
            adapt=adapt,
        )
        mixed = []
        for r, (forwards, compiled) in zip(runners, before):
            ran_compiled = r.compiled_forwards - compiled
            ran_eager = r.forwards - forwards - ran_compiled
            m.compiled_forwards += ran_compiled
            m.eager_forwards += ran_eager
            mixed.append(ran_compiled > 0 and ran_eager > 0)
        exact, why = self.verdict(mixed=mixed[0])  # on the forwards it ran (eager ones unloaded); mixed[0]: the target's
        text = self.codec.decode(out) if self.codec is not None else ""
        if stream is not None:
            on_text(stream.finish())
        return Result(text, out, time.perf_counter() - start, m, exact, why)
