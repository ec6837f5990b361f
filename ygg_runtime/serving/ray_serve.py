"""`ygg serve --ray`: the server as replicas of a Ray Serve application, past one machine.

Each replica is `ygg serve` in-process: the same scheduler thread stepping the same batch, the same
FastAPI app (routes, streaming, cancellation, errors, API key) behind `serve.ingress`; Ray's proxy
spreads requests over the replicas, holds back what no replica has a batch row for
(`max_ongoing_requests` is the replica's batch, `max_queued_requests` its queue: past that the
proxy answers 503), restarts a replica that dies or whose scheduler stops (`check_health`), and
adds replicas under load (`--autoscale`).

Artifacts per hardware: the application is given a directory holding one artifact, or several in
folders of their own (as CI jobs build them, one per machine kind, with --calibration-from); each
replica loads the one compiled for the machine it runs on (`choose_artifact`: the GPU's name and
compute capability, or the CPU's model and vector instruction set, as plan.yaml records them) and a
replica on a machine none was built for refuses at start in one line, which `serve status` shows.

Metrics: every family of /metrics goes to Ray's metrics too (`ray.serve.metrics`, which labels each
sample with its deployment, replica and application; the colon of a name becomes "_", and Ray's
exporter prefixes "ray_": `vllm:generation_tokens` is `ray_vllm_generation_tokens`): the Ray node's
Prometheus endpoint (--metrics-port) shows them per replica, and `sum without (replica)` is the
application's.

Loopback: `ygg serve --ray` without --ray-address starts a Ray of this machine alone whose every
part binds to and talks over 127.0.0.1 (`start_local`). The application is importable for `serve
run` / `serve deploy` (`app`; deploy/ray-serve.yaml and deploy/rayservice.yaml).

Ray (the `ray` extra) is imported by this module alone, inside its functions: the rest of the
runtime, and a process that only chooses an artifact, never imports it. This module itself is
imported by `ygg serve --ray` once its arguments have passed (it imports torch and the server).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ygg_runtime.artifact.load import load, plan_sha256
from ygg_runtime.backend import gpu_identity as gpu
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.checks.integrity import cpu_info
from ygg_runtime.machine import CPUInfo
from ygg_runtime.options import MAX_BATCH, RayOptions, ServeOptions
from ygg_runtime.schema.plan import PLAN_FILE, Plan
from ygg_runtime.serving.app import create_app, model_name
from ygg_runtime.serving.metrics import ServerMetrics
from ygg_runtime.serving.server import Server, kv_slots
from ygg_runtime.ui import err

APP_NAME = "ygg"  # the Serve application's and its deployment's name
# How often Ray asks a replica whether its scheduler still runs, and how long it waits for the answer.
HEALTH_PERIOD_S, HEALTH_TIMEOUT_S = 2.0, 30.0
# A replica that cannot start (no artifact for its machine, a bad file) will not start on a retry.
CONSTRUCTOR_RETRIES = 1
# Ray's switch for a cluster of one machine (see `start_local`).
LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# What gives Ray Serve's HTTP proxy our middleware (`ReplicaLost`): read from the proxy's environment.
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


@dataclass(frozen=True)
class ReplicaConfig:
    """What each replica is told: the application's arguments (`serve run ... key=value`, or `args:`
    in a Serve config file). Checked when the application is built, before any replica starts."""

    artifacts: str  # an artifact directory, or a directory of artifacts (one per machine kind)
    model_name: str | None = None  # the model name clients send (default: the target's)
    max_batch: int = MAX_BATCH
    max_queue: int = 64
    cost_aware: bool = True
    adapt: bool = True
    kv_cache_gb: float | None = None
    eager: bool = False
    expect_plan: str | None = None  # plan sha256s (comma-separated): the chosen artifact must be one of them
    threads: int | None = None  # torch threads of a replica (default: the CPUs Ray gave it)
    api_key: str | None = None  # default: $YGG_API_KEY in the replica's environment

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ReplicaConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise YggError(f"unknown application argument {', '.join(unknown)}: it takes {', '.join(sorted(known))}")
        if "artifacts" not in args:
            raise YggError("the application needs artifacts=DIR: an artifact, or a directory of artifacts")
        config = cls(**args)
        ServeOptions(max_batch=int(config.max_batch), max_queue=int(config.max_queue),
                     kv_cache_gb=config.kv_cache_gb, api_key=config.key())  # the same checks as `ygg serve`'s
        if config.threads is not None and int(config.threads) < 1:
            raise YggError(f"threads must be at least 1, not {config.threads}")
        return config

    def key(self) -> str | None:
        return self.api_key if self.api_key is not None else os.environ.get("YGG_API_KEY")

    def pins(self) -> set[str]:
        return {p.strip() for p in (self.expect_plan or "").split(",") if p.strip()}


# ------------------------------------------------------------------ artifacts per hardware


def candidates(root: Path) -> dict[Path, Plan]:
    """The artifacts under root (root itself, or each folder of it holding a plan.yaml) and their plans."""
    root = Path(root)
    dirs = [root] if (root / PLAN_FILE).is_file() else (
        sorted(p for p in root.iterdir() if (p / PLAN_FILE).is_file()) if root.is_dir() else [])
    if not dirs:
        raise YggError(f"{root} holds no artifact (a {PLAN_FILE} in it, or in folders of it, one per machine kind)")
    plans = {}
    for d in dirs:
        try:
            text = (d / PLAN_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise YggError(f"cannot read {d / PLAN_FILE}: {first_line(e)}") from None
        plans[d] = Plan.from_yaml(text, str(d / PLAN_FILE))
    return plans


def cpu_label(cpu: CPUInfo) -> str:
    """A CPU as artifacts are matched to it: its model and vector instruction set."""
    return f"CPU {cpu.model} ({' '.join(sorted(cpu.isa)) or 'no vector flags'})"


def built_for(plan: Plan) -> str:
    """The machine an artifact was compiled for, in words."""
    return f"GPU {plan.gpu.label()}" if plan.gpu is not None else cpu_label(plan.cpu)


def this_machine() -> tuple[str | None, str]:
    """(the GPU's label or None, the CPU's label): what `built_for` is compared with."""
    gpu_label = f"GPU {gpu.info('cuda').label()}" if torch.cuda.is_available() else None
    return gpu_label, cpu_label(cpu_info())


def choose_artifact(root: Path, machine: tuple[str | None, str] | None = None) -> Path:
    """The artifact under root compiled for this machine: one built for this GPU if it has one,
    else one built for this CPU (its model and vector instruction set). Refuses in one line when
    none is, or when two are (which to serve would be a guess)."""
    plans = candidates(root)
    gpu_label, cpu_label = machine or this_machine()
    for label in (gpu_label, cpu_label):
        found = [d for d, plan in plans.items() if label is not None and built_for(plan) == label]
        if len(found) > 1:
            raise YggError(f"{len(found)} artifacts under {root} were compiled for this machine ({label}): "
                           f"{', '.join(d.name for d in found)}; keep one")
        if found:
            return found[0]
    held = "; ".join(f"{d.name}: {built_for(p)}" for d, p in plans.items())
    here = f"{gpu_label} and {cpu_label}" if gpu_label else cpu_label
    raise YggError(f"no artifact under {root} was compiled for this machine ({here}); it holds {held}: compile one "
                   f"here (ygg compile --calibration-from ARTIFACT reuses a calibration)")


# ------------------------------------------------------------------ a replica


class Mirrored:
    """A prometheus_client metric and its twin in Ray's metrics: each update goes to both (the
    replica's own /metrics, and the node's Prometheus endpoint, labelled by replica)."""

    def __init__(self, local: Any, remote: Any, keys: tuple[str, ...], tags: dict[str, str] | None = None):
        self.local, self.remote, self.keys, self.tags = local, remote, keys, tags

    @classmethod
    def make(cls, local: Any, kind: str, name: str, doc: str, labels: tuple[str, ...],
             buckets: tuple | None) -> Mirrored:
        from ray.serve import metrics

        name = name.replace(":", "_")  # Ray's names take no colon (vLLM's Ray metrics do the same)
        if kind == "histogram":
            remote = metrics.Histogram(name, doc, boundaries=list(buckets), tag_keys=labels)
        else:
            remote = {"counter": metrics.Counter, "gauge": metrics.Gauge}[kind](name, doc, tag_keys=labels)
        return cls(local, remote, labels)

    def labels(self, *values: str) -> Mirrored:
        return Mirrored(self.local.labels(*values), self.remote, self.keys, dict(zip(self.keys, values)))

    def inc(self, amount: float = 1) -> None:
        self.local.inc(amount)
        if amount > 0:  # Ray refuses an increment of 0
            self.remote.inc(amount, tags=self.tags)

    def set(self, value: float) -> None:
        self.local.set(value)
        self.remote.set(value, tags=self.tags)

    def observe(self, value: float) -> None:
        self.local.observe(value)
        self.remote.observe(value, tags=self.tags)


class Replica:
    """One replica of the application: loads the artifact for its machine and runs `ygg serve`'s
    scheduler on a thread of its own, which does every torch op from the load on (one OpenMP team,
    as in `ygg serve`, where the main thread loads and steps); Ray's event loop runs the app."""

    async def __init__(self, args: dict[str, Any]):
        self.config = ReplicaConfig.from_args(args)
        loopback_only()
        self.server = None
        self.failure: BaseException | None = None
        self.stopping = False
        ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(ready,), name="ygg-scheduler", daemon=True)
        self.thread.start()
        await asyncio.to_thread(ready.wait)
        if self.failure is not None:
            raise YggError(f"ygg replica: {first_line(self.failure, limit=2000)}") from None  # whole: it names machines

    def _main(self, ready: threading.Event) -> None:
        try:
            import ray

            c = self.config
            threads = c.threads or max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
            torch.set_num_threads(int(threads))
            path = choose_artifact(Path(c.artifacts))
            pinned = c.pins()
            if pinned and plan_sha256(path) not in pinned:
                raise YggError(f"the artifact for this machine, {path}, is not one of the pinned plans (expect_plan)")
            decoder = load(path, eager=c.eager, expect_plan=plan_sha256(path) if pinned else None)
            slots, _ = kv_slots(decoder, c.kv_cache_gb, int(c.max_batch))
            self.server = Server(decoder, model_name(decoder, c.model_name), int(c.max_batch), int(c.max_queue),
                                 c.cost_aware, slots, metrics=ServerMetrics(mirror=Mirrored.make), adapt=c.adapt)
            err.print(f"ygg replica: serving {path} ({built_for(decoder.plan)}) with {threads} thread(s)")
        except BaseException as e:  # noqa: BLE001 - said by the constructor, which Ray reports
            self.failure = e
            ready.set()
            return
        ready.set()
        self.server.scheduler.run(alive=lambda: not self.stopping)

    def __serve_build_asgi_app__(self):
        return create_app(self.server, self.config.key())

    async def check_health(self) -> None:
        """Ray restarts a replica whose scheduler has stopped (its requests would never be stepped)."""
        if not self.thread.is_alive():
            raise RuntimeError("the replica's scheduler thread has stopped")

    def __del__(self) -> None:
        self.stopping = True
        if self.server is not None:
            self.server.scheduler.stop()


def loopback_only() -> None:
    """On a node whose address is 127.0.0.1 (`start_local`), keep the replica's gRPC server for
    calls between deployments on loopback too: Ray Serve 2.60 binds it to every interface ([::]),
    whatever the node's address (nothing of ours calls it; Ray's proxy talks to the replica over
    the node's address). A Ray without that hook leaves it as it is, and the loopback test says so."""
    import ray
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or ray.util.get_node_ip_address() != "127.0.0.1" or getattr(bind, "ygg", False):
        return

    def on_loopback(server: Any, address: str) -> int:
        return bind(server, "127.0.0.1:0" if address == "[::]:0" else address)

    on_loopback.ygg = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_loopback


def deployment(config: ReplicaConfig, replicas: int = 1, autoscale: tuple[int, int] | None = None,
               cpus: float = 1.0):
    """The Serve deployment of `Replica` (a config file's `deployments:` may override any option)."""
    from ray import serve

    scale: dict[str, Any] = {"num_replicas": replicas}
    if autoscale is not None:
        scale = {"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                        "target_ongoing_requests": max(1, int(config.max_batch) // 2)}}
    return serve.deployment(
        serve.ingress()(Replica), name=APP_NAME,
        max_ongoing_requests=int(config.max_batch),  # a request a replica holds has a batch row
        max_queued_requests=int(config.max_queue) or -1,
        ray_actor_options={"num_cpus": cpus},
        health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S,
        graceful_shutdown_timeout_s=600,  # requests running at shutdown finish, as under `ygg serve`
        max_constructor_retry_count=CONSTRUCTOR_RETRIES,
        **scale,
    )


def app(args: dict[str, Any]):
    """The application builder: `serve run ygg_runtime.serving.ray_serve:app artifacts=DIR [max_batch=8 ...]`,
    or `import_path: ygg_runtime.serving.ray_serve:app` in a Serve config file (deploy/ray-serve.yaml)."""
    config = ReplicaConfig.from_args(dict(args))
    return deployment(config).bind(dict(args))


# ------------------------------------------------------------------ Ray Serve's proxy


def error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()


LOST = ("the replica running this request stopped before it finished (Ray restarts it); what was generated is lost: "
        "retry the request")


class ReplicaLost:
    """A middleware of Ray Serve's HTTP proxy (set by `start_local`; on a cluster of one's own,
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=ygg_runtime.serving.ray_serve:proxy_middlewares in the nodes'
    environment, as deploy/rayservice.yaml does) for a request
    whose replica died under it (or that its replica failed in plain text): the proxy leaves a non-streamed one without a response (which
    uvicorn answers "Internal Server Error" in plain text) and cuts a stream off mid-body; here the first becomes one line of OpenAI's JSON error and
    the stream ends with an error event and `data: [DONE]`, as `ygg serve` ends a failed stream.
    Neither is retried here (tokens may have been sent); OpenAI's clients retry a 5xx by default."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1"):
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = {"started": False, "ended": False, "sse": False, "held": None}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                kind = dict(message.get("headers") or []).get(b"content-type", b"")
                state["sse"] = kind.startswith(b"text/event-stream")
                if message["status"] >= 500 and not kind.startswith(b"application/json"):
                    state["held"] = message  # a plain-text server error: said in JSON below
                    return
            elif message["type"] == "http.response.body":
                if state["held"] is not None:
                    state["text"] = state.get("text", b"") + message.get("body", b"")
                    if not message.get("more_body", False):
                        said = state["text"].decode(errors="replace").strip()[:200] or "no reason given"
                        await self._json(send, state["held"]["status"], f"the replica failed the request: {said}",
                                         "replica_error")
                        state["ended"] = True
                    return
                state["ended"] = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if not state["started"] or state["held"] is not None:
                await self._json(send, 500)
                return
            if not state["sse"] or state["ended"]:
                raise
        if not state["started"]:  # the proxy gives up on a request whose replica died without answering
            await self._json(send, 500)
        elif state["sse"] and not state["ended"]:
            event = b"data: " + error_body(LOST, "replica_lost") + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})

    @staticmethod
    async def _json(send: Any, status: int, message: str = LOST, code: str = "replica_lost") -> None:
        body = error_body(message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list:
    """For RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (a cluster whose proxy `ygg serve --ray` did not start)."""
    from fastapi.middleware import Middleware  # starlette's, as FastAPI gives it

    return [Middleware(ReplicaLost)]


# ------------------------------------------------------------------ `ygg serve --ray`


def start_local(cpus: int, metrics_port: int | None = None) -> None:
    """A Ray of this machine alone, every part of it on 127.0.0.1: its node address (Ray otherwise
    takes the machine's network address for the node, its workers and Serve's proxy), no dashboard.

    Ray turns a node address of 127.0.0.1 into the machine's network address unless told it runs a
    cluster of one machine (its switch for Windows and macOS, read when `ray` is imported, by this
    process and by every Ray process it starts): told so, the node is 127.0.0.1, and Ray's servers
    then bind to loopback alone."""
    os.environ[LOCAL_ONLY] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(PROXY_CALLBACK, f"{__name__}:proxy_middlewares")  # read by the proxy Ray starts
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case this process imported ray before the line above
    extra = {"_metrics_export_port": metrics_port} if metrics_port else {}
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=cpus,
             log_to_driver=False, configure_logging=False, **extra)


def serve_ray(opts: ServeOptions, ray_opts: RayOptions, artifacts: Path, model_name: str | None = None,
              eager: bool = False, expect_plan: str | None = None) -> None:
    """What `ygg serve --ray` does: start a Ray of this machine alone (or join ray_opts.address), run
    the application with Ray Serve's HTTP proxy on opts.host:opts.port, and on SIGINT or SIGTERM shut
    it down once running requests finish."""
    threads = ray_opts.replica_threads(os.cpu_count() or 1)
    args = {"artifacts": str(Path(artifacts).resolve()), "model_name": model_name, "max_batch": opts.max_batch,
            "max_queue": opts.max_queue, "cost_aware": opts.cost_aware, "adapt": opts.adapt, "kv_cache_gb": opts.kv_cache_gb,
            "eager": eager, "expect_plan": expect_plan, "threads": threads, "api_key": opts.api_key}
    config = ReplicaConfig.from_args(args)
    if ray_opts.address is None:
        path = choose_artifact(Path(artifacts))  # this machine runs every replica: refuse now, before Ray starts
        err.print(f"artifact for this machine: {path}")
        start_local(cpus=max(ray_opts.most * threads, os.cpu_count() or 1), metrics_port=ray_opts.metrics_port)
    else:
        import ray

        ray.init(address=ray_opts.address, log_to_driver=False, configure_logging=False)
    import ray
    from ray import serve

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": opts.host, "port": opts.port})
        how = (f"{ray_opts.autoscale[0]}..{ray_opts.autoscale[1]} replicas (autoscaled)" if ray_opts.autoscale else
               f"{ray_opts.replicas} replica(s)")
        err.print(f"starting {how} of {threads} thread(s) each on Ray at {ray.get_runtime_context().gcs_address}")
        try:
            serve.run(deployment(config, ray_opts.replicas, ray_opts.autoscale, cpus=threads).bind(args),
                      name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            raise YggError(f"the application did not start: {why_failed(APP_NAME, e)}") from None
        metrics = (f" · replicas' metrics on http://127.0.0.1:{ray_opts.metrics_port}/metrics"
                   if ray_opts.metrics_port else "")
        err.print(f"serving on http://{opts.host}:{opts.port}/v1 through Ray Serve's proxy · batch ≤ "
                  f"{opts.max_batch} a replica{metrics} · Ctrl-C or SIGTERM stops it once running requests finish")
        if warning := opts.exposed():
            err.print(warning)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    err.print("ygg serve: stopped")


def why_failed(app: str, error: BaseException) -> str:
    """Why an application did not start, in one line: the line its replica refused with, as Ray's
    status holds it (`serve.run`'s own error names only the deployment that failed)."""
    from ray import serve

    try:
        status = serve.status().applications[app]
        said = "\n".join([status.message, *(d.message for d in status.deployments.values())])
    except Exception:  # noqa: BLE001 - no status to read: the error is all there is
        said = ""
    return replica_error(f"{said}\n{error}")


def replica_error(message: str) -> str:
    """The line a replica refused with, out of the traceback Ray reports a failed deployment with."""
    lines = [line.strip() for line in message.splitlines() if "ygg replica:" in line]
    return lines[-1].split("ygg replica:", 1)[1].strip() if lines else first_line(message)
