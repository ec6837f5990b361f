"""The metrics' definitions (`ygg_runtime.decoding.metrics`): one TPOT for every report."""

from __future__ import annotations

import pytest

from ygg_runtime.decoding.metrics import Metrics, tpot_ms


def test_tpot_runs_from_the_first_output_token_to_the_last_over_the_tokens_after_it():
    assert tpot_ms(0.0, 1.0, 3.0, 5) == pytest.approx(500.0)  # 4 intervals in 2 s
    assert tpot_ms(0.0, 0.25, 0.25, 1) == pytest.approx(250.0)  # one token: its own time stands in
    assert tpot_ms(0.0, 0.0, 0.0, 0) == 0.0
    m = Metrics(generated_tokens=5, decode_s=3.0, first_token_s=1.0)
    assert m.tpot_ms == pytest.approx(500.0)  # the wait for the first token is not TPOT's


def test_a_generation_times_its_first_token(artifact):
    from ygg_runtime.artifact import load as artifacts

    m = artifacts.load(artifact).generate("Once upon a time", max_new_tokens=12, raw=True, ignore_eos=True).metrics
    assert 0 < m.first_token_s < m.decode_s
    assert m.tpot_ms == pytest.approx(1000 * (m.decode_s - m.first_token_s) / 11)
