"""The depth predictor: trained on calibration steps, exported as plain tensors, read by egt at
run time to pick each step's depth."""

import json
import subprocess
import sys

import pytest
import tiny
import torch
from helpers import (COMPILED, assert_one_line_error, PROFILE, depth_policy, hf_greedy, noised_runtime, random_predictor, runner,
                     to_runtime, with_random_predictor, ygg)

from ygg_compile import predictor_training
from ygg_compile import calibrate
from ygg_compile.calibrate import PROBE_DEPTH, Agreement, Calibration, ProbeStep
from ygg_runtime.decoding import objective
from ygg_runtime.decoding.engine import generate
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.params import StepShape
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.proposers import Drafter, build


def synthetic(prompts: int = 8, length: int = 120, dim: int = 24, seed: int = 0) -> tuple[Calibration, Agreement]:
    """Texts of easy stretches (the drafter's top token is the target's) and hard ones (rank 9),
    where the hidden state at q says how long a run starts at the next root q + 1: h[0] is that
    length plus a little noise, the other dimensions noise. Plus a probe step every 5 positions whose
    accepted length is the top-1 run at its root."""
    g = torch.Generator().manual_seed(seed)
    hidden, rank, prompt, position, steps = [], [], [], [], []
    for q in range(prompts):
        r = []
        while len(r) < length:
            r += [0] * int(torch.randint(1, 9, (1,), generator=g)) + [9] * int(torch.randint(1, 4, (1,), generator=g))
        r = torch.tensor(r[:length])
        rank.append(r)
        prompt += [q] * length
        position += list(range(length))
    ag = Agreement(torch.zeros(0), torch.cat(rank), prompt, position, {q: length + 1 for q in range(prompts)})
    run = ag.run(1, PROBE_DEPTH)
    for i in range(len(prompt)):
        h = torch.randn(dim, generator=g)
        nxt = i + 1 if i + 1 < len(prompt) and prompt[i + 1] == prompt[i] else None
        h[0] = (int(run[nxt]) if nxt is not None else 0) + 0.3 * h[0]
        hidden.append(h)
    ag.hidden = torch.stack(hidden)
    for i in range(1, len(prompt), 5):
        if prompt[i - 1] == prompt[i]:
            steps.append(ProbeStep([-1], [0], [1.0], {}, {}, 1 + int(run[i]), position[i] + 1, prompt[i], ag.hidden[i - 1]))
    return Calibration(steps, prompts, len(prompt), 0.0), ag


def test_agreement_runs_count_the_next_tokens_the_drafter_ranks_within_top():
    ag = Agreement(torch.zeros(0), torch.tensor([0, 1, 0, 0, 3, 0, 0, 0]), [0] * 5 + [1] * 3, [0, 1, 2, 3, 4, 0, 1, 2], {0: 6, 1: 4})
    assert ag.run(1, 6).tolist() == [1, 0, 2, 1, 0, 3, 2, 1]  # runs stop at a rank >= top and at a text's end
    assert ag.run(2, 6).tolist() == [4, 3, 2, 1, 0, 3, 2, 1]
    assert ag.run(2, 2).tolist() == [2, 2, 2, 1, 0, 2, 2, 1]


def test_agreement_of_a_model_with_itself_ranks_every_target_token_first(models):
    hf, target, _ = models
    g = torch.Generator().manual_seed(36)
    texts = {0: torch.randint(0, 256, (70,), generator=g).tolist(), 3: torch.randint(0, 256, (40,), generator=g).tolist()}
    ag = calibrate.agreement(target, target, texts, chunk=16)
    assert ag.rank.eq(0).all() and len(ag.prompt) == 69 + 39 and ag.hidden.shape == (108, target.model.args.dim)
    with torch.no_grad():
        want = hf(torch.tensor([texts[3]]), output_hidden_states=True).hidden_states[-1][0, :-1]
    got = ag.hidden[[ag.row(3, p) for p in range(39)]]
    assert torch.allclose(got, want, atol=1e-4)


def test_labels_use_the_top_whose_runs_match_the_probes_accepted_lengths():
    calib, ag = synthetic()
    ag.rank = torch.where(ag.rank == 0, torch.randint(0, 2, ag.rank.shape), ag.rank)  # top-2 runs now = the probe's
    for s in calib.steps:
        s.accepted = 1 + int(ag.run(2, PROBE_DEPTH)[ag.row(s.prompt, s.context - 1)])
    top, corr = predictor_training.label_top(calib, ag)
    assert top == 2 and corr > 0.999


def test_best_depth_maximises_tokens_per_modelled_ms():
    curves = Curves(PROFILE)
    shapes = [StepShape((), 1)] + [StepShape((2,) + (2,) * (d - 1), 8) for d in range(1, 7)]
    factors = [1.0] * 7
    assert objective.best_depth([0.0] * 6, factors, shapes, curves, 100) == 0  # nothing accepted: plain decoding
    assert objective.best_depth([1.0] * 6, factors, shapes, curves, 100) == 6  # everything accepted: go deep
    for reach in ([0.9, 0.5, 0.2, 0.1, 0.0, 0.0], [0.95, 0.9, 0.85, 0.3, 0.1, 0.05], [0.3, 0.05, 0, 0, 0, 0]):
        rate = [(1 + sum(reach[:d])) / objective.step_ms(shapes[d], curves, 100) for d in range(7)]
        assert objective.best_depth(reach, factors, shapes, curves, 100) == max(range(7), key=rate.__getitem__)
    # a factor below one (the runtime tree accepts less than the deep probe) lowers the depth
    reach = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7]
    assert objective.best_depth(reach, [1.0] + [0.3] * 6, shapes, curves, 100) < objective.best_depth(reach, factors, shapes, curves, 100)


def test_predictor_learns_the_accepted_length_from_the_hidden_state_on_held_out_prompts():
    calib, ag = synthetic()
    trained = predictor_training.train(calib, ag)
    assert trained is not None and trained.top == 1
    m = trained.metrics
    assert m["folds"] == 4 and m["prompts"] == 8
    aucs = [h["auc"] for h in m["heads"]]
    assert all(a > 0.9 for a in aucs), m["heads"]  # every head is a threshold on h[0]
    assert m["depth_mae"] < 0.7 * m["baseline_depth_mae"], m
    # every probe step is judged by the fold that did not train on its prompt
    assert sorted(trained.step_reach) == list(range(len(calib.steps)))


def test_exported_predictor_gives_the_scikit_learn_probabilities():
    calib, ag = synthetic(seed=1)
    trained = predictor_training.train(calib, ag)
    x = ag.hidden.numpy()
    want = trained.model.predict_proba(x)
    got = DepthPredictor(trained.tensors).raw(torch.from_numpy(x)).numpy()
    assert got.shape == (len(x), PROBE_DEPTH)
    assert abs(got - want).max() < 1e-5
    reach = DepthPredictor(trained.tensors).reach(torch.from_numpy(x[0]))
    assert reach == sorted(reach, reverse=True) and all(0 <= p <= 1 for p in reach)


def test_too_little_calibration_trains_no_predictor():
    assert predictor_training.train(*synthetic(prompts=1)) is None  # nothing to validate on
    assert predictor_training.train(*synthetic(prompts=2, length=30)) is None  # too few positions


@pytest.fixture(scope="module")
def models():
    hf = tiny.hf_model("llama", seed=30)
    target = to_runtime(hf)
    return hf, runner(target), runner(noised_runtime(target, 0.05, seed=31))


def test_egt_with_a_predictor_picks_a_depth_each_step_and_keeps_the_targets_greedy_output(models):
    """A predictor whose reach swings with the hidden state: egt changes depth from step to step
    (plain steps included, after which the drafter catches up), every forward keeps a compiled
    width, and the output is the target's own greedy output."""
    from ygg_runtime.model.runner import PREFILL_CHUNK

    hf, target, draft = models
    params = {"depth": 2, "draft_width": 2, "top_k": 4, "verify_widths": list(COMPILED), "depth_policy": depth_policy()}
    try:
        target.widths, draft.widths = COMPILED, (2, 4, 8)
        egt = build("egt", params, Drafter(draft, target.vocab_size), Curves(PROFILE), DepthPredictor(random_predictor(64)))
        depths = []
        g = torch.Generator().manual_seed(35)
        for n in (1, 5, 90):
            prompt = torch.randint(0, 256, (n,), generator=g).tolist()
            with target.recording() as target_calls, draft.recording() as draft_calls:
                out, m = generate(target, egt, prompt, max_new_tokens=64)
            assert out == hf_greedy(hf, prompt, 64)
            depths += m.tree_depths
            skip = -(-(n - 1) // PREFILL_CHUNK)  # the prompt's chunks run at their own lengths
            assert set(target_calls[skip:]) <= set(COMPILED), target_calls
            assert set(draft_calls[skip:]) <= {2, 4, 8}, draft_calls
    finally:
        target.widths = draft.widths = ()
    assert 0 in depths and len(set(depths)) >= 3, depths


def test_egt_with_a_predictor_samples_the_targets_distribution():
    from test_sampling import ALPHA, N_TOKENS, PROMPT, SAMPLES, VOCAB, chi_square_pvalue, exact_joint, sampling_models

    target, draft = sampling_models()
    params = {"depth": 2, "draft_width": 2, "top_k": 3, "verify_widths": [2, 4, 8], "depth_policy": depth_policy()}
    egt = build("egt", params, Drafter(draft, target.vocab_size), Curves(PROFILE), DepthPredictor(random_predictor(32, seed=4)))
    counts, depths = torch.zeros(VOCAB * VOCAB), set()
    for seed in range(SAMPLES):
        out, m = generate(target, egt, PROMPT, max_new_tokens=N_TOKENS, temperature=1.0, seed=seed)
        counts[out[0] * VOCAB + out[1]] += 1
        depths.update(m.tree_depths)
    assert len(depths) >= 2, depths
    assert chi_square_pvalue(counts, exact_joint(target, 1.0)) > ALPHA


@pytest.fixture(scope="module")
def predicted(artifact, tmp_path_factory):
    return with_random_predictor(artifact, tmp_path_factory.mktemp("pred") / "art")


def test_run_with_and_without_the_predictor_is_the_targets_greedy_output(pair, predicted, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Once upon a time")
    want = hf_greedy(pair["hf"], list(b"Once upon a time"), 40)
    runs = {}
    for flags in ((), ("--no-predictor",)):
        proc = ygg("run", prompt, "-a", predicted, "-m", "egt", "-n", 40, "--json", "--raw", "--ignore-eos", *flags)
        assert proc.returncode == 0, proc.stderr
        runs[flags] = json.loads(proc.stdout)
        assert runs[flags]["token_ids"] == want
    fixed = runs[("--no-predictor",)]["metrics"]["mean_tree_depth"]
    assert runs[()]["metrics"]["mean_tree_depth"] != fixed  # the predictor did move the depth


def test_runtime_runs_the_predictor_without_scikit_learn(predicted):
    code = (
        "import sys, ygg_runtime\n"
        f"d = ygg_runtime.load({str(predicted)!r})\n"
        "assert d.predictor is not None\n"
        "r = d.generate('hello there', max_new_tokens=24, method='egt', ignore_eos=True)\n"
        "assert len(set(r.metrics.tree_depths)) > 1, r.metrics.tree_depths\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('sklearn', 'transformers', 'ygg_compile')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_compile_reports_the_predictor_and_no_predictor_leaves_it_out(tmp_path, pair, artifact):
    import yaml

    report = yaml.safe_load((artifact / "plan.yaml").read_text())["planning"]["predictor"]
    assert len(report["heads"]) == PROBE_DEPTH and report["validation_steps"] > 0  # trained on the default prompts
    assert report["depth_mae"] >= 0 and "validation_speedup" in report
    out = tmp_path / "fixed"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "float32",
               "--max-context", 256, "--calib-tokens", 8, "--no-predictor", "--no-aot")
    assert proc.returncode == 0, proc.stderr
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert "depth_policy" not in plan["methods"]["egt"] and not (out / "predictor.safetensors").exists()
    assert plan["planning"]["predictor"] == {"used": False, "why": "--no-predictor"}
    assert "depth predictor: none (--no-predictor)" in proc.stderr
    both = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", tmp_path / "x", "--no-predictor", "--force-predictor")
    assert_one_line_error(both, "--no-predictor and --force-predictor contradict each other")
    assert not (tmp_path / "x").exists()


def test_force_predictor_puts_the_predictor_in_the_plan_even_without_a_gain(tmp_path, pair):
    import yaml

    out = tmp_path / "forced"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "float32",
               "--max-context", 256, "--calib-tokens", 8, "--force-predictor", "--no-aot")
    assert proc.returncode == 0, proc.stderr
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    report = plan["planning"]["predictor"]
    assert report["used"] and plan["methods"]["egt"]["depth_policy"]["file"] == "predictor.safetensors"
    assert "predictor.safetensors" in plan["files"]
    gained = report["validation_speedup"] >= predictor_training.MIN_GAIN * report["fixed_validation_speedup"]
    assert gained or "used anyway: --force-predictor" in report["why"]


def test_bench_times_egt_with_and_without_its_predictor(predicted, artifact, tmp_path):
    proc = ygg("bench", "--artifact", predicted, "--peers", "none", "--methods", "egt,egt-fixed", "-n", 12, "-o", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["config"]["contestants"] == ["ar", "egt", "egt-fixed"]
    overall = {r["contestant"]: r for r in results["summary"] if r["category"] == "all"}
    assert overall["egt"]["same_as_ar"] == overall["egt-fixed"]["same_as_ar"] == overall["egt"]["prompts"]
    assert overall["egt"]["mean_tree_depth"] != overall["egt-fixed"]["mean_tree_depth"]
    if not yaml_plan(artifact)["methods"]["egt"].get("depth_policy"):
        proc = ygg("bench", "--artifact", artifact, "--peers", "none", "--methods", "egt-fixed", "-n", 4, "-o", tmp_path / "c")
        assert_one_line_error(proc, "egt-fixed is egt without its depth predictor")


def yaml_plan(artifact):
    import yaml

    return yaml.safe_load((artifact / "plan.yaml").read_text())
