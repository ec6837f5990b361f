"""Artifacts with quantized weights (`ygg compile --weights int4|int8`), end to end: what the plan
says, every method's greedy output equal to the same artifact's plain decoding (compiled and
eager), and a real GGUF file's own blocks kept, checked and decoded as the file holds them."""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import METHODS, Notes, assert_one_line_error, decode, noised_runtime, runner, ygg

from ygg_compile import inspection, invariance, quantize
from ygg_compile.convert import convert_state, to_runtime
from ygg_runtime.errors import YggError
from ygg_runtime.model.transformer import from_state
from ygg_runtime.model.quant import QEmbedding, QLinear

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("def square(x):\n    return x * x\n---\nThe weather today is\n---\nOnce upon a time, once upon a time\n")
    return path


@pytest.fixture(scope="module")
def int4_artifact(pair, calib, tmp_path_factory):
    """The tiny pair in bfloat16 with 4-bit weights quantized here (a float checkpoint), compiled
    ahead of time; the drafter keeps its float weights."""
    out = tmp_path_factory.mktemp("q") / "int4"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "bfloat16",
               "--weights", "int4", "--draft-weights", "bf16", "--max-context", 256, "--calib", calib,
               "--calib-tokens", 8, "--quick")
    assert proc.returncode == 0, proc.stderr
    assert "target weights: int4 codes, quantized by ygg compile" in " ".join(proc.stderr.split())
    return out


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    path.write_text(PROMPT + " " + PROMPT + "\n")
    return path


def test_the_plan_says_how_each_models_weights_are_held(int4_artifact):
    plan = yaml.safe_load((int4_artifact / "plan.yaml").read_text())
    target, draft = plan["models"]["target"]["weights"], plan["models"]["draft"]["weights"]
    assert target["kind"] == "int4" and target["numbers"] == "quantized" and not target["fallbacks"]
    # embeddings, head, 4 linears per layer (a float checkpoint's fused q/k/v and gate/up are one tensor each)
    assert target["formats"] == {"quantized 4-bit": 2 + 4 * 2} and target["bytes"] > 0
    assert draft == {"kind": "float", "numbers": "checkpoint", "formats": {}, "fallbacks": [], "bytes": 0, "max_rel_error": 0.0}
    # every linear layer is row-invariant: no forward is padded, plain decoding included
    assert {kind: rec["min_width"] for kind, rec in plan["exactness"].items()} == {"compiled": 1, "eager": 1}
    assert plan["files"]["kernels.so"]["bytes"] > 0


def _run40(artifact: Path, prompt: Path, method: str) -> dict:
    return json.loads(ygg("run", prompt, "-a", artifact, "-m", method, "-n", 40, "--json", "--ignore-eos").stdout)


@pytest.fixture(scope="module")
def int4_plain(int4_artifact, prompt_file) -> dict:
    """Plain decoding's 40 tokens on the quantized artifact, run once for every method's test."""
    return _run40(int4_artifact, prompt_file, "ar")


@pytest.mark.parametrize("method", ["chain", "specinfer", "sequoia", "egt", "pld"])
def test_every_method_gives_the_quantized_targets_own_greedy_output(int4_artifact, int4_plain, prompt_file, method):
    run = _run40(int4_artifact, prompt_file, method)
    assert run["token_ids"] == int4_plain["token_ids"] and len(run["token_ids"]) == 40
    assert run["exact"] is True


def test_eager_quantized_forwards_are_exact_too(int4_artifact, prompt_file):
    """`ygg run --eager` (no compiled code loaded): its own plain decoding, every method."""
    runs = {m: json.loads(ygg("run", prompt_file, "-a", int4_artifact, "-m", m, "-n", 32, "--json", "--ignore-eos",
                              "--eager").stdout) for m in ("ar", "egt", "sequoia")}
    assert runs["egt"]["token_ids"] == runs["ar"]["token_ids"] == runs["sequoia"]["token_ids"]
    assert runs["egt"]["metrics"]["compiled_forwards"] == 0


def test_the_compiled_forward_of_a_quantized_model_matches_its_eager_one(tmp_path):
    """The custom op inside an AOTInductor graph: same logits as eager at every width (float32)."""
    import tiny

    from ygg_compile.aot import compile_model
    from ygg_runtime.model.compiled import CompiledForward

    args, state = convert_state(tiny.hf_model("qwen2", seed=40), torch.float32)
    model = from_state(*quantize.quantize_state(state, args, "int4", None)[:2])
    model.setup_cache(80)
    compile_model(model, tmp_path / "model.pt2")
    fwd = CompiledForward(tmp_path / "model.pt2", model)
    for width in (1, 3, 16):
        tokens = torch.arange(width)[None] + 40
        positions = slots = torch.arange(width) + 5
        view = (slots.clone(), torch.zeros(width, dtype=torch.long), torch.full((width,), 5),
                torch.ones(width, width, dtype=torch.bool).tril(), model.kv.data)
        want, _ = model(tokens, positions, *view)
        got, _ = fwd(tokens, positions, *view, torch.arange(width))
        assert (got - want).abs().max() < 1e-4, width
        last, _ = fwd(tokens, positions, *view, torch.tensor([width - 1]))
        assert torch.equal(last[0, 0], got[0, -1])  # the quantized head: a row's logits whatever else it computes


def test_inspect_says_the_weights_are_quantized_and_lossy(int4_artifact, tmp_path):
    proc = ygg("inspect", int4_artifact, "-o", tmp_path / "insp")
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stdout.split())
    assert "int4 codes, quantized by ygg compile from the float checkpoint: lossy against it" in said
    assert "bfloat16 (F.linear)" in said  # the drafter's


def test_unknown_weights_kind_is_one_line_before_writing(pair, tmp_path):
    out = tmp_path / "out"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--weights", "int5")
    assert_one_line_error(proc, "--weights must be auto, bf16, int8, int4, int3, int2")
    assert not out.exists()


def test_auto_weights_keep_the_targets_file_numbers_and_put_the_drafter_at_four_bits(monkeypatch):
    """auto quantizes only GGUF sources, only where the kernel has a vector path (AVX-512 VNNI or
    AVX2): the target as its file has it, the drafter (which only proposes) at 4 bits."""
    from types import SimpleNamespace

    from ygg_compile import build

    gguf, checkpoint = SimpleNamespace(gguf="model.gguf"), SimpleNamespace(gguf=None)
    monkeypatch.setattr(build.native, "qlinear_path", lambda: "avx512-vnni")
    assert build._weights("auto", gguf, "cpu", "target") == "int8"
    assert build._weights("auto", gguf, "cpu", "draft") == "int4"
    assert build._weights("auto", checkpoint, "cpu", "draft") == "float"
    assert build._weights("auto", gguf, "cuda", "target") == "float"
    assert build._weights("bf16", gguf, "cpu", "draft") == "float"
    monkeypatch.setattr(build.native, "qlinear_path", lambda: "avx2")
    assert build._weights("auto", gguf, "cpu", "target") == "int8"
    assert build._weights("auto", gguf, "cpu", "draft") == "int4"
    monkeypatch.setattr(build.native, "qlinear_path", lambda: "portable")
    assert build._weights("auto", gguf, "cpu", "target") == "float"


def test_int8_weights_of_a_tiny_model_are_exact_against_their_own_plain_decoding(pair):
    """In memory, without a compile: 8-bit codes, float32 activations, every method of the test
    table equal to plain decoding with no forward padded."""
    import tiny

    hf = tiny.hf_model("qwen2", seed=40)  # qkv bias, tied embeddings
    args, state = convert_state(hf, torch.float32)
    args, state, info = quantize.quantize_state(state, args, "int8", None)
    assert info.kind == "int8" and not args.tie_embeddings
    model = from_state(args, state)
    assert isinstance(model.layers[0].attention.wqkv, QLinear) and isinstance(model.tok_embeddings, QEmbedding)
    target = runner(model)
    assert invariance.check(target, [1, 2, 4, 8, 16]).min_width == 1
    draft = runner(noised_runtime(to_runtime(hf), 0.05, seed=41))
    prompt = pair["tokenizer"](PROMPT).input_ids
    ref, _ = decode(target, None, "ar", {}, prompt, 32)
    for method, params in METHODS[1:]:
        out, _ = decode(target, draft, method, params, prompt, 32)
        assert out == ref, (method, params)


# ---------------------------------------------------------------- a real GGUF file


@pytest.fixture(scope="module")
def smollm2_gguf():
    from ygg_compile import sources

    return sources.resolve("smollm2-135m").gguf


@pytest.mark.real
def test_a_gguf_files_own_blocks_are_kept_and_every_method_equals_plain_decoding(smollm2_hf, smollm2_tokenizer, smollm2_gguf):
    """SmolLM2-135M's Q4_1 linears and Q8_0 embeddings (a Llama: q and k rows reordered by
    llama.cpp, restored here) held as the file has them, checked against transformers' own
    dequantization; bfloat16 activations; a float drafter that mixes accepts and rejects. Each
    method runs on every other text (chain, sequoia and grafted egt on two; the others on the copy)."""
    float_args, float_state = convert_state(smollm2_hf, torch.bfloat16)
    args, state, info = quantize.quantize_state(float_state, float_args, "int8", smollm2_gguf)
    assert info.numbers == "gguf" and not info.fallbacks
    assert info.formats == {"Q8_0 8-bit": 2, "Q4_1 4-bit": 7 * 30}  # embeddings and head from one tensor; 7 parts a layer
    assert info.max_rel_error < 1e-2  # against the bf16 checkpoint: its rounding, nothing more
    _, _, four = quantize.quantize_state(float_state, float_args, "int4", smollm2_gguf)  # at most 4 bits: said so
    assert four.formats == {"requantized 4-bit": 2, "Q4_1 4-bit": 7 * 30}
    assert four.fallbacks == ["tok_embeddings: Q8_0 -> int4 (requantized, lossy)", "output: Q8_0 -> int4 (requantized, lossy)"]
    assert quantize.fallbacks_line(four.fallbacks) == "2 not as in the file: Q8_0 -> int4 (requantized, lossy) ×2"
    said = [inspection.weights_summary(SimpleNamespace(weights=w), "bfloat16") for w in (info, four)]
    assert said[0].startswith("4/8-bit codes (at most int8), the GGUF file's own quantization — Q8_0 8-bit ×2")
    assert said[1].startswith("4-bit codes (at most int4), the GGUF file's numbers where the kind holds them")
    target = runner(from_state(args, state))
    assert invariance.check(target, [1, 2, 4, 8, 16, 32, 64]).min_width == 1
    draft = runner(noised_runtime(to_runtime(smollm2_hf, torch.bfloat16), 0.1, seed=3))
    diverged, accepted = [], []
    methods = METHODS[1:3] + METHODS[4:6] + [("egt", METHODS[5][1] | {"graft": {}}), ("pld", {})]
    for i, text in enumerate(("def quicksort(items):\n", "Copy exactly: the quick brown fox. Copy exactly: the quick",
                              "The history of the printing press begins")):
        prompt = smollm2_tokenizer(text).input_ids
        ref, _ = decode(target, None, "ar", {}, prompt, 32)
        for method, params in methods[i % 2 :: 2]:
            out, m = decode(target, draft, method, params, prompt, 32)
            diverged += [f"{method} on {text[:20]!r}"] if out != ref else []
            accepted += [m.mean_accepted_length] if method == "chain" else []
    assert not diverged, diverged
    assert sum(accepted) / len(accepted) > 1.5  # the float drafter still agrees with the quantized target


@pytest.mark.real
def test_a_decoding_that_misreads_the_file_is_an_error_not_a_model(smollm2_hf, smollm2_gguf, monkeypatch):
    """Without restoring llama.cpp's q/k row order the decoded weights are another model's: the
    compile-time check against the dequantized checkpoint refuses them."""
    args, state = convert_state(smollm2_hf, torch.bfloat16)
    monkeypatch.setattr(quantize, "_unpermute", lambda c, heads: c)
    with pytest.raises(YggError, match="decode to other weights"):
        quantize.quantize_state(state, args, "int8", smollm2_gguf)


# ---------------------------------------------------------------- llama.cpp as a peer


@pytest.fixture(scope="module")
def smollm2_artifact(tmp_path_factory, calib):
    """SmolLM2-135M's GGUF as target and drafter, its own quantization kept (int8: exact)."""
    out = tmp_path_factory.mktemp("q") / "smol"
    proc = ygg("compile", "--draft", "smollm2-135m", "--target", "smollm2-135m", "-o", out, "--weights", "int8",
               "--max-context", 512, "--calib", calib, "--calib-tokens", 8, "--quick", "--no-aot")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.real
def test_an_artifact_holding_a_gguf_files_codes_has_its_conversion_cached_in_the_artifacts_dtype(smollm2_artifact):
    """The file dequantized once for compile (the next compile reuses it) is cached in the dtype the
    artifact runs in, not float32. (An artifact holding the floats caches none: see test_egt.)"""
    from ygg_compile.sources import conversion_dir

    plan = yaml.safe_load((smollm2_artifact / "plan.yaml").read_text())
    target = plan["models"]["target"]
    assert target["weights"]["kind"] == "int8" and target["gguf"]
    assert (conversion_dir(target["sha256"], getattr(torch, plan["dtype"])) / "config.json").is_file()


def test_llama_cpp_is_built_without_ggml_amx_path_on_a_cpu_with_amx():
    """make install-llama's CMAKE_ARGS: ggml's native detection where the CPU has no AMX; with AMX
    (whose ggml path dies in llama.cpp 0.3.36's first decode) native detection off, the CPU's own
    vector extensions named, AMX off."""
    from ygg_bench.peers import llama_cmake_args

    epyc = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi"}
    assert llama_cmake_args(epyc) == llama_cmake_args({"avx", "avx2", "fma"}) == ""
    xeon = llama_cmake_args(epyc | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}).split()
    assert xeon[0] == "-DGGML_NATIVE=OFF" and xeon[-3:] == ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON"} <= set(xeon)
    # only what the CPU has: an AMX CPU without AVX-512 BF16 is not told it has it
    assert "-DGGML_AVX512_BF16=ON" not in llama_cmake_args(epyc - {"avx512_bf16"} | {"amx_tile"})


@pytest.mark.real
def test_bench_times_llama_cpp_on_the_targets_own_gguf_file(smollm2_artifact, tmp_path):
    """llama.cpp plain and with prompt lookup, on the same prompt ids, in the same interleaved run."""
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "copy",
                                   "turns": ["Repeat: the cat sat on the mat. Repeat: the cat sat on the mat."]}) + "\n")
    out = tmp_path / "res"
    proc = ygg("bench", "--artifact", smollm2_artifact, "--prompts", prompts, "--methods", "ar,pld",
               "--peers", "llama.cpp,llama.cpp-pld", "-n", 24, "-o", out)
    assert proc.returncode == 0, proc.stderr
    runs = {r["contestant"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"ar", "pld", "llama.cpp", "llama.cpp-pld"}
    for name in ("llama.cpp", "llama.cpp-pld"):
        assert runs[name]["generated"] >= 1 and runs[name]["tpot_ms"] > 0
    assert runs["llama.cpp"]["mean_accepted_length"] == 1.0  # one token per forward: plain decoding
    assert runs["llama.cpp-pld"]["mean_accepted_length"] > 1.0  # the prompt repeats itself: lookups hit
    # prompt processing, timed alike for every contestant: to the first token, over the prompt's tokens
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert {r["contestant"] for r in summary if r["prefill_ms_per_token"] > 0} == set(runs)
    assert "prefill ms/token" in (out / "summary.md").read_text()


def test_llama_cpp_peer_needs_a_gguf_target(artifact, tmp_path):
    proc = ygg("bench", "--artifact", artifact, "--peers", "llama.cpp", "-o", tmp_path / "res")
    assert_one_line_error(proc, "peer llama.cpp reads GGUF files", "checkpoint directory")
    assert not (tmp_path / "res").exists()


def test_a_profile_measured_with_other_weight_codes_is_not_reused():
    """The same GGUF file held as other codes (6- vs 8-bit) runs at other speeds: its stored T(W)
    must not be taken for the new artifact's."""
    from ygg_compile import latency as profile

    eight = profile.fingerprint("cpu", "aot", {"Q4_K 4-bit": 85, "Q6_K 8-bit g16": 15})
    six = profile.fingerprint("cpu", "aot", {"Q4_K 4-bit": 85, "Q6_K 6-bit g16": 15})  # the same file, other codes
    assert eight != six and "qlinear" in eight
    assert "qlinear" not in profile.fingerprint("cpu", "aot")  # float weights: the kernel's source does not count


def test_a_profile_timed_on_another_kernel_path_is_not_reused(monkeypatch):
    """A compile with YGG_QLINEAR=amx times the tile path: its stored T(W) is not the default
    path's, on the same machine with the same kernel source."""
    from ygg_compile import latency as profile

    formats = {"Q4_K 4-bit": 85, "Q6_K 6-bit g16": 15}
    here = profile.fingerprint("cpu", "aot", formats)
    assert here["qlinear_path"] == profile.native.qlinear_path()
    other = "amx" if here["qlinear_path"] != "amx" else "avx512-vnni"
    monkeypatch.setattr(profile.native, "qlinear_path", lambda: other)
    assert profile.fingerprint("cpu", "aot", formats) != here


@pytest.mark.real
def test_bench_serve_drives_llama_cpp_server_with_the_same_load_and_stops_it(smollm2_artifact, tmp_path):
    """`--peers llama.cpp-server`: llama-cpp-python's server on the target's GGUF, on loopback, gets
    the same prompts at every level; its rows stand beside ours, each of ours is set against it,
    its text is compared with ar's, and no server outlives the benchmark."""
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n"
                               for i, t in enumerate(["The capital of France is", "def add(a, b):"])))
    out = tmp_path / "serve"
    proc = ygg("bench-serve", "--artifact", smollm2_artifact, "--prompts", prompts, "--concurrency", "1,2",
               "--methods", "ar", "--peers", "llama.cpp-server", "-n", 16, "-o", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["concurrency"]): r for r in report["summary"]}
    assert set(rows) == {(m, c) for m in ("ar", "llama.cpp-server") for c in (1, 2)}
    for c in (1, 2):
        peer = rows[("llama.cpp-server", c)]
        assert peer["peer"] and peer["requests"] == 2 and peer["tokens"] > 0 and peer["ttft_ms_p50"] > 0
        assert peer["outputs_equal_ar"].endswith("/2")
        assert rows[("ar", c)]["vs_peers"]["llama.cpp-server"]["tokens_per_s"] > 0
    texts = [r["text"] for r in report["runs"] if r["method"] == "llama.cpp-server"]
    assert len(texts) == 4 and all(texts)
    assert "## Against the serving peers" in (out / "summary.md").read_text()
    gguf = yaml.safe_load((smollm2_artifact / "plan.yaml").read_text())["models"]["target"]["gguf"]
    left = subprocess.run(["pgrep", "-f", f"llama_cpp.server --model {gguf}"], capture_output=True, text=True)
    assert not [p for p in left.stdout.split() if p], "llama.cpp-server outlived the benchmark"


@pytest.mark.real
def test_a_serving_peer_that_crashes_costs_one_line_and_ours_are_written(smollm2_artifact, tmp_path, monkeypatch):
    """The llama.cpp server dying by a signal after its warm-up (planted: SIGSEGV, as its AMX build
    does on a Xeon): one line names it and the signal, ar's levels are measured and written, the
    crash is named in the results."""
    import os
    import signal

    from ygg_bench import bench_serve
    from ygg_bench.options import ServeBenchOptions

    complete, calls = bench_serve.LlamaServer.complete, []

    def dies_after_its_warm_up(self, prompt, method, max_tokens):
        calls.append(max_tokens)
        if len(calls) == 2:
            os.kill(self.proc.pid, signal.SIGSEGV)
            self.proc.wait(30)
        return complete(self, prompt, method, max_tokens)

    monkeypatch.setattr(bench_serve.LlamaServer, "complete", dies_after_its_warm_up)

    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["The capital of France is"]}) + "\n")
    ui, out = Notes(), tmp_path / "serve"
    report = bench_serve.run_bench_serve(ServeBenchOptions(smollm2_artifact, prompts=prompts, concurrency=[1, 2],
                                                           methods=["ar"], peers=["llama.cpp-server"],
                                                           max_new_tokens=8, output=out), ui)
    why = report["config"]["left_out"]["llama.cpp-server"]  # on a CPU with AMX, with how to rebuild it
    assert why.startswith("peer llama.cpp-server crashed: its process was killed by SIGSEGV (signal 11)")
    assert ui.lines == [f"{why}; its runs are left out, every other contestant's are kept"]
    written = json.loads((out / "results.json").read_text())
    assert written["config"]["left_out"] == {"llama.cpp-server": why}
    assert [(r["method"], r["concurrency"]) for r in written["summary"]] == [("ar", 1), ("ar", 2)]
    assert f"Left out: **llama.cpp-server**, {why}" in (out / "summary.md").read_text()


def test_the_llama_cpp_server_peer_needs_a_gguf_target_and_a_known_name(artifact, tmp_path):
    proc = ygg("bench-serve", "--artifact", artifact, "--peers", "llama.cpp-server", "-o", tmp_path / "res")
    assert_one_line_error(proc, "peer llama.cpp-server reads GGUF files", "checkpoint directory")
    assert not (tmp_path / "res").exists()
    assert_one_line_error(ygg("bench-serve", "--artifact", artifact, "--peers", "vllm"), "unknown serving peer 'vllm'")
