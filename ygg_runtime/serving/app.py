"""The ASGI app over a `Server`, and what `ygg serve` runs: uvicorn on a thread of its own while the
main thread steps the scheduler.

(No `from __future__ import annotations` here: FastAPI then reads the endpoints' annotations as the
objects `create_app` imported, not as names to look up in this module.)
"""

import hmac
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ygg_runtime.artifact.load import load
from ygg_runtime.decoding.decoder import Decoder
from ygg_runtime.errors import YggError
from ygg_runtime.options import ServeOptions
from ygg_runtime.serving.api import ApiError, ChatRequest, CompletionRequest
from ygg_runtime.serving.server import Server, kv_slots
from ygg_runtime.ui import err

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_app(server: Server, api_key: str | None = None) -> "FastAPI":
    """The ASGI app; the end of its lifespan stops the scheduler. api_key: every /v1 request must
    send it as `Authorization: Bearer <key>`, or gets 401 (/health and /metrics stay open to load
    balancers and scrapers, as vLLM's do)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:  # after uvicorn's graceful shutdown has let running requests finish
            server.scheduler.stop()

    app = FastAPI(title="Yggdrasil", lifespan=lifespan)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next):
            sent = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1") and not hmac.compare_digest(sent, expected):
                return ApiError(401, "invalid or missing API key: send the header `Authorization: Bearer <key>`",
                                code="invalid_api_key").response()
            return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        what = "the body is not valid JSON" if first.get("type") == "json_invalid" else first.get("msg", "invalid request")
        return ApiError(400, f"{where}: {what}" if where and first.get("type") != "json_invalid" else what,
                        param=where).response()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await server.answer(req, server.completion_prompt(req), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await server.answer(req, server.chat_prompt(req), request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "yggdrasil", "max_model_len": server.context}]}

    @app.get("/health")
    async def health():
        """200 while serving (what load balancers and vLLM's clients look for), with whether the
        greedy output on this machine is guaranteed to be plain decoding's and the sampling rule."""
        exact, why = server.decoder.verdict()
        return {"status": "ok", "exact": exact, "exactness": why, "sampling": server.decoder.sampling}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(decoder: Decoder, model_name: str, opts: ServeOptions = ServeOptions(), slots: int | None = None) -> None:
    """Run the server until SIGINT or SIGTERM, which stop new connections, let running requests
    finish, then stop the scheduler. Call from the main thread (the one that loaded the decoder):
    the scheduler steps there, uvicorn serves HTTP from a thread of its own. slots: the KV cache's
    (None: `kv_slots` of the options)."""
    import uvicorn

    opts.check_address()
    host, port = opts.host, opts.port
    if slots is None:
        slots, why = kv_slots(decoder, opts.kv_cache_gb, opts.max_batch)
        err.print(why)
    server = Server(decoder, model_name, opts.max_batch, opts.max_queue, opts.cost_aware, slots, adapt=opts.adapt)
    config = uvicorn.Config(create_app(server, opts.api_key), host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=600)
    http = uvicorn.Server(config)
    # Signals reach the main thread only: hand them to uvicorn, whose graceful shutdown stops
    # accepting, waits for running requests, then ends the app's lifespan (which stops the scheduler).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, http.handle_exit)
    thread = threading.Thread(target=http.run, name="ygg-http")
    thread.start()
    try:
        server.scheduler.run(alive=thread.is_alive)
    finally:
        http.should_exit = True
        thread.join()
    if not http.started:
        raise YggError(f"the HTTP server did not start on {host}:{port} (its log above says why)")


def model_name(decoder: Decoder, given: str | None = None) -> str:
    """The model name clients send: `given`, or the target's (a path's last part)."""
    target = decoder.plan.models["target"].spec if decoder.plan else "model"
    return given or (Path(target).name if "/" in target or Path(target).exists() else target)


def serve_artifact(opts: ServeOptions, artifact: Path, given: str | None, eager: bool,
                   expect_plan: str | None) -> None:
    """What `ygg serve` does once `ygg_runtime.cli` has checked its arguments."""
    decoder = load(artifact, eager=eager, expect_plan=expect_plan)
    slots, cache = kv_slots(decoder, opts.kv_cache_gb, opts.max_batch)
    name = model_name(decoder, given)
    err.print(f"serving {name} ({decoder.default_method}, {decoder.forwards}) on http://{opts.host}:{opts.port}/v1 · batch "
              f"≤ {opts.max_batch}, queue ≤ {opts.max_queue} · Ctrl-C or SIGTERM stops it once running requests finish")
    err.print(f"exactness: {decoder.verdict()[1]} · sampling at temperature > 0: {decoder.sampling} (a request's seed gives "
              + ("the text plain decoding gives it, whatever else is running)" if decoder.sampling == "coupled"
                 else "a sample that depends on the batch it runs in)"))
    err.print(cache)
    if warning := opts.exposed():
        err.print(warning)
    serve(decoder, name, opts, slots)
    err.print("ygg serve: stopped")
