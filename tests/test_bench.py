"""`ygg bench` and `ygg inspect` end to end on the tiny pair, as a user types them."""

import csv
import json

import pytest
from helpers import Notes, assert_one_line_error, ygg

PEERS = ["hf", "hf-assisted", "hf-pld"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "q.jsonl"
    rows = [{"question_id": 1, "category": "story", "turns": ["Once upon a time"]},
            {"question_id": 2, "category": "code", "turns": ["def add(a, b):"]},
            {"question_id": 3, "category": "code", "turns": ["left out by --limit 1"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def contestants(artifact):
    """Every compiled method, the ablations the artifact has something to ablate for, the peers."""
    import yaml

    plan = yaml.safe_load((artifact / "plan.yaml").read_text())
    stages = plan["planning"]["stages"]
    plain = stages["chosen"] == {"tail": "plain", "head": "plain"}
    ablations = {"egt-fixed": bool(plan["methods"]["egt"].get("depth_policy")),
                 "egt-nograft": bool(plan["methods"]["egt"].get("graft")), "egt-eager": bool(plan["aot"]),
                 "egt-plain": not plain, "egt-ahead": plain and bool(stages["alternatives"]),
                 "egt-noadapt": bool(plan["methods"]["egt"].get("adapt")),
                 "auto-noadapt": plan["method"] not in ("ar", "pld") and bool(plan["methods"]["egt"].get("adapt")),
                 "ar-eager": bool(plan["aot"])}
    auto = ["auto"] if plan["method"] not in ("ar", "pld") else []  # what a request naming no method runs
    return [*plan["methods"], *auto, *(name for name, applies in ablations.items() if applies), *PEERS]


@pytest.fixture(scope="module")
def bench(artifact, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results"
    proc = ygg("bench", "--artifact", artifact, "--prompts", prompts, "--limit", 1, "-n", 20, "-o", out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_bench_runs_every_method_and_peer_on_every_prompt(bench, contestants):
    out, proc = bench
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["contestants"] == contestants
    assert sorted((r["prompt"], r["contestant"]) for r in results["runs"]) == sorted(
        (p, c) for p in ("1", "2") for c in contestants)
    assert all(r["generated"] >= 1 and r["tpot_ms"] > 0 for r in results["runs"])
    assert "ygg bench --artifact" in results["config"]["command"]
    for name in contestants:
        assert name in proc.stdout  # the terminal table


def test_bench_greedy_outputs_all_equal_the_targets_in_float32(bench, contestants):
    out, _ = bench
    summary = json.loads((out / "results.json").read_text())["summary"]
    overall = {r["contestant"]: r for r in summary if r["category"] == "all"}
    assert set(overall) == set(contestants)
    for name, row in overall.items():  # a peer with the checkpoint's own sampling defaults would fail here
        assert row["same_as_ar"] == row["prompts"] == 2, name
    assert overall["egt-eager"]["reference"] == "ar-eager" and overall["chain"]["reference"] == "ar"
    assert overall["ar"]["speedup_vs_ar"] == 1.0 and overall["hf-assisted"]["speedup_vs_hf_assisted"] == 1.0
    assert overall["ar"]["mean_accepted_length"] == 1.0 and overall["hf"]["mean_accepted_length"] == 1.0
    assert overall["chain"]["mean_accepted_length"] > 1.0
    assert abs(sum(overall["specinfer"][f"{k}_share"] for k in ("draft", "verify", "other")) - 1) < 1e-6


def test_bench_writes_csv_plots_and_summary(bench, contestants):  # runs before the resume test rewrites them
    out, _ = bench
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {(r["category"], r["contestant"]) for r in rows} == {(c, n) for c in ("code", "story", "all") for n in contestants}
    for png in ("speedup.png", "tpot_vs_accepted.png", "tw_curves.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, png
    md = (out / "summary.md").read_text()
    assert "ygg bench --artifact" in md and "| all | specinfer |" in md and "Fastest per category" in md
    glance = md.split("## At a glance")[1].split("\n## ")[0]
    assert f"| category | {' | '.join(contestants)} |" in glance
    assert {line.split(" | ")[0] for line in glance.splitlines() if line.startswith("| ") and "**" in line} == {"| code", "| story", "| all"}
    summary = json.loads((out / "results.json").read_text())["summary"]
    pld = next(r for r in summary if r["category"] == "all" and r["contestant"] == "pld")
    assert "## Where the tokens come from" in md and "| all | pld |" in md.split("## Where the tokens come from")[1]
    assert sum(pld["tokens_per_step_by_source"].values()) == pytest.approx(pld["mean_accepted_length"])
    assert pld["tokens_per_step_by_source"]["draft"] == 0 and pld["retrieval_ms_per_step"] > 0
    ablations = [c for c in contestants if c.startswith("egt-") or c == "auto-noadapt"]
    assert ("What each part of `egt` buys" in md) == bool(ablations)
    for r in rows:  # egt's paired gain over each ablation, and nothing for the other contestants
        assert (float(r["egt_speedup_over"]) > 0) if r["contestant"] in ablations else r["egt_speedup_over"] == "", r
    profile = json.loads((out / "results.json").read_text())["profile"]
    assert len(profile["contexts"]) == len(profile["target_ms"]) == len(profile["draft_ms"]) == 1
    assert len(profile["target_ms"][0]) == len(profile["draft_ms"][0]) == len(profile["other_ms"]) == len(profile["widths"])
    assert not list(out.glob(".*.tmp"))


def test_bench_resume_reuses_finished_runs_and_refuses_other_settings(bench, artifact, prompts, contestants):
    out, _ = bench
    before = (out / "runs.jsonl").read_text()
    with open(out / "runs.jsonl", "a") as f:
        f.write('{"prompt": "2", "contest')  # an interrupt mid-write leaves a cut line: dropped on resume
    proc = ygg("bench", "--artifact", artifact, "--prompts", prompts, "--limit", 1, "-n", 20, "-o", out, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert (out / "runs.jsonl").read_text() == before  # nothing ran again
    proc = ygg("bench", "--artifact", artifact, "--prompts", prompts, "--limit", 1, "-n", 20, "-o", out, "--resume",
               "--categories", "code", "--peers", "hf")
    assert proc.returncode == 0, proc.stderr
    assert (out / "runs.jsonl").read_text() == before
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert {(r["prompt"], r["contestant"]) for r in runs} == {("2", c) for c in contestants if c not in ("hf-assisted", "hf-pld")}
    proc = ygg("bench", "--artifact", artifact, "--prompts", prompts, "--limit", 1, "-n", 21, "-o", out, "--resume")
    assert_one_line_error(proc, "cannot resume", "max_new_tokens")


def test_a_peer_that_crashes_costs_one_line_and_every_other_result_is_written(artifact, prompts, tmp_path, monkeypatch):
    """A peer's native code dying mid-generation (planted: its child process killed by SIGSEGV, as
    llama.cpp's AMX repack dies on a Xeon): one line names the peer and the signal; ar, egt and the
    other peer of the same family (its process started again) keep every run, and the results are
    written with the crash named. runs.jsonl keeps what the peer finished before it died."""
    import os
    import signal

    from ygg_bench import peer_process
    from ygg_bench.bench import run_bench
    from ygg_bench.options import BenchOptions

    answer, pids, asked = peer_process.PeerProcess._answer, set(), []

    def dies_in_hf_pld(self, who, doing, timeout=None):
        pids.add(self.proc.pid)
        if who == "peer hf-pld" and doing == "generating":
            asked.append(who)
            if len(asked) == 2:  # after its warm-up, in its first prompt
                os.kill(self.proc.pid, signal.SIGSEGV)
        return answer(self, who, doing, timeout)

    monkeypatch.setattr(peer_process.PeerProcess, "_answer", dies_in_hf_pld)

    ui = Notes()
    out = tmp_path / "res"
    results = run_bench(BenchOptions(artifact, prompts=prompts, limit=1, methods=["ar", "egt"],
                                     peers=["hf-pld", "hf"], max_new_tokens=12, output=out), ui)
    assert len(asked) == 2 and len(pids) == 2  # hf's process started again after hf-pld's died
    crash = [line for line in ui.lines if "hf-pld" in line]
    assert crash == ["peer hf-pld crashed generating: its process was killed by SIGSEGV (signal 11); "
                     "its runs are left out, every other contestant's are kept"], ui.lines
    written = json.loads((out / "results.json").read_text())
    assert written["left_out"] == results["left_out"] == {
        "hf-pld": "peer hf-pld crashed generating: its process was killed by SIGSEGV (signal 11)"}
    runs = sorted((r["contestant"], r["prompt"]) for r in written["runs"])
    assert runs == sorted((c, p) for c in ("ar", "egt", "hf") for p in ("1", "2"))
    assert {r["contestant"] for r in written["summary"]} == {"ar", "egt", "hf"}
    assert all(r["same_as_ar"] == r["prompts"] for r in written["summary"] if r["category"] == "all")
    assert "Left out: **hf-pld**, peer hf-pld crashed generating" in (out / "summary.md").read_text()
    logged = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()[1:]]
    assert "hf-pld" not in [r["contestant"] for r in logged]
    assert not [pid for pid in pids if _alive(pid)], "a peer process outlived the benchmark"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bench_without_peers_on_the_builtin_prompts(artifact, tmp_path):
    proc = ygg("bench", "--artifact", artifact, "--peers", "none", "--methods", "chain", "-n", 8, "-o", tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["contestants"] == ["ar", "chain"]  # ar always runs: it is the baseline
    assert len({r["category"] for r in results["runs"]}) >= 4


@pytest.mark.parametrize("args, needle", [
    (["--prompts", "missing.jsonl"], "does not exist"),
    (["--peers", "vllm"], "unknown peer 'vllm'"),
    (["--methods", "medusa"], "not in this artifact"),
    (["--categories", "poetry"], "no prompts"),
    (["--long", "10"], "--long takes prompt lengths in tokens of at least 64"),
    (["--long", "1k"], "--long takes token counts"),
    (["--long", "100", "--limit", "1"], "--long replaces the prompt set"),
])
def test_bench_bad_input_is_one_line(artifact, tmp_path, args, needle):
    assert_one_line_error(ygg("bench", "--artifact", artifact, "-o", tmp_path / "out", *args), needle)


def test_bench_long_prompts_time_whole_requests_and_what_a_request_naming_no_method_runs(artifact, tmp_path):
    """--long: prompts of about the lengths asked, cut from the standard library's source, one
    category each; every contestant's time to the first token and whole request beside TPOT, paired
    with ar's; `auto` (no method named) runs what `Decoder.choose` picks, and says which;
    --ignore-eos: every run generates the whole budget."""
    proc = ygg("bench", "--artifact", artifact, "--long", "64,150", "--methods", "chain,auto", "--peers", "none",
               "-n", 8, "-o", tmp_path, "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["contestants"] == ["ar", "chain", "auto"] and "--long 64,150" in results["config"]["prompts"]
    assert results["config"]["ignore_eos"] is True and {r["generated_tokens"] for r in results["runs"]} == {8}
    lengths = {r["category"]: r["prompt_tokens"] for r in results["runs"] if r["contestant"] == "ar"}
    assert set(lengths) == {"long-64", "long-150"} and 64 <= lengths["long-64"] < lengths["long-150"] <= 150 + 40
    rows = {(r["category"], r["contestant"]): r for r in results["summary"]}
    for (cat, name), r in rows.items():
        assert r["same_as_ar"] == r["prompts"] and 0 < r["first_token_s"] < r["request_s"], (cat, name)
        assert r["request_speedup_vs_ar"] > 0 and r["first_token_vs_ar"] > 0
    assert rows[("all", "ar")]["request_speedup_vs_ar"] == 1.0
    assert sum(rows[("all", "auto")]["methods_run"].values()) == 2 and set(rows[("all", "auto")]["methods_run"]) <= {
        "chain", "pld", "ar"}
    md = (tmp_path / "summary.md").read_text()
    assert "## Whole requests" in md and "| long-150 | auto |" in md.split("## Whole requests")[1]


def test_inspect_explains_the_plan_and_draws_a_tree(artifact, tmp_path):
    proc = ygg("inspect", artifact, "--prompt", "Once upon a time", "--method", "specinfer", "-n", 16, "-o", tmp_path)
    assert proc.returncode == 0, proc.stderr
    for needle in ("chain", "specinfer", "break-even", "predicted speed-up", "T(W) target", "exactness", "attention",
                   "drafter's window", "answers' length"):
        assert needle in proc.stdout, needle
    assert "greedy output is identical to this artifact's plain decoding" in " ".join(proc.stdout.split()).replace("│ ", "")
    for png in ("tree.png", "tw_curves.png"):
        data = (tmp_path / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000


def test_inspect_without_a_prompt_and_a_step_beyond_the_generation(artifact, tmp_path):
    proc = ygg("inspect", artifact, "-o", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "modelled step ms" in proc.stdout and (tmp_path / "tw_curves.png").exists()
    proc = ygg("inspect", artifact, "--prompt", "Hi", "-n", 2, "--step", 50, "-o", tmp_path)
    assert_one_line_error(proc, "--step")


def test_every_contestant_of_a_full_bench_draws_in_a_colour_of_its_own():
    """The speed-up bars index contestants past `ar` in their order; those without a colour of their
    own once took matplotlib's C0..C9, which the named ones use (egt-eager drew in llama.cpp's pink)."""
    from matplotlib.colors import to_hex

    from ygg_bench import plots

    names = ["chain", "specinfer", "pld", "sequoia", "egt", "auto", "egt-nograft", "egt-eager", "egt-ahead", "ar-eager", "hf",
             "hf-assisted", "hf-pld", "llama.cpp", "llama.cpp-pld", "openvino", "openvino-sd", "openvino-pld", "openvino-gguf"]
    colours = [to_hex(plots._color(n, i)) for i, n in enumerate(names)] + [to_hex(plots._color("ar", 0))]
    assert len(set(colours)) == len(colours), colours


def test_a_transformers_peer_told_to_ignore_eos_has_no_end_of_sequence_token():
    """--ignore-eos reaches the peers: transformers' generation config then carries no EOS token
    (so it runs the whole budget, as ours and llama.cpp's loop do)."""
    from types import SimpleNamespace

    from ygg_bench.peers import HFPeers

    peers = SimpleNamespace(eos_ids=[7, 9], pad_id=7)
    assert HFPeers.config(peers, "hf", 16, 0.0, 1.0).eos_token_id == [7, 9]
    assert HFPeers.config(peers, "hf", 16, 0.0, 1.0, ignore_eos=True).eos_token_id is None
