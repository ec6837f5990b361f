"""plan.yaml as types: what compile writes is what everything reads back, and a malformed plan is
refused in one line naming the field."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from ygg_runtime.errors import YggError
from ygg_runtime.schema.params import ChainParams, DepthPolicy, EGTParams, GraftParams, Params, Stages
from ygg_runtime.schema.plan import (FORMAT_VERSION, AOTInfo, BatchFactors, CalibrationInfo, CPUInfo, EGTCandidate,
                              ExactnessRecord, FileEntry, KernelInfo, ModelInfo, OutputLength, Plan, Planning,
                              PredictorReport, Profile, SequoiaCandidate, StagesReport, TokenizerInfo)


def a_plan() -> Plan:
    model = ModelInfo("tiny", "local", "/tmp/tiny", "ab" * 32, "llama", 1000, 2, 256, 512, [2])
    record = ExactnessRecord(2, [1, 2, 4], {1: False, 2: True, 4: True}, {1: 0.1, 2: 0.0, 4: 0.0}, [37], 2, 1.5)
    return Plan(
        format_version=FORMAT_VERSION, yggdrasil_version="0.1.0", created="2026-11-23T00:00:00Z", compile_seconds=12.5,
        compile_phases={"convert": 1.0}, quick=False, models={"target": model, "draft": dataclasses.replace(model, layers=1)},
        device="cpu", dtype="float32", torch_version="2.13.0+cpu", cpu=CPUInfo("a CPU", 2, ["avx2"]), max_context=400,
        cache_slots=450, aot=AOTInfo("model.pt2", 512, {"target": 3.0, "draft": 2.0}, "avx2", ["avx2", "fma"]),
        kernel=KernelInfo("attention.so", "avx2", ["avx2"]), exactness={"compiled": record, "eager": record},
        method="egt", methods={"ar": Params(), "chain": ChainParams(4), "egt": EGTParams(
            depth=3, stages=Stages("ahead", "plain"), graft=GraftParams(budget=8),
            depth_policy=DepthPolicy("depth.safetensors", 2, [1.0, 0.9, 0.8], [1, 4, 8]))},
        profile=Profile([1, 2], [64], [[10.0, 11.0]], target_batch=BatchFactors([2], [1, 2], [[None, 1.2]])),
        calibration=CalibrationInfo("builtin", 2, 96, 20, 3.0, 4.8),
        planning=Planning(40, [0.7, 0.2], [EGTCandidate(0, 0, 1.0, 10.0, 1.0, 1)], [SequoiaCandidate(1, 0, 1.0, 1.0)],
                          PredictorReport(False, "--no-predictor"), stages=StagesReport(Stages("ahead", "plain"), "faster")),
        tokenizer=TokenizerInfo("tokenizer.json", None, None, [2]), files={"plan-free.bin": FileEntry("cd" * 32, 10)},
        output_length=OutputLength(answers=2, ended=1, tokens=60, budget=48),
    )


def test_a_plan_reads_back_as_it_was_written():
    plan = a_plan()
    again = Plan.from_yaml(plan.to_yaml())
    assert again == plan
    assert again.exactness["compiled"].agree[1] is False and again.aot.cpu_flags == ["avx2", "fma"]
    # the file's order (a field left at its default of None, as `gpu` on a CPU, is left out)
    assert list(yaml.safe_load(plan.to_yaml())) == [f.name for f in dataclasses.fields(Plan)
                                                    if getattr(plan, f.name) is not None or f.default is not None]


def test_a_plan_without_native_code_reads_back():
    plan = dataclasses.replace(a_plan(), aot=None, kernel=None)
    assert Plan.from_yaml(plan.to_yaml()) == plan


def _dump(change) -> str:
    data = a_plan().to_dict()
    change(data)
    return yaml.safe_dump(data)


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.update(format_version=FORMAT_VERSION - 1), f"format version {FORMAT_VERSION - 1} is not supported"),
    (lambda d: d.pop("format_version"), "not a Yggdrasil plan (no format_version)"),
    (lambda d: d["models"]["draft"].pop("sha256"), "lacks `models.draft.sha256`"),
    (lambda d: d.update(cache_slots="many"), "`cache_slots` should be an integer, not str"),
    (lambda d: d.update(quick=1), "`quick` should be a bool, not int"),
    (lambda d: d["exactness"]["eager"].update(widths="1,2"), "`exactness.eager.widths` should be a list, not str"),
    (lambda d: d.update(tokenizer=["tokenizer.json"]), "`tokenizer` should be a mapping, not list"),
    (lambda d: d["methods"]["chain"].update(k="four"), "method chain: `k` should be an integer, not str: recompile"),
    (lambda d: d["methods"]["egt"]["stages"].update(tail="soon"), "egt stages must be tail/head: plain or ahead"),
    (lambda d: d["methods"]["egt"]["depth_policy"].pop("factors"), "method egt lacks `depth_policy.factors`"),
    (lambda d: d["methods"].update(beam={}), "unknown method 'beam'"),
    (lambda d: d["profile"].update(widths="1,2"), "`profile.widths` should be a list, not str"),
    (lambda d: d["planning"]["egt"][0].pop("speedup"), "lacks `planning.egt[0].speedup`"),
])
def test_a_malformed_plan_is_refused_in_one_line_naming_the_field(change, needle):
    with pytest.raises(YggError) as e:
        Plan.from_yaml(_dump(change), "art/plan.yaml")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_yaml_tag_that_would_construct_an_object_is_refused():
    with pytest.raises(YggError, match="art/plan.yaml is corrupt: could not determine a constructor"):
        Plan.from_yaml("!!python/object/apply:os.system ['true']\n", "art/plan.yaml")


def test_a_field_dropped_since_the_format_began_is_ignored():
    """Format 5 plans written before calibration.safetensors was dropped name it: still readable."""
    data = a_plan().to_dict()
    data["calibration"]["file"] = "calibration.safetensors"
    assert Plan.from_dict(data) == a_plan()


def test_nothing_outside_the_plan_reads_it_by_string_keys():
    """The plan is typed all the way down: outside plan.py and params.py no code subscripts, or
    calls .get on, a plan's methods entry, profile or planning with a string (`plan.methods["egt"]`
    picks a method by name and stays; `plan.methods["egt"]["depth"]` does not)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    parts = {"profile", "planning"}

    def plan_part(node: ast.AST) -> bool:
        """node is `<x>.profile`, `<x>.planning`, or `<x>.methods[<name>]` or `<x>.methods.get(<name>)`
        (a method's parameters)."""
        if isinstance(node, ast.Attribute) and node.attr in parts:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            node = node.func.value
            return isinstance(node, ast.Attribute) and node.attr == "methods"
        if isinstance(node, ast.BoolOp):  # `(plan.methods.get("egt") or {}).get(...)`
            return any(plan_part(v) for v in node.values)
        return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "methods"

    found = []
    for package in ("ygg_runtime", "ygg_compile", "ygg_bench"):
        for path in (root / package).rglob("*.py"):
            if path.name in ("plan.py", "params.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                string_key = (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                              and isinstance(node.slice.value, str) and plan_part(node.value))
                get = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                       and plan_part(node.func.value))
                if string_key or get:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


def test_every_part_of_a_plan_reads_back_typed():
    again = Plan.from_yaml(a_plan().to_yaml())
    egt = again.methods["egt"]
    assert isinstance(egt, EGTParams) and egt.stages.tail == "ahead" and egt.depth_policy.max_depth == 2
    assert egt.graft.budget == 8 and isinstance(again.methods["chain"], ChainParams)
    assert again.profile.target_batch.factors == [[None, 1.2]] and again.profile.compiled_widths("draft") == [1, 2]
    assert again.planning.stages.chosen == Stages("ahead", "plain") and again.planning.egt[0].speedup == 1.0
    assert again.output_length == OutputLength(answers=2, ended=1, tokens=60, budget=48)
    data = a_plan().to_dict()
    del data["output_length"]  # a plan from before calibration measured its answers' length
    assert Plan.from_dict(data).output_length is None
