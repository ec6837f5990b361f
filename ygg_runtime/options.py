"""What a user chooses when running or serving an artifact: each default and each check in one place,
read by the `ygg` command and the Python API alike.

Imports nothing heavy (no torch): the command line checks its arguments with this module before it
loads anything, so bad input is refused at once.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from ygg_runtime.errors import YggError

# The margin any plan change must win by on modelled (or calibration-measured) time before it replaces
# what it would change: the depth predictor over the fixed depth (`ygg_compile.predictor_training`), a
# run-ahead stage order over the plain one (`ygg_compile.stage_order`), a request's own choice over the
# plan's method (`Decoder.choose`). A tie keeps the simpler plan: on the Zen 5 EPYC a predictor that
# tied (1.701× vs 1.699×) measured slower than the fixed depth in all six categories (docs/measured.md).
MIN_GAIN = 1.02

DEFAULT_DIR = Path("artifacts/default")  # where `ygg compile` writes and `ygg run` looks
MAX_NEW_TOKENS = 256  # tokens a generation produces at most unless told otherwise
# The most rows one batched forward carries: the widest forward the compile-time row check covers
# (ygg_compile.latency's grid ends at 64), so every row of it is scored as it is alone.
MAX_ROWS = 64
# Sequences decoded together unless told otherwise; at most MAX_ROWS, as every member puts at least
# one row in each verify.
MAX_BATCH = 8
# How a sampled generation (temperature > 0) draws its tokens (docs/design.md, "The lossless rules"):
# "coupled" (Gumbel-max noise keyed by seed and position: every method prints the tokens `ar` prints
# with the same seed, alone or in any batch) or "rejection" (speculative rejection sampling: the
# same distribution, text that depends on the tree). Both sample the target's distribution exactly.
SAMPLINGS = ("coupled", "rejection")
SAMPLING = "coupled"  # the default: chosen from the acceptance measured against rejection (docs/measured.md)
# `ygg serve`'s KV cache (both models'), unless --kv-cache-gb says: this share of the memory free
# once the models are loaded, and no more than max_batch sequences of the artifact's longest
# context hold (more could never be used). Half, so that the process and the machine keep room.
KV_CACHE_SHARE = 0.5


def check_max_batch(max_batch: int) -> int:
    if not 1 <= max_batch <= MAX_ROWS:
        raise YggError(f"--max-batch must be in 1..{MAX_ROWS}, not {max_batch}")
    return max_batch


def check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise YggError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")


def check_settings(max_new_tokens: int, temperature: float, top_p: float, seed: int | None = None) -> None:
    """The generation settings alone, in the CLI's words: checked by every generation, and by the
    command line and a benchmark before anything loads."""
    check_max_new_tokens(max_new_tokens)
    if not 0 <= temperature < math.inf:  # the comparison also refuses NaN
        raise YggError(f"--temperature must be a finite number >= 0 (0 = greedy), not {temperature}")
    if not 0 < top_p <= 1:
        raise YggError(f"--top-p must be in (0, 1], not {top_p}")
    if seed is not None and not 0 <= seed < 2**63:
        raise YggError(f"--seed must be in [0, 2^63), not {seed}")


def check_sampling(sampling: str) -> str:
    if sampling not in SAMPLINGS:
        raise YggError(f"--sampling must be one of {', '.join(SAMPLINGS)}, not {sampling!r}")
    return sampling


@dataclass(frozen=True)
class Ablation:
    """What a generation runs without, for A/B (`ygg bench`'s ablations, `ygg run --no-...`): each
    switch takes away one part of the plan for this generation only."""

    predictor: bool = True  # False: egt at its planned fixed depth
    stages: Any = None  # egt's stage order instead of the plan's (a `schema.params.Stages`; None: the plan's)
    graft: bool = True  # False: egt drafting only, no retrieval grafted
    eager: bool = False  # True: the eager forwards, even where compiled ones are loaded


@dataclass(frozen=True)
class RunOptions:
    """How one generation runs (`ygg run`, `Decoder.generate`, a benchmark's contestant), checked
    once when made — where the request enters — before any model loads."""

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    sampling: str | None = None  # the rule at temperature > 0 (None: the plan's)
    method: str | None = None  # None: the request's own choice (`Decoder.choose`)
    draft_window: int | None = None  # the drafter reads the prompt's last K tokens (0: all; None: as chosen)
    raw: bool = False  # the prompt as it is, not wrapped in the chat template
    ignore_eos: bool = False  # always max_new_tokens tokens
    adapt: bool = True  # False: every step shaped as planned (`--no-adapt`)
    ablation: Ablation = Ablation()

    def __post_init__(self) -> None:
        check_settings(self.max_new_tokens, self.temperature, self.top_p, self.seed)
        if self.sampling is not None:
            check_sampling(self.sampling)
        if self.draft_window is not None and self.draft_window < 0:
            raise YggError(f"--draft-window takes a number of tokens (0: the whole prompt), not {self.draft_window}")

    @classmethod
    def of(cls, **given: Any) -> "RunOptions":
        """From keyword arguments as `Decoder.generate` takes them: the ablation's switches among them."""
        ablation = {k: given.pop(k) for k in ("predictor", "stages", "graft", "eager") if k in given}
        return cls(**given, ablation=Ablation(**ablation))


@dataclass(frozen=True)
class ServeOptions:
    """How `ygg serve` (and `ygg_runtime.serving.app.serve` from Python) serves. Invalid values raise
    YggError when the options are made, before any model loads."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    max_batch: int = MAX_BATCH  # requests decoded together at most
    max_queue: int = 64  # requests waiting for a batch row at most (more: 429)
    cost_aware: bool = True  # CAST: trees sized to the batch's load
    adapt: bool = True  # each request's steps shaped by its own acceptance estimate (`--no-adapt`: as planned)
    kv_cache_gb: float | None = None  # the KV cache's size (None: KV_CACHE_SHARE of free memory)
    # the bearer token every /v1 request must send (None: none asked; `ygg serve --api-key` or
    # $YGG_API_KEY, as vLLM's --api-key / $VLLM_API_KEY)
    api_key: str | None = None

    def __post_init__(self) -> None:
        check_max_batch(self.max_batch)
        if self.kv_cache_gb is not None and not 0 < self.kv_cache_gb < math.inf:
            raise YggError(f"--kv-cache-gb must be a positive number of GiB, not {self.kv_cache_gb}")
        if self.max_queue < 0:
            raise YggError(f"--max-queue must be at least 0, not {self.max_queue}")
        if not 0 <= self.port < 65536:
            raise YggError(f"--port must be in 0..65535, not {self.port}")
        if self.api_key is not None and (not self.api_key.strip() or self.api_key != self.api_key.strip()):
            raise YggError("--api-key must be a non-empty key without spaces around it")

    def exposed(self) -> str | None:
        """The warning a server that answers beyond this machine without a key gets (None: it is
        bound to loopback, or it asks for a key)."""
        if self.api_key is not None or _loopback(self.host):
            return None
        return (f"warning: serving on {self.host} without --api-key: anyone who reaches this port may run requests "
                f"(set --api-key or $YGG_API_KEY)")

    def check_address(self) -> None:
        """A clear line now rather than uvicorn's log after the models have loaded."""
        try:
            with socket.create_server((self.host, self.port)):
                pass
        except OSError as e:
            raise YggError(f"cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None


@dataclass(frozen=True)
class RayOptions:
    """How `ygg serve --ray` runs its replicas (`ygg_runtime.serving.ray_serve`): a fixed number, or as many
    as the load asks between autoscale's bounds; each with `threads` torch threads (and as many of
    Ray's CPUs). address: a running Ray cluster to join (None: start one of this machine alone, on
    loopback, whose Prometheus endpoint for the replicas' metrics is metrics_port)."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    threads: int | None = None  # None: this machine's cores over the most replicas (1 on a cluster joined)
    address: str | None = None
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise YggError(f"--replicas must be at least 1, not {self.replicas}")
        if self.autoscale is not None and not 1 <= self.autoscale[0] <= self.autoscale[1]:
            raise YggError(f"--autoscale takes MIN,MAX with 1 <= MIN <= MAX, not {self.autoscale[0]},{self.autoscale[1]}")
        if self.threads is not None and self.threads < 1:
            raise YggError(f"--replica-threads must be at least 1, not {self.threads}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise YggError(f"--metrics-port must be in 1..65535, not {self.metrics_port}")
        if self.metrics_port is not None and self.address is not None:
            raise YggError("--metrics-port sets the Ray this command starts; a cluster joined with --ray-address "
                           "exports metrics on the port it was started with")

    @property
    def most(self) -> int:
        """Replicas at most."""
        return self.autoscale[1] if self.autoscale else self.replicas

    def replica_threads(self, cores: int) -> int:
        if self.threads is not None:
            return self.threads
        return 1 if self.address is not None else max(1, cores // self.most)

    @staticmethod
    def parse_autoscale(text: str | None) -> tuple[int, int] | None:
        if text is None:
            return None
        low, _, high = text.partition(",")
        try:
            return int(low), int(high)
        except ValueError:
            raise YggError(f"--autoscale takes MIN,MAX (two numbers of replicas), not {text!r}") from None


def _loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
