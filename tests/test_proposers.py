"""The proposer contract (docs/design.md, "Adding a method"): two verbs and a start (and what a step
reads with its verdict, which a method may leave as none), nothing else public, each method built
from what it uses."""

from __future__ import annotations

import inspect

import pytest

from ygg_runtime.decoding import proposers
from ygg_runtime.errors import YggError
from ygg_runtime.decoding.proposers import METHODS, Proposer

CONTRACT = {"start", "propose", "update", "with_verdict", "max_tree_size", "name", "Params"}


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
