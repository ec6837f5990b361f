"""Which CUDA graphs a runner holds (`ygg_runtime.model.graphs.CapturedForwards`), checked without a GPU:
the capture itself is replaced by a stand-in that records what it was asked for, so what is pinned
here is the bookkeeping around it — one graph per (kind, width), reused, and none kept for a cache
or a tree window that forwards no longer use."""

from __future__ import annotations

import torch

from ygg_runtime.model.graphs import CapturedForwards, ForwardInputs, _Graph


class Replay:
    def __init__(self):
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def stub(graphs: CapturedForwards, monkeypatch) -> list[tuple]:
    """Capture as a stand-in graph; returns the list of (width, cache address) each capture saw."""
    seen: list[tuple] = []

    def capture(forward, inputs: ForwardInputs, cache: torch.Tensor) -> _Graph:
        seen.append((inputs.width, cache.data_ptr()))
        graphs.captures += 1
        return _Graph(Replay(), inputs.host.clone(), torch.zeros(1), torch.zeros(1))

    monkeypatch.setattr(graphs, "_capture", capture)
    return seen


def forward_over(graphs: CapturedForwards, cache: torch.Tensor, width: int, kind: str = "compiled"):
    inputs = ForwardInputs(width, width, graphs.window_for(8))
    return graphs.run(kind, lambda *a: None, inputs, cache)


def test_a_graph_is_captured_once_per_kind_and_width_and_then_replayed(monkeypatch):
    graphs = CapturedForwards(torch.device("cpu"))
    seen = stub(graphs, monkeypatch)
    cache = torch.zeros(2, 2, 1, 64, 4)
    for _ in range(3):
        for w in (1, 8):
            forward_over(graphs, cache, w)
    forward_over(graphs, cache, 8, kind="eager")
    assert [w for w, _ in seen] == [1, 8, 8] and graphs.captures == 3
    assert sorted(g.graph.replays for g in graphs._graphs.values()) == [1, 3, 3]


def test_a_new_cache_drops_the_graphs_of_the_old_one(monkeypatch):
    """`ygg serve` sets the caches up anew (sized by memory): the graphs captured over the old cache
    must not pile up beside the new ones for the rest of the process."""
    graphs = CapturedForwards(torch.device("cpu"))
    seen = stub(graphs, monkeypatch)
    caches = [torch.zeros(2, 2, 1, slots, 4) for slots in (64, 96, 128)]
    for cache in caches:
        for w in (1, 2, 4):
            forward_over(graphs, cache, w)
        assert len(graphs._graphs) == 3
    assert [p for _, p in seen] == [c.data_ptr() for c in caches for _ in range(3)]
    forward_over(graphs, caches[0], 1)  # back to an earlier cache: captured again over it
    assert len(graphs._graphs) == 1 and seen[-1] == (1, caches[0].data_ptr())


def test_a_wider_tree_window_drops_every_graph_and_later_forwards_take_it(monkeypatch):
    graphs = CapturedForwards(torch.device("cpu"))
    seen = stub(graphs, monkeypatch)
    cache = torch.zeros(2, 2, 1, 64, 4)
    forward_over(graphs, cache, 4)
    assert graphs.window_for(100) == 128 and not graphs._graphs
    assert graphs.window_for(8) == 128  # never narrowed again: the graphs captured at 128 serve it
    forward_over(graphs, cache, 4)
    assert len(seen) == 2 and len(graphs._graphs) == 1
