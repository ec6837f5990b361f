"""The /metrics families of `ygg serve`, vLLM's names where vLLM has one."""

from __future__ import annotations

from typing import Any, Callable

from ygg_runtime.decoding.metrics import Step
from ygg_runtime.decoding.tree import DRAFT

# Position labels of vllm:spec_decode_num_accepted_tokens_per_pos (deeper acceptances count in the last).
MAX_POSITIONS = 16


class ServerMetrics:
    """The /metrics families, in one registry per server (tests start several in one process).
    Spec-decode counters follow vLLM and count what each step's event (`ygg_runtime.decoding.metrics.Step`)
    says, as `ygg run --json` and `ygg bench` do: a draft is one verified tree with at least one
    drafted node, its draft tokens are those nodes, accepted tokens are the drafted tokens in the
    output (bonus excluded, after any stop or length cut), and accepted_tokens_per_pos[i] counts
    drafts whose accepted path reached depth i + 1."""

    def __init__(self, mirror: Callable[..., Any] | None = None) -> None:
        """mirror(metric, kind, name, doc, labels, buckets): what to use in the metric's place, given
        it (`ygg_runtime.serving.ray_serve` sends every update to Ray's metrics too, labelled by replica)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}

        def family(kind: str, name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple | None = None):
            extra = {"buckets": buckets} if buckets else {}
            made = kinds[kind](name, doc, labels, registry=r, **extra)
            return made if mirror is None else mirror(made, kind, name, doc, labels, buckets)

        self.num_drafts = family("counter", "vllm:spec_decode_num_drafts", "Verified trees with a drafted token")
        self.num_draft_tokens = family("counter", "vllm:spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.num_accepted_tokens = family("counter", "vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.accepted_per_pos = family("counter", "vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Drafts whose accepted path reached this depth (0-based)", ("position",))
        self.running = family("gauge", "vllm:num_requests_running", "Requests decoding in the batch")
        self.waiting = family("gauge", "vllm:num_requests_waiting", "Requests queued for a batch row")
        self.prompt_tokens = family("counter", "vllm:prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = family("counter", "vllm:generation_tokens", "Tokens generated")
        self.success = family("counter", "vllm:request_success", "Requests finished", ("finished_reason",))
        self.tpot = family("histogram", "vllm:time_per_output_token_seconds", "Time per output token after the first",
                           buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5))
        self.latency = family("histogram", "vllm:e2e_request_latency_seconds", "Request latency, arrival to last token",
                              buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300))
        self.ttft = family("histogram", "vllm:time_to_first_token_seconds", "Arrival to first token",
                           buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20))
        self.steps = family("counter", "ygg:batch_steps", "Target verify forwards, by sequences verified together",
                            ("sequences",))
        self.nodes = family("counter", "ygg:batch_verified_nodes", "Tree nodes (roots included) verified, by sequences "
                            "verified together: divided by ygg:batch_steps and sequences, the tree size per sequence",
                            ("sequences",))
        self.preemptions = family("counter", "vllm:num_preemptions", "Requests preempted: their cache slots taken "
                                  "back, recomputed when room returns")
        self.kv_usage = family("gauge", "vllm:kv_cache_usage_perc", "Share of the KV cache's slots the running "
                               "requests hold (1 = full)")
        self.kv_tokens = family("gauge", "ygg:kv_cache_tokens", "KV cache slots: the cache's (capacity), the running "
                                "requests' regions' (held), their sequences' tokens (written), and what reserving each "
                                "one's max_tokens up front would hold for them (upfront: how the server took the "
                                "cache before it held what a request had written)", ("kind",))
        self.kv_token_steps = family("counter", "ygg:kv_cache_token_steps", "ygg:kv_cache_tokens (held, written, "
                                     "upfront) summed over the batch's steps: their ratios over an interval are the "
                                     "cache's use in it, whatever the scrape interval", ("kind",))
        self.kv_token_bytes = family("gauge", "ygg:kv_cache_token_bytes", "Bytes a token takes in the KV cache (both "
                                     "models)")
        self.method = family("counter", "ygg:request_method", "Requests admitted, by the method each runs and how it "
                             "was chosen: asked (the request's method field), plan (the plan's method), request "
                             "(another modelled faster over the whole request: a long prompt the drafter's prefill "
                             "would not repay runs without the drafter, or with a drafter that reads only its last "
                             "tokens)", ("method", "chosen"))
        self.window = family("counter", "ygg:request_draft_window", "Requests admitted, by how many of the prompt's "
                             "last tokens their drafter reads (\"whole\": all of them)", ("window",))
        self.shapes = family("counter", "ygg:step_shapes", "Verified steps by shape, as each request's acceptance "
                             "estimate chose it: the tree's depth (0: the root alone), the verify's width, and what "
                             "proposed its tokens (plain: nothing; retrieval: no drafter forward; draft: the drafter)",
                             ("depth", "width", "kind"))
        self.kv_moves = family("counter", "ygg:kv_region_moves", "Regions moved to grow (their rows copied)")
        self.kv_moved = family("counter", "ygg:kv_moved_tokens", "Rows those moves copied")

    def record(self, step: Step) -> None:
        kind = "plain" if not step.drafted else "draft" if DRAFT in step.sources else "retrieval"
        self.shapes.labels(str(step.tree_depth), str(step.verify_width), kind).inc()
        if step.drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(step.drafted)
            self.num_accepted_tokens.inc(step.accepted)
            for i in range(step.accepted):
                self.accepted_per_pos.labels(str(min(i, MAX_POSITIONS - 1))).inc()
