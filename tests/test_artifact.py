"""The artifact as `ygg run` meets it: its compiled forwards are used (or not, and the stats say
so), and every integrity refusal is one line through the CLI."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from helpers import YGG, assert_one_line_error, hf_greedy, ygg

PROMPT = "Once upon a time"


@pytest.fixture()
def copy(artifact, tmp_path):
    """A private copy of the compiled tiny artifact, free to damage."""
    out = tmp_path / "art"
    shutil.copytree(artifact, out)
    return out


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    return path


def edit_plan(art, **changes):
    path = art / "plan.yaml"
    plan = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = plan
        for p in parents:
            node = node[p]
        node[key] = value
    path.write_text(yaml.safe_dump(plan, sort_keys=False))


def test_the_artifact_holds_a_compiled_forward_per_model_and_records_what_it_needs(artifact):
    plan = yaml.safe_load((artifact / "plan.yaml").read_text())
    aot = plan["aot"]
    assert {"target/model.pt2", "draft/model.pt2"} <= set(plan["files"])
    assert all(len(meta["sha256"]) == 64 for meta in plan["files"].values())
    assert aot["seconds"]["target"] > 0 and aot["max_width"] >= 64
    assert plan["kernel"]["file"] in plan["files"] and plan["kernel"]["cpu_flags"] == aot["cpu_flags"]
    for kind in ("compiled", "eager"):  # the row-invariance check ran on both kinds of forward
        rec = plan["exactness"][kind]
        assert rec["min_width"] in rec["widths"] and rec["widths"][-1] >= 64 and rec["agree"][rec["widths"][-1]]
    assert min(plan["profile"]["target_widths"]) >= plan["exactness"]["compiled"]["min_width"]
    assert set(plan["compile_phases"]) >= {"convert", "aot", "exactness", "profile", "calibrate", "plan", "hash"}


@pytest.mark.parametrize("method", ["ar", "egt", "chain"])
def test_compiled_and_eager_runs_both_give_the_targets_greedy_output(pair, artifact, prompt_file, method):
    want = hf_greedy(pair["hf"], pair["tokenizer"](PROMPT).input_ids, 32)
    for flags, forward in (((), "compiled"), (("--eager",), "eager")):
        proc = ygg("run", prompt_file, "-a", artifact, "-m", method, "-n", 32, "--json", "--ignore-eos", "--raw", *flags)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["token_ids"] == want, (method, flags)
        m = out["metrics"]
        assert m["forward"] == forward, (method, flags)  # every forward, the prefill included
        assert (m["compiled_forwards"] if forward == "compiled" else m["eager_forwards"]) >= out["steps"]


def test_a_generations_ablations_and_window_leave_the_decoder_as_it_was(pair, artifact):
    """`Decoder.generate` runs on views of the decoder's runners with a drafter and proposer of its
    own: an eager generation with a drafter window runs eager forwards only, a failing one (its
    text callback raises) leaves nothing behind, and the decoder's runners keep their compiled
    forwards, exactness floor and counters — the next generation runs compiled, with ar's tokens."""
    import ygg_runtime

    dec = ygg_runtime.load(artifact)
    prompt = pair["tokenizer"](PROMPT).input_ids
    before = {role: (r.compiled, r.min_width, r.forwards, r.compiled_forwards) for role, r in dec.runners.items()}
    assert before["target"][0] is not None and before["draft"][0] is not None
    want = dec.generate(prompt, max_new_tokens=24, method="ar", ignore_eos=True).token_ids
    eager = dec.generate(prompt, max_new_tokens=24, method="chain", ignore_eos=True, eager=True, draft_window=4)
    assert eager.token_ids == want and eager.metrics.forward == "eager" and eager.metrics.draft_window == 4

    def broken(text: str) -> None:
        raise RuntimeError("the reader went away")

    with pytest.raises(RuntimeError, match="went away"):
        dec.generate(prompt, max_new_tokens=24, method="egt", eager=True, draft_window=4, on_text=broken)
    assert {role: (r.compiled, r.min_width, r.forwards, r.compiled_forwards) for role, r in dec.runners.items()} == before
    again = dec.generate(prompt, max_new_tokens=24, method="chain", ignore_eos=True)
    assert again.token_ids == want and again.metrics.forward == "compiled" and again.metrics.draft_window == 0


def test_stats_say_which_forwards_ran(artifact, prompt_file):
    compiled = ygg("run", prompt_file, "-a", artifact, "-n", 8, "--stats")
    eager = ygg("run", prompt_file, "-a", artifact, "-n", 8, "--stats", "--eager")
    assert compiled.returncode == 0 and eager.returncode == 0, compiled.stderr + eager.stderr
    assert "compiled ahead of time" in compiled.stderr.replace("\n", " ")
    assert "eager (--eager: kernels built from source)" in " ".join(eager.stderr.split())


def test_an_artifact_compiled_without_aot_runs_eager_and_says_why(pair, tmp_path, prompt_file):
    out = tmp_path / "eager"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "float32",
               "--max-context", 256, "--no-aot", "--quick")
    assert proc.returncode == 0, proc.stderr
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert plan["aot"] is None and plan["quick"] and not list(out.rglob("*.pt2"))
    assert plan["calibration"]["prompts"] <= 6 and plan["planning"]["predictor"]["why"] == "--quick"
    run = ygg("run", prompt_file, "-a", out, "-n", 8, "--stats")
    assert run.returncode == 0, run.stderr
    assert "the artifact has no compiled forwards" in run.stderr.replace("\n", " ")


def test_refuses_another_format_version(copy, prompt_file):
    edit_plan(copy, format_version=1)
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "format version 1 is not supported", "recompile")


def test_refuses_a_changed_file_of_the_same_size(copy, prompt_file):
    ygg("run", prompt_file, "-a", copy, "-n", 2)  # records the verified hashes
    weights = copy / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "target/model.safetensors has changed", "sha256")


def test_refuses_a_changed_compiled_package(copy, prompt_file):
    package = copy / "draft" / "model.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF
    package.write_bytes(bytes(data))
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "draft/model.pt2 has changed")


def test_refuses_a_missing_file(copy, prompt_file):
    (copy / "target" / "model.pt2").unlink()
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "target/model.pt2 is missing")


def test_refuses_another_torch_version_unless_eager(copy, prompt_file):
    """The compiled forwards and kernels.so are native code built against one torch; --eager loads
    neither (it builds the kernels from source), so it runs on this torch."""
    edit_plan(copy, torch_version="2.0.0")
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "compiled with torch 2.0.0", "recompile", "--eager")
    assert ygg("run", prompt_file, "-a", copy, "-n", 4, "--eager").returncode == 0


def test_refuses_another_device(copy, prompt_file):
    assert_one_line_error(ygg("run", prompt_file, "-a", copy, "--device", "cuda"), "compiled for cpu, not cuda")
    edit_plan(copy, device="cuda")
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "compiled for cuda")


def test_refuses_another_dtype(copy, prompt_file):
    assert_one_line_error(ygg("run", prompt_file, "-a", copy, "--dtype", "bfloat16"), "holds float32 weights, not bfloat16")


def test_refuses_a_cpu_lacking_an_instruction_set_the_compiled_code_uses(copy, prompt_file):
    edit_plan(copy, aot__cpu_flags=["avx512f", "avx1024_imaginary"])  # the graphs need it: --eager does not
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "this CPU lacks avx1024_imaginary")
    assert ygg("run", prompt_file, "-a", copy, "-n", 4, "--eager").returncode == 0
    edit_plan(copy, aot__cpu_flags=[], kernel__cpu_flags=["avx1024_imaginary"])  # the artifact's kernels.so needs it
    assert_one_line_error(ygg("run", prompt_file, "-a", copy), "this CPU lacks avx1024_imaginary")
    assert ygg("run", prompt_file, "-a", copy, "-n", 4, "--eager").returncode == 0  # built here from source


def test_a_ctrl_c_that_makes_a_library_fail_its_own_way_still_stops_the_compile_as_interrupted(pair, tmp_path, monkeypatch):
    """A terminal's Ctrl-C reaches the compilers a library waits on too, which then fails its own
    way (AOTInductor's bare "C++ compile error"; torch.export's fake tensors once a TypeError): the
    compile must still end as interrupted, leaving nothing."""
    from ygg_compile import build
    from ygg_compile.options import CompileOptions

    def failing(b):
        os.kill(os.getpid(), signal.SIGINT)  # remembered, nothing raised
        raise RuntimeError("C++ compile error")

    monkeypatch.setattr(build, "_resolve", failing)
    out = tmp_path / "out" / "art"
    with pytest.raises(KeyboardInterrupt):
        build.compile_artifact(CompileOptions(draft=str(pair["draft"]), target=str(pair["target"]), output=out))
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_a_signal_landing_in_a_finalizer_stops_the_compile_at_its_next_stage_without_a_traceback(pair, tmp_path,
                                                                                                 monkeypatch, capfd):
    """A signal is only remembered where it lands (here inside an object's finalizer, as a library's
    can run anywhere): raised there, Python printed "Exception ignored in ..." with a traceback and
    went on. The compile stops where it looks, before its next stage, in one exception and no trace."""
    from ygg_compile import build
    from ygg_compile.options import CompileOptions

    class Held:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs here, inside the finalizer

    reached = []

    def resolve(b):
        Held()  # dropped at once: its finalizer runs
        reached.append("resolve")

    ignored = []  # what Python would print as "Exception ignored in ..." (pytest's own hook hides it)
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    monkeypatch.setattr(build, "_resolve", resolve)
    monkeypatch.setattr(build, "_convert", lambda b: reached.append("convert"))
    out = tmp_path / "out" / "art"
    with pytest.raises(KeyboardInterrupt):
        build.compile_artifact(CompileOptions(draft=str(pair["draft"]), target=str(pair["target"]), output=out))
    err = capfd.readouterr().err
    assert ignored == [] and "Traceback" not in err, (ignored, err)
    assert reached == ["resolve"] and not out.exists() and list(out.parent.iterdir()) == []


def test_a_second_signal_stops_the_compile_at_once(pair, tmp_path, monkeypatch):
    """Work that reports no progress (a C++ build, AOTInductor) is not cut by a first SIGTERM sent to
    the compile alone; a second signal stops it where it is."""
    from ygg_compile import build
    from ygg_compile.options import CompileOptions

    reached = []

    def resolve(b):
        os.kill(os.getpid(), signal.SIGTERM)
        reached.append("first")
        os.kill(os.getpid(), signal.SIGTERM)
        reached.append("second")

    monkeypatch.setattr(build, "_resolve", resolve)
    out = tmp_path / "out" / "art"
    with pytest.raises(KeyboardInterrupt):
        build.compile_artifact(CompileOptions(draft=str(pair["draft"]), target=str(pair["target"]), output=out))
    assert reached == ["first"] and not out.exists() and list(out.parent.iterdir()) == []


def test_ctrl_c_during_compile_leaves_nothing_at_the_output(pair, tmp_path):
    out = tmp_path / "out" / "art"
    proc = subprocess.Popen([YGG, "compile", "--draft", pair["draft"], "--target", pair["target"], "-o", str(out),
                             "--dtype", "float32", "--max-context", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not any((d / "draft").is_dir() for d in out.parent.glob(".art.tmp-*")):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]
    time.sleep(1.0)  # into the conversion or the AOT compile
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group, compiler processes too
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and stderr.strip().splitlines()[-1] == "error: interrupted", stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert not out.exists() and list(out.parent.iterdir()) == []
