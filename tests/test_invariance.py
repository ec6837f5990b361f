"""Exactness in the artifact's own dtype: the compile-time row-invariance check, the padding rule
the runtime follows from it, and what a generation says about it."""

from dataclasses import replace

import pytest
import tiny
import torch
from helpers import runner, to_runtime

from ygg_compile import invariance
from ygg_runtime.checks import exactness
from ygg_runtime.decoding.proposers import build, Drafter
from ygg_runtime.decoding.engine import generate
from ygg_runtime.schema.plan import ExactnessRecord

WIDTHS = [1, 2, 4, 8, 16, 32]


def flags_this_cpu_lacks(n: int) -> list[str]:
    """Vector flags to plant as another CPU's: ones this machine does not have (an AMX Xeon has
    amx_bf16 and amx_tile; none here has AVX10.2), so a planted difference is a difference."""
    from ygg_runtime.machine import cpu_flags

    have = cpu_flags()
    return [f for f in ("amx_bf16", "amx_tile", "avx512_fp16", "avx10_1", "avx10_2") if f not in have][:n]


@pytest.fixture(scope="module")
def target():
    return runner(to_runtime(tiny.hf_model("llama", seed=30), torch.bfloat16), 400)


def perturb(r, when, where="logits"):
    """Make the runner's eager forward disagree with itself whenever when(width, seen) holds (seen:
    how many slots each row sees): its logits, or the KV rows it writes, moved by a little."""
    model = r.model
    forward = model.forward

    def wrapped(tokens, positions, slots, lo, hi, tree, cache, heads=None):
        logits, hidden = forward(tokens, positions, slots, lo, hi, tree, cache, heads)
        if when(tokens.shape[1], hi - lo + tree.sum(1)):
            if where == "logits":
                logits = logits + 1e-3
            else:
                for cache in model.caches():
                    cache.k[:, :, slots] += 0.01
        return logits, hidden

    model.forward = wrapped
    return lambda: model.__dict__.pop("forward")


def test_the_check_finds_every_width_agreeing_on_a_row_invariant_forward(target):
    """Our attention kernel makes rows independent of their layout; the tiny model's matmuls agree
    from one or two rows on (a one-row bf16 matmul may take a gemv path)."""
    rec = invariance.check(target, WIDTHS)
    assert rec.min_width in (1, 2) and all(rec.agree[w] for w in WIDTHS if w >= rec.min_width)
    assert rec.widths == WIDTHS and rec.threads == torch.get_num_threads() and rec.contexts
    exact, why = exactness.verdict(rec)
    assert exact and "identical" in why


def seen_lengths(seen) -> int:
    """How many different numbers of slots the forward's real rows see: padding rows see only
    themselves (one slot), so a padded plain-decoding forward has one such number, a tree several."""
    return seen[seen > 1].unique().numel()


@pytest.mark.parametrize("when,where,expected", [
    (lambda w, m: w < 4, "logits", 4),           # a narrow-width kernel path (as bf16 linear at one row)
    (lambda w, m: w == 8, "logits", 16),          # one width in the middle of the family
    (lambda w, m: w == 2, "kv", 4),               # right logits, wrong KV rows written
    (lambda w, m: w == 32, "logits", 32),         # only the widest agrees with itself: pad to it
    (lambda w, m: seen_lengths(m) > 1, "logits", None),  # trees only (real rows see different lengths)
])
def test_the_check_detects_an_injected_disagreement(target, when, where, expected):
    undo = perturb(target, when, where)
    try:
        rec = invariance.check(target, WIDTHS)
    finally:
        undo()
    assert rec.min_width == expected, rec.agree
    exact, why = exactness.verdict(rec)
    assert exact == (expected is not None)
    assert ("never used" in why) if expected else ("can differ" in why)


def test_every_target_forward_is_padded_to_min_width_even_at_the_end_of_the_cache(target):
    draft = runner(to_runtime(tiny.hf_model("llama", seed=31), torch.bfloat16), 400)
    target.min_width, target.widths = 4, (4, 8, 16)
    try:
        for method, params in (("ar", {}), ("chain", {"k": 2})):
            prop = build(method, params, Drafter(draft, target.vocab_size))
            prompt = list(range(3, 40))
            room = 400 - len(prompt) - 4  # the whole cache but the step room
            with target.recording() as calls:
                out, _ = generate(target, prop, prompt, max_new_tokens=room)
            assert len(out) == room and min(calls) >= 4
    finally:
        target.min_width, target.widths = 0, ()


def test_a_generation_says_whether_it_is_exact():
    rec = ExactnessRecord(2, [1, 2, 4], {1: False, 2: True, 4: True}, {1: 0.19, 2: 0.0, 4: 0.0}, [37], torch.get_num_threads(), 1.0)
    exact, why = exactness.verdict(rec)
    assert exact and "width 1 differs (|Δlogit| up to 0.19) and is never used" in why
    exact, why = exactness.verdict(rec, mixed=True)
    assert not exact and "both compiled and eager" in why
    assert "threads" in exactness.verdict(replace(rec, threads=rec.threads + 1))[1]
    assert not exactness.verdict(None)[0] and not exactness.verdict(replace(rec, min_width=None))[0]


def test_a_check_made_on_another_machine_is_not_claimed_here(monkeypatch):
    """Another torch, CPU model or set of vector flags (a CPU with AMX picks other bf16 kernels):
    the record says nothing about this machine, in one sentence that says what differs and how to
    check it again."""
    rec = ExactnessRecord(1, [1, 2, 4], {1: True, 2: True, 4: True}, {1: 0.0, 2: 0.0, 4: 0.0}, [37],
                          torch.get_num_threads(), 1.0)
    here = exactness.Machine.here()
    assert exactness.verdict(rec, here)[0]
    flag, = flags_this_cpu_lacks(1)
    for other, says in ((replace(here, isa=here.isa + (flag,)), f"CPU flags -{flag}"),
                        (replace(here, cpu="Intel(R) Xeon(R) Platinum 8480+"), "not 'Intel(R) Xeon(R) Platinum 8480+'"),
                        (replace(here, torch="2.12.0"), f"torch {torch.__version__}, not 2.12.0")):
        exact, why = exactness.verdict(rec, other)
        assert not exact and why.startswith("not checked on this machine (") and says in why, why
        assert "`ygg compile` on this machine checks it again" in why
    monkeypatch.setattr(torch, "__version__", "2.99.0")  # this process's torch, as Machine.here() reads it
    assert "torch 2.99.0, not" in exactness.verdict(rec, here)[1]


def test_a_loaded_artifact_on_a_cpu_with_other_flags_says_it_was_not_checked_here(artifact, monkeypatch):
    """The same through the artifact: `generate`'s result (what --json and --stats print) and the
    decoder's verdict (what `ygg serve`'s /health and start-up line say)."""
    import ygg_runtime
    import ygg_runtime.checks.integrity as integrity

    real = integrity.cpu_flags
    planted = flags_this_cpu_lacks(2)
    monkeypatch.setattr(integrity, "cpu_flags", lambda: real() | set(planted))
    dec = ygg_runtime.load(artifact)
    res = dec.generate([3, 4, 5], max_new_tokens=2)
    says = "not checked on this machine (CPU flags " + ", ".join(f"+{f}" for f in sorted(planted)) + ")"
    assert not res.exact and res.exactness.startswith(says), res.exactness
    assert dec.verdict() == (res.exact, res.exactness)
    monkeypatch.setattr(integrity, "cpu_flags", real)
    assert ygg_runtime.load(artifact).generate([3, 4, 5], max_new_tokens=2).exact
