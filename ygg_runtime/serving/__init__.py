"""`ygg serve`: an OpenAI-compatible HTTP server over one artifact, its requests decoded together.

The HTTP side is FastAPI on uvicorn; the decoding side is one scheduler thread that owns the models
and steps a `ygg_runtime.decoding.batch.Batch`: requests wait in a bounded queue (full: 429), join the batch
when it has a free row and cache room, stream their tokens back as they are accepted, and leave
when done, stopped, or when their client goes away (the scheduler drops them before its next step).
The KV cache is sized by memory (`--kv-cache-gb`, `server.kv_slots`) and taken on demand: a request
holds what it has written, not its max_tokens, so requests without max_tokens batch like any other;
when the cache is full the newest is preempted and recomputed later (`ygg_runtime.decoding.batch`). Every
request's greedy output is what it gets alone (`ygg_runtime.decoding.batch`).

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as server-sent events, or
not), GET /v1/models, /health and /metrics (Prometheus text, vLLM's names where vLLM has one).
Errors are OpenAI's JSON: {"error": {"message", "type", "param", "code"}}.

One job a module: `api` (OpenAI's request schema and error), `metrics` (the /metrics families),
`scheduler` (the thread that owns the models), `server` (a request checked, run and answered;
the KV cache's size), `app` (the ASGI app, `serve`, what `ygg serve` does) and `ray_serve` (the
same server as replicas of a Ray Serve application). They need the `serve` extra (FastAPI, uvicorn,
pydantic, prometheus-client), and `ray_serve` the `ray` extra too; the rest of the runtime never
imports this package.
"""
