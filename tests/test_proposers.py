"""The proposer contract (docs/design.md, "Adding a method"): two verbs and a start (and what a step
reads with its verdict, which a method may leave as none), nothing else public, each method built
from what it uses."""

from __future__ import annotations

import inspect

import pytest

from ygg_runtime.decoding import proposers
from ygg_runtime.errors import YggError
from ygg_runtime.decoding.proposers import METHODS, Proposer

CONTRACT = {"start", "propose", "update", "with_verdict", "max_tree_size", "name", "Params", "build"}


def test_the_proposer_interface_is_two_verbs_and_a_start():
    assert {n for n in dir(Proposer) if not n.startswith("_")} == CONTRACT
    assert list(inspect.signature(Proposer.propose).parameters) == ["self", "state"]
    assert list(inspect.signature(Proposer.update).parameters) == ["self", "verdict"]
    assert list(inspect.signature(Proposer.with_verdict).parameters) == ["self", "hidden"]


@pytest.mark.parametrize("name", list(METHODS))
def test_no_method_adds_a_public_verb(name):
    cls = METHODS[name]
    extra = {n for n in dir(cls) if not n.startswith("_") and n not in CONTRACT and not n.isupper()}
    assert extra == set()


@pytest.mark.parametrize("name", ["chain", "specinfer", "sequoia", "egt"])
def test_a_drafting_method_without_a_drafter_is_refused_in_one_line(name):
    with pytest.raises(YggError, match=f"method {name} needs a draft model"):
        proposers.build(name, {"parents": [-1], "ranks": [0]} if name == "sequoia" else {})


def test_every_method_has_its_parameters_and_its_proposer_registered_once():
    from ygg_runtime.schema.params import PARAMS

    assert set(METHODS) == set(PARAMS)
    assert all(METHODS[name].Params is PARAMS[name] for name in METHODS)


# A method as a newcomer would add one: its parameters and its proposer in one module, nothing else
# touched. `repeat` proposes the root token k times in a row (a guess that pays on runs of one token).
PLANTED = """
from dataclasses import dataclass
from typing import ClassVar

from ygg_runtime.decoding.proposers.base import Proposer
from ygg_runtime.decoding.tree import TokenTree
from ygg_runtime.errors import YggError
from ygg_runtime.schema.params import Params, StepShape


@dataclass(frozen=True)
class RepeatParams(Params):
    method: ClassVar[str] = "repeat"
    k: int = 3

    def __post_init__(self):
        if self.k < 1:
            raise YggError("repeat needs k >= 1")

    def step_shape(self) -> StepShape:
        return StepShape((), self.k + 1)


class Repeat(Proposer):
    name = "repeat"
    Params = RepeatParams

    @property
    def max_tree_size(self) -> int:
        return self.params.k + 1

    def propose(self, state):
        tree, node = TokenTree(state.seq[-1]), 0
        for _ in range(self.params.k):
            node = tree.add(node, state.seq[-1], 1.0)
        return tree
"""


def test_a_new_method_is_its_parameters_and_one_module(tmp_path):
    """Planted in a module of its own: the schema reads its parameters (and refuses bad ones in one
    line), the objective prices its step, `ygg inspect` sums it up, compile writes it into plans at
    its defaults, and it decodes exactly `ar`'s tokens — nothing else names it."""
    import importlib.util

    import tiny
    from helpers import runner, to_runtime
    from ygg_runtime.decoding.engine import generate
    from ygg_runtime.decoding.proposers.base import PROPOSERS
    from ygg_runtime.schema.params import PARAMS

    path = tmp_path / "repeat.py"
    path.write_text(PLANTED)
    spec = importlib.util.spec_from_file_location("planted_repeat", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        assert PARAMS["repeat"] is module.RepeatParams and METHODS["repeat"] is module.Repeat
        p = proposers.params("repeat", {"k": 2})
        assert p.step_shape().verify_width == 3 and p.summary() == "k=2"
        assert proposers.default_params()["repeat"] == {"k": 3}  # compile writes it into every plan
        with pytest.raises(YggError, match="repeat needs k >= 1"):
            proposers.params("repeat", {"k": 0})
        target = runner(to_runtime(tiny.hf_model("llama", seed=3)))
        prompt = [5, 6, 7, 7, 7]
        want, _ = generate(target, proposers.build("ar", None), prompt, max_new_tokens=24)
        target.reset()
        got, metrics = generate(target, proposers.build("repeat", {"k": 3}), prompt, max_new_tokens=24)
        assert got == want and metrics.steps <= 24
    finally:
        PARAMS.pop("repeat", None)
        PROPOSERS.pop("repeat", None)
