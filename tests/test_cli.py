"""`ygg compile` then `ygg run`, as a user types them, and every bad input ends in one line."""

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import tiny
import yaml
from helpers import assert_one_line_error, hf_greedy, ygg

from ygg_runtime.errors import YggError

from ygg_runtime.decoding.metrics import DERIVED, PER_STEP, Metrics
from ygg_runtime.schema.plan import FORMAT_VERSION

PROMPT = "Once upon a time"


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT + "\n")
    return path


def test_compile_writes_a_complete_artifact(artifact):
    plan = yaml.safe_load((artifact / "plan.yaml").read_text())
    assert plan["format_version"] == FORMAT_VERSION and plan["dtype"] == "float32" and plan["method"] == "chain"
    assert set(plan["methods"]) == {"ar", "chain", "specinfer", "sequoia", "egt", "pld"}
    graft = plan["methods"]["egt"]["graft"]  # retrieval calibrated on the target's continuations, in both methods
    assert plan["methods"]["pld"]["graft"] == graft and graft["file"] == "adjacency.safetensors" in plan["files"]
    assert len(graft["context"]) == 4 and all(0 <= p <= 1 for row in graft["context"] for pos in row for p in pos)
    assert plan["planning"]["graft"]["labelled_tokens"] > 0
    assert plan["calibration"]["steps"] > 0 and plan["calibration"]["tokens"] > 0
    for rel, meta in plan["files"].items():
        assert (artifact / rel).stat().st_size == meta["bytes"]
    assert {"draft/model.safetensors", "target/model.safetensors", "tokenizer.json"} <= set(plan["files"])
    assert [p.name for p in artifact.parent.iterdir()] == ["tiny"]  # no temporary directory or lock left


def test_piped_output_keeps_each_line_whole(artifact, prompt_file):
    """A pipe or a CI log gets lines as they are: rich would wrap them at 80 columns mid-word."""
    proc = ygg("run", prompt_file, "--artifact", artifact, "-n", 8, "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    line = f"exactness: {json.loads(proc.stdout)['exactness']}"
    assert len(line) > 80 and line in proc.stderr.splitlines()


@pytest.mark.parametrize("method", ["ar", "chain", "specinfer", "sequoia", "egt", "pld"])
def test_run_json_is_the_targets_greedy_output(pair, artifact, prompt_file, method):
    proc = ygg("run", prompt_file, "--artifact", artifact, "--method", method, "-n", 40, "--json", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"text", "token_ids", "prompt_tokens", "method", "steps", "accepted_lengths", "tpot_ms", "wall_s"} <= set(out)
    prompt_ids = pair["tokenizer"](PROMPT).input_ids
    assert out["prompt_tokens"] == len(prompt_ids) and out["method"] == method
    assert out["token_ids"] == hf_greedy(pair["hf"], prompt_ids, 40)
    assert sum(out["accepted_lengths"]) == 40 and len(out["accepted_lengths"]) == out["steps"]
    assert out["exact"] is True and "identical to this artifact's plain decoding" in out["exactness"]
    assert out["text"] == pair["tokenizer"].decode(out["token_ids"])
    # one schema: every counter (per-step lists aside) and every derived metric, agreeing with the top level
    assert set(out["metrics"]) == {f.name for f in fields(Metrics) if f.name not in PER_STEP} | set(DERIVED)
    m = out["metrics"]
    assert (m["steps"], m["prompt_tokens"], m["method"], m["tpot_ms"]) == (out["steps"], out["prompt_tokens"], method, out["tpot_ms"])
    assert (m["acceptance_rate"] is None) == (m["drafted_tokens"] == 0) and m["generated_tokens"] == 40


def test_run_streams_text_and_prints_stats(artifact, prompt_file):
    as_json = json.loads(ygg("run", prompt_file, "-a", artifact, "-n", 24, "--json").stdout)
    proc = ygg("run", prompt_file, "-a", artifact, "-n", 24, "--stats")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == as_json["text"] + "\n"
    assert "mean accepted length" in proc.stderr and "TPOT" in proc.stderr
    assert "exactness" in proc.stderr and "greedy output is identical" in " ".join(proc.stderr.split())


def test_run_without_grafting_is_the_same_text_with_no_retrieved_token(artifact, prompt_file):
    """A prompt that repeats itself, so retrieval has something to find."""
    prompt = prompt_file.with_name("repeat.txt")
    prompt.write_text((PROMPT + " ") * 3)
    runs = {flag: json.loads(ygg("run", prompt, "-a", artifact, "-m", "egt", "-n", 32, "--json", "--ignore-eos",
                                 *([flag] if flag else [])).stdout) for flag in ("", "--no-graft")}
    assert runs[""]["token_ids"] == runs["--no-graft"]["token_ids"]
    assert runs["--no-graft"]["metrics"]["retrieved_tokens"] == 0 and runs[""]["metrics"]["retrieved_tokens"] > 0
    proc = ygg("run", prompt, "-a", artifact, "-m", "pld", "-n", 32, "--stats")
    assert proc.returncode == 0 and "tokens per step by source" in proc.stderr


def test_run_reads_stdin_and_sampling_is_reproducible(artifact):
    runs = [ygg("run", "-", "-a", artifact, "-n", 16, "-t", "0.8", "--seed", "7", "--json", stdin=PROMPT) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert json.loads(runs[0].stdout)["token_ids"] == json.loads(runs[1].stdout)["token_ids"]


def test_missing_prompt_file(artifact, tmp_path):
    assert_one_line_error(ygg("run", tmp_path / "nope.txt", "-a", artifact), "does not exist")


def test_empty_prompt(artifact, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    assert_one_line_error(ygg("run", tmp_path / "empty.txt", "-a", artifact), "empty")


def test_prompt_longer_than_the_context(artifact, tmp_path):
    (tmp_path / "long.txt").write_text("x" * 300)
    assert_one_line_error(ygg("run", tmp_path / "long.txt", "-a", artifact), "does not fit the context")


def test_artifact_directory_missing(tmp_path, prompt_file):
    assert_one_line_error(ygg("run", prompt_file, "-a", tmp_path / "missing"), "does not exist")


def test_artifact_without_plan(tmp_path, prompt_file):
    (tmp_path / "art").mkdir()
    assert_one_line_error(ygg("run", prompt_file, "-a", tmp_path / "art"), "no plan.yaml")


def test_unknown_method(artifact, prompt_file):
    assert_one_line_error(ygg("run", prompt_file, "-a", artifact, "-m", "medusa"), "not in this artifact")


def test_unknown_model(tmp_path, pair):
    """Refused in one line before torch or the toolchain loads (the name alone says it names nothing)."""
    out = tmp_path / "out"
    assert_one_line_error(ygg("compile", "--draft", "gpt-17", "--target", pair["target"], "-o", out), "unknown model 'gpt-17'")
    assert not out.exists()
    code = ("import sys\nfrom ygg_compile.cli import app\n"
            f"try:\n    app(['compile', '--draft', 'gpt-17', '--target', {str(pair['target'])!r}, '-o', {str(out)!r}])\n"
            "except SystemExit:\n    pass\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy'}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[-1] == "[]" and "unknown model 'gpt-17'" in proc.stdout, proc.stdout + proc.stderr


def test_missing_model_directory(tmp_path, pair):
    assert_one_line_error(ygg("compile", "--draft", pair["draft"], "--target", tmp_path / "no" / "model.gguf",
                              "-o", tmp_path / "out"), "does not exist")


def test_hub_model_offline(tmp_path, pair):
    proc = ygg("compile", "--draft", "someone/some-model", "--target", pair["target"], "-o", tmp_path / "out",
               env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, "could not download 'someone/some-model'", "packaged alias")


def test_tokenizer_mismatch_leaves_nothing_behind(tmp_path, pair):
    tok = tiny.byte_tokenizer()
    tok.add_tokens(["<extra>"])
    other = tiny.save_pair_dir(tmp_path / "other", tiny.hf_model("llama", seed=42, vocab_size=259), tok)
    out = tmp_path / "artifacts" / "mismatch"
    assert_one_line_error(ygg("compile", "--draft", other, "--target", pair["target"], "-o", out), "tokenizers differ")
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_unwritable_output_directory(tmp_path, pair):
    (tmp_path / "file").write_text("not a directory")
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", tmp_path / "file" / "art")
    assert_one_line_error(proc, "cannot write")


def test_output_that_is_not_an_artifact_is_not_overwritten(tmp_path, pair):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("...")
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", tmp_path / "precious")
    assert_one_line_error(proc, "refusing to overwrite")
    assert (tmp_path / "precious" / "thesis.tex").exists()


def test_runtime_never_imports_compile_time_libraries(artifact):
    code = (
        "import sys, ygg_runtime\n"
        f"d = ygg_runtime.load({str(artifact)!r})\n"
        "d.generate('hello', max_new_tokens=4, method='egt')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'sklearn', 'ygg_compile')]\n"
        "assert not bad, bad\n"
        # torch's compilers either: importing them costs ~3 s of every start (the compiled forwards
        # load through the C++ loader, not Inductor's Python wrapper)
        "slow = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
        "assert not slow, slow\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_invalid_method_parameters_are_refused_before_writing(tmp_path, pair):
    out = tmp_path / "out"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--tree-depth", 0)
    assert_one_line_error(proc, "specinfer needs width >= 1 and depth >= 1")
    assert not out.exists()
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--tree-width", 8,
               "--tree-depth", 4)  # 4681 nodes: no compiled forward holds the verify
    assert_one_line_error(proc, "specinfer's tree of 4681 nodes is wider than the widest forward (512)")
    assert not out.exists()


def test_unknown_default_method_is_refused_before_writing(tmp_path, pair):
    out = tmp_path / "out"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--method", "medusa")
    assert_one_line_error(proc, "default method 'medusa' is not one of the compiled methods")
    assert not out.exists()


@pytest.fixture()
def small_calib(tmp_path):
    """Two calibration prompts in the text form (split by a --- line): keeps a compile quick."""
    path = tmp_path / "calib.txt"
    path.write_text("def square(x):\n    return x * x\n---\nThe weather today is\n")
    return path


def test_compile_reuses_a_matching_profile_and_reprofile_measures_again(tmp_path, pair, small_calib):
    """A compile stores both models' profiles; the next compile of the same pair reuses them,
    --reprofile measures again, and a profile from another machine is not reused. (Eager
    forwards and --quick, to keep it quick: compiled ones have profiles of their own, as the plan's key says.)"""
    args = ["compile", "--draft", pair["draft"], "--target", pair["target"], "--dtype", "float32",
            "--max-context", 256, "--calib", small_calib, "--calib-tokens", 8, "--no-aot", "--quick"]
    first = ygg(*args, "-o", tmp_path / "first")
    assert first.returncode == 0, first.stderr
    out = tmp_path / "a"
    again = ygg(*args, "-o", out)
    if "disagrees with this machine" in again.stderr.replace("\n", " "):  # the first measured under the other
        out = tmp_path / "a2"  # worker's load (3.1 against 1.0 ms once): measured anew, as it must be, then reused
        again = ygg(*args, "-o", out)
    assert again.returncode == 0, again.stderr
    said = again.stderr.replace("\n", " ")
    assert said.count("reusing the measured profile") == 2 and "measuring its latency profile" not in said
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert plan["calibration"]["prompts"] == 2 and plan["calibration"]["source"] == str(small_calib)
    filed = plan["profile"]["files"]["target"]  # under the store: the plan names no directory of this machine
    stored = Path(os.environ["YGG_PROFILES"]) / filed
    assert not Path(filed).is_absolute() and stored.is_file() and stored.name.endswith("-eager.yaml")
    before = stored.read_text()
    forced = ygg(*args, "-o", tmp_path / "b", "--reprofile")
    assert forced.returncode == 0, forced.stderr
    said = forced.stderr.replace("\n", " ")
    assert "measuring target T(W)" in said and "--reprofile" in said
    assert stored.read_text() != before  # measured anew (the timestamp at least)
    other = yaml.safe_load(stored.read_text())
    other["fingerprint"]["threads"] += 1
    stored.write_text(yaml.safe_dump(other))
    moved = ygg(*args, "-o", tmp_path / "c")
    said = moved.stderr.replace("\n", " ")
    assert moved.returncode == 0 and "measuring target T(W)" in said and "another machine" in said


def test_cpus_of_one_name_file_their_profiles_apart_by_instruction_set_class(monkeypatch):
    """Zen 3 and Zen 4 EPYCs both say "AMD EPYC", Xeons with and without AMX "Intel Xeon": each
    instruction-set class gets a directory of its own (its kernels, `--dtype auto` and timings differ)."""
    import torch

    from ygg_compile import hardware
    from ygg_runtime.schema.plan import CPUInfo

    threads = torch.get_num_threads()
    for model, isa, slug in (
            ("AMD EPYC", ["avx", "avx2", "avx512f", "avx512_vnni", "fma"], f"cpu-amd-epyc-avx512-{threads}t"),
            ("AMD EPYC", ["avx", "avx2", "fma"], f"cpu-amd-epyc-avx2-{threads}t"),
            ("AMD EPYC", ["avx", "sse4_2"], f"cpu-amd-epyc-{threads}t"),
            ("Intel(R) Xeon(R) Processor", ["avx2", "avx512f", "amx_tile", "amx_int8"], f"cpu-intel-xeon-amx-{threads}t"),
            ("Intel(R) Xeon(R) Processor", ["avx2", "avx512f"], f"cpu-intel-xeon-avx512-{threads}t")):
        monkeypatch.setattr(hardware, "cpu_info", lambda model=model, isa=isa: CPUInfo(model, threads, isa))
        assert hardware.device_slug("cpu") == slug


def test_a_profile_from_a_slower_machine_of_the_same_name_is_spot_checked_and_measured_again(tmp_path, pair, small_calib):
    """Two machines of one device name (2-core EPYCs with half the memory bandwidth of each other)
    file their profiles under one name: a stored profile whose times a few forwards timed here
    disagree with (here: every time scaled by 10, as a much slower machine would have measured)
    is measured anew, and the compile says why; a matching one is reused after the same check."""
    args = ["compile", "--draft", pair["draft"], "--target", pair["target"], "--dtype", "float32",
            "--max-context", 256, "--calib", small_calib, "--calib-tokens", 8, "--no-aot", "--quick"]
    profiles = tmp_path / "profiles"
    first = ygg(*args, "-o", tmp_path / "first", env={"YGG_PROFILES": str(profiles)})
    assert first.returncode == 0, first.stderr
    stored = profiles / yaml.safe_load((tmp_path / "first" / "plan.yaml").read_text())["profile"]["files"]["target"]
    slower = yaml.safe_load(stored.read_text())
    measured = slower["forward_ms"][0][0]
    slower["forward_ms"] = [[round(t * 10, 3) for t in row] for row in slower["forward_ms"]]
    stored.write_text(yaml.safe_dump(slower, sort_keys=False))
    again = ygg(*args, "-o", tmp_path / "again", env={"YGG_PROFILES": str(profiles)})
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stderr.split())
    assert "target: measuring its latency profile (the stored profile disagrees with this machine: T(1)" in said
    assert "draft: reusing the measured profile" in said and "spot check: T(1)" in said
    plan = yaml.safe_load((tmp_path / "again" / "plan.yaml").read_text())
    check = plan["profile"]["spot_checks"]
    assert check["target"]["agrees"] is False and check["draft"]["agrees"] is True  # what was checked, and found
    remeasured = yaml.safe_load(stored.read_text())["forward_ms"][0][0]
    assert remeasured < measured * 5  # the profile on file is this machine's again


@pytest.mark.parametrize("content, needle", [(None, "does not exist"), ("", "no calibration prompts"),
                                             ("\n---\n  \n", "no calibration prompts")])
def test_bad_calibration_input_is_one_line_before_writing(tmp_path, pair, content, needle):
    calib = tmp_path / "calib.txt"
    if content is not None:
        calib.write_text(content)
    out = tmp_path / "out"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--calib", calib)
    assert_one_line_error(proc, needle)
    assert not out.exists()


def test_calibration_prompts_from_text_jsonl_and_directories(tmp_path):
    from ygg_compile.prompts import calibration

    (tmp_path / "a.txt").write_text("first prompt\n---\nsecond\nprompt\n")
    (tmp_path / "b.jsonl").write_text('{"turns": ["third"]}\n{"prompt": "fourth"}\n')
    (tmp_path / "ignored.bin").write_bytes(b"\x00")
    assert calibration(tmp_path / "a.txt") == ["first prompt", "second\nprompt"]
    assert calibration(tmp_path) == ["first prompt", "second\nprompt", "third", "fourth"]
    builtin = calibration(None)
    assert len(builtin) >= 10
    spec_bench = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
    if spec_bench.exists():  # written by us: nothing shared with the benchmark's prompts
        import json

        bench = {json.loads(line)["turns"][0].strip() for line in spec_bench.read_text().splitlines() if line.strip()}
        assert not bench & set(builtin)


def test_a_pair_whose_target_has_more_vocabulary_rows_compiles_and_runs(tmp_path, pair, small_calib, prompt_file):
    """One tokenizer, a target with 6 padding rows more than its drafter (as Qwen2.5-7B over
    Qwen2.5-0.5B), one of which the target emits: compile accepts the pair and says so, every
    method's greedy output is the target's."""
    import torch

    hf = tiny.hf_model("llama", seed=40, vocab_size=tiny.BYTE_VOCAB + 6)
    ids = pair["tokenizer"](PROMPT).input_ids
    favourite = torch.tensor(hf_greedy(hf, ids, 32)).bincount().argmax()
    with torch.no_grad():
        hf.lm_head.weight[tiny.BYTE_VOCAB + 1] = hf.lm_head.weight[favourite] * 1.01
    target = tiny.save_pair_dir(tmp_path / "big", hf, pair["tokenizer"])
    want = hf_greedy(hf, ids, 32)
    assert tiny.BYTE_VOCAB + 1 in want
    out = tmp_path / "art"
    proc = ygg("compile", "--draft", pair["draft"], "--target", target, "-o", out, "--dtype", "float32",
               "--max-context", 256, "--calib", small_calib, "--calib-tokens", 8, "--no-aot", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert "target 264 rows, draft 258" in " ".join(proc.stderr.split())
    for method in ("ar", "chain", "egt", "sequoia"):
        run = ygg("run", prompt_file, "-a", out, "-m", method, "-n", 32, "--json", "--ignore-eos")
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["token_ids"] == want, method


@pytest.mark.parametrize("args, needle", [
    (["run", "nope.txt"], "prompt file nope.txt does not exist"),
    (["run", "p.txt", "-a", "no-artifact"], "artifact directory no-artifact does not exist"),
    (["run", "p.txt", "-a", ".", "-n", "0"], "--max-new-tokens must be at least 1"),
    (["run", "p.txt", "-a", ".", "--top-p", "2"], "--top-p must be in (0, 1]"),
    (["run", "p.txt", "-a", ".", "--draft-window", "-1"], "--draft-window takes a number of tokens"),
    (["run", "p.txt", "-a", ".", "-t", "1", "--sampling", "gumbel"], "--sampling must be one of coupled, rejection"),
    (["compile", "--draft", "d", "--target", "t", "--sampling", "exact"], "--sampling must be one of coupled, rejection"),
    (["bench", "-a", ".", "--sampling", "typical"], "--sampling must be one of coupled, rejection"),
    (["run", "p.txt", "-a", "."], ". is not a Yggdrasil artifact: it has no plan.yaml"),
    (["serve", "-a", ".", "--max-batch", "0"], "--max-batch must be in 1..64"),
    (["inspect", "no-artifact"], "artifact directory no-artifact does not exist"),
    (["compile", "--draft", "d", "--target", "t", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["compile", "--draft", "d", "--target", "t", "--draft-weights", "int5"], "--draft-weights must be auto, bf16"),
    (["compile", "--draft", "d", "--target", "t", "--calib-tokens", "0"], "--calib-tokens must be at least 1"),
    (["compile", "--draft", "d", "--target", "t", "-o", "p.txt"], "refusing to overwrite p.txt"),
    (["bench", "-a", ".", "--rounds", "0"], "--rounds must be at least 1"),
    (["bench", "-a", ".", "--peers", "vllm"], "unknown peer 'vllm'"),
    (["bench", "-a", ".", "-t", "-1"], "--temperature must be a finite number"),
    (["bench-serve", "-a", ".", "--limit", "0"], "--limit must be at least 1"),
])
def test_a_refused_call_answers_before_torch_is_imported(tmp_path, args, needle):
    """Bad input and missing files get their one line from the light command line: torch, the
    toolchain and the commands' bodies are never imported (`python -X importtime` lists every module
    a process imports)."""
    (tmp_path / "p.txt").write_text(PROMPT)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ygg_runtime", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 1 and said == [f"error: {said[0][7:]}"] and needle in said[0], proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"ygg_bench.cli", "ygg_compile.cli"} <= imported  # the measurement saw the command line
    assert not {"torch", "transformers", "ygg_compile.commands", "ygg_bench.commands", "ygg_runtime.run", "ygg_runtime.serving.app",
                "ygg_runtime.artifact.load"} & imported


def test_a_runs_options_are_checked_once_when_made_and_carry_the_ablations():
    """`RunOptions` is where a request enters (`ygg run` makes it from its flags, `Decoder.generate`
    from its keyword arguments): bad values are refused when it is made, the ablations ride in one
    field, and a generation takes options or keywords, never both."""
    from ygg_runtime.options import Ablation, RunOptions

    with pytest.raises(YggError, match="--top-p must be in"):
        RunOptions(top_p=0.0)
    with pytest.raises(YggError, match="--sampling must be one of"):
        RunOptions(sampling="beam")
    with pytest.raises(YggError, match="--draft-window takes a number of tokens"):
        RunOptions(draft_window=-1)
    got = RunOptions.of(max_new_tokens=8, method="egt", graft=False, eager=True)
    assert got == RunOptions(8, method="egt", ablation=Ablation(graft=False, eager=True))
    with pytest.raises(TypeError):
        RunOptions.of(medusa_heads=4)


def test_generate_takes_options_or_keywords_not_both(artifact):
    import ygg_runtime
    from ygg_runtime.options import RunOptions

    dec = ygg_runtime.load(artifact)
    a = dec.generate([5, 6, 7], RunOptions(max_new_tokens=6, method="egt"))
    b = dec.generate([5, 6, 7], max_new_tokens=6, method="egt")
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 6
    with pytest.raises(TypeError, match="not both"):
        dec.generate([5, 6, 7], RunOptions(), max_new_tokens=6)
