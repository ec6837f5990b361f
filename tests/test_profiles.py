"""Latency profiles on machines the repository has never seen, and the committed ones.

Every user's machine is new to the repository: no profile of it is committed, so `ygg compile`
measures its latency curves there. The suite does the same (conftest gives each run an empty store
of its own); the committed `profiles/` are read here alone."""

from pathlib import Path

import pytest
import tiny
import yaml
from helpers import ygg

from ygg_compile import hardware
from ygg_compile import latency as prof
from ygg_runtime.schema.params import WIDTHS
from ygg_runtime.decoding.objective import Curves

REPO = Path(__file__).resolve().parent.parent
COMMITTED = sorted((REPO / "profiles").rglob("*.yaml"))


def machine_of(fingerprint: dict) -> str:
    """The folder a profile with this fingerprint is filed under (`hardware.device_slug`)."""
    if fingerprint["device"].startswith("cuda"):
        return hardware.slug("cuda", fingerprint["gpu"])
    return hardware.slug("cpu", fingerprint["cpu"], fingerprint["isa"], fingerprint["threads"])


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_committed_profile_is_filed_under_the_machine_and_model_it_was_measured_on(path):
    """Each committed profile reads as the planner reads it: its folder is the machine its
    fingerprint names (an AVX2 EPYC's profile in the AVX-512 EPYC's folder would be spot-checked
    against the wrong machine), its name the model, dtype and forward kind it holds, every table
    the shape of its widths and contexts, and its batched forwards (where measured) timed exactly
    where a width holds the batch's sequences."""
    stored = yaml.safe_load(path.read_text())
    assert stored["format"] == prof.PROFILE_FORMAT
    fp, model = stored["fingerprint"], stored["model"]
    assert path.parent.name == machine_of(fp) and stored["threads"] == fp["threads"]
    assert path.name == prof.profile_name(model["spec"], model["sha256"], stored["dtype"], fp["forward"])
    widths, contexts = stored["widths"], stored["contexts"]
    assert widths == sorted(widths) and set(widths) <= set(WIDTHS) and contexts == sorted(contexts)
    assert len(stored["forward_ms"]) == len(contexts) and len(stored["other_ms"]) == len(widths)
    assert all(len(row) == len(widths) and min(row) > 0 for row in stored["forward_ms"])
    batch = stored.get("batch_ms")  # absent from profiles measured before batching (a compile adds it)
    if batch is not None:
        assert batch["widths"] == widths and len(batch["ms"]) == len(batch["sequences"])
        assert all((ms is None) == (w < b) for b, row in zip(batch["sequences"], batch["ms"]) for w, ms in zip(widths, row))
    curves = Curves(prof.combine(stored, stored, tuple(widths), tuple(contexts)))
    for context, row in zip(contexts, stored["forward_ms"]):
        assert [curves.t_verify(w, context) for w in widths] == pytest.approx(row)


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """The suite's tiny pair with a 4096-token context (the pair fixture's is 1024), and a short
    calibration text: a compile of it takes seconds."""
    root = tmp_path_factory.mktemp("long")
    target = tiny.hf_model("llama", seed=40, max_position_embeddings=4096)
    tok = tiny.byte_tokenizer()
    tiny.save_pair_dir(root / "target", target, tok)
    tiny.save_pair_dir(root / "draft", tiny.noised(target, 0.05, seed=41), tok)
    (root / "calib.txt").write_text("def square(x):\n    return x * x\n---\nThe weather today is\n")
    return root


# (--weights, --dtype): how the artifact holds both models' weights
KINDS = [("auto", "auto"), ("bf16", "bfloat16"), ("bf16", "float32"), ("int8", "auto"), ("int4", "auto")]


@pytest.mark.parametrize("weights, dtype", KINDS, ids=[f"{w}-{d}" for w, d in KINDS])
def test_every_weights_kind_compiles_on_a_machine_with_no_stored_profile(tmp_path, long_pair, weights, dtype):
    """On a machine no profile store has seen (an empty --profiles), a compile of every weights
    kind measures both models' latency curves — T(W), a step's CPU work, CAST's batched forwards —
    at the smallest --max-context and at a long one, and writes an artifact whose chain decoding
    is its plain decoding, token for token. (`--weights bf16` crashed on the AMX Xeon measuring
    its batched forwards: issue 72. Eager forwards keep it quick: the compiled ones are timed
    through the same `forward_many`.)"""
    import ygg_runtime

    for context in (1, 4096):
        store, out = tmp_path / f"profiles-{context}", tmp_path / f"art-{context}"
        proc = ygg("compile", "--draft", long_pair / "draft", "--target", long_pair / "target", "-o", out,
                   "--weights", weights, "--dtype", dtype, "--max-context", context, "--profiles", store,
                   "--calib", long_pair / "calib.txt", "--calib-tokens", 8, "--no-aot", "--quick")
        assert proc.returncode == 0, proc.stderr
        said = " ".join(proc.stderr.split())
        for role in ("target", "draft"):
            assert f"{role}: measuring its latency profile (no stored profile)" in said, said
        plan = yaml.safe_load((out / "plan.yaml").read_text())
        assert plan["max_context"] == context
        kind = "float" if weights in ("auto", "bf16") else weights  # auto: a checkpoint's float weights
        assert {m["weights"]["kind"] for m in plan["models"].values()} == {kind}
        assert plan["dtype"] == (dtype if dtype != "auto" else str(hardware.resolve_dtype("auto", "cpu")).removeprefix("torch."))
        files = plan["profile"]["files"]
        assert all((store / files[role]).is_file() for role in ("target", "draft"))
        measured = [row for role in ("target", "draft") for row in plan["profile"][f"{role}_batch"]["factors"]]
        assert any(f is not None for row in measured for f in row) == (context > 1)  # no width holds two at 1
    decoder = ygg_runtime.load(out)
    prompt = list(b"def square(x):\n")
    ar = decoder.generate(prompt, max_new_tokens=24, method="ar").token_ids
    assert decoder.generate(prompt, max_new_tokens=24, method="chain").token_ids == ar and len(ar) == 24
