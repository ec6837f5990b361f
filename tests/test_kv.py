"""After a step, the compacted KV cache equals the cache of running the accepted tokens one by one."""

import torch
import tiny
from helpers import noised_runtime, runner, to_runtime

from ygg_runtime.decoding import proposers
from ygg_runtime.decoding.accept import accept_greedy


def sequential_cache(model, tokens: list[int]):
    r = runner(model, 256)
    for t in tokens:
        r.forward_chain([t])
        r.commit([0])
    return r


def assert_same_prefix(a, b, n: int):
    for ca, cb in zip(a.model.caches(), b.model.caches()):
        torch.testing.assert_close(ca.k[:, :, :n], cb.k[:, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ca.v[:, :, :n], cb.v[:, :, :n], atol=1e-5, rtol=1e-5)


def test_compacted_cache_equals_sequential_cache():
    hf = tiny.hf_model("qwen2", seed=30)
    target_model = to_runtime(hf)
    draft_model = noised_runtime(target_model, 0.05, seed=31)
    target, draft = runner(target_model, 256), runner(draft_model, 256)
    prop = proposers.build("specinfer", {"width": 3, "depth": 3}, proposers.Drafter(draft, target.vocab_size))
    moved = 0
    for seed in range(8):
        prompt = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
        target.reset()
        target.prefill(prompt[:-1])
        prop.start(prompt[:-1])
        seq = list(prompt)
        for _ in range(4):
            tree = prop.propose(proposers.StepState(seq))
            logits = target.forward(tree.tokens, list(range(len(tree))), tree.depths, tree.ancestor_mask())
            verdict = accept_greedy(tree, logits)
            target.commit(verdict.path)
            prop.update(verdict)
            moved += verdict.path != list(range(len(verdict.path)))
            seq += [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]
            # seq[:-1] is exactly what each cache must now hold (the bonus is the next root).
            assert target.committed == len(seq) - 1
            assert_same_prefix(target, sequential_cache(target_model, seq[:-1]), target.committed)
            assert_same_prefix(draft, sequential_cache(draft_model, seq[: draft.committed]), draft.committed)
    assert moved > 3, "no step accepted a path that needed its rows moved"


def test_a_region_moves_whole_whether_or_not_its_new_place_overlaps_the_old():
    """`kv.move`, what a batch runs when a region cannot grow in place or the regions are packed:
    every layer's rows arrive in order, into a range after, before, or overlapping the old one."""
    from ygg_runtime.model.kv import KVCache, move

    for src, dst in ((10, 60), (60, 10), (10, 17), (17, 10)):
        cache = KVCache(3, 100, 2, 4, torch.float32, "cpu")
        cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(src + dst)))
        rows = cache.data[:, :, :, src : src + 20].clone()
        move(cache, src, 20, dst)
        assert torch.equal(cache.data[:, :, :, dst : dst + 20], rows), (src, dst)


def _resident_bytes() -> int:
    import os
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cache_for_the_whole_context_costs_memory_only_where_rows_are_written():
    """A KV cache sized for 32k tokens is set up untouched (zeroed pages come from the system as
    rows are written): a default compile serves the models' own context without holding it."""
    from ygg_runtime.model.kv import ALIGN, KVCache

    before = _resident_bytes()
    cache = KVCache(8, 65536, 2, 128, torch.float32, "cpu")  # 1 GiB
    assert cache.data.data_ptr() % ALIGN == 0 and cache.data.is_contiguous()
    assert _resident_bytes() - before < 64 << 20
    cache.data[3, 1, 1, 40000] = 2.0
    assert cache.data[3, 1, 1, 40000, 0] == 2.0 and cache.data[3, 1, 1, 39999].abs().sum() == 0
    assert _resident_bytes() - before < 64 << 20
    bf = KVCache(2, 100, 1, 8, torch.bfloat16, "cpu").data
    assert bf.dtype == torch.bfloat16 and bf.shape == (2, 2, 1, 100, 8) and not bf.any()
