import os
import sys
from pathlib import Path

# Under pytest-xdist (`make test` runs two workers on two cores) each worker, and every `ygg` it
# starts, uses one thread: two processes of two OpenMP threads each on two cores spin against
# each other. Set before torch is imported, so every process of a worker agrees.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
# Converted GGUF checkpoints are cached here between test runs (the user cache is left alone).
os.environ.setdefault("YGG_CACHE", str(REPO / ".cache" / "ygg-test"))
# Latency profiles the tests measure stay out of the committed profiles/.
os.environ.setdefault("YGG_PROFILES", str(REPO / ".cache" / "ygg-test" / "profiles"))
torch.set_num_threads(min(2, torch.get_num_threads()))


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


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """A tiny random Llama target and a noised copy as drafter, saved as HF directories."""
    import tiny

    root = tmp_path_factory.mktemp("models")
    target = tiny.hf_model("llama", seed=40)
    draft = tiny.noised(target, 0.05, seed=41)
    tok = tiny.byte_tokenizer()
    return {
        "target": tiny.save_pair_dir(root / "target", target, tok),
        "draft": tiny.save_pair_dir(root / "draft", draft, tok),
        "hf": target,
        "tokenizer": tok,
        "root": root,
    }


@pytest.fixture(scope="session")
def artifact(pair, tmp_path_factory):
    """`ygg compile` of the tiny pair in float32 (token-exact), default method chain."""
    from helpers import ygg

    out = tmp_path_factory.mktemp("art") / "tiny"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "float32",
               "--max-context", 256, "--method", "chain")
    assert proc.returncode == 0, proc.stderr
    return out
