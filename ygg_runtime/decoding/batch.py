"""Several sequences decoding together: continuous batching of tree speculative decoding.

Each sequence (a `Member`) owns a region of the target's and the drafter's slot-addressed caches
(`ModelRunner.region`, the same slots in both) and its own proposer, so its trees, acceptance and
compaction are exactly those of `engine.Generation` alone. A step drafts every member's tree, each in its own greenlet, and
runs their drafter forwards together (`Gate`: when every member still drafting is waiting on a
forward, one forward serves them all); then one target forward verifies every tree (one mask whose
rows see only their own sequence). Sequences join and leave between steps. Everything runs on the
caller's thread: the thread that loaded the models (`ygg serve` steps the batch on its main thread).

Chunked prefill (Sarathi-Serve's idea, vLLM's default): a new member's prompt enters in chunks that
share the target forward with the decoding members' trees, each chunk as large as keeps the step
within PREFILL_STRETCH of its cost without it (`Batch._chunks`, from the measured T(B, n)), so
nobody's tokens stall behind a long prompt. A member's drafter is lazy (`proposers.Drafter`): it
follows its target's chunks a step behind, in the drafting forwards, and only when its method
drafts, so a request that never drafts never runs the drafter at all.

Why a member's greedy output is what it gets alone: the target's kernels compute every row from
its own query and visible keys only (`ygg_runtime.backend`), regions need no alignment, a prompt
is run in forwards of at most MAX_ROWS alone too (`runner.PREFILL_CHUNK`), and a
batched forward is never wider than `MAX_ROWS`, the widest the compile-time row check covers, nor
narrower than the exactness floor, and always at a compiled width (its padding rows go to slots the
batch keeps for them when no region has room), so only at widths the check measured. The drafter's rows are as invariant when its weights are
quantized or its forwards run at the same widths; where they are not, a batch can draft another
tree than alone, which changes the speed, never the text (the target verifies every token).

The cache on demand (vLLM's idea, PagedAttention's allocation without its pages): a region holds
what its sequence has written plus the room its next step needs, and grows as the sequence does —
in place when the slots after it are free, else by moving (its rows copied to a free range, never
recomputed: `ModelRunner.move_to`), after packing the regions together when the free slots are
scattered. Contiguous regions rather than pages keep the attention kernel's view of a sequence one
range, the exactness argument unchanged (a row's keys in slot order are its positions' order), and
measured cheap: moving costs a copy of the sequence's rows (`Batch.moved_slots` counts them). When
the cache is full, the newest running sequence is preempted: its slots are freed, and it is
recomputed from its tokens (prompt and output so far, prefilled like a prompt) when room returns,
before any new request joins. Its output is unchanged: the recomputed rows are the bits the steps
wrote (rows are computed as alone, whatever the forward: above), and its sampling state is its own.

Cost-aware trees (CAST): with several members, the verify's nodes are allocated across the batch
by `prune.allocate` — one knapsack over every member's drafted nodes, by expected accepted tokens
per modelled millisecond of the whole step — so trees shrink as the batch grows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from greenlet import greenlet
from torch import Tensor

from ygg_runtime.decoding import engine, prune
from ygg_runtime.decoding.accept import Verdict
from ygg_runtime.decoding.engine import Generation, step_room
from ygg_runtime.model.kv import restore, snapshot
from ygg_runtime.decoding.metrics import Step
from ygg_runtime.options import MAX_BATCH, MAX_ROWS, SAMPLING, check_max_batch, check_sampling
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.params import fit_width
from ygg_runtime.decoding.proposers import Drafter, Proposer
from ygg_runtime.model.runner import Call, ModelRunner, forward_many
from ygg_runtime.transfer import Stopwatch
from ygg_runtime.decoding.tree import TokenTree

# Chunked prefill: a step that carries prompt chunks may cost up to this many times the step
# without them (so a decoding request's time per token stays within 2x of an undisturbed one),
# and carries at least MIN_CHUNK prompt tokens (so a prompt always progresses); DEFAULT_CHUNK
# when the batch has no curves to price a chunk with (CAST off).
PREFILL_STRETCH = 2.0
MIN_CHUNK = 4
DEFAULT_CHUNK = 16
# A region grows by at least this many slots (or an eighth of itself) at a time, so that a long
# generation moves a handful of times, not every step.
GROW = 128
# A request joins (or a preempted one comes back) only while this share of the cache stays free
# beside it (vLLM's watermark), so that a join does not force a preemption at the next step.
WATERMARK = 0.01

class Regions:
    """First-fit allocation of cache slots [start, size) to sequences, each a contiguous range."""

    def __init__(self, size: int, start: int = 0):
        self.size, self.start = size, start
        self.taken: dict[int, int] = {}  # base -> length

    @property
    def capacity(self) -> int:
        """The longest range there is: every slot free."""
        return self.size - self.start

    def alloc(self, length: int) -> int | None:
        """The base of a free range of `length` slots, now taken (None: no such range)."""
        start = self.start
        for base in sorted(self.taken):
            if base - start >= length:
                break
            start = base + self.taken[base]
        if start + length > self.size:
            return None
        self.taken[start] = length
        return start

    def grow(self, base: int, length: int) -> bool:
        """Make the range at `base` `length` slots long in place, when the slots past it are free."""
        after = min((b for b in self.taken if b > base), default=self.size)
        if base + length > after:
            return False
        self.taken[base] = length
        return True

    def free(self, base: int) -> None:
        del self.taken[base]

    @property
    def used(self) -> int:
        return sum(self.taken.values())

    @property
    def free_slots(self) -> int:
        return self.capacity - self.used


@dataclass(eq=False)
class Member:
    """One sequence of a batch: its generation, its cache regions and who hears its tokens."""

    generation: Generation
    base: int | None  # its region's first slot (None: preempted, it holds none)
    length: int  # its region's slots, from base: what it has written and its next step's room
    cap: int  # the most it can ever need: prompt + max_new_tokens + room
    room: int  # the slots a step needs past the sequence (`engine.step_room`)
    order: int  # when it joined: the newest running member is preempted first
    on_tokens: Callable[[list[int]], None] | None = None
    started: bool = False  # its prompt has begun (`Generation.begin_prefill`)
    prefilled: bool = False  # its whole prompt is in the target's cache: it decodes
    preempted: bool = False  # its slots were taken back: it waits to be recomputed
    error: BaseException | None = None  # why it stopped early (the batch goes on without it)
    steps_batched: list[int] = field(default_factory=list)  # members verified with it, per step
    nodes: list[int] = field(default_factory=list)  # its verified tree's size per step (root included)

    @property
    def done(self) -> bool:
        return self.generation.done or self.error is not None

    def runners(self) -> list[ModelRunner]:
        """Its regions: the target's, and the drafter's when its method drafts."""
        return [self.generation.target] + ([self.generation.proposer.drafter.runner] if _drafts(self) else [])


class Gate:
    """Runs the members' drafter forwards together. Each member drafts in a greenlet of the
    engine's own thread; a drafter forward (`ModelRunner.forward` while this gate is set) hands its
    call to the coordinator and waits. Once every member still drafting waits on one, the
    coordinator runs them all, in as few forwards as MAX_ROWS allows, and resumes each member with
    its logits (or raises the forward's error in it).

    Greenlets rather than threads, so that every torch op of a batch runs on one OS thread: with a
    second thread running parallel regions beside the first, each with its own OpenMP team, the
    1.5B target's forward measured 1.5x slower on 2 cores (61 -> 96 ms)."""

    def run(self, call: Call, width: int) -> Tensor:
        """In a member: wait for the coordinator to run this forward with the others."""
        return greenlet.getcurrent().parent.switch((call, width))

    @staticmethod
    def drive(tasks: list[Callable[[], object]]) -> list[tuple[int, int]]:
        """Run every task to its end, each in its own greenlet, their forwards together; returns
        each forward run as (the tasks it served, its rows): what the step paid for drafting."""
        waiting = []
        for task in tasks:
            g = greenlet(task)
            request = g.switch()
            if not g.dead:
                waiting.append((g, request))
        forwards = []
        while waiting:
            work, waiting = waiting, []
            for group in _groups(work, lambda item: len(item[1][0].tokens)):
                width = group[0][1][1] if len(group) == 1 else 0
                try:
                    outs = forward_many([call for _, (call, _) in group], width)
                except Exception as e:  # every waiting member learns it
                    outs = [e] * len(group)
                forwards.append((len(group), sum(len(call.tokens) for _, (call, _) in group)))
                for (g, _), out in zip(group, outs):
                    request = g.throw(out) if isinstance(out, BaseException) else g.switch(out)
                    if not g.dead:
                        waiting.append((g, request))
        return forwards


def _drafts(member: Member) -> bool:
    """Whether the member's method runs the draft model (its forwards then meet at the Gate)."""
    return hasattr(member.generation.proposer, "drafter")


def _groups(items: list, rows: Callable) -> list[list]:
    """Consecutive runs of items of at most MAX_ROWS rows in all (an item wider alone goes alone)."""
    groups, current, n = [], [], 0
    for item in items:
        if current and n + rows(item) > MAX_ROWS:
            groups.append(current)
            current, n = [], 0
        current.append(item)
        n += rows(item)
    return groups + [current] if current else groups


class Batch:
    """Sequences of one artifact decoding together. `join` admits a request (or says there is no
    room yet), `step` advances every member by one step, `cancel` drops one."""

    def __init__(self, target: ModelRunner, drafter: ModelRunner | None,
                 make_proposer: Callable[[str, Drafter | None], Proposer], curves: Curves | None = None,
                 max_batch: int = MAX_BATCH, cost_aware: bool = True, sampling: str = SAMPLING, adapt: bool = True):
        """The batch's cache is its models' whole caches (`Decoder.batch` sizes them by memory).
        adapt: each member keeps its own acceptance estimate (`ygg_runtime.decoding.estimate`)."""
        self.target, self.drafter = target, drafter
        self.adapt = adapt
        self.sampling = check_sampling(sampling)  # the rule of a sampled member that names none
        self.make_proposer = make_proposer
        self.curves = curves if cost_aware else None
        self.max_batch = check_max_batch(max_batch)
        # The first MAX_ROWS slots of both caches are no sequence's: a batched forward's padding
        # rows write there when no member's region has room past its tree, so every target forward
        # runs at a compiled width at least the exactness floor, the widths the row check measured.
        self.scratch = range(MAX_ROWS)
        size = target.model.max_len if drafter is None else min(target.model.max_len, drafter.model.max_len)
        self.regions = Regions(size, MAX_ROWS)
        self.members: list[Member] = []
        self.joined = 0
        self.steps = 0
        self.drafted: list[tuple[int, int]] = []  # this step's drafter forwards: (members served, rows)
        # Per number of sequences verified together: [steps, tree nodes verified in them] — how
        # the trees' size follows the load (`ygg serve`'s /metrics shows it).
        self.load: dict[int, list[int]] = {}
        self.preemptions = 0  # members preempted (their slots taken back, recomputed later)
        self.moves = 0  # regions moved to grow
        self.moved_slots = 0  # the rows those moves copied

    @property
    def running(self) -> list[Member]:
        """The members holding cache slots (the others are preempted, waiting for room)."""
        return [m for m in self.members if not m.preempted]

    @property
    def free_rows(self) -> int:
        return self.max_batch - len(self.running)

    def held(self) -> tuple[int, int, int]:
        """(slots the running members' regions hold, tokens of their sequences, slots reserving
        each one's max_new_tokens up front would hold): what the cache holds, what of it is
        written, and what it would hold for the same requests without the cache on demand."""
        running = self.running
        return self.regions.used, sum(len(m.generation.seq) for m in running), sum(m.cap for m in running)

    def _probe(self, method: str) -> Proposer:
        """A proposer over a one-slot drafter region: it sizes a request before a region is taken."""
        probe = Drafter(self.drafter.region(0, 1), self.target.vocab_size) if self.drafter is not None else None
        return self.make_proposer(method, probe)

    def longest(self, method: str) -> int:
        """The longest sequence (prompt and output) a request of `method` can have in this cache."""
        return self.regions.capacity - step_room(self.target, self._probe(method))

    def admissible(self, prompt: list[int], method: str, *, max_new_tokens: int) -> tuple[int, int]:
        """(the most cache slots the request can need, its step room); YggError, in one line, when
        it can never be served (an unknown method, a token the target lacks, or more than a
        sequence's share of the cache holds: `engine.check`). Its settings were checked where it entered."""
        proposer = self._probe(method)
        engine.check(self.target, proposer, prompt, max_new_tokens, self.regions.capacity)
        room = step_room(self.target, proposer)
        return len(prompt) + max_new_tokens + room, room

    def join(self, prompt: list[int], method: str, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, sampling: str | None = None,
             eos_ids: frozenset[int] = frozenset(),
             on_tokens: Callable[[list[int]], None] | None = None,
             on_step: Callable[[TokenTree, Verdict], None] | None = None,
             on_event: Callable[[Step], None] | None = None, draft_window: int | None = None) -> Member | None:
        """A new member, prefilled at the next step; None when the batch or the cache is full now,
        or a preempted member still waits for room (try again after a step). A request that can
        never fit is refused (YggError). It takes the slots of its prompt and a step's room; more
        as it grows (`_reserve`). on_tokens hears each step's new tokens, on_step each verified
        tree and its verdict, on_event each step's metrics event (`ygg_runtime.decoding.metrics.Step`).
        sampling: the rule at temperature > 0 (None: the batch's, which a decoder takes from its plan);
        draft_window: its drafter reads only the last that many prompt tokens (None: all)."""
        if len(self.running) >= self.max_batch or any(m.preempted for m in self.members):
            return None
        cap, room = self.admissible(prompt, method, max_new_tokens=max_new_tokens)
        length = min(cap, len(prompt) + room + GROW)
        base = self._take(length)
        if base is None:
            return None
        try:
            target = self.target.region(base, length)
            target.scratch = self.scratch
            drafter = None
            if self.drafter is not None:
                region = self.drafter.region(base, length)
                region.scratch = self.scratch
                drafter = Drafter(region, self.target.vocab_size, lazy=True, window=draft_window)
            gen = Generation(target, self.make_proposer(method, drafter), prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, seed=seed, sampling=sampling or self.sampling,
                             eos_ids=eos_ids, on_step=on_step, on_event=on_event, context=cap, adapt=self.adapt)
        except BaseException:
            self.regions.free(base)
            raise
        member = Member(gen, base, length, cap, room, self.joined, on_tokens)
        self.joined += 1
        self.members.append(member)
        return member

    def nodes_per_sequence(self) -> dict[int, float]:
        """Mean verified tree size (root included) per sequence, by sequences verified together."""
        return {b: nodes / (steps * b) for b, (steps, nodes) in sorted(self.load.items())}

    def cancel(self, member: Member) -> None:
        """Drop a member now (a client went away); its slots are free for the next join."""
        if member in self.members:
            self.members.remove(member)
            if member.base is not None:
                self.regions.free(member.base)
                member.base = None
            if not member.generation.done:
                member.generation.finish()

    def step(self) -> list[Member]:
        """One step of every member: a decoding member drafts and verifies a tree, a prefilling
        one puts the next chunk of its prompt into the same target forward (chunked prefill);
        returns the members that finished in it (done or failed), which have left the batch."""
        self._resume()
        for m in self.running:
            if not m.started:
                m.started = True
                self._guard(m, m.generation.begin_prefill)
                self._end_prefill(m)  # a prompt the prefix cache held whole
        self._reserve([m for m in self.running if m.prefilled and not m.done])
        live = [m for m in self.running if m.prefilled and not m.done]
        filling = [m for m in self.running if not m.prefilled and not m.done]
        if self.curves is not None:  # CAST: each tree is weighed as its share of this step
            for m in live:
                m.generation.sequences = len(live)
        self._propose(live, filling)
        live = [m for m in live if not m.done]
        filling = [m for m in filling if not m.done]
        if len(live) > 1 and self.curves is not None:
            self._allocate(live)
        self._verify(live, filling)
        finished = [m for m in self.members if m.done]
        for m in finished:
            self.cancel(m)
        self.steps += 1
        return finished

    # -------------------------------------------------------------- the cache on demand

    def _take(self, length: int) -> int | None:
        """A free range of `length` slots, now taken (packing the regions together when the free
        slots are scattered), leaving the watermark free beside it; None when there is no room."""
        spare = int(WATERMARK * self.regions.capacity) if self.running else 0
        if self.regions.free_slots < length + spare:
            return None
        base = self.regions.alloc(length)
        if base is None:
            self._pack()
            base = self.regions.alloc(length)
        return base

    def _pack(self, last: Member | None = None) -> None:
        """Move every region down against the one before it (`last`'s after all the others, its
        rows held aside meanwhile): the free slots become one range, at the end."""
        held = []
        if last is not None:
            held = [(r, snapshot(r.model.kv, r.base, self._keep(last, r))) for r in last.runners()]
            self.regions.free(last.base)
            last.base = None
        at = self.regions.start
        for m in sorted((m for m in self.members if m.base is not None), key=lambda m: m.base):
            if m.base != at:
                self._relocate(m, at, m.length)
            at += m.length
        if last is not None:
            last.base = self.regions.alloc(last.length)
            for r, rows in held:
                restore(r.model.kv, rows, last.base)
                r.base = last.base
                self.moved_slots += rows.shape[3]
            self.moves += 1

    @staticmethod
    def _keep(m: Member, r: ModelRunner) -> int:
        """The rows of a region worth moving: the committed ones, and any fed ahead of them."""
        return min(r.max_len, r.committed + m.room)

    def _relocate(self, m: Member, base: int, length: int) -> None:
        """Move a member's rows to [base, base + length) (both models'), which the regions then hold."""
        for r in m.runners():
            keep = self._keep(m, r)
            r.move_to(base, length, keep)
            self.moved_slots += keep
        self.moves += 1
        self.regions.free(m.base)
        self.regions.taken[base] = length
        m.base, m.length = base, length

    def _reserve(self, live: list[Member]) -> None:
        """Before a step: every decoding member's region holds its sequence and the step's room,
        grown when not: in place, or moved to a free range, or after packing; and when the cache
        has no room left, the newest running member is preempted (maybe the one growing)."""
        for m in sorted(live, key=lambda m: m.order):  # the oldest first: they keep their slots
            need = len(m.generation.seq) + m.room
            while not m.preempted and need > m.length:
                want = min(m.cap, max(need, m.length + max(GROW, m.length // 8)))
                if not self._grow(m, need, want):
                    self._preempt(max((x for x in self.members if x.base is not None), key=lambda x: x.order))

    def _grow(self, m: Member, need: int, want: int) -> bool:
        """Make m's region `want` slots long, or at least `need`: in place, else moved to a free
        range, else after packing the regions with m's last (the free slots then follow it)."""
        for length in (want, need):
            if self.regions.free_slots < length - m.length:
                continue
            if not self.regions.grow(m.base, length):
                base = self.regions.alloc(length)
                if base is not None:
                    self.regions.free(base)  # _relocate takes it, with the rows moved there
                    self._relocate(m, base, length)
                    return True
                self._pack(last=m)
                self.regions.grow(m.base, length)
            for r in m.runners():
                r.max_len = length
            m.length = length
            return True
        return False

    def _preempt(self, m: Member) -> None:
        """Take a member's slots back: it waits, and is recomputed from its tokens when there is room."""
        self.regions.free(m.base)
        m.base, m.preempted, m.started, m.prefilled = None, True, False, False
        for r in m.runners():
            r.reset()
        self.preemptions += 1

    def _resume(self) -> None:
        """Preempted members come back, the oldest first, when their tokens and some room fit: their
        prompt is now everything they have, prefilled in chunks like any prompt."""
        for m in sorted((m for m in self.members if m.preempted), key=lambda m: m.order):
            length = min(m.cap, len(m.generation.seq) + m.room + GROW)
            base = self._take(length)
            if base is None:
                return
            for r in m.runners():
                r.move_to(base, length, 0)
            m.base, m.length, m.preempted = base, length, False

    def _end_prefill(self, m: Member) -> None:
        if not m.done and not m.generation.owed():
            m.prefilled = True
            self._guard(m, m.generation.end_prefill)

    def _chunks(self, live: list[Member], filling: list[Member], rows: int) -> list[tuple[Member, int]]:
        """How many prompt tokens each prefilling member puts into this step's target forward,
        beside `rows` verify rows of the live members (Sarathi-Serve's chunked prefill): as many as
        keep the step within PREFILL_STRETCH times what it costs without them (by the measured
        T(B, n): the verify forward and the drafter forwards of the step), at least MIN_CHUNK,
        and then up to the compiled width the forward is padded to (padding rows cost what prompt
        rows do: on the 1.5B target a 9-row forward runs at 16 rows, 115 ms against 64 at 8), in
        one forward of at most MAX_ROWS rows with the verify when it has room. With no member
        decoding, the forward is filled. Members take their share in the order they joined."""
        if not filling:
            return []
        if not live:
            total = MAX_ROWS
        elif self.curves is None:
            total = DEFAULT_CHUNK
        else:
            c = self.curves
            context = sum(len(m.generation.seq) for m in live) // len(live)
            drafted = sum(c.t_batch("draft", b, n, context) for b, n in self.drafted) if c.draft_ms else 0.0
            plain = c.t_batch("target", len(live), rows, context)
            budget = (PREFILL_STRETCH - 1) * (plain + drafted)
            drafts = c.draft_ms and any(_drafts(m) for m in filling)
            total = 0
            for n in range(1, MAX_ROWS + 1):
                extra = c.t_batch("target", len(live) + 1, rows + n, context) - plain
                extra += c.t_batch("draft", 1, n, context) if drafts else 0.0  # next step, a chunk behind
                if extra > budget:
                    break
                total = n
            # the forward is padded to a compiled width anyway: prompt rows fill it for free
            total = fit_width(rows + max(total, MIN_CHUNK), self.target.widths) - rows
        if rows < MAX_ROWS:
            total = min(total, max(MAX_ROWS - rows, MIN_CHUNK))
        out = []
        for m in filling:
            n = min(total, len(m.generation.owed()))
            if n:
                out.append((m, n))
                total -= n
            if total <= 0:
                break
        return out

    def _guard(self, member: Member, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as e:  # this member fails; the others go on
            member.error = e
            return None

    def _propose(self, live: list[Member], filling: list[Member]) -> None:
        """Every live member drafts its tree, and every prefilling member's drafter catches up with
        the chunks its target took; their drafter forwards run together through a Gate."""
        self.drafted = []
        tasks, runners = [], []
        for m in live:
            tasks.append(functools.partial(self._guard, m, m.generation.propose))
            if _drafts(m):
                runners.append(m.generation.proposer.drafter.runner)
        for m in filling:
            d = getattr(m.generation.proposer, "drafter", None)
            upto = m.generation.target.committed
            if d is not None and d.owes(upto):
                tasks.append(functools.partial(self._guard, m, d.feed_prompt, m.generation.seq, upto))
                runners.append(d.runner)
        if len(tasks) == 1:
            tasks[0]()
            return
        gate = Gate()
        for r in runners:
            r.gate = gate
        try:
            self.drafted = gate.drive(tasks)
        finally:
            for r in runners:
                r.gate = None

    def _allocate(self, live: list[Member]) -> None:
        """CAST: share the verify's nodes across the batch (prune.allocate) for the members whose
        trees any part of can be verified: greedy and coupled sampling (the target's choice at a
        node does not depend on its siblings); a rejection-sampled tree is verified whole."""
        greedy = [m for m in live if (m.generation.sampling is None or m.generation.sampling.noise is not None)
                  and len(m.generation.tree) > 1]
        if not greedy:
            return
        gens = [m.generation for m in greedy]
        context = sum(len(m.generation.seq) for m in live) // len(live)
        others = sum(len(m.generation.tree) for m in live if m not in greedy)
        # The step's drafter forwards as the Gate ran them, each over the members it served
        draft_ms = (sum(self.curves.t_batch("draft", b, rows, context) for b, rows in self.drafted)
                    if self.curves.draft_ms else 0.0)
        trees = prune.allocate([g.tree for g in gens], self.curves, context, draft_ms, others, MAX_ROWS, len(live))
        for g, tree in zip(gens, trees):
            g.tree = tree

    def _verify(self, live: list[Member], filling: list[Member]) -> None:
        """One target forward (or a few, MAX_ROWS rows each) over every live member's tree and the
        prefilling members' chunks; accept, or commit the chunk."""
        calls = [(m, m.generation.call()) for m in live]
        rows = sum(len(c.tokens) for _, c in calls)
        chunks = self._chunks(live, filling, rows)
        calls += [(m, m.generation.target.chain_call(m.generation.owed()[:n], logits=False)) for m, n in chunks]
        for group in _groups(calls, lambda item: len(item[1].tokens)):
            width = group[0][0].generation.tree.verify_width if len(group) == 1 and group[0][0].prefilled else 0
            watch = Stopwatch(self.target.device).start()
            try:
                outs = forward_many([c for _, c in group], width)
            except Exception as e:
                for m, _ in group:
                    m.error = e
                continue
            watch.stop()
            verified = [(m, c) for m, c in group if m.prefilled]
            if verified:
                record = self.load.setdefault(len(verified), [0, 0])
                record[0] += 1
                record[1] += sum(len(c.tokens) for _, c in verified)
            for m, _ in verified:
                m.steps_batched.append(len(verified))
                m.nodes.append(len(m.generation.tree))
            for (m, c), logits in zip(group, outs):
                if not m.prefilled:  # a chunk of its prompt: keep its rows
                    self._guard(m, m.generation.target.commit, c.offsets)
                    self._end_prefill(m)
                    continue
                new = self._guard(m, m.generation.accept, logits, watch)
                if new is not None and m.on_tokens is not None:
                    self._guard(m, m.on_tokens, new)
