"""Building blocks the tests share: runtime models from HF ones and reference generations."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import torch
from prometheus_client.parser import text_string_to_metric_families

from ygg_compile.convert import to_runtime
from ygg_runtime.decoding import proposers
from ygg_runtime.decoding.engine import generate
from ygg_runtime.model.transformer import Transformer, from_state
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.plan import Profile
from ygg_runtime.model.runner import ModelRunner
from ygg_runtime.ui import Reporter

YGG = str(Path(sys.executable).parent / "ygg")
TIMEOUT = 120  # seconds any one request or wait on a server may take


def ygg(*args, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed `ygg` command as a user would."""
    return subprocess.run([YGG, *map(str, args)], capture_output=True, text=True, input=stdin,
                          env={**os.environ, **(env or {})}, timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# A Sequoia-shaped static tree: ranks 0,1 under the root, 0,1 under the first child, 0 below.
SEQUOIA_TREE = {"parents": [-1, 0, 0, 1, 1, 2, 3], "ranks": [0, 0, 1, 0, 1, 0, 0]}
METHODS = [("ar", {}), ("chain", {"k": 4}), ("specinfer", {"width": 2, "depth": 3}), ("specinfer", {"width": 3, "depth": 2}),
           ("sequoia", SEQUOIA_TREE), ("egt", {"depth": 4, "draft_width": 4, "top_k": 4, "verify_widths": [1, 2, 4, 8, 16]}),
           ("egt", {"depth": 3, "draft_width": 2, "top_k": 2, "verify_widths": [4]})]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def runner(model: Transformer, max_len: int = 1024) -> ModelRunner:
    return ModelRunner(model, max_len)


def decode(target: ModelRunner, draft: ModelRunner | None, method: str, params: dict, prompt, n: int, **kw):
    drafter = proposers.Drafter(draft, target.vocab_size) if draft is not None else None
    return generate(target, proposers.build(method, params, drafter), prompt, max_new_tokens=n, **kw)


def truncated(model: Transformer, n_layers: int) -> Transformer:
    """A drafter made of the first layers of `model` (shares embeddings, final norm and head)."""
    from dataclasses import replace

    state = {k: v for k, v in model.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    return from_state(replace(model.args, n_layers=n_layers), state)


def noised_runtime(model: Transformer, scale: float, seed: int) -> Transformer:
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.float().std().clamp_min(1e-3))
    return m


# A made-up profile in which a verify of 16 costs double one of 4: the objective must trade.
COMPILED = (1, 2, 4, 8, 16)
PROFILE = {"widths": list(COMPILED), "contexts": [16, 256], "threads": 2,
           "target_ms": [[10, 10, 11, 14, 22], [12, 12, 13, 17, 26]],
           "draft_ms": [[3, 3, 3, 4, 6], [4, 4, 4, 5, 7]], "other_ms": [0.2, 0.2, 0.3, 0.4, 0.6]}


def random_predictor(dim: int, depths: int = 6, seed: int = 0, scale: float = 3.0) -> dict[str, torch.Tensor]:
    """Depth predictor tensors with random weights: reach that swings with the hidden state, so
    egt's depth changes from step to step (tests of the runtime path, not of training)."""
    g = torch.Generator().manual_seed(seed)
    return {"mean": torch.zeros(dim), "scale": torch.ones(dim),
            "w0": torch.randn(dim, 16, generator=g) * scale / dim**0.5, "b0": torch.zeros(16),
            "w1": torch.randn(16, depths, generator=g) * scale / 4, "b1": torch.linspace(1.0, -1.0, depths)}


def depth_policy(depths: int = 6, draft_width: int = 2, factor: float = 1.0) -> dict:
    """A plan's egt depth policy; factor > 1 makes every depth look more rewarding (the tiny
    models draft as slowly as they verify, where no honest factor would ever leave depth 0)."""
    return {"file": "predictor.safetensors", "draft_width": draft_width, "factors": [factor] * (depths + 1),
            "verify_widths": [1, 4, 8, 8, 16, 16, 16][: depths + 1]}


def with_random_predictor(artifact: Path, out: Path, seed: int = 0) -> Path:
    """A copy of `artifact` whose egt runs a random-weight depth predictor, planned on the fixed
    PROFILE curves (a measured tiny-model profile is noise, which would decide the depths)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from dataclasses import replace

    from ygg_runtime.checks.integrity import file_entry
    from ygg_runtime.schema.params import DepthPolicy
    from ygg_runtime.schema.plan import Plan, Profile

    shutil.copytree(artifact, out)
    plan = Plan.from_yaml((out / "plan.yaml").read_text())
    dim = json.loads((out / "target" / "config.json").read_text())["dim"]
    save_file(random_predictor(dim, seed=seed), str(out / "predictor.safetensors"))
    plan.methods["egt"] = replace(plan.methods["egt"], depth_policy=DepthPolicy(**depth_policy(factor=4.0)),
                                  verify_widths=list(COMPILED))
    curves = Profile.from_dict(PROFILE)
    plan.profile = replace(plan.profile, widths=curves.widths, contexts=curves.contexts, target_ms=curves.target_ms,
                           draft_ms=curves.draft_ms, other_ms=curves.other_ms, target_widths=list(COMPILED),
                           draft_widths=list(COMPILED))
    plan.files["predictor.safetensors"] = file_entry(out / "predictor.safetensors")
    (out / "plan.yaml").write_text(plan.to_yaml())
    return out


__all__ = ["YGG", "ygg", "assert_one_line_error", "METHODS", "hf_greedy", "runner", "decode", "truncated", "noised_runtime", "to_runtime",
           "COMPILED", "PROFILE", "random_predictor", "depth_policy", "with_random_predictor"]


class Notes(Reporter):
    """A reporter that keeps the lines a command would print (its notes), for a test to read."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `ygg serve` process on a free loopback port, ready once /health answers."""

    def __init__(self, artifact: Path, *args: str, command: str = YGG, api_key: str | None = None,
                 env: dict[str, str] | None = None):
        """api_key: the server asks for it, given as $YGG_API_KEY; the client sends it. env: more
        environment for the server."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = os.environ | (env or {}) | ({"YGG_API_KEY": api_key} if api_key is not None else {})
        self.proc = subprocess.Popen([command, "serve", "--artifact", str(artifact), "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ygg serve exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            self.stop()
            raise AssertionError("ygg serve did not become ready")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", timeout=TIMEOUT,
                                    max_retries=0)
        self.model = self.client.models.list().data[0].id

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.stderr.read()


def linear_curves(fixed_ms: float, row_ms: float, other_row_ms: float = 0.0) -> Curves:
    """Planted costs: a target forward of w rows takes fixed_ms + row_ms·w whatever the batch (no
    batch factors), drafting takes nothing (no drafter curve), a step's CPU work other_row_ms·w."""
    widths = list(range(1, 65))
    return Curves(Profile(widths, [64], [[fixed_ms + row_ms * w for w in widths]],
                          other_ms=[other_row_ms * w for w in widths]))
