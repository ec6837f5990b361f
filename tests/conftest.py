import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
# Converted GGUF checkpoints are cached here between test runs (the user cache is left alone).
os.environ.setdefault("YGG_CACHE", str(REPO / ".cache" / "ygg-test"))
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
