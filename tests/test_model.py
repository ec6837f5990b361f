"""The runtime decoder computes the same logits as transformers for every supported architecture."""

import pytest
import torch
import tiny
from helpers import runner, to_runtime

ARCHS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
}


def full_forward(model, ids):
    r = runner(model, 256)
    return r.forward_chain(ids[0].tolist())


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(name):
    arch, over = ARCHS[name]
    hf = tiny.hf_model(arch, seed=0, **over)
    ids = torch.randint(0, tiny.BYTE_VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits[0]
    ours = full_forward(to_runtime(hf), ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_incremental_decoding_matches_one_full_forward():
    """Prefill, then one token at a time through the cache, equals one forward over everything."""
    hf = tiny.hf_model("qwen2", seed=2)
    model = to_runtime(hf)
    ids = torch.randint(0, tiny.BYTE_VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))[0].tolist()
    full = full_forward(model, torch.tensor([ids]))
    r = runner(model, 256)
    r.prefill(ids[:20])
    steps = []
    for t in ids[20:]:
        steps.append(r.forward_chain([t])[0])
        r.commit([0])
    torch.testing.assert_close(torch.stack(steps), full[20:], atol=1e-4, rtol=1e-4)


@pytest.mark.real
def test_smollm2_logits_match_transformers(smollm2_hf, smollm2_tokenizer):
    ids = smollm2_tokenizer("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids
    ref = smollm2_hf(ids).logits[0]
    ours = full_forward(to_runtime(smollm2_hf), ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
