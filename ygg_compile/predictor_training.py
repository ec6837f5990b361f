"""Train the depth predictor on calibration text, export it for the runtime, and plan the
per-step depth policy it drives (docs/design.md, "egt"; the runtime half is `ygg_runtime.decoding.predictor`).

Data (`calibrate.Agreement`): at every position q of every calibration text (prompt and the
target's continuation), the target's final hidden state — what the runtime sees after a step whose
last accepted token sits at q — and the label A: how many of the tokens after the next root (the
bonus at q + 1) a tree would get accepted, the run of positions from q + 1 where the target's greedy
token is among the drafter's top `top` candidates. `top` is the one whose runs best match the deep
probe's measured accepted lengths (`label_top`). Head d (1..D_max) learns P(A >= d), multi-label.
Prompts, not positions, are split into training and validation, so the validation figures are on
text the predictor never saw.

The policy: at run time `objective.best_depth` turns the heads into tokens per step for every
depth and picks the fastest. Here that exact rule is run on every probe step (with the reach of the
fold that did not see its prompt) through the recorded replays (`calibrate.Replays`) for every draft width, and the predictor is
used only when its best policy beats the fixed plan there.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ygg_compile.calibrate import PROBE_DEPTH, PROBE_TOP_K, Agreement, Calibration, Replays
from ygg_runtime.options import MIN_GAIN
from ygg_runtime.decoding import objective
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.schema.params import EGTParams
from ygg_runtime.decoding.proposers.egt import Planner

HIDDEN_LAYERS = (32, 16)
# L2 strengths tried (cross-validated Brier picks). ~1 k positions from a dozen prompts against a
# ~1.5 k-dimensional hidden state need strong L2: on the Qwen pair alpha 1e-2 gave held-out Brier
# scores worse than a constant (over-confident heads); 100 beats the constant at the same AUC.
ALPHAS = (1.0, 10.0, 100.0)
MIN_ROWS = 100  # fewer training positions than this: no predictor
TOPS = (1, 2, 3, 4, 8)  # candidate `top` for the labels
FOLDS = 4  # cross-validation folds over prompts
# The predictor is used when its held-out modelled speed-up is at least the fixed depth's times
# MIN_GAIN (`ygg_runtime.options`): on the Zen 5 EPYC the Qwen pair's predictor tied (1.701× vs 1.699×)
# and `make bench` measured it slower than the fixed depth in all six categories, 1.53× against 1.61×
# llama.cpp over 60 prompts (docs/measured.md). An earlier tie on the Zen 4 EPYC (1.415× vs 1.412×, an
# older kernel and plan) measured 1.06× faster on code: 2 % keeps the predictor where the model says it
# wins, not where it cannot tell.
MAX_ITER = 200
FILE = "predictor.safetensors"


@dataclass
class Samples:
    """The predictor's data: features x [n, dim], accepted lengths a [n] (≤ PROBE_DEPTH), and the
    prompt of every row."""

    x: np.ndarray
    a: np.ndarray
    prompt: list[int]

    def labels(self) -> np.ndarray:
        """Multi-label Y [n, D_max]: Y[i, d - 1] = (a_i >= d)."""
        return (self.a[:, None] >= np.arange(1, PROBE_DEPTH + 1)[None, :]).astype(int)


@dataclass
class Trained:
    model: object  # the scikit-learn pipeline (scaler, MLP) trained on every prompt
    tensors: dict[str, torch.Tensor]  # what predictor.safetensors holds
    top: int  # the labels' drafter top-k
    step_reach: dict[int, list[float]]  # probe step -> reach from the fold that did not see its prompt
    metrics: dict


def label_top(calib: Calibration, ag: Agreement) -> tuple[int, float]:
    """The `top` whose agreement runs correlate best with the probe's accepted lengths at the same
    roots (and that correlation): the labels then mean what the runtime's trees achieve."""
    pairs = [(ag.row(s.prompt, s.context - 1), s.accepted - 1) for s in calib.steps]
    pairs = [(i, a) for i, a in pairs if i is not None]
    if len(pairs) < 3:
        return 1, float("nan")
    rows, acc = [i for i, _ in pairs], np.array([a for _, a in pairs], dtype=float)
    best = (1, -2.0)
    for top in TOPS:
        run = ag.run(top, PROBE_DEPTH).numpy()[rows].astype(float)
        corr = float(np.corrcoef(run, acc)[0, 1]) if run.std() > 0 and acc.std() > 0 else -1.0
        if corr > best[1]:
            best = (top, corr)
    return best


def samples(ag: Agreement, top: int) -> Samples:
    """One row per position q whose next root q + 1 is in the text and whose label is not cut short
    by the text's end: the hidden state at q, the run from q + 1."""
    run = ag.run(top, PROBE_DEPTH).tolist()
    rows, labels = [], []
    for i, (q, p) in enumerate(zip(ag.prompt, ag.position)):
        nxt = ag.row(q, p + 1)
        if nxt is None:
            continue
        if run[nxt] < PROBE_DEPTH and p + 2 + run[nxt] >= ag.ends[q]:
            continue  # the run stopped at the text's end, not at a rejection
        rows.append(i)
        labels.append(run[nxt])
    return Samples(ag.hidden[rows].numpy(), np.array(labels, dtype=int), [ag.prompt[i] for i in rows])


def train(calib: Calibration, ag: Agreement, seed: int = 0) -> Trained | None:
    """The predictor, or None when calibration is too small to learn one (too few positions or
    prompts, or every position has the same label). Validated by FOLDS-fold cross-validation over
    prompts: every figure in `metrics`, and `step_reach`, come from a model that never saw the
    prompt. The L2 strength is the one of ALPHAS with the lowest cross-validated Brier score; the
    exported model is then trained on every prompt with it."""
    top, corr = label_top(calib, ag)
    data = samples(ag, top)
    prompts = sorted(set(data.prompt))
    if len(prompts) < 2 or len(data.a) < MIN_ROWS or len(set(data.a.tolist())) < 2:
        return None
    folds = min(FOLDS, len(prompts))
    fold_of = {q: k % folds for k, q in enumerate(prompts)}
    fold = np.array([fold_of[q] for q in data.prompt])
    y = data.labels()
    baseline = np.zeros(len(y))
    for k in range(folds):
        baseline[fold == k] = data.a[fold != k].mean()
    runs = []
    for alpha in ALPHAS:
        probs = np.zeros(y.shape, dtype=np.float32)
        step_reach: dict[int, list[float]] = {}
        for k in range(folds):
            held, kept = np.flatnonzero(fold == k), np.flatnonzero(fold != k)
            runtime = DepthPredictor(export(_fit(data.x[kept], y[kept], alpha, seed)))
            probs[held] = runtime.raw(torch.from_numpy(data.x[held])).numpy()
            for i, s in enumerate(calib.steps):
                if s.hidden is not None and fold_of.get(s.prompt) == k:
                    step_reach[i] = runtime.reach(s.hidden)
        runs.append((float(((probs - y) ** 2).mean()), alpha, probs, step_reach))
    _, alpha, probs, step_reach = min(runs, key=lambda r: r[0])
    model = _fit(data.x, y, alpha, seed)
    metrics = validation_metrics(probs, y, baseline)
    metrics |= {"label_top": top, "label_probe_corr": round(corr, 3), "rows": len(y), "prompts": len(prompts),
                "folds": folds, "alpha": alpha}
    return Trained(model, export(model), top, step_reach, metrics)


def _fit(x: np.ndarray, y: np.ndarray, alpha: float, seed: int):
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    mlp = MLPClassifier(hidden_layer_sizes=HIDDEN_LAYERS, alpha=alpha, max_iter=MAX_ITER, random_state=seed)
    model = make_pipeline(StandardScaler(), mlp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # MAX_ITER bounds the seconds
        model.fit(x, y)
    return model


def export(model) -> dict[str, torch.Tensor]:
    """The pipeline's numbers as plain tensors for `ygg_runtime.decoding.predictor.DepthPredictor`."""
    scaler, mlp = model[0], model[-1]
    if mlp.activation != "relu" or mlp.out_activation_ != "logistic":
        raise ValueError(f"cannot export an MLP with {mlp.activation}/{mlp.out_activation_} activations")
    out = {"mean": torch.tensor(scaler.mean_, dtype=torch.float32), "scale": torch.tensor(scaler.scale_, dtype=torch.float32)}
    for i, (w, b) in enumerate(zip(mlp.coefs_, mlp.intercepts_)):
        out[f"w{i}"] = torch.tensor(w, dtype=torch.float32).contiguous()
        out[f"b{i}"] = torch.tensor(b, dtype=torch.float32)
    return out


def validation_metrics(probs: np.ndarray, y: np.ndarray, baseline: np.ndarray) -> dict:
    """Per head: positives (the rate of A >= d), ROC AUC (None when one class only) and Brier
    score of the held-out probabilities. Depth: the mean absolute error of the predicted accepted
    length Σ_d P(A >= d) (heads made non-increasing, as the runtime does) against A, beside that of
    always guessing the mean A of the training prompts (`baseline`)."""
    from sklearn.metrics import brier_score_loss, roc_auc_score

    heads = []
    for d in range(y.shape[1]):
        labels = y[:, d]
        auc = float(roc_auc_score(labels, probs[:, d])) if 0 < labels.sum() < len(labels) else None
        heads.append({"depth": d + 1, "positives": round(float(labels.mean()), 3),
                      "auc": None if auc is None else round(auc, 3),
                      "brier": round(float(brier_score_loss(labels, probs[:, d])), 4)})
    a = y.sum(1)
    predicted = np.minimum.accumulate(probs, axis=1).sum(1)
    return {"heads": heads,
            "depth_mae": round(float(np.abs(predicted - a).mean()), 3),
            "baseline_depth_mae": round(float(np.abs(baseline - a).mean()), 3)}


def plan_policy(trained: Trained, calib: Calibration, ag: Agreement, replays: Replays, curves: Curves,
                fixed: dict, verify_widths: tuple[int, ...]) -> tuple[dict, dict]:
    """The depth policy for each draft width: per-depth token factors (what the runtime's tree
    yields per unit of the label, on the replays) and verify widths; its cross-validated speed-up
    by running `objective.best_depth` on every probe step. Returns the best width's policy and a
    report (with `used`: whether it beats the fixed plan's speed-up on the same steps)."""
    steps = calib.steps
    run = ag.run(trained.top, PROBE_DEPTH).tolist()

    def label(i: int) -> int:  # the predictor's label at a probe step's root
        row = ag.row(steps[i].prompt, steps[i].context - 1)
        return run[row] if row is not None else min(steps[i].accepted - 1, PROBE_DEPTH)

    judged = sorted(trained.step_reach)
    fixed_speedup = replays.speedup([(i, fixed["depth"], fixed["draft_width"]) for i in judged])
    candidates = []
    for w in replays.widths:
        shaper = Planner(EGTParams(PROBE_DEPTH, w, PROBE_TOP_K, list(verify_widths)))
        factors, widths = [1.0], [1]
        for depth in range(1, PROBE_DEPTH + 1):
            runs = replays.at(depth, w)
            got = sum(runs[i][0] - 1 for i in range(len(steps)))
            deep = sum(min(label(i), depth) for i in range(len(steps)))
            factors.append(round(got / deep, 4) if deep else 0.0)
            widths.append(int(statistics.median_low(r[1] for r in runs)))
        shapes = [shaper.shape(d, vw) for d, vw in enumerate(widths)]
        picks = [(i, objective.best_depth(trained.step_reach[i], factors, shapes, curves, steps[i].context), w)
                 for i in judged]
        depths = [d for _, d, _ in picks]
        candidates.append(({"file": FILE, "draft_width": w, "factors": factors, "verify_widths": widths},
                           {"draft_width": w, "validation_speedup": round(replays.speedup(picks), 3),
                            "depths": {d: depths.count(d) for d in sorted(set(depths))}}))
    policy, best = max(candidates, key=lambda c: c[1]["validation_speedup"])
    report = {"used": best["validation_speedup"] >= MIN_GAIN * fixed_speedup, **best, "validation_steps": len(judged),
              "fixed_validation_speedup": round(fixed_speedup, 3),
              "by_draft_width": {c["draft_width"]: c["validation_speedup"] for _, c in candidates}}
    return policy, report


def save(trained: Trained, path: Path) -> None:
    save_file(trained.tensors, str(path), metadata={"heads": str(PROBE_DEPTH), "hidden_layers": str(HIDDEN_LAYERS)})
