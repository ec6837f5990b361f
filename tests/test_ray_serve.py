"""`ygg serve --ray` end to end on loopback: the real command starts a Ray of this machine alone with
two single-thread replicas of the suite's tiny artifact (chosen from a directory that also holds an
artifact planted for another CPU), spoken to through Ray Serve's proxy with the official client.
The module's tests share that one Ray (about 15 s to start on 2 cores); the last one stops it and
checks that no process is left."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers import TIMEOUT, Served, assert_one_line_error, free_port, ygg
from ygg_runtime.artifact import load as artifacts
from ygg_runtime.serving import ray_serve
from ygg_runtime.errors import YggError
from ygg_runtime.schema.plan import PLAN_FILE, Plan

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time", "import numpy as np\n",
           "SELECT name FROM", "Dear Sir or Madam,"]
KEY = "s3cret"


def planted(src: Path, dst: Path, cpu_model: str) -> Path:
    """An artifact whose plan says it was compiled on another CPU (its other files linked to src's)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != PLAN_FILE:
            (dst / f.name).symlink_to(f)
    plan = Plan.from_yaml((src / PLAN_FILE).read_text())
    plan = dataclasses.replace(plan, cpu=dataclasses.replace(plan.cpu, model=cpu_model))
    (dst / PLAN_FILE).write_text(plan.to_yaml())
    return dst


@pytest.fixture(scope="module")
def roots(artifact, tmp_path_factory):
    """{"mixed": this machine's artifact beside another CPU's, "other": the other CPU's alone}."""
    base = tmp_path_factory.mktemp("per-hardware")
    (base / "mixed").mkdir()
    (base / "mixed" / "here").symlink_to(artifact, target_is_directory=True)
    planted(artifact, base / "mixed" / "imaginary", "Imaginary CPU 9000")
    (base / "other").mkdir()
    planted(artifact, base / "other" / "imaginary", "Imaginary CPU 9000")
    (base / "twice").mkdir()
    for name in ("a", "b"):
        (base / "twice" / name).symlink_to(artifact, target_is_directory=True)
    return {"mixed": base / "mixed", "other": base / "other", "twice": base / "twice"}


@pytest.fixture(scope="module")
def decoder(artifact):
    return artifacts.load(artifact)


@pytest.fixture(scope="module")
def ray_served(roots):
    metrics_port = free_port()
    s = Served(roots["mixed"], "--ray", "--replicas", "2", "--replica-threads", "1", "--max-batch", "4",
               "--metrics-port", str(metrics_port), api_key=KEY,
               env={"RAY_metrics_report_interval_ms": "500"})  # Ray's metrics flushed quickly, for the test
    s.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    s.tree = tree(s.proc.pid)
    yield s
    if s.proc.poll() is None:
        s.stop()


def tree(pid: int) -> list[psutil.Process]:
    """A process and every process below it (the Ray it started: GCS, raylet, workers, proxy, replicas)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def replicas() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith("ray::ServeReplica")]


def alone(decoder, prompt: str, n: int) -> list[int]:
    return decoder.generate(prompt, max_new_tokens=n, raw=True, ignore_eos=True, method="ar").token_ids


def complete(s: Served, prompt: str, n: int, **extra):
    return s.client.completions.create(model=s.model, prompt=prompt, max_tokens=n, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True, **extra})


def ray_metrics(s: Served, name: str) -> dict[str, float]:
    """One family of the Ray node's Prometheus endpoint: its samples' values by replica (and label)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(s.metrics_url, timeout=TIMEOUT).text):
        for sample in family.samples:
            if sample.name == name:
                labels = {k: v for k, v in sample.labels.items() if k not in ("replica", "WorkerId")}
                key = sample.labels.get("replica", "") + "".join(f",{k}={v}" for k, v in sorted(labels.items())
                                                                 if k in ("finished_reason",))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def wait_for(check, what: str, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, f"waited {seconds} s for {what}"
            return value
        time.sleep(0.25)


# ------------------------------------------------------------------ before any Ray starts


def test_each_machine_gets_the_artifact_compiled_for_it_and_none_another(roots, artifact):
    """The choice a replica makes: this CPU's artifact out of a directory that also holds another
    CPU's; a directory of other machines' artifacts only is refused in one line naming them."""
    here = ray_serve.this_machine()
    assert ray_serve.choose_artifact(roots["mixed"]) == roots["mixed"] / "here"
    assert ray_serve.choose_artifact(artifact) == artifact  # an artifact directory alone
    with pytest.raises(YggError, match="no artifact under .* was compiled for this machine") as e:
        ray_serve.choose_artifact(roots["other"])
    assert "imaginary: CPU Imaginary CPU 9000" in str(e.value) and "\n" not in str(e.value)
    gpu = ("GPU NVIDIA H200 (compute capability 9.0)", here[1])  # a GPU machine without a GPU artifact: its CPU's
    assert ray_serve.choose_artifact(roots["mixed"], gpu) == roots["mixed"] / "here"
    with pytest.raises(YggError, match="2 artifacts under .* were compiled for this machine .*: a, b; keep one"):
        ray_serve.choose_artifact(roots["twice"])


@pytest.mark.parametrize("args, needle", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--replicas", "2", "--autoscale", "1,2"], "give --replicas or --autoscale, not both"),
    (["--ray", "--autoscale", "3,1"], "--autoscale takes MIN,MAX with 1 <= MIN <= MAX"),
    (["--ray", "--autoscale", "two"], "--autoscale takes MIN,MAX"),
    (["--ray", "--replica-threads", "0"], "--replica-threads must be at least 1"),
])
def test_ray_options_are_refused_in_one_line(artifact, args, needle):
    assert_one_line_error(ygg("serve", "-a", artifact, *args), needle)


def test_a_replica_is_sent_no_more_requests_than_its_batch_and_autoscales_between_the_bounds_given():
    """The deployment's options (nothing started): Ray sends a replica at most its batch, its proxy
    holds the queue, --autoscale MIN,MAX bounds the replicas and aims at half a batch each."""
    config = ray_serve.ReplicaConfig.from_args({"artifacts": "/artifacts", "max_batch": 6, "max_queue": 10})
    scaled = ray_serve.deployment(config, autoscale=(1, 3), cpus=2)
    options = scaled._deployment_config
    assert (options.max_ongoing_requests, options.max_queued_requests) == (6, 10)
    assert (options.autoscaling_config.min_replicas, options.autoscaling_config.max_replicas,
            options.autoscaling_config.target_ongoing_requests) == (1, 3, 3)
    assert scaled.ray_actor_options == {"num_cpus": 2}
    fixed = ray_serve.deployment(config, replicas=3)
    assert fixed.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None
    with pytest.raises(YggError, match="unknown application argument replicas"):
        ray_serve.ReplicaConfig.from_args({"artifacts": "/artifacts", "replicas": 2})
    with pytest.raises(YggError, match="needs artifacts=DIR"):
        ray_serve.ReplicaConfig.from_args({})


def test_serving_on_a_machine_no_artifact_was_built_for_is_refused_before_ray_starts(roots):
    assert_one_line_error(ygg("serve", "--ray", "-a", roots["other"], "--port", free_port()),
                          "no artifact under", "Imaginary CPU 9000")


def test_the_deploy_configs_build_the_application_ygg_serve_runs():
    """deploy/'s Serve config and KubeRay manifest name the importable application and arguments it
    takes (their artifact paths are the cluster's: not read here)."""
    config = yaml.safe_load((ROOT / "deploy" / "ray-serve.yaml").read_text())
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    for c in (config, embedded):
        (application,) = c["applications"]
        module, _, name = application["import_path"].partition(":")
        assert (module, name) == ("ygg_runtime.serving.ray_serve", "app")
        ray_serve.ReplicaConfig.from_args(application["args"])
        assert [d["name"] for d in application["deployments"]] == [ray_serve.APP_NAME]
    env = {e["name"]: e for c in manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
           for e in c.get("env", [])}
    assert env[ray_serve.PROXY_CALLBACK]["value"] == "ygg_runtime.serving.ray_serve:proxy_middlewares"
    assert "secretKeyRef" in env["YGG_API_KEY"]["valueFrom"]


# ------------------------------------------------------------------ one Ray, two replicas


def test_concurrent_requests_through_ray_get_what_ar_alone_gives(ray_served, decoder):
    """Six greedy requests at once over two replicas of batch 4 (Ray's proxy holds two back), then
    seeded samples: each is what plain decoding gives it alone."""
    methods = ["egt", "chain", "ar", "egt", "specinfer", "egt"]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(complete, ray_served, p, 40, method=m) for p, m in zip(PROMPTS, methods)]
        got = [f.result(timeout=TIMEOUT).choices[0].model_extra["token_ids"] for f in futures]
    assert got == [alone(decoder, p, 40) for p in PROMPTS]

    def sample(prompt, seed, method):
        return ray_served.client.completions.create(
            model=ray_served.model, prompt=prompt, max_tokens=24, temperature=1.0, top_p=0.9, seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True, "method": method}).choices[0].model_extra["token_ids"]

    jobs = [(PROMPTS[i % 3], seed, m) for i, (seed, m) in enumerate([(1, "egt"), (2, "chain"), (3, "specinfer"),
                                                                     (1, "ar")])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        sampled = [f.result(timeout=TIMEOUT) for f in [pool.submit(sample, *job) for job in jobs]]
    assert sampled == [decoder.generate(p, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=seed, raw=True,
                                        ignore_eos=True, method="ar", sampling="coupled").token_ids
                       for p, seed, _ in jobs]


def test_the_ray_endpoint_asks_for_the_key_and_answers_bad_requests_as_ygg_serve_does(ray_served):
    url = ray_served.url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(url + "/v1/models", headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    health = httpx.get(url + "/health", timeout=TIMEOUT)  # open, as under `ygg serve`
    assert health.status_code == 200 and set(health.json()) == {"status", "exact", "exactness", "sampling"}
    auth = {"Authorization": f"Bearer {KEY}"}
    for body, status, code in [({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
                               ({"model": ray_served.model, "prompt": "x", "max_tokens": 0}, 400, None),
                               ({"model": ray_served.model, "prompt": "x", "max_tokens": 10**6}, 400,
                                "context_length_exceeded")]:
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=TIMEOUT)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
        assert "\n" not in r.text.strip()
    r = httpx.post(url + "/v1/completions", content=b"not json", headers=auth | {"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the body is not valid JSON"


def test_a_stream_joins_to_the_answer_and_a_client_that_hangs_up_is_cancelled(ray_served, decoder):
    stream = ray_served.client.completions.create(model=ray_served.model, prompt=PROMPTS[1], max_tokens=30,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == decoder.codec.decode(alone(decoder, PROMPTS[1], 30))
    name = "ray_vllm_request_success_total"
    before = sum(v for k, v in ray_metrics(ray_served, name).items() if "finished_reason=cancelled" in k)
    body = {"model": ray_served.model, "prompt": PROMPTS[5], "max_tokens": 220, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", ray_served.url + "/v1/completions", json=body, timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data: "))  # one event, then hang up
    wait_for(lambda: sum(v for k, v in ray_metrics(ray_served, name).items()
                         if "finished_reason=cancelled" in k) == before + 1, "the cancelled request's count")
    wait_for(lambda: sum(ray_metrics(ray_served, "ray_vllm_num_requests_running").values()) == 0, "no request running")


def test_metrics_are_labelled_by_replica_and_sum_to_the_applications(ray_served):
    name = "ray_vllm_generation_tokens_total"
    before = sum(ray_metrics(ray_served, name).values())
    with ThreadPoolExecutor(8) as pool:
        done = [f.result(timeout=TIMEOUT) for f in [pool.submit(complete, ray_served, p, 16) for p in PROMPTS + PROMPTS[:2]]]
    made = sum(r.usage.completion_tokens for r in done)
    per_replica = wait_for(lambda: (m := ray_metrics(ray_served, name)) and sum(m.values()) == before + made and m,
                           "the replicas' token counts")
    assert len(per_replica) == 2  # eight requests over two replicas of batch 4: both served


def test_a_replica_killed_under_load_fails_its_own_requests_in_one_line_and_comes_back(ray_served, decoder):
    """SIGKILL one replica while eight long requests run, four a replica: the other's four complete
    and are plain decoding's; each of the dead one's ends in one clear error (500 in OpenAI's JSON
    when no response had begun, a stream under way with an error event and [DONE]); none hangs; Ray
    starts a new replica, which serves."""
    n = 200
    expected = alone(decoder, PROMPTS[2], n)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": ray_served.model, "prompt": PROMPTS[2], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    first = []

    def streamed():
        events = []
        with httpx.stream("POST", ray_served.url + "/v1/completions", json=body | {"stream": True}, headers=auth,
                          timeout=TIMEOUT) as r:
            if r.status_code != 200:  # its replica died before the stream began: one JSON error, as non-streamed
                text = r.read().decode()
                assert "\n" not in text.strip()
                return json.loads(text)["error"]
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first.append(1)
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        if "error" in chunks[-1]:
            return chunks[-1]["error"]
        return [t for c in chunks for t in c["choices"][0]["token_ids"]]

    def plain():
        r = httpx.post(ray_served.url + "/v1/completions", json=body, headers=auth, timeout=TIMEOUT)
        assert "\n" not in r.text.strip()
        return r.json()["error"] if r.status_code != 200 else r.json()["choices"][0]["token_ids"]

    before = {p.pid for p in replicas()}
    assert len(before) == 2
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(streamed) for _ in range(4)] + [pool.submit(plain) for _ in range(4)]
        wait_for(lambda: len(first) >= 4, "the streams' first tokens", 30)
        victim = psutil.Process(sorted(before)[0])
        victim.send_signal(signal.SIGKILL)
        got = [f.result(timeout=TIMEOUT) for f in futures]
    lost = [g for g in got if isinstance(g, dict)]
    assert [g for g in got if not isinstance(g, dict)] == [expected] * (8 - len(lost))
    assert 1 <= len(lost) <= 4 and all(e["code"] == "replica_lost" for e in lost), lost
    wait_for(lambda: len(now := {p.pid for p in replicas()}) == 2 and now != before, "a new replica", 90)
    assert wait_for(lambda: _serves(ray_served), "the new replica to serve", 60)


def _serves(s: Served) -> bool:
    try:
        return all(complete(s, PROMPTS[0], 4).choices[0].finish_reason == "length" for _ in range(4))
    except Exception:  # noqa: BLE001 - the proxy may still route to the replica that is starting
        return False


def test_a_replica_on_a_machine_no_artifact_was_built_for_refuses_in_one_line_that_ray_reports(ray_served, roots):
    """The application deployed as `serve deploy` would (a driver joining the running Ray) over
    artifacts of another CPU only: its replica refuses at start, `serve.run` fails, and Ray's status
    holds the replica's one line."""
    code = f"""
import os
os.environ[{ray_serve.LOCAL_ONLY!r}] = "0"
import ray
from ray import serve
from ygg_runtime.serving import ray_serve
ray.init(address="auto", log_to_driver=False)
args = {{"artifacts": {str(roots["other"])!r}}}
try:
    serve.run(ray_serve.deployment(ray_serve.ReplicaConfig.from_args(args), cpus=0).bind(args), name="refused",
              route_prefix="/refused")
except RuntimeError as e:
    print("REFUSED", ray_serve.why_failed("refused", e))
said = serve.status().applications["refused"].deployments["ygg"].message
print("STATUS", said.count("ygg replica:"), repr(said[-300:]))
serve.delete("refused")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    said = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("REFUSED", "STATUS")))
    assert said["REFUSED"].startswith("no artifact under") and "Imaginary CPU 9000" in said["REFUSED"], proc.stderr
    assert int(said["STATUS"].split()[0]) >= 1, said["STATUS"]
    assert complete(ray_served, PROMPTS[0], 4).choices[0].finish_reason == "length"  # the application serves on


def test_bench_serve_measures_each_method_through_ray_beside_ygg_serve(artifact, tmp_path, ray_served):
    """`ygg bench-serve --ray 2`: the same method, prompts and clients through a Ray of its own with
    two replicas, beside `ygg serve`; every output is ar's, the Ray row is set against the direct
    one, and its Ray is gone when it ends (the module's stays)."""
    def raylets() -> set[int]:
        return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"}

    before = raylets()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [p]}) + "\n"
                               for i, p in enumerate(PROMPTS[:3])))
    out = tmp_path / "serve"
    proc = ygg("bench-serve", "--artifact", artifact, "--prompts", prompts, "--concurrency", "2", "--methods", "ar",
               "-n", 12, "--ray", "2", "-o", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "results.json").read_text())
    assert [r["replicas"] for r in report["config"]["ray"]] == [2]
    rows = {r["method"]: r for r in report["summary"]}
    assert set(rows) == {"ar", "ar@ray×2"}
    assert all(r["outputs_equal_ar"] == "3/3" for r in rows.values())
    ray_row = rows["ar@ray×2"]
    assert ray_row["via"] == "ray×2" and ray_row["metrics"] is None and ray_row["background_cores"] is not None
    assert ray_row["vs_direct"]["tokens_per_s"] == pytest.approx(ray_row["tokens_per_s"] / rows["ar"]["tokens_per_s"])
    assert "## Through Ray Serve" in (out / "summary.md").read_text()
    assert raylets() == before


def test_bench_serve_refuses_bad_replica_counts_in_one_line(artifact):
    assert_one_line_error(ygg("bench-serve", "-a", artifact, "--ray", "0"), "--ray takes distinct replica counts")
    assert_one_line_error(ygg("bench-serve", "-a", artifact, "--ray", "two"), "--ray takes replica counts")


def test_every_ray_process_listens_and_talks_on_loopback_only(ray_served):
    """Every socket of the processes `ygg serve --ray` started (GCS, raylet, workers, proxy,
    replicas, the agents): bound to and connected with 127.0.0.1 (or ::1) alone."""
    def loopback(address) -> bool:
        ip = ipaddress.ip_address(address.ip)
        return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback

    seen, outside = 0, []
    for p in tree(ray_served.proc.pid):
        try:
            for c in p.net_connections(kind="inet"):
                seen += 1
                if (c.laddr and not loopback(c.laddr)) or (c.raddr and not loopback(c.raddr)):
                    outside.append((p.name(), c.status, c.laddr, c.raddr))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    assert seen > 20 and outside == []


def test_sigterm_stops_ray_and_leaves_no_process(ray_served):
    started = {p.pid for p in ray_served.tree} | {p.pid for p in tree(ray_served.proc.pid)}
    stderr = ray_served.stop()
    assert ray_served.proc.returncode == 0, stderr
    assert f"artifact for this machine: {ray_served_root(stderr)}" in stderr and "ygg serve: stopped" in stderr
    left = [p for p in (psutil.Process(pid) for pid in started if psutil.pid_exists(pid))
            if p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], [p.cmdline()[:2] for p in left]


def ray_served_root(stderr: str) -> str:
    line = next(line for line in stderr.splitlines() if line.startswith("artifact for this machine: "))
    path = line.split(": ", 1)[1]
    assert path.endswith(os.sep + "here"), line  # not the planted artifact beside it
    return path
