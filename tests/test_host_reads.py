"""A decode step reads device values once per forward whose result the host needs, and no more
(`ygg_runtime.transfer`): on a GPU each read is a round trip the device idles through. Counted here
on the CPU, where the code path is the same: every `.tolist()` / `.item()` / truth test of a tensor
during a step, which must all be `transfer.to_host`'s."""

from __future__ import annotations

import pytest
import tiny
import torch
from helpers import COMPILED, PROFILE, depth_policy, noised_runtime, random_predictor, runner, to_runtime

from ygg_runtime import transfer
from ygg_runtime.decoding.engine import Generation
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.params import DepthPolicy, EGTParams
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.proposers import Drafter, build
from ygg_runtime.transfer import Stopwatch

PROMPT = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n")


@pytest.fixture(scope="module")
def models():
    target = to_runtime(tiny.hf_model("llama", seed=30))
    return runner(target), runner(noised_runtime(target, 0.05, seed=31))


@pytest.fixture
def reads(monkeypatch):
    """Every read of tensor values by Python: (all of them, those through transfer.to_host)."""
    seen = {"all": 0}
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            seen["all"] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


def step_reads(target, proposer, reads, n: int = 40, **kw) -> list[tuple[int, int, int]]:
    """(the step's egt depth or -1, its reads through to_host, all its reads) for every step."""
    g = Generation(target, proposer, PROMPT, max_new_tokens=n, **kw)
    g.prefill()
    out = []
    while not g.done:
        mine, every = transfer.host_reads(), reads["all"]
        tree = g.propose()
        c = g.call()
        watch = Stopwatch(target.device).start()
        logits = target.forward(c.tokens, c.offsets, c.depths, c.tree_mask, tree.verify_width)
        g.accept(logits, watch.stop())
        out.append((getattr(proposer, "step_depth", -1), transfer.host_reads() - mine, reads["all"] - every))
    return out


def test_a_greedy_egt_step_reads_its_tree_once_whatever_its_depth_and_once_for_its_verdict(models, reads):
    """Two reads: the drafted tree, once its rounds chose and fed their nodes on the device
    (`Planner.grow_on`), and the target's choices; a depth-0 step (plain decoding) one."""
    target, draft = models
    for params in ({"depth": 4, "draft_width": 4, "top_k": 4, "verify_widths": list(COMPILED)},
                   {"depth": 2, "draft_width": 8, "top_k": 2, "verify_widths": [4, 8]}):
        egt = build("egt", params, Drafter(draft, target.vocab_size), Curves(PROFILE))
        steps = step_reads(target, egt, reads)
        assert len(steps) > 5
        assert {d for d, _, _ in steps} - {0, 1}  # deep steps ran
        for depth, mine, every in steps:
            assert mine == every  # nothing read around transfer.to_host
            assert mine == min(depth + 1, 2)


def test_a_predicted_depth_travels_with_the_verdict_and_coupled_sampling_reads_a_round_at_a_time(models, reads,
                                                                                                monkeypatch):
    """With the depth predictor: as without it — its reach at every verified row is read in the
    verdict's transfer (`Proposer.with_verdict`); only the first step, after the prompt, reads it
    on its own. Greedy: the tree and the verdict. Coupled sampling (with the GPU's choice of every
    tree row at once) still reads each round's guesses under the noise: depth + 1."""
    from ygg_runtime.decoding import accept

    target, draft = models
    policy = DepthPolicy(**depth_policy(factor=4.0))
    params = EGTParams(depth=3, draft_width=2, top_k=3, verify_widths=list(COMPILED), depth_policy=policy)
    predictor = DepthPredictor(random_predictor(target.model.args.dim))

    def predicted(reads_of, **kw):
        egt = build("egt", params, Drafter(draft, target.vocab_size), Curves(PROFILE), predictor=predictor)
        steps = step_reads(target, egt, reads, **kw)
        assert {d for d, _, _ in steps} - {0, 1}  # it drafted deep
        (d0, mine0, every0), *rest = steps
        assert mine0 == every0 == reads_of(d0) + 1
        assert rest and all(mine == every == reads_of(d) for d, mine, every in rest)

    predicted(lambda depth: min(depth + 1, 2))
    monkeypatch.setattr(accept, "rows_at_once", lambda device: True)
    predicted(lambda depth: depth + 1, temperature=1.0, seed=3)
    egt = build("egt", {"depth": 3, "draft_width": 2, "top_k": 3, "verify_widths": list(COMPILED)},
                Drafter(draft, target.vocab_size), Curves(PROFILE))
    steps = step_reads(target, egt, reads, temperature=1.0, seed=3)
    assert all(mine == every == d + 1 for d, mine, every in steps)


def test_the_reach_read_with_the_verdict_is_the_one_its_row_gives_alone(models):
    """The predictor's heads computed over every verified row and read with the verdict give,
    at the accepted row, the reach it gives that row alone (within float32 rounding of a batched
    product): what the depth choice reads is the predictor's, whichever way it travels."""
    target, draft = models
    policy = DepthPolicy(**depth_policy(factor=4.0))
    params = EGTParams(depth=3, draft_width=2, top_k=3, verify_widths=list(COMPILED), depth_policy=policy)
    predictor = DepthPredictor(random_predictor(target.model.args.dim))
    egt = build("egt", params, Drafter(draft, target.vocab_size), Curves(PROFILE), predictor=predictor)
    g = Generation(target, egt, PROMPT, max_new_tokens=24)
    g.prefill()
    checked = 0
    while not g.done:
        tree = g.propose()
        c = g.call()
        logits = target.forward(c.tokens, c.offsets, c.depths, c.tree_mask, tree.verify_width)
        g.accept(logits, Stopwatch(target.device).start().stop())
        if not g.done:
            alone = predictor.reach(g.hidden)
            assert predictor.monotone(g.extra) == pytest.approx(alone, abs=1e-6)
            checked += 1
    assert checked > 3


STATIC = [("chain", {"k": 3}), ("specinfer", {"width": 2, "depth": 3}),
          ("sequoia", {"parents": [-1, 0, 0, 1, 1, 2, 3], "ranks": [0, 0, 1, 0, 1, 0, 0]})]


@pytest.mark.parametrize("method,params,reads_per_step", [("ar", {}, 1)] + [(m, p, 2) for m, p in STATIC])
def test_a_greedy_static_tree_is_read_once_whatever_its_depth_and_once_for_its_verdict(models, reads, method, params,
                                                                                      reads_per_step):
    """chain, specinfer and sequoia draft greedily on the device (`StaticTree`): each level's
    children feed the next level where they are, the tree comes back in one read; then the verdict."""
    target, draft = models
    proposer = build(method, params, Drafter(draft, target.vocab_size) if method != "ar" else None)
    steps = step_reads(target, proposer, reads, n=24)
    assert all(mine == every == reads_per_step for _, mine, every in steps)


def host_walk(proposer, seq: list[int]):
    """A static tree drafted level by level with every level's children read back and added on the
    host, each level fed through `Drafter.expand` from the tree built so far: what the methods did
    before their levels stayed on the device."""
    from ygg_runtime.schema.params import fit_width
    from ygg_runtime.decoding.tree import TokenTree
    from ygg_runtime.transfer import read_top

    shape, drafter = proposer.shape, proposer.drafter
    widths = getattr(proposer, "widths", ())
    tree = TokenTree(seq[-1])
    rows = drafter.begin(seq)
    for d, nodes in enumerate(shape.nodes):
        if d:
            rows = drafter.expand(tree, nodes, fit_width(len(nodes), widths) if widths else 0)
        tops = read_top(*rows.top(shape.k[d]))
        for i, r in zip(shape.rows[d].tolist(), shape.ranks[d].tolist()):
            tree.add(nodes[i], tops[i][1][r], tops[i][0][r])
    tree.verify_width = getattr(proposer, "verify_width", 0)
    return tree


@pytest.mark.parametrize("method,params", STATIC)
def test_a_static_tree_drafted_on_the_device_is_the_one_a_host_walk_drafts(models, method, params):
    """Step for step, the same tokens, draft probabilities, parents and widths as the walk that
    reads every level back (`host_walk`): the next level's tokens, slots, depths and masks the
    device path feeds are the tree's."""
    target, draft = models
    trees = {}
    for on_device in (True, False):
        proposer = build(method, params, Drafter(draft, target.vocab_size))
        if not on_device:
            proposer.propose = lambda state, p=proposer: host_walk(p, state.seq)
        g = Generation(target, proposer, PROMPT, max_new_tokens=24)
        g.prefill()
        seen = []
        while not g.done:
            tree = g.propose()
            c = g.call()
            logits = target.forward(c.tokens, c.offsets, c.depths, c.tree_mask, tree.verify_width)
            g.accept(logits, Stopwatch(target.device).start().stop())
            seen.append((tree.tokens, tree.parents, tree.draft_probs, tree.verify_width))
        trees[on_device] = seen
    assert trees[True] == trees[False] and len(trees[True]) > 3


@pytest.mark.parametrize("width,heads", [(1, 1), (3, 2), (5, 5), (8, 3)])
def test_a_forwards_inputs_each_start_on_a_16_byte_boundary_of_their_one_buffer(width, heads):
    """A graph compiled ahead of time for a GPU may load its inputs as aligned (its examples were);
    the one buffer a forward's inputs travel in keeps each of them so, and each holds its values."""
    from ygg_runtime.model.graphs import ForwardInputs

    inputs = ForwardInputs(width, heads, window=7)
    values = [[100 * k + i for i in range(width)] for k in range(5)]
    inputs.set_ints(*values, heads=[900 + i for i in range(heads)])
    inputs.tree[:] = torch.ones(width, 7, dtype=torch.bool).tril()
    args = inputs.args()
    assert all(a.storage_offset() * a.element_size() % ForwardInputs.ALIGN == 0 for a in args)
    assert [a.flatten().tolist() for a in args[:5]] == values and args[6].tolist() == [900 + i for i in range(heads)]
    assert torch.equal(args[5], torch.ones(width, 7, dtype=torch.bool).tril())
