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
from ygg_runtime.options import MAX_BATCH, MIN_GAIN, SAMPLING, Ablation, RunOptions
from ygg_runtime.schema.params import EGTParams, Params, StepShape
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


@dataclass(frozen=True)
class Setup:
    """What one generation runs on: views of the decoder's runners (the draft model's is its
    drafter's), its drafter and its proposer."""

    target: ModelRunner
    drafter: proposers.Drafter | None
    proposer: proposers.Proposer


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
        self.draft = drafter  # the draft model's runner (None: the artifact has none)

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
        return {"target": self.target} | ({"draft": self.draft} if self.draft is not None else {})

    def proposer(self, method: str, ablation: Ablation = Ablation(),
                 drafter: proposers.Drafter | None = None) -> proposers.Proposer:
        """A new proposer of the method, as a generation with `ablation` runs it (predictor=False: egt
        at its planned fixed depth; stages: egt's stage order instead of the plan's; graft=False:
        egt without retrieval grafting — other methods do not graft), drafting with `drafter`
        (default: one over the draft model's runner). A proposer holds one sequence's state, so
        each generation builds its own (10–200 µs with its views: `benchmarks/step_overhead.py`)."""
        if method not in self.methods:
            raise YggError(f"method '{method}' is not in this artifact (it has: {', '.join(self.methods)})")
        params = self.methods[method]
        if ablation.stages is not None:
            params = dataclasses.replace(params, stages=ablation.stages)
        if not ablation.graft and method == "egt":
            params = dataclasses.replace(params, graft=None)
        if drafter is None and self.draft is not None:
            drafter = proposers.Drafter(self.draft, self.target.vocab_size)
        return proposers.build(method, params, drafter, self.curves(), self.predictor if ablation.predictor else None,
                               self.adjacency)

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
            return self.proposer(method, drafter=drafter)

        return Batch(self.target, self.draft, make, self.curves(), max_batch, cost_aware, self.sampling, adapt)

    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.codec is None:
            raise YggError("this decoder has no tokenizer: pass token ids")
        if not prompt.strip():
            raise YggError("the prompt is empty")
        return self.codec.encode(prompt, raw=raw)

    def setup(self, method: str, ablation: Ablation = Ablation(), window: int | None = None) -> Setup:
        """A generation's own runners (views of the decoder's: `ModelRunner.view`, eager for the
        ablation, at its forward kind's exactness floor), drafter (reading the prompt's last `window`
        tokens; None: all) and proposer: nothing of the decoder changes for it."""
        record = self.exactness.get(self.forward_kind(ablation.eager))
        target = self.target.view(eager=ablation.eager, min_width=exactness.min_width(record))
        draft = self.draft.view(eager=ablation.eager) if self.draft is not None else None
        drafter = proposers.Drafter(draft, target.vocab_size, window=window) if draft is not None else None
        return Setup(target, drafter, self.proposer(method, ablation, drafter))

    def generate(self, prompt: str | list[int], options: RunOptions | None = None, *,
                 on_text: Callable[[str], None] | None = None, on_step: Callable | None = None, **given) -> Result:
        """Generate exactly what the target alone would (greedy), or a sample from its distribution
        by the `sampling` rule (None: the plan's; coupled prints `ar`'s tokens for the same seed).
        options: how (`RunOptions`, checked when made: the settings are not checked again here); or
        its fields as keyword arguments (`max_new_tokens=64, method="egt"`, and the ablation's:
        predictor=False, stages, graft=False, eager=True — see proposer()). draft_window: the drafter
        reads only the last that many prompt tokens (0: all of them; None: as `choose` decides, or
        all when a method is named). adapt=False: every step shaped as planned, without the
        request's acceptance estimate (`ygg_runtime.decoding.estimate`; `--no-adapt`, for A/B).

        The generation runs on views of the decoder's runners (`ModelRunner.view`) with its own
        drafter and proposer: its forwards, exactness floor and window are its own, and nothing of
        the decoder changes (the models' caches are the one thing shared, as a generation owns them
        while it runs)."""
        if options is None:
            options = RunOptions.of(**given)
        elif given:
            raise TypeError("Decoder.generate takes RunOptions or keyword arguments, not both")
        start = time.perf_counter()
        o, ablation = options, options.ablation
        ids = self.encode(prompt, o.raw)
        if o.method:
            choice = Choice(o.method, o.draft_window or None, "asked for")
        else:
            choice = self.choose(len(ids), o.max_new_tokens)
            if o.draft_window is not None:
                choice = dataclasses.replace(choice, window=o.draft_window or None)
        own = self.setup(choice.method, ablation, choice.window)
        target, drafter, prop = own.target, own.drafter, own.proposer
        # The plan's context bounds a request on top of the cache (which has room past it for a step's tree).
        room = engine.step_room(target, prop)
        context = min(target.max_len, self.max_context + room) if self.max_context else None
        stream = StreamDecoder(self.codec) if on_text is not None and self.codec is not None else None
        on_tokens = (lambda new: on_text(stream.push(new))) if stream is not None else None
        out, m = engine.generate(
            target,
            prop,
            ids,
            max_new_tokens=o.max_new_tokens,
            temperature=o.temperature,
            top_p=o.top_p,
            seed=o.seed,
            sampling=o.sampling or self.sampling,
            eos_ids=frozenset() if o.ignore_eos else self.eos_ids,
            on_tokens=on_tokens,
            on_step=on_step,
            adapt=o.adapt,
            context=context,
        )
        m.choice = choice.why
        m.draft_window = choice.window if drafter is not None and drafter.cut > 0 else 0
        for r in (target, drafter.runner if drafter is not None else None):
            if r is not None:
                m.compiled_forwards += r.compiled_forwards
                m.eager_forwards += r.forwards - r.compiled_forwards
        mixed = 0 < target.compiled_forwards < target.forwards  # the target ran both kinds of forward
        exact, why = self.verdict(ablation.eager, mixed=mixed)  # on the forwards it ran
        text = self.codec.decode(out) if self.codec is not None else ""
        if stream is not None:
            on_text(stream.finish())
        return Result(text, out, time.perf_counter() - start, m, exact, why)
