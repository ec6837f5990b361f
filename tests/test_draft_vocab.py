"""A drafter whose output head covers part of the vocabulary (ygg_compile.draft_vocab): the rows it
keeps compute what the whole head computes, a token without a row is never drafted, and every
method's output stays the target's."""

import json

import pytest
import tiny
import torch
from helpers import METHODS, assert_one_line_error, decode, noised_runtime, runner, ygg

from ygg_compile import draft_vocab, quantize
from ygg_compile.convert import convert_state, to_runtime
from ygg_runtime.model.transformer import from_state
from ygg_runtime.decoding.proposers import Drafter

PROMPT = [5, 17, 99, 17, 5, 40, 41, 42, 40, 41]


def test_rows_are_ranked_special_tokens_first_then_by_count_then_by_id():
    texts = [[7, 7, 3, 9], [9, 7, 250]]
    order = draft_vocab.ranking(texts, special=[257, 256], vocab=258)
    assert order[:5] == [257, 256, 7, 9, 3]  # specials as given, then 7 (x3), 9 (x2), 3 and 250 (x1, by id)
    assert order[5] == 250 and order[6:9] == [0, 1, 2] and sorted(order) == list(range(258))


def test_a_chain_replayed_on_agreements_counts_tokens_per_forward():
    # one text of 10 positions: agree at 0-4 (a run of 5), miss at 5, agree at 6-9
    agree = [True] * 5 + [False] + [True] * 4
    # k = 4: forward 1 takes 4 + bonus (pos 0-4), forward 2 misses at 5 (1 token), forward 3 takes pos 6-9 (4)
    assert draft_vocab.chain_tokens_per_forward(agree, [10], k=4) == pytest.approx(10 / 3)
    assert draft_vocab.chain_tokens_per_forward([False] * 6, [6]) == 1.0
    assert draft_vocab.chain_tokens_per_forward([True] * 6, [3, 6], k=4) == 3.0  # chains stop at a text's end


def test_draft_vocab_is_parsed_and_refused_in_one_line(pair, tmp_path):
    assert draft_vocab.parse("auto") is None and draft_vocab.parse("all") == 0 and draft_vocab.parse("300") == 300
    out = tmp_path / "out"
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--draft-vocab", "some")
    assert_one_line_error(proc, "--draft-vocab takes a number of tokens, all or auto")
    assert not out.exists()


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_a_cut_head_computes_the_whole_heads_logits_on_its_rows(weights):
    """Float weights (the head tied to the embeddings, untied by the cut) and 4-bit codes: each
    kept row's logit is the whole head's for that token (the quantized kernel bit for bit: an
    output column never depends on the others)."""
    hf = tiny.hf_model("qwen2", seed=44, vocab_size=300)  # ties its head to the embeddings
    args, state = convert_state(hf, torch.float32)
    if weights == "int4":
        args, state, _ = quantize.quantize_state(state, args, "int4", None)
    full = from_state(args, dict(state))
    ids = torch.tensor([0, 3, 17, 40, 41, 42, 99, 250, 299])
    cut_args, cut_state = draft_vocab.cut_head(args, state, ids)
    assert cut_args.head_rows == 9 and not cut_args.tie_embeddings
    cut = from_state(cut_args, cut_state)
    a, b = runner(full, 64), runner(cut, 64)
    whole, part = a.forward_chain(PROMPT), b.forward_chain(PROMPT)
    assert part.shape == (len(PROMPT), 9)
    if weights == "int4":
        assert torch.equal(part, whole[:, ids])
    else:
        assert torch.allclose(part, whole[:, ids], atol=1e-5)
    mapped = Drafter(b, 300).fit(part)  # back on the vocabulary: the rows at their ids, nothing elsewhere
    assert torch.equal(mapped[:, ids], part) and bool((mapped[:, [1, 2, 298]] == float("-inf")).all())


def test_every_method_with_a_cut_head_drafter_gives_the_targets_output():
    """The drafter keeps 60 of 258 tokens, the target's first choices among them or not: every
    method's greedy output equals plain decoding's, and drafts still get accepted."""
    hf = tiny.hf_model("llama", seed=40)
    target = runner(to_runtime(hf))
    noisy = noised_runtime(to_runtime(hf), 0.05, seed=41)
    args, state = noisy.args, {k: v for k, v in noisy.state_dict().items()}
    ref, _ = decode(target, None, "ar", {}, PROMPT, 40)
    ids = torch.tensor(sorted(set(ref[::2]) | set(range(60))))[:60]
    draft = runner(from_state(*draft_vocab.cut_head(args, state, ids)))
    accepted = []
    for method, params in METHODS[1:]:
        out, m = decode(target, draft, method, params, PROMPT, 40)
        assert out == ref, (method, params)
        accepted.append(m.mean_accepted_length)
    assert max(accepted) > 1.2


def test_compile_cuts_the_drafters_head_as_asked_and_every_method_equals_ar(pair, tmp_path):
    out = tmp_path / "art"
    calib = tmp_path / "calib.txt"
    calib.write_text("def square(x):\n    return x * x\n---\nThe weather today is\n")
    proc = ygg("compile", "--draft", pair["draft"], "--target", pair["target"], "-o", out, "--dtype", "float32",
               "--draft-vocab", 120, "--max-context", 256, "--calib", calib, "--calib-tokens", 8, "--quick", "--no-aot")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(json.dumps(__import__("yaml").safe_load((out / "plan.yaml").read_text())))
    assert plan["planning"]["draft_vocab"]["rows"] == 120 and plan["planning"]["draft_vocab"]["vocab"] == 258
    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["head_rows"] == 120
    prompt = tmp_path / "p.txt"
    prompt.write_text("def square(x):\n")
    runs = {m: json.loads(ygg("run", prompt, "-a", out, "-m", m, "-n", 24, "--json", "--ignore-eos").stdout)
            for m in ("ar", "chain", "egt", "sequoia")}
    assert runs["chain"]["token_ids"] == runs["egt"]["token_ids"] == runs["sequoia"]["token_ids"] == runs["ar"]["token_ids"]


def test_auto_measures_every_head_size_and_keeps_the_fastest_modelled_chain():
    """A 20k-token vocabulary (larger than the size kept whole): every candidate size is tried on
    held-out halves of the texts, and the choice is the table's best modelled speed-up."""
    hf = tiny.hf_model("llama", seed=45, vocab_size=20000)
    target = runner(to_runtime(hf), 256)
    draft = runner(noised_runtime(to_runtime(hf), 0.05, seed=46), 256)
    g = torch.Generator().manual_seed(0)
    texts, starts = {}, {}
    for i in range(4):  # a prompt of frequent ids, then the target's greedy continuation
        prompt = torch.randint(0, 300, (12,), generator=g).tolist()
        out, _ = decode(target, None, "ar", {}, prompt, 24)
        texts[i], starts[i] = prompt + out, len(prompt)
    choice = draft_vocab.choose(target, draft, texts, starts, special=[19999], asked=None)
    assert [r["rows"] for r in choice.table] == [4096, 8192, 16384, 20000]
    best = max(choice.table, key=lambda r: (r["chain_speedup"], r["rows"]))
    assert choice.rows == best["rows"] and "measured" in choice.why
    assert all(1.0 <= r["tokens_per_forward"] <= draft_vocab.CHAIN_K + 1 for r in choice.table)
    if choice.ids is not None:
        assert len(choice.ids) == choice.rows and 19999 in choice.ids.tolist()  # special tokens always kept
