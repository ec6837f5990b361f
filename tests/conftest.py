import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Under pytest-xdist (`make test` runs two workers on two cores) each worker, and every `ygg` it
# starts, uses one thread: two processes of two OpenMP threads each on two cores spin against
# each other. Set before torch is imported, so every process of a worker agrees.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

from ygg_runtime.files import locked

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
# Converted GGUF checkpoints are cached here between test runs (the user cache is left alone).
os.environ.setdefault("YGG_CACHE", str(REPO / ".cache" / "ygg-test"))
# Every run measures its latency profiles in a store of its own that starts empty, as every user's
# machine is one the repository has never seen: the measuring path runs on every machine, never
# hidden by a profile committed (profiles/, read by test_profiles.py alone) or kept from an earlier
# run. Made by the first process (xdist's controller, before it starts its workers, which inherit
# it) and removed when that process ends; YGG_PROFILES set beforehand is used as it is.
OWN_PROFILES = None
if "YGG_PROFILES" not in os.environ:
    OWN_PROFILES = os.environ["YGG_PROFILES"] = tempfile.mkdtemp(prefix="ygg-test-profiles-")
torch.set_num_threads(min(2, torch.get_num_threads()))
# Without a GPU, Triton kernels (the GPU attention) run on CPU tensors in Triton's interpreter: their
# semantics are tested everywhere. Read when a kernel is defined, so set before any is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session) -> None:
    """The native kernels, built into the suite's cache before any test: under pytest-xdist this
    runs in the controller before its workers start (xdist starts them last), so the build has
    both cores (its sources side by side) and no worker waits on it with a test half set up."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        from ygg_runtime.backend import native

        native.build()


def pytest_unconfigure(config) -> None:
    if OWN_PROFILES is not None:
        shutil.rmtree(OWN_PROFILES, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The packaged SmolLM2-135M-Instruct, dequantized once into a transformers directory."""
    from ygg_compile import sources

    return sources.resolve("smollm2-135m").path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """<run>/<name>/<name>, a directory every test of this run shares, built by whichever xdist
    worker asks first while the other waits on a lock (a session fixture alone is built once per
    worker: the compiled artifact twice). Alone in its parent, as a user's output would be; tests
    read it and copy it before they change anything."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    path, done = root / name / name, root / f"{name}.done"
    with locked(root / name):  # its lock file sits in the run's directory, not beside the output
        if not done.exists():
            path.parent.mkdir(exist_ok=True)
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """A tiny random Llama target and a noised copy as drafter, saved as HF directories."""
    import tiny

    target = tiny.hf_model("llama", seed=40)
    draft = tiny.noised(target, 0.05, seed=41)
    tok = tiny.byte_tokenizer()
    for model in (target, draft):  # as saving sets it, in the worker that does not save too
        tiny.set_eos(model)

    def save(root: Path) -> None:
        tiny.save_pair_dir(root / "target", target, tok)
        tiny.save_pair_dir(root / "draft", draft, tok)

    root = built_once(tmp_path_factory, "models", save)
    return {"target": root / "target", "draft": root / "draft", "hf": target, "tokenizer": tok, "root": root}


@pytest.fixture(scope="session")
def artifact(pair, tmp_path_factory):
    """`ygg compile` of the tiny pair in float32 (token-exact), default method chain."""
    from helpers import ygg

    def compile_(out: Path) -> None:
        proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "float32",
                   "--max-context", 256, "--method", "chain")
        assert proc.returncode == 0, proc.stderr

    return built_once(tmp_path_factory, "tiny", compile_)
