"""OpenVINO GenAI's peers in `ygg bench`: its child process over a socket pair (the real child script,
and planted ones for the answers and a crash), the one-line refusals, the tuning and the exactness
counts. OpenVINO itself is not installed here (its venv is `make install-openvino`'s): what needs it
runs in `ygg bench` on a machine that has it (docs/notes)."""

import importlib.util
import json
import sys
import textwrap

import pytest
from helpers import assert_one_line_error, ygg

from ygg_bench import openvino_peers, peer_process
from ygg_bench.options import OPENVINO_PEERS, OWN_PLAIN, BenchOptions
from ygg_bench.peer_process import PeerCrashed, PeerFamily, PeerProcess
from ygg_bench.report import peers_exactness, peers_weights, summarize
from ygg_runtime.errors import YggError


def family(python: str = sys.executable) -> PeerFamily:
    return PeerFamily("openvino", (python, "/nowhere/target-ir", None, None, [7]), 1)


def plant(tmp_path, monkeypatch, body: str) -> None:
    """A child script in the real one's place: the same protocol, `body` deciding the answers."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent('''
        import os, signal, sys
        from multiprocessing.connection import Connection
        conn = Connection(int(sys.argv[1]))
        while True:
            request = conn.recv()
            if request is None:
                break
    ''') + textwrap.indent(textwrap.dedent(body), "    "))
    monkeypatch.setattr(openvino_peers, "CHILD", script)


def test_the_child_serves_the_peers_the_benchmark_names():
    """The child imports nothing of ours (it runs under OpenVINO's venv), so it keeps its own list."""
    spec = importlib.util.spec_from_file_location("openvino_child", openvino_peers.CHILD)
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)  # at the top: the standard library only
    assert child.PEERS == OPENVINO_PEERS
    assert all(OWN_PLAIN.get(p, "openvino") == "openvino" for p in OPENVINO_PEERS)


def test_a_child_whose_openvino_is_missing_costs_one_line():
    """The real child script under an interpreter without OpenVINO: the load fails, and says so."""
    proc = PeerProcess(family())
    with pytest.raises(YggError) as e:
        proc.generate("openvino", [1, 2, 3], 4)
    assert str(e.value) == "ModuleNotFoundError: No module named 'openvino'"
    assert proc.proc is None  # stopped and forgotten: the family's next peer starts it again


def test_the_childs_stamps_become_the_peer_run_timed_by_the_one_definition(tmp_path, monkeypatch):
    plant(tmp_path, monkeypatch, '''
        if request[0] == "load":
            conn.send(("ready", None))
        else:
            peer, ids, n, eos, ignore_eos, settings = request
            assert eos == [7] and settings == {"num_assistant_tokens": 3}, request
            conn.send(("ok", {"tokens": [5, 6, 7, 8, 9], "marks": [[10.5, 1], [10.6, 2], [10.9, 2]],
                              "start": 10.0, "end": 11.0}))
    ''')
    fam = family()
    fam.settings["openvino-sd"] = {"num_assistant_tokens": 3}
    proc = PeerProcess(fam)
    try:
        run = proc.generate("openvino-sd", [1, 2], 5)
        assert run.tokens == [5, 6, 7, 8, 9] and run.chunks == 3
        assert run.tpot_ms == pytest.approx(100.0)  # (10.9 - 10.5) s over the 4 tokens after the first
        assert run.prefill_s == pytest.approx(0.5) and run.wall_s == pytest.approx(1.0)
        with pytest.raises(YggError, match="peer openvino-sd is measured greedy only here"):
            proc.generate("openvino-sd", [1, 2], 5, temperature=0.7)
    finally:
        proc.close()


def test_a_child_that_dies_is_one_line_with_its_signal_and_its_last_words(tmp_path, monkeypatch):
    plant(tmp_path, monkeypatch, '''
        if request[0] == "load":
            conn.send(("ready", None))
        else:
            print("oneDNN: illegal instruction in a planted kernel", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
    ''')
    proc = PeerProcess(family())
    with pytest.raises(PeerCrashed) as e:
        proc.generate("openvino", [1], 3)
    assert str(e.value) == ("peer openvino crashed generating: its process was killed by SIGSEGV (signal 11) "
                            "(oneDNN: illegal instruction in a planted kernel)")
    assert proc.proc is None


def test_an_openvino_peer_without_its_venv_is_refused_before_any_work(artifact, tmp_path):
    proc = ygg("bench", "--artifact", artifact, "--peers", "openvino-sd", "-n", 4, "-o", tmp_path / "out",
               env={"YGG_OPENVINO_PYTHON": str(tmp_path / "no-python")})
    assert_one_line_error(proc, "peer openvino-sd needs OpenVINO GenAI in a venv of its own: make install-openvino")
    assert not (tmp_path / "out").exists()
    BenchOptions(artifact, peers=list(OPENVINO_PEERS))  # every one a peer the options take


def test_tuning_keeps_the_fastest_setting_and_sweeps_once_a_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(openvino_peers, "SWEEP", {"openvino-sd": [{"num_assistant_tokens": k} for k in (2, 3, 5)],
                                                  "openvino-pld": [{"num_assistant_tokens": 3, "max_ngram_size": 3}]})
    times = {2: [50.0, 30.0, 31.0], 3: [29.0, 29.5, 80.0], 5: [40.0, 40.0, 40.0]}  # medians 31, 29.5, 40
    calls = []

    def generate(peer, ids, n, settings):
        calls.append((peer, settings))
        k = settings["num_assistant_tokens"]
        return times[k][sum(1 for p, s in calls if s == settings) % 3 - 1]

    monkeypatch.setattr(openvino_peers, "TUNE_PROMPTS", 3)
    tuned = tmp_path / "tuned.json"
    got = openvino_peers.tune(["openvino", "openvino-sd"], generate, lambda text: [1, 2, 3], tuned, "machine-a")
    assert got == {"openvino-sd": {"settings": {"num_assistant_tokens": 3},
                                   "swept": {"num_assistant_tokens=2": 31.0, "num_assistant_tokens=3": 29.5,
                                             "num_assistant_tokens=5": 40.0}}}
    assert len(calls) == 9 and {p for p, _ in calls} == {"openvino-sd"}  # plain decoding has nothing to tune
    again = openvino_peers.tune(["openvino-sd"], generate, lambda text: [1], tuned, "machine-a")
    assert again == got and len(calls) == 9  # read back
    openvino_peers.tune(["openvino-sd"], generate, lambda text: [1], tuned, "machine-b")
    assert len(calls) == 18 and set(json.loads(tuned.read_text())) == {"machine-a", "machine-b"}


def test_speculative_peers_are_counted_against_their_own_plain_decoding_and_ours():
    def row(who, prompt, tokens):
        return {"contestant": who, "prompt": prompt, "category": "code", "kind": "peer", "tokens": tokens,
                "tpot_ms": 10.0, "wall_s": 1.0, "prefill_s": 0.1, "prompt_tokens": 4, "generated": len(tokens),
                "mean_accepted_length": 1.0, "acceptance_rate": None, "depth_acceptance": [], "draft_s": None,
                "verify_s": None, "other_s": None}

    rows = [row("ar", "a", [1, 2, 3]), row("ar", "b", [4, 5]),
            row("openvino", "a", [1, 2, 9]), row("openvino", "b", [4, 5]),
            row("openvino-sd", "a", [1, 2, 9]), row("openvino-sd", "b", [4, 6])]
    summary = summarize(rows, ["ar", "openvino", "openvino-sd"], greedy=True)
    sd = next(r for r in summary if r["contestant"] == "openvino-sd" and r["category"] == "all")
    assert (sd["own_plain"], sd["same_as_own_plain"], sd["own_plain_prompts"], sd["same_as_ar"]) == ("openvino", 1, 2, 0)
    plain = next(r for r in summary if r["contestant"] == "openvino" and r["category"] == "all")
    assert "own_plain" not in plain and plain["same_as_ar"] == 1
    assert "| all | openvino-sd | 1/2 | `openvino` | 0/2 |" in peers_exactness(summary)


def test_what_each_reads_and_the_tuned_settings_are_in_the_summary():
    lines = "\n".join(peers_weights({
        "ours": {"weights": "Q4_K 4-bit", "bytes": 1_135_790_344},
        "openvino, openvino-sd": {"weights": "OpenVINO IR, int4_asym g128", "bytes": 1_148_812_109},
        "openvino-sd": {"settings": {"num_assistant_tokens": 3}, "swept": {"num_assistant_tokens=3": 29.5}}}))
    assert "| our methods | Q4_K 4-bit | 1.14 |" in lines and "| openvino, openvino-sd | OpenVINO IR, int4_asym g128 | 1.15 |" in lines
    assert "- `openvino-sd`: **num_assistant_tokens=3** (swept, ms a token: num_assistant_tokens=3: 29.5)" in lines


def test_an_export_is_described_by_its_weights_in_the_cache(tmp_path, monkeypatch):
    from ygg_compile import cache

    monkeypatch.setenv("YGG_CACHE", str(tmp_path))
    ir = openvino_peers.ir_dir("ab" * 32)
    ir.mkdir(parents=True)
    (ir / "openvino_model.xml").write_text(
        '<net><rt_info><nncf><weight_compression><backup_mode value="int8_asym" /><group_size value="128" />'
        '<mode value="int4_asym" /></weight_compression></nncf></rt_info></net>')
    assert openvino_peers.weights_format(ir) == "int4_asym g128, embeddings and head int8_asym"
    (ir / "source.json").write_text(json.dumps({"gguf": "/x/model-q4_k_m.gguf", "sha256": "ab" * 32,
                                                "weights": openvino_peers.weights_format(ir)}))
    (entry,) = [e for e in cache.entries() if e.kind == "openvino"]
    assert entry.what == "model-q4_k_m.gguf as OpenVINO IR (int4_asym g128, embeddings and head int8_asym)"
    assert peer_process.openvino_peers is openvino_peers
