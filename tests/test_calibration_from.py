"""`ygg compile --calibration-from ARTIFACT`: a plan from another compile's calibration (what a
CI job building one artifact per GPU kind does), the profiles and the row check measured here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, ygg

from ygg_compile import calibration_file
from ygg_runtime.schema.plan import Plan


def plan(directory: Path) -> Plan:
    return Plan.from_yaml((directory / "plan.yaml").read_text())


@pytest.fixture(scope="module")
def again(artifact, pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("again") / "again"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "float32",
               "--max-context", 256, "--method", "chain", "--no-aot", "--calibration-from", artifact)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_a_compile_from_another_artifacts_calibration_plans_from_its_statistics(artifact, again):
    """No probe runs; what follows from the calibration alone (the acceptance map, Sequoia's rank
    vector, retrieval's values) is the source's; the calibration is kept in the new artifact too."""
    out, proc = again
    a, b = plan(artifact), plan(out)
    assert b.calibration.source == f"calibration-from {artifact / calibration_file.FILE}"
    assert "calibrating on" not in proc.stderr + proc.stdout
    assert (b.calibration.steps, b.calibration.tokens, b.calibration.prompts) == \
        (a.calibration.steps, a.calibration.tokens, a.calibration.prompts)
    assert b.methods["egt"].accept == a.methods["egt"].accept
    assert b.planning.rank_acceptance == a.planning.rank_acceptance
    assert (b.methods["egt"].graft.context, b.methods["egt"].graft.adjacency) == \
        (a.methods["egt"].graft.context, a.methods["egt"].graft.adjacency)
    assert b.exactness and b.profile.target_ms  # measured here
    first, second = calibration_file.load(artifact), calibration_file.load(out)
    assert [s.tokens for s in first.calib.steps] == [s.tokens for s in second.calib.steps]
    assert first.calib.texts == second.calib.texts
    assert (first.agreement is None) == (second.agreement is None)
    if first.agreement is not None:
        assert torch.equal(first.agreement.hidden, second.agreement.hidden)


def test_the_artifact_planned_from_another_calibration_decodes_the_targets_output(again):
    import ygg_runtime

    dec = ygg_runtime.load(again[0])
    prompt = list(b"The quick brown fox")
    ar = dec.generate(prompt, max_new_tokens=24, method="ar").token_ids
    for method in ("egt", "chain", "sequoia"):
        assert dec.generate(prompt, max_new_tokens=24, method=method).token_ids == ar


def test_a_calibration_saved_without_hidden_states_plans_a_fixed_depth(artifact, tmp_path):
    """The slim file the repository keeps for the real pair: steps and texts, no hidden states."""
    stored = calibration_file.load(artifact)
    models = plan(artifact).models
    dims = {role: m["dim"] for role, m in stored.models.items()}
    slim = tmp_path / "slim.safetensors"
    calibration_file.slim(artifact, slim)
    back = calibration_file.load(slim)
    assert back.agreement is None and all(s.hidden is None for s in back.calib.steps)
    assert [s.argmax for s in back.calib.steps] == [s.argmax for s in stored.calib.steps]
    notes = calibration_file.check_fits(back, models, dims)
    assert any("no hidden states" in n for n in notes)


def test_a_calibration_that_cannot_plan_this_pair_is_refused_in_one_line(artifact, pair, tmp_path):
    missing = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", tmp_path / "x",
                  "--calibration-from", tmp_path)
    assert_one_line_error(missing, "no calibration.safetensors there")
    stored = calibration_file.load(artifact)
    stored.calib.steps[0].tokens[0] = 10**6  # a token of a larger vocabulary
    other = tmp_path / "other.safetensors"
    calibration_file.save(other, stored.calib, None, stored.models, torch.float32)
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", tmp_path / "y",
               "--calibration-from", other, "--dtype", "float32", "--max-context", 256)
    assert_one_line_error(proc, "past the target's vocabulary")
    assert not (tmp_path / "y").exists()
