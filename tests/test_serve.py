"""`ygg serve` end to end, as a user runs it: the real command on a loopback port, spoken to with the
official `openai` client (and raw HTTP where a client would refuse to send the request). Every
request loop is bounded in count and time, and every server started here is stopped here."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest

from helpers import TIMEOUT, Served, assert_one_line_error, ygg
from ygg_runtime.artifact import load as artifacts
from ygg_runtime.errors import YggError
from ygg_runtime.options import MAX_ROWS, ServeOptions

YGG = str(Path(sys.executable).parent / "ygg")
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time", "import numpy as np\n",
           "SELECT name FROM", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def decoder(artifact):
    return artifacts.load(artifact)


@pytest.fixture(scope="module")
def server(artifact):
    s = Served(artifact, "--max-batch", "4", "--max-queue", "16")
    yield s
    s.stop()


def alone(decoder, prompt: str, n: int, method: str | None = None) -> list[int]:
    return decoder.generate(prompt, max_new_tokens=n, raw=True, ignore_eos=True, method=method).token_ids


def complete(server: Served, prompt: str, n: int, **extra):
    return server.client.completions.create(model=server.model, prompt=prompt, max_tokens=n, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True, **extra})


@pytest.mark.parametrize("bad, needle", [
    ({"max_batch": 0}, f"--max-batch must be in 1..{MAX_ROWS}, not 0"),
    ({"max_batch": MAX_ROWS + 1}, f"--max-batch must be in 1..{MAX_ROWS}"),
    ({"max_queue": -1}, "--max-queue must be at least 0"),
    ({"port": 65536}, "--port must be in 0..65535"),
    ({"api_key": ""}, "--api-key must be a non-empty key"),
])
def test_python_and_the_cli_refuse_the_same_serve_options(bad, needle):
    """One home for serve's defaults and checks: `serve()` from Python refuses what `ygg serve` does,
    and the command says so before it loads a model."""
    with pytest.raises(YggError, match=needle.replace(".", "\\.")):
        ServeOptions(**bad)
    (option, value), = bad.items()
    assert_one_line_error(ygg("serve", "-a", "/nonexistent", f"--{option.replace('_', '-')}", value), needle)


def test_a_server_with_an_api_key_answers_401_in_one_line_without_it_and_serves_with_it(artifact, decoder):
    """`ygg serve` with a key ($YGG_API_KEY here, `--api-key` alike): every /v1 request without the
    bearer token, or with another, gets 401 in one line of OpenAI's JSON (before its body is even
    read); /health and /metrics stay open; with the key, a completion is the target's own output."""
    served = Served(artifact, api_key="s3cret")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for r in (httpx.get(served.url + "/v1/models", headers=headers, timeout=TIMEOUT),
                      httpx.post(served.url + "/v1/completions", content=b"not json", headers=headers,
                                 timeout=TIMEOUT)):
                assert r.status_code == 401 and "\n" not in r.text.strip()
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(served.url + "/health", timeout=TIMEOUT).status_code == 200
        assert httpx.get(served.url + "/metrics", timeout=TIMEOUT).status_code == 200
        out = complete(served, PROMPTS[0], 8)
        assert out.choices[0].token_ids == alone(decoder, PROMPTS[0], 8)
    finally:
        served.stop()


@pytest.mark.parametrize("host, key, warned", [("127.0.0.1", None, False), ("::1", None, False),
                                               ("localhost", None, False), ("0.0.0.0", None, True),
                                               ("0.0.0.0", "k", False), ("10.1.2.3", None, True)])
def test_a_server_that_answers_beyond_loopback_without_a_key_is_warned(host, key, warned):
    """Bound beyond loopback without a key, `ygg serve` starts with a one-line warning (never binding
    such an address here: the line comes from the options)."""
    line = ServeOptions(host=host, api_key=key).exposed()
    assert (line is not None) == warned
    assert line is None or ("without --api-key" in line and "\n" not in line)


def test_the_server_counts_each_step_as_the_generation_does(decoder):
    """One step event feeds the generation's metrics and /metrics' spec-decode counters alike: a
    drafted token that the target accepted but the budget cut counts in neither."""
    from ygg_runtime.serving.metrics import ServerMetrics

    prompt = decoder.encode(PROMPTS[0], raw=True)
    cut = 0
    for budget in range(1, 7):
        server, verdicts = ServerMetrics(), []
        batch = decoder.batch(max_batch=1)
        member = batch.join(prompt, "chain", max_new_tokens=budget, on_event=server.record,
                            on_step=lambda tree, verdict: verdicts.append(verdict.accepted))
        for _ in range(50):
            if not batch.members:
                break
            assert all(m.error is None for m in batch.step())
        m = member.generation.metrics
        assert sum(m.accepted_lengths) == budget
        assert server.num_accepted_tokens._value.get() == m.accepted_tokens
        assert server.num_draft_tokens._value.get() == m.drafted_tokens
        cut += sum(verdicts) - m.accepted_tokens
    assert cut > 0  # some budget did cut accepted tokens (the case the old counter got wrong)


def test_the_server_binds_to_loopback_and_lists_its_model(server):
    assert server.model == "target"
    models = server.client.models.list().data
    assert [m.id for m in models] == ["target"] and models[0].model_extra["max_model_len"] == 256
    assert listening_on(server.port) == ["127.0.0.1"]


def listening_on(port: int) -> list[str]:
    """The IPv4 addresses a socket listens on at `port`, read from the kernel's table."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, at = local.split(":")
        if int(at, 16) == port and state == "0A":  # 0A: LISTEN
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_a_completion_is_the_targets_own_greedy_output(server, decoder):
    r = complete(server, PROMPTS[0], 24)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == alone(decoder, PROMPTS[0], 24)
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(decoder.encode(PROMPTS[0], raw=True))
    assert choice.text == decoder.codec.decode(choice.model_extra["token_ids"])


def test_a_streamed_completion_joins_to_the_same_text(server, decoder):
    stream = server.client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks)
    assert text == decoder.codec.decode(alone(decoder, PROMPTS[1], 24))


def test_chat_streamed_and_not_give_the_same_answer(server, decoder):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    whole = server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=20, temperature=0,
                                                  extra_body={"ignore_eos": True})
    ids = decoder.generate(PROMPTS[2], max_new_tokens=20, ignore_eos=True).token_ids
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == decoder.codec.decode(ids)
    stream = server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=20, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stop_string_ends_the_text_before_it(server, decoder):
    full = decoder.codec.decode(alone(decoder, PROMPTS[3], 32))
    stop = full[10:13]
    r = complete(server, PROMPTS[3], 32, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]


def test_concurrent_greedy_requests_each_get_their_own_output(server, decoder):
    """Six requests at once on a batch of four (two wait, then join as rows free up), mixing
    methods: each one's token ids are the request's alone."""
    methods = ["egt", "chain", "ar", "egt", "specinfer", "egt"]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(complete, server, p, 40, method=m) for p, m in zip(PROMPTS, methods)]
        got = [f.result(timeout=TIMEOUT).choices[0].model_extra["token_ids"] for f in futures]
    assert got == [alone(decoder, p, 40) for p in PROMPTS]


def test_a_seeded_sampled_request_prints_plain_decodings_text_whatever_runs_beside_it(server, decoder):
    """The OpenAI `seed` under the artifact's coupled sampling: a request's text is what `ar`
    prints alone with that seed, whether it runs alone or beside other requests (other methods,
    greedy and sampled, joining and leaving), whatever tree its method drafts."""
    def sample(prompt, seed, method, temperature=1.0):
        return server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=24, temperature=temperature, top_p=0.9, seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True, "method": method}).choices[0].model_extra["token_ids"]

    def plain(prompt, seed, temperature=1.0):
        return decoder.generate(prompt, max_new_tokens=24, temperature=temperature, top_p=0.9, seed=seed, raw=True,
                                ignore_eos=True, method="ar", sampling="coupled").token_ids

    assert sample(PROMPTS[0], 1, "egt") == plain(PROMPTS[0], 1)  # alone
    jobs = [(PROMPTS[i % 3], seed, m) for i, (seed, m) in enumerate([(1, "egt"), (2, "chain"), (3, "specinfer"),
                                                                     (1, "ar"), (4, "egt"), (5, "sequoia")])]
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        greedy = pool.submit(complete, server, PROMPTS[4], 40, method="egt")
        futures = [pool.submit(sample, p, seed, m) for p, seed, m in jobs]
        got = [f.result(timeout=TIMEOUT) for f in futures]
        greedy.result(timeout=TIMEOUT)
    assert got == [plain(p, seed) for p, seed, _ in jobs]
    assert plain(PROMPTS[0], 1) != plain(PROMPTS[0], 2)  # the seed matters


def test_health_says_whether_greedy_output_is_exact_here_and_how_it_samples(server):
    import httpx2 as httpx

    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["sampling"] == "coupled"
    assert body["exact"] is True and "identical to this artifact's plain decoding" in body["exactness"]


def test_bad_requests_get_openai_errors_while_another_request_completes(server, decoder):
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, server, PROMPTS[4], 120)
        raw = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=TIMEOUT,
                         headers={"content-type": "application/json"})
        assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError) as e:
            server.client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=server.model, prompt="hi", max_tokens=-1)
        assert "max_tokens must be at least 1" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=server.model, prompt="x" * 400, max_tokens=4)
        assert e.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=server.model, prompt="hi", max_tokens=4, temperature=-1)
        assert e.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=server.model, prompt="hi", max_tokens=4,
                                             extra_body={"method": "medusa"})
        assert "method 'medusa' is not in this artifact" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=server.model, prompt="hi", max_tokens=4, seed=1,
                                             extra_body={"sampling": "typical"})
        assert e.value.body["param"] == "sampling" and "coupled, rejection" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=server.model, prompt=[5, decoder.target.vocab_size + 3], max_tokens=4)
        assert "prompt token ids must be in [0, " in e.value.body["message"]
        r = long.result(timeout=TIMEOUT)
    assert r.choices[0].model_extra["token_ids"] == alone(decoder, PROMPTS[4], 120)


def running(server: Served) -> float:
    return server.metrics()["vllm:num_requests_running"]


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server):
    start = server.metrics()
    before = start.get("vllm:request_success_total{finished_reason=cancelled}", 0.0)
    body = {"model": server.model, "prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # one event, then hang up
        mid = server.metrics()  # tokens are counted as they are made, not when the request ends
        assert mid["vllm:num_requests_running"] == 1
        assert mid["vllm:generation_tokens_total"] > start.get("vllm:generation_tokens_total", 0.0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running(server) > 0:
        time.sleep(0.1)
    after = server.metrics()
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:request_success_total{finished_reason=cancelled}"] == before + 1
    assert complete(server, PROMPTS[0], 4).choices[0].finish_reason == "length"  # still serving


def test_metrics_move_with_the_load_and_agree_with_the_responses(server):
    """The counters match the responses. `chain` drafts k tokens every step whatever the machine: egt's
    depth is planned from the costs measured here, and on the tiny pair it may plan plain decoding, where
    only a graft drafts (once: 3 drafts, none accepted), so the spec-decode counters would not move."""
    before = server.metrics()
    with ThreadPoolExecutor(4) as pool:
        done = [f.result(timeout=TIMEOUT) for f in [pool.submit(complete, server, p, 32, method="chain") for p in PROMPTS[:4]]]
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in done) == 4 * 32
    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in done)
    assert delta("vllm:request_success_total{finished_reason=length}") == 4
    drafts, drafted, accepted = (delta(f"vllm:spec_decode_num_{n}_total") for n in ("drafts", "draft_tokens", "accepted_tokens"))
    assert drafts > 0 and 0 < accepted <= drafted
    per_pos = sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == accepted
    assert delta("vllm:time_per_output_token_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    batched = sum(delta(k) for k in after if k.startswith("ygg:batch_steps_total{sequences=") and not k.endswith("=1}"))
    assert batched > 0  # some steps verified several requests together


def chat_without_max_tokens(server: Served, prompt: str):
    """A chat request as the openai client sends it by default: no max_tokens (the rest of the context)."""
    return server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                                 temperature=0, extra_body={"return_token_ids": True})


def chat_load(server: Served, prompts: list[str]) -> tuple[list[list[int]], float]:
    """The prompts' chat requests at once; (each answer's token ids, the most requests /metrics saw running)."""
    peak, done = [0.0], threading.Event()

    def watch():
        while not done.wait(0.05):
            peak[0] = max(peak[0], server.metrics().get("vllm:num_requests_running", 0.0))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = [f.result(timeout=TIMEOUT) for f in [pool.submit(chat_without_max_tokens, server, p) for p in prompts]]
    finally:
        done.set()
        watcher.join()
    return [a.choices[0].model_extra["token_ids"] for a in answers], peak[0]


def chat_alone(decoder, prompt: str) -> list[int]:
    """The request's `ar` output alone: up to the artifact's context, as the server's default."""
    ids = decoder.encode(prompt)
    return decoder.generate(ids, max_new_tokens=decoder.max_context - len(ids), method="ar").token_ids


CHATS = PROMPTS + ["Write a haiku about", "for i in range(10):"]


def test_chat_requests_without_max_tokens_all_run_together_and_each_gets_its_own_output(artifact, decoder):
    """Eight chat requests at once as the openai client sends them (no max_tokens: the rest of the
    context each): the cache is taken as tokens are written, not reserved for that context, so all
    eight run together, and each answer is the request's `ar` output alone."""
    s = Served(artifact, "--max-batch", "8")
    try:
        got, _ = chat_load(s, CHATS)
        assert got == [chat_alone(decoder, p) for p in CHATS]
        # all eight verified together in some step (the server's own count: a 50 ms sample of the
        # running gauge can miss a short overlap on a loaded machine, as a fresh clone's suite showed)
        metrics = s.metrics()
        assert metrics.get("ygg:batch_steps_total{sequences=8}", 0) > 0
        assert metrics["vllm:num_preemptions_total"] == 0
    finally:
        s.stop()


def test_a_cache_too_small_for_the_load_preempts_and_every_answer_is_still_its_own(artifact, decoder):
    """A KV cache of 400 tokens (--kv-cache-gb) under four chat requests that write about 250
    each: the newest is preempted when the cache is full and recomputed when room returns; none
    fails, every answer is the request's `ar` output alone, and /metrics counts the preemptions."""
    gb = (MAX_ROWS + 400) * decoder.kv_bytes_per_token() / 2**30
    s = Served(artifact, "--max-batch", "4", "--kv-cache-gb", f"{gb:.12f}")
    try:
        got, _ = chat_load(s, CHATS[:4])
        assert got == [chat_alone(decoder, p) for p in CHATS[:4]]
        m = s.metrics()
        assert m["vllm:num_preemptions_total"] > 0 and m["ygg:kv_cache_tokens{kind=capacity}"] == 400
        assert m["vllm:request_success_total{finished_reason=length}"] + m.get(
            "vllm:request_success_total{finished_reason=stop}", 0) == 4
    finally:
        log = s.stop()
    assert "KV cache: " in log and "400 tokens for both models" in log


def test_a_full_queue_answers_429_and_the_admitted_requests_complete(artifact):
    s = Served(artifact, "--max-batch", "1", "--max-queue", "1")
    try:
        def send(_):
            body = {"model": s.model, "prompt": "Once", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "method": "ar"}
            return httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)

        with ThreadPoolExecutor(6) as pool:
            codes = [r.status_code for r in pool.map(send, range(6), timeout=TIMEOUT)]
        assert codes.count(200) >= 2 and 429 in codes and set(codes) == {200, 429}, codes
        assert complete(s, "Once", 4).choices[0].finish_reason == "length"
    finally:
        s.stop()


def test_sigterm_lets_a_running_request_finish_then_exits(artifact):
    s = Served(artifact)
    first = threading.Event()
    texts, reasons = [], []

    def stream():
        for chunk in s.client.completions.create(model=s.model, prompt="Once", max_tokens=150, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True, "method": "ar"}):
            texts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
            first.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(TIMEOUT)
        s.proc.send_signal(signal.SIGTERM)
        t.join(TIMEOUT)
        assert not t.is_alive() and reasons[-1] == "length"
        assert s.proc.wait(timeout=60) == 0
    finally:
        s.stop()


def test_serve_refuses_a_taken_port_in_one_line(artifact):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = ygg("serve", "--artifact", artifact, "--port", busy.getsockname()[1])
    assert_one_line_error(proc, "cannot listen on 127.0.0.1:")


def test_serve_refuses_bad_settings_in_one_line(artifact):
    assert_one_line_error(ygg("serve", "--artifact", artifact, "--max-batch", 0), "--max-batch must be in 1..64")
    assert_one_line_error(ygg("serve", "--artifact", artifact, "--max-queue", -1), "--max-queue must be at least 0")
    assert_one_line_error(ygg("serve", "--artifact", artifact, "--kv-cache-gb", 0), "--kv-cache-gb must be a positive")
    assert_one_line_error(ygg("serve", "--artifact", artifact, "--kv-cache-gb", "0.00000001"), "give it at least")


def test_bench_serve_loads_the_server_at_each_level_and_writes_its_results(artifact, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [p]}) + "\n"
                               for i, p in enumerate(PROMPTS[:4])))
    out = tmp_path / "serve"
    proc = ygg("bench-serve", "--artifact", artifact, "--prompts", prompts, "--concurrency", "1,2", "--methods",
               "egt,ar", "-n", 12, "-o", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "results.json").read_text())
    assert {(r["method"], r["concurrency"]) for r in report["summary"]} == {(m, c) for m in ("egt", "ar") for c in (1, 2)}
    for r in report["summary"]:
        assert r["requests"] == 4 and r["tokens_per_s"] > 0 and r["outputs_equal_ar"] == "4/4"
        assert r["tpot_ms_p50"] > 0 and r["nodes_per_sequence"] >= 1
        # the server's /metrics account of the level is the clients' own
        assert r["metrics_agree"] and r["metrics"]["generation_tokens"] == r["tokens"]
    ar = [r for r in report["summary"] if r["method"] == "ar"]
    assert all(r["nodes_per_sequence"] == 1 for r in ar)  # plain decoding verifies only the root
    assert (out / "serve.png").stat().st_size > 0 and (out / "metrics.png").stat().st_size > 0
    assert "| egt | 2 |" in (out / "summary.md").read_text()


def test_bench_serve_runs_a_chat_load_without_max_tokens_and_reports_the_cache(artifact, tmp_path):
    """--chat: chat requests without max_tokens, as the openai client sends them; every output is
    still ar's, and the report says what the cache held against reserving max_tokens up front."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [p]}) + "\n"
                               for i, p in enumerate(PROMPTS[:3])))
    out = tmp_path / "serve"
    proc = ygg("bench-serve", "--artifact", artifact, "--prompts", prompts, "--concurrency", "3", "--methods",
               "chain,ar", "--chat", "-o", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "results.json").read_text())
    assert report["config"]["chat"] and report["config"]["max_new_tokens"] is None
    for r in report["summary"]:
        assert r["outputs_equal_ar"] == "3/3" and r["metrics_agree"] and r["preemptions"] == 0
        assert r["tokens"] > 3 * 100  # answers run on: nobody asked for fewer tokens
        assert r["kv_tokens_per_gb"] > r["kv_tokens_per_gb_upfront"] > 0  # (the tiny context of 256 leaves little to gain)
    assert "chat requests without max_tokens" in (out / "summary.md").read_text()


def test_bench_serve_refuses_a_bad_concurrency_in_one_line(artifact):
    assert_one_line_error(ygg("bench-serve", "--artifact", artifact, "--concurrency", "0,2"), "--concurrency takes levels")
    assert_one_line_error(ygg("bench-serve", "--artifact", artifact, "--concurrency", "a"), "--concurrency takes integers")


def test_a_request_without_a_method_runs_what_the_decoder_chooses_for_its_length_and_the_metrics_say_so(decoder,
                                                                                                          monkeypatch):
    """The server prices each request as `ygg run` does (`Decoder.choose`, given its prompt and
    max_tokens): the method chosen runs, with the drafter's window chosen, a named one runs as
    asked, and ygg:request_method and ygg:request_draft_window count each by how it was chosen."""
    import asyncio

    from ygg_runtime.decoding.decoder import Choice
    from ygg_runtime.serving.api import CompletionRequest
    from ygg_runtime.serving.server import Server

    server = Server(decoder, "tiny", max_batch=2)
    asked = []

    def choose(prompt: int, new: int) -> Choice:
        asked.append((prompt, new))
        return Choice("ar", why="modelled") if prompt > 5 else Choice(decoder.default_method, 8 if prompt > 2 else None)

    monkeypatch.setattr(decoder, "choose", choose)

    async def jobs():
        out = []
        for prompt, method in (([5, 6, 7, 8, 9, 10], None), ([5, 6], None), ([5, 6, 7], None),
                               ([5, 6, 7, 8, 9, 10], "chain")):
            req = CompletionRequest(model="tiny", prompt=prompt, max_tokens=4, method=method)
            job = server.job(req, prompt, False)
            out.append((job.method, job.draft_window))
        return out

    assert asyncio.run(jobs()) == [("ar", None), (decoder.default_method, None), (decoder.default_method, 8),
                                   ("chain", None)]
    assert asked == [(6, 4), (2, 4), (3, 4)]
    counted = {name: {tuple(s.labels.values()): s.value for s in m.samples if s.name.endswith("_total")}
               for m in server.metrics.registry.collect() for name in ("ygg:request_method", "ygg:request_draft_window")
               if m.name == name}
    assert counted["ygg:request_method"] == {("ar", "request"): 1.0, (decoder.default_method, "plan"): 1.0,
                                             (decoder.default_method, "request"): 1.0, ("chain", "asked"): 1.0}
    assert counted["ygg:request_draft_window"] == {("whole",): 3.0, ("8",): 1.0}
