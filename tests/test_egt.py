"""EGT with static shapes, the objective on measured curves, calibration and its replays."""

import dataclasses
import os
import random
from pathlib import Path

import pytest
import tiny
import torch
from helpers import COMPILED, PROFILE, decode, hf_greedy, noised_runtime, runner, to_runtime

from ygg_compile import calibrate
from ygg_runtime.ui import Reporter
from ygg_runtime.decoding import objective
from ygg_runtime.decoding.objective import AcceptanceMap, Curves
from ygg_runtime.schema.params import StepShape
from ygg_runtime.decoding.proposers import Drafter, build
from ygg_runtime.schema.params import EGTParams
from ygg_runtime.decoding.proposers.egt import Planner
from ygg_runtime.decoding.decoder import Choice
from ygg_runtime.decoding.prune import Pruning, best_subtree



class ByteCodec:
    """The tiny models' byte-level stand-in for the artifact's TextCodec."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


@pytest.fixture(scope="module")
def models():
    hf = tiny.hf_model("llama", seed=30)
    target = to_runtime(hf)
    return hf, runner(target), runner(noised_runtime(target, 0.05, seed=31))


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_every_egt_forward_has_a_compiled_width_whatever_the_context(models):
    """Instrument both models' forwards: egt pads every drafter round and every verify to a
    compiled width, at short and long contexts, with few candidates (top_k 2 < draft width) and
    the objective choosing verify widths per step; the output stays the target's own."""
    from ygg_runtime.decoding.engine import generate
    from ygg_runtime.model.runner import PREFILL_CHUNK

    hf, target, draft = models
    chosen = []
    for params in ({"depth": 4, "draft_width": 8, "top_k": 2, "verify_widths": [1, 4, 16]},
                   {"depth": 3, "draft_width": 4, "top_k": 3, "verify_widths": list(COMPILED)}):
        drafter = Drafter(draft, target.vocab_size)
        egt = build("egt", params, drafter, Curves(PROFILE))
        for prompt in prompts(4, seed=32):
            with target.recording() as target_calls, draft.recording() as draft_calls:
                out, m = generate(target, egt, prompt, max_new_tokens=48, on_step=lambda t, v: chosen.append(t.verify_width))
            assert out == hf_greedy(hf, prompt, 48)
            prefill = -(-(len(prompt) - 1) // PREFILL_CHUNK)  # the prompt's forwards come first
            steps_target = target_calls[prefill:]
            assert set(steps_target) <= set(params["verify_widths"]), steps_target
            rounds = draft_calls[prefill:]
            assert set(rounds) <= set(COMPILED) and params["draft_width"] in rounds, rounds
    assert len(set(chosen)) > 1, chosen  # the objective traded widths step by step


@pytest.mark.parametrize("tail", ["plain", "ahead"])
@pytest.mark.parametrize("head", ["plain", "ahead"])
@pytest.mark.parametrize("same", [False, True])
def test_every_stage_order_decodes_the_targets_greedy_output(models, tail, head, same):
    """AOT tail and head drafts change only what the drafter has fed when: the output stays the
    target's own. With the target as its own drafter and a verify narrower than the drafted tree,
    the head draft's guess (the verified leaf's best pruned child) is the bonus on most steps, and
    each hit saves the next step's first drafter forward."""
    hf, target, draft = models
    if same:
        draft = runner(to_runtime(hf))
    params = {"depth": 3, "draft_width": 2, "top_k": 3, "verify_widths": [2] if same else [4, 8],
              "stages": {"tail": tail, "head": head}}
    for prompt in prompts(2, seed=34):
        with draft.recording() as draft_calls:
            out, m = decode(target, draft, "egt", params, prompt, 40)
        assert out == hf_greedy(hf, prompt, 40), (tail, head)
        rounds = len(draft_calls) - (len(prompt) > 1)  # the prompt's prefill aside
        ahead = m.steps if "ahead" in (tail, head) else 0  # at most one stage forward per step
        assert rounds <= 3 * m.steps - m.ahead_hits + 1 + ahead  # the last step's hit saves nothing
        if head == "plain":
            assert m.ahead_hits == 0
        elif same:
            assert m.ahead_hits > m.steps / 2, (m.ahead_hits, m.steps)


def test_egt_depth_zero_is_plain_decoding_and_never_runs_the_drafter(models):
    hf, target, draft = models
    prompt = prompts(1, seed=33)[0]
    with draft.recording() as draft_calls:
        out, m = decode(target, draft, "egt", {"depth": 0}, prompt, 24)
    assert out == hf_greedy(hf, prompt, 24) and m.steps == 24 and draft_calls == []


def test_objective_interpolates_context_and_keeps_plain_decoding_at_one():
    c = Curves(PROFILE)
    assert c.t_verify(4, 16) == 11 and c.t_verify(4, 256) == 13
    assert c.t_verify(4, 136) == pytest.approx(12)
    assert c.t_verify(4, 496) == pytest.approx(15)  # past the last context: extrapolated (attention grows with it)
    assert c.t_verify(4, 8) == 11  # before the first: clamped
    falling = Curves(dict(PROFILE, target_ms=[[10, 10, 13, 14, 22], [12, 12, 12, 17, 26]]))
    assert falling.t_verify(4, 10_000) == 12  # never below the longest measured context's time
    assert c.t_verify(6, 16) == 14  # a forward of 6 is padded to the compiled 8
    slow_one = dict(PROFILE, target_ms=[[15, 10, 11, 14, 22], [15, 12, 13, 17, 26]])
    assert objective.undominated(PROFILE["widths"], slow_one["target_ms"]) == [2, 4, 8, 16]
    padded = Curves(slow_one | {"target_widths": [2, 4, 8, 16]})
    assert padded.t_verify(1, 16) == 10 and objective.plain_ms(padded, 16) == pytest.approx(10.2)
    plain = StepShape((), 1)
    assert objective.speedup(1.0, plain, c, 100) == pytest.approx(1.0)
    shape = StepShape((2, 4, 4), 16)
    assert objective.break_even(shape, c, 16) == pytest.approx((3 + 3 + 3 + 22 + 0.6) / 10.2)


def test_a_requests_modelled_time_is_its_prompts_chunks_then_its_steps():
    """prefill_ms: the prompt in forwards of MAX_ROWS tokens, each at its own context; request_ms:
    the target's prefill, the drafter's too where the shape drafts, then new / E[A] steps at the
    context halfway through the output."""
    from ygg_runtime.options import MAX_ROWS

    c = Curves(PROFILE)
    assert objective.prefill_ms(c, "target", 0) == 0.0
    assert objective.prefill_ms(c, "target", 3) == c.t_verify(3, 0)
    two = objective.prefill_ms(c, "draft", MAX_ROWS + 5, start=10)
    assert two == pytest.approx(c.t_draft(MAX_ROWS, 10) + c.t_draft(5, 10 + MAX_ROWS))
    egt = StepShape((2, 4, 4), 16)
    cost = objective.request_ms(egt, 3.0, 200, 60, c)
    assert cost.prefill_ms == pytest.approx(objective.prefill_ms(c, "target", 200) + objective.prefill_ms(c, "draft", 200))
    assert cost.decode_ms == pytest.approx(60 / 3.0 * objective.step_ms(egt, c, 230))
    plain = objective.request_ms(StepShape((), 1), 1.0, 200, 60, c)
    assert plain.prefill_ms == pytest.approx(objective.prefill_ms(c, "target", 200)) and plain.ms == plain.prefill_ms + plain.decode_ms
    windowed = objective.request_ms(egt, 3.0, 200, 60, c, window=50)  # the drafter reads the last 50 prompt tokens
    prefills = objective.prefill_ms(c, "target", 200) + objective.prefill_ms(c, "draft", 50)
    assert windowed.prefill_ms == pytest.approx(prefills)
    assert windowed.decode_ms == pytest.approx(60 / 3.0 * objective.step_ms(egt, c, 230, 80))
    assert objective.request_ms(egt, 3.0, 40, 60, c, window=50) == objective.request_ms(egt, 3.0, 40, 60, c)
    assert objective.windowed_tokens_per_step(3.0, 0.75) == pytest.approx(2.5)


@pytest.mark.parametrize("method", ["egt", "chain", "specinfer"])
def test_a_drafter_that_reads_a_window_feeds_only_the_prompts_last_tokens_and_the_output_stays_the_targets(models, method):
    """A drafter with a window prefills the prompt's last `window` tokens (after the prefix cache's,
    which it keeps), at positions that run on; every later step feeds only what is new, and the
    output is the target's (the drafter only proposes)."""
    from ygg_runtime.decoding.engine import generate
    from ygg_runtime.model.runner import PrefixCache

    hf, target, draft = models
    prompt = prompts(1, seed=35)[0] * 3
    ref = hf_greedy(hf, prompt, 24)
    params = {"egt": {"depth": 3, "draft_width": 2}, "chain": {"k": 3}, "specinfer": {"depth": 2, "width": 2}}[method]
    drafter = Drafter(draft, target.vocab_size, window=16)
    with draft.recording() as fed:
        out, _ = generate(target, build(method, params, drafter), prompt, max_new_tokens=24)
    assert out == ref and fed[0] == 16 and sum(fed) < len(prompt) // 2
    assert drafter.cut == len(prompt) - 1 - 16 and drafter.view(prompt[:-1]) == prompt[-17:-1]
    draft.prefix = PrefixCache(prompt[:5])  # a shared prefix stays in view, before the window
    try:
        out, _ = generate(target, build(method, params, drafter), prompt, max_new_tokens=24)
        assert out == ref and drafter.head == 5 and drafter.view(prompt[:-1]) == prompt[:5] + prompt[-17:-1]
    finally:
        draft.prefix = None


def test_pruning_every_size_from_one_table_matches_the_single_size_search():
    rng = random.Random(5)
    for _ in range(50):
        n = rng.randint(1, 30)
        parents = [-1] + [rng.randrange(v) for v in range(1, n)]
        values = [1.0] + [rng.random() for _ in range(1, n)]
        pruning = Pruning(parents, values, 16)
        for k in range(1, 17):
            assert pruning.nodes(k) == best_subtree(parents, values, k)


def test_acceptance_map_is_monotone_and_bounded():
    m = AcceptanceMap([[0.0, 0.0], [0.2, 0.1], [0.5, 0.7], [1.0, 0.95]])
    qs = [i / 100 for i in range(101)]
    vals = [m(q) for q in qs]
    assert all(0 <= a <= 1 for a in vals) and vals == sorted(vals) and m(0.35) == pytest.approx(0.4)
    assert AcceptanceMap()(0.3) == pytest.approx(0.3)  # uncalibrated: the draft probability itself


@pytest.fixture(scope="module")
def probe(models):
    hf, target, draft = models

    texts = ["def add(a, b):\n    return a + b\n", "Once upon a time there was a", "SELECT name FROM users WHERE"]
    return calibrate.run_probe(target, draft, ByteCodec(), texts, 24, Reporter())


def test_calibration_replay_of_the_probe_itself_reproduces_every_step(probe):
    """Replaying the probe's own shape on its recorded trees gives exactly the accepted lengths
    the real run had: the replay runs the runtime's growth, pruning and acceptance."""
    egt = Planner(EGTParams(calibrate.PROBE_DEPTH, calibrate.PROBE_WIDTH, calibrate.PROBE_TOP_K, [calibrate.PROBE_VERIFY]))
    assert len(probe.steps) > 10
    assert [calibrate.replay(egt, calibrate.PROBE_DEPTH, s)[0] for s in probe.steps] == [s.accepted for s in probe.steps]
    for prompt in range(probe.prompts):  # every prompt decoded its 24 tokens, the last step cut to fit
        lengths = [s.accepted for s in probe.steps if s.prompt == prompt]
        assert sum(lengths[:-1]) < 24 <= sum(lengths)


def test_calibration_statistics_and_the_plan_from_them(probe):
    ranks = probe.rank_acceptance()
    assert 0 < sum(ranks) <= 1 and ranks[0] == max(ranks)
    points = calibrate.acceptance_map(probe)
    accept = [a for _, a in points]
    assert accept == sorted(accept) and 0 <= accept[0] and accept[-1] <= 1
    curves = Curves(PROFILE)
    params, rows = calibrate.plan_egt(calibrate.replay_all(probe, curves, points, COMPILED, COMPILED), points, COMPILED)
    best = max(rows, key=lambda r: r["speedup"])
    assert params["depth"] == best["depth"] and rows[0]["depth"] == 0 and rows[0]["speedup"] == 1.0
    deeper = [r["tokens_per_step"] for r in rows if r["draft_width"] == 1]
    assert deeper == sorted(deeper)  # a deeper chain never yields fewer tokens
    seq, table = calibrate.plan_sequoia(ranks, curves, COMPILED, 64)
    assert seq["parents"][0] == -1 and max(r["speedup"] for r in table) >= 1.0


def test_a_useless_drafter_plans_depth_zero(models):
    """An unrelated random drafter: no tree pays for itself, so egt and sequoia fall back to plain."""
    hf, target, _ = models
    useless = runner(to_runtime(tiny.hf_model("llama", seed=99)))

    calib = calibrate.run_probe(target, useless, ByteCodec(), ["the quick brown fox", "import os\n"], 16, Reporter())
    curves = Curves(PROFILE)
    accept = calibrate.acceptance_map(calib)
    params, _ = calibrate.plan_egt(calibrate.replay_all(calib, curves, accept, COMPILED, COMPILED), accept, COMPILED)
    seq, _ = calibrate.plan_sequoia(calib.rank_acceptance(), curves, COMPILED, 64)
    assert params["depth"] == 0 and seq["parents"] == [-1]


@pytest.mark.real
def test_a_layer_truncated_smollm2_drafter_plans_the_depth_its_measured_costs_favour(tmp_path, smollm2_dir, smollm2_tokenizer):
    """SmolLM2-135M drafted by its own first layer (embeddings and head included, so a third of
    the target's cost for little agreement): the calibration sees little agreement, and the plan
    takes the candidate with the best modelled speed-up from this machine's costs (depth 0 on the
    EPYCs, 2 on a Xeon whose wide forwards cost little more than one row: which depth wins is the
    machine's, that the objective's maximum is taken is not). At depth 0 `ygg run --method egt` is
    plain decoding, token for token; at any depth its output is `ar`'s. --quick leaves the depth predictor
    out, so the planned depth is every step's (a predictor would pick each step's depth). The
    target comes from its GGUF package into an artifact that holds its float weights: the compile
    caches no dequantized copy of them (a cache of its own, to see that). `--weights bf16` says so:
    `auto` holds a GGUF target as integer codes on CPUs where the quantized kernel has a vector path
    (AVX-512 VNNI or AVX2), and then caches the conversion it quantizes from."""
    import json

    import yaml
    from helpers import ygg
    from transformers import AutoModelForCausalLM

    from ygg_compile.cache import entries

    draft = tmp_path / "smollm2-1-layer"
    AutoModelForCausalLM.from_pretrained(smollm2_dir, num_hidden_layers=1).save_pretrained(draft)
    smollm2_tokenizer.save_pretrained(draft)
    calib = tmp_path / "calib.txt"
    calib.write_text("Write a haiku about autumn.\n---\nWhat is the capital of France?\n---\ndef is_even(n):\n")
    out = tmp_path / "art"
    cache = {"YGG_CACHE": str(tmp_path / "cache")}
    # The suite's native kernels serve here too (building them takes ~50 s of one core): what this
    # compile must not cache, a conversion, would still land in the private cache.
    shared = Path(os.environ["YGG_CACHE"]) / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(shared, target_is_directory=True)
    proc = ygg("compile", "--draft", draft, "--target", "smollm2-135m", "-o", out, "--max-context", 256,
               "--calib", calib, "--calib-tokens", 24, "--no-aot", "--quick", "--weights", "bf16", env=cache)
    assert proc.returncode == 0, proc.stderr
    assert [e.kind for e in entries(tmp_path / "cache") if e.kind == "conversions"] == []
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    egt, table = plan["methods"]["egt"], plan["planning"]["egt"]
    best = max(table, key=lambda r: r["speedup"])
    chosen = next(r for r in table if r["depth"] == egt["depth"] and max(1, r["draft_width"]) == egt["draft_width"])
    assert chosen["speedup"] == best["speedup"], table
    # little agreement: one drafted token is accepted well under half the time
    assert all(r["tokens_per_step"] < 1.5 for r in table if r["depth"] == 1), table

    def run(*a):
        return json.loads(ygg("run", calib, "-a", out, "-n", 16, "--json", "--ignore-eos", *a, env=cache).stdout)

    ar, grafted, plain = run("-m", "ar"), run("-m", "egt"), run("-m", "egt", "--no-graft")
    assert grafted["token_ids"] == plain["token_ids"] == ar["token_ids"]
    if egt["depth"] == 0:  # no drafter forward; with grafting a step may verify retrieved tokens alone
        assert plain["steps"] == 16 and grafted["steps"] <= 16


def test_runners_pad_every_forward_to_their_compiled_widths_and_outputs_stay_the_targets(models):
    """The artifact gives each runner its compiled widths (W = 1 left out where W = 2 is faster):
    a one-token forward then runs as two, with the same logits, and greedy output is unchanged."""
    hf, target, draft = models
    prompt = prompts(1, seed=34)[0]
    target.reset()
    target.prefill(prompt[:-1])
    plain = target.forward_chain(prompt[-1:])
    try:
        target.widths, draft.widths = (2, 4, 8, 16), (2, 4, 8)
        target.reset()
        target.prefill(prompt[:-1])
        with target.recording() as calls:
            padded = target.forward_chain(prompt[-1:])
        assert calls == [2] and torch.allclose(plain, padded, atol=1e-5)
        ref = hf_greedy(hf, prompt, 32)
        for method, params in (("ar", {}), ("egt", {"depth": 3, "draft_width": 2, "top_k": 2, "verify_widths": [2, 4, 8]})):
            with target.recording() as target_calls, draft.recording() as draft_calls:
                assert decode(target, draft, method, params, prompt, 32)[0] == ref
            assert set(target_calls[1:]) <= {2, 4, 8, 16} and set(draft_calls[1:]) <= {2, 4, 8}
    finally:
        target.widths = draft.widths = ()


def priced_egt(dec, monkeypatch) -> None:
    """The decoder's plan as egt at depth 3 (2.5 calibrated tokens a step) over made-up curves in
    which a drafter forward costs about a third of a verify, and prompts cost by their length."""
    monkeypatch.setattr(dec, "default_method", "egt")
    egt = dec.methods["egt"]
    monkeypatch.setitem(dec.methods, "egt", dataclasses.replace(egt, depth=3, draft_width=1, verify_width=4,
                                                                 tokens_per_step=2.5))
    widths = [1, 2, 4, 8, 16, 32, 64]
    profile = {"widths": widths, "contexts": [64, 2048], "threads": 1,
               "target_ms": [[10 + 0.1 * w for w in widths], [14 + 0.1 * w for w in widths]],
               "draft_ms": [[3 + 0.05 * w for w in widths], [5 + 0.05 * w for w in widths]],
               "other_ms": [0.1] * len(widths)}
    monkeypatch.setattr(dec, "curves", lambda: Curves(profile))


def test_a_request_runs_plain_steps_where_the_drafters_prefill_would_not_pay(artifact, monkeypatch):
    """With no method named, a request runs the plan's egt unless steps without the drafter are
    modelled faster over the whole request: a long prompt (the drafter's prefill) and a short
    output pick pld (retrieval only: plain decoding's steps where the prompt offers nothing), or ar
    in an artifact without pld; a short prompt and a long output keep egt; a named method is run as
    asked. What was chosen and why is in the result (`--json`'s "choice", `--stats`' "method chosen")."""
    import ygg_runtime

    dec = ygg_runtime.load(artifact)
    assert "pld" in dec.methods
    priced_egt(dec, monkeypatch)
    monkeypatch.setattr(dec.plan, "draft_window", None)  # the drafter reads every prompt whole
    choice = dec.choose(3000, 16)
    assert choice.method == "pld" and choice.why.startswith("modelled egt") and "plain steps" in choice.why
    assert dec.choose(20, 200).method == "egt"
    result = dec.generate(list(range(3, 200)), max_new_tokens=2)
    assert result.method == "pld" and result.to_json()["choice"].startswith("modelled egt")
    assert result.token_ids == dec.generate(list(range(3, 200)), max_new_tokens=2, method="ar").token_ids
    assert dec.generate(list(range(3, 200)), max_new_tokens=2, method="egt").to_json()["choice"] == "asked for"
    monkeypatch.delitem(dec.methods, "pld")
    assert dec.choose(3000, 16).method == "ar"
    monkeypatch.setattr(dec, "curves", lambda: None)  # nothing to model with: the plan's method
    assert dec.choose(3000, 16) == Choice("egt", None, "the plan's method")


def test_a_long_request_may_run_the_plans_method_with_a_drafter_that_reads_only_a_window(artifact, monkeypatch):
    """Where compile measured what a window keeps of the drafter's acceptance, a request may run the
    plan's method with a drafter that reads only the prompt's last K tokens: chosen when that is
    modelled faster over the whole request than the whole prompt (its prefill) and than plain steps
    (a window that keeps little acceptance is not, nor one within the margin of plain steps). The
    output is ar's; --json says the window."""
    import ygg_runtime
    from ygg_runtime.schema.plan import DraftWindow

    dec = ygg_runtime.load(artifact)
    measured = dec.plan.draft_window  # compile measured the windows its context leaves room for
    assert measured.windows == [64, 128] and measured.text_tokens == 256 and len(measured.kept) == 2
    priced_egt(dec, monkeypatch)
    window = DraftWindow(windows=[32, 256], kept=[0.5, 0.97], acceptance=0.7, text_tokens=4096, positions=256,
                         source="test", seconds=0.0)
    monkeypatch.setattr(dec.plan, "draft_window", window)
    choice = dec.choose(3000, 400)
    assert (choice.method, choice.window) == ("egt", 256) and "reading the last 256 tokens" in choice.why
    assert dec.choose(100, 400).window is None  # nothing to leave out of a short prompt
    # 8 new tokens: the window is modelled 1.8 % faster than plain steps (1.015 s against 1.033 s),
    # short of the margin a window must win by over them
    assert dec.choose(3000, 8) == Choice("pld", None, dec.choose(3000, 8).why)
    monkeypatch.setattr(window, "kept", [0.5, 0.3])  # windows that lose most of the acceptance
    assert dec.choose(3000, 400).window is None
    prompt = list(range(3, 200))
    monkeypatch.setattr(dec, "choose", lambda prompt, new: Choice("egt", 32, "modelled"))
    result = dec.generate(prompt, max_new_tokens=40)
    assert result.method == "egt" and result.to_json()["metrics"]["draft_window"] == 32
    assert result.token_ids == dec.generate(prompt, max_new_tokens=40, method="ar").token_ids
    forced = dec.generate(prompt, max_new_tokens=40, method="egt", draft_window=64)
    assert forced.metrics.draft_window == 64 and forced.token_ids == result.token_ids
    assert dec.generate(prompt, max_new_tokens=4, method="egt").metrics.draft_window == 0


def test_calibrations_answers_run_to_their_first_end_token_or_are_cut_off_at_the_budget():
    """`calibrate.output_length`: each continuation counts up to and with its first end token; one
    that has none is counted whole and as still running (censored at the budget)."""
    texts = {0: [1, 2, 7, 7, 9, 4], 1: [1, 2, 3, 5, 6, 6, 6], 2: [1, 2, 9, 5, 9], 3: [1, 2]}
    lengths = {0: 2, 1: 2, 2: 2, 3: 2}  # prompt 3 made nothing: not an answer
    found = calibrate.output_length(calibrate.Calibration([], 4, 10, 0.0, texts, lengths), [9, 8])
    assert found == {"answers": 3, "ended": 2, "tokens": 3 + 5 + 1, "budget": 5}
    assert calibrate.output_length(calibrate.Calibration([], 4, 10, 0.0, texts, lengths), []) is None


def test_a_request_is_expected_to_make_the_tokens_an_answer_length_fitted_to_calibration_leaves_it():
    """`objective.expected_tokens`: with h = answers ended / answer tokens seen, E[min(L, B)] is
    the sum over t < B of P(L > t) = (1 - h)^t; nothing ended, or nothing measured, is the budget."""
    from ygg_runtime.schema.plan import OutputLength

    length = OutputLength(answers=18, ended=3, tokens=300, budget=48)
    h = 3 / 300
    for budget in (1, 16, 64, 256, 4000):
        survival = sum((1 - h) ** t for t in range(budget))
        assert objective.expected_tokens(length, budget) == max(1, round(survival))
    assert objective.expected_tokens(length, 256) < 256 and objective.expected_tokens(length, 4000) == round(1 / h)
    assert objective.expected_tokens(OutputLength(18, 0, 864, 48), 256) == 256
    assert objective.expected_tokens(None, 256) == 256


def test_a_request_whose_answer_is_expected_to_end_early_is_priced_at_that_length(artifact, monkeypatch):
    """`Decoder.choose` prices the tokens a budget is expected to make (`Plan.output_length`):
    where answers end soon, the drafter's prefill over a long prompt is not repaid and plain steps
    run; the reason names the expected length and the budget."""
    import ygg_runtime
    from ygg_runtime.schema.plan import OutputLength

    dec = ygg_runtime.load(artifact)
    measured, cal = dec.plan.output_length, dec.plan.calibration  # compile measured its answers
    assert measured.answers == cal.prompts and measured.budget == cal.tokens // cal.prompts
    assert measured.tokens <= cal.tokens and 0 <= measured.ended <= measured.answers
    priced_egt(dec, monkeypatch)
    monkeypatch.setattr(dec.plan, "draft_window", None)
    monkeypatch.setattr(dec.plan, "output_length", None)
    assert dec.choose(3000, 400).method == "egt"
    monkeypatch.setattr(dec.plan, "output_length", OutputLength(answers=18, ended=12, tokens=240, budget=48))
    choice = dec.choose(3000, 400)
    assert choice.method == "pld" and choice.why.endswith("for 3000 + 20 tokens (expected of a budget of 400)")


def test_the_acceptance_a_window_keeps_is_the_drafters_greedy_agreement_reading_only_it(models):
    """`calibrate.window_acceptance`: at the text's last positions, the drafter's argmax against
    the target's, reading the whole text and only the last w tokens before them — the same
    figures as whole teacher-forced passes give; windows that leave nothing out are dropped."""
    _, target, draft = models
    text = (prompts(1, seed=36)[0] * 4)[:300]
    found = calibrate.window_acceptance(target, draft, text, windows=(16, 64, 290), positions=32)
    assert found["windows"] == [16, 64] and found["text_tokens"] == 300
    start = 300 - 32
    want = calibrate._teacher_forced(target, text, 64)[0][start:].argmax(-1)

    def agree(seq):
        d = calibrate._teacher_forced(draft, seq, 64)[0][-32:].argmax(-1)
        return (d == want).float().mean().item()

    whole = agree(text)
    assert found["acceptance"] == pytest.approx(whole, abs=1e-4)
    assert found["kept"] == [pytest.approx(agree(text[start - w :]) / whole, abs=1e-4) for w in (16, 64)]
    assert calibrate.window_acceptance(target, draft, text[:40], windows=(16,), positions=32) is None


class Scales:
    """A request's estimate as `grow` reads it: a price factor per depth (some above 1, so the cap
    at 1 matters)."""

    def __init__(self, by_depth: list[float]):
        self.by_depth = by_depth

    def scale(self, source: int, depth: int) -> float:
        return self.by_depth[min(depth, len(self.by_depth)) - 1]


@pytest.mark.parametrize("depth,width,k", [(4, 4, 4), (3, 2, 3), (5, 1, 2), (2, 8, 2), (4, 8, 1)])
@pytest.mark.parametrize("scales", [None, [1.4, 0.6, 1.0, 2.5, 0.3]])
def test_egt_rounds_on_the_device_grow_the_tree_the_host_grows(models, depth, width, k, scales):
    """`Planner.grow_on` (the rounds chosen and fed on the drafter's device, the tree read once)
    against `Planner.grow` with the drafter's rows read every round: the same nodes, tokens,
    parents, draft probabilities and path values, bit for bit, and the same nodes fed, for several
    shapes, uncalibrated and calibrated acceptance maps, and with a request's price factors."""
    from ygg_runtime.decoding.proposers import StepState

    _, target, draft = models
    accept = [[0.0, 0.0], [0.05, 0.02], [0.2, 0.3], [0.5, 0.55], [1.0, 0.97]]
    for prompt, calibrated in zip(prompts(3, seed=40), (False, True, True)):
        params = EGTParams(depth=depth, draft_width=width, top_k=k, verify_widths=list(COMPILED),
                           accept=accept if calibrated else None)
        planner = Planner(params)
        estimate = Scales(scales) if scales is not None else None
        trees, fed = [], []
        for on_device in (False, True):
            drafter = Drafter(draft, target.vocab_size)
            drafter.reset()
            drafter.prefill(prompt[:-1])
            rows = drafter.begin(prompt)
            if on_device:
                tree = planner.grow_on(drafter, prompt[-1], rows, depth, estimate)
            else:
                state = StepState(list(prompt))

                def expand(tree, picks, drafter=drafter, state=state):
                    return state.top(drafter.expand(tree, picks, width), [tree.depths[v] for v in picks], k)

                (root,) = state.top(rows, [0], k)
                tree = planner.grow(prompt[-1], root, expand, depth, estimate)
            trees.append((tree.tokens, tree.parents, tree.depths, tree.draft_probs, tree.path_values, tree.accepts))
            fed.append(drafter.fed)
        assert trees[0] == trees[1] and fed[0] == fed[1]
        assert len(trees[0][0]) > 1 + k  # the rounds added nodes
