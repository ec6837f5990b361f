"""plan.yaml as types: what compile writes is what everything reads back, and a malformed plan is
refused in one line naming the field."""

import dataclasses

import pytest
import yaml

from ygg_runtime.errors import YggError
from ygg_runtime.plan import (FORMAT_VERSION, AOTInfo, CalibrationInfo, CPUInfo, ExactnessRecord, FileEntry, KernelInfo,
                              ModelInfo, Plan, TokenizerInfo)


def a_plan() -> Plan:
    model = ModelInfo("tiny", "local", "/tmp/tiny", "ab" * 32, "llama", 1000, 2, 256, 512, [2])
    record = ExactnessRecord(2, [1, 2, 4], {1: False, 2: True, 4: True}, {1: 0.1, 2: 0.0, 4: 0.0}, [37], 2, 1.5)
    return Plan(
        format_version=FORMAT_VERSION, yggdrasil_version="0.1.0", created="2026-11-23T00:00:00Z", compile_seconds=12.5,
        compile_phases={"convert": 1.0}, quick=False, models={"target": model, "draft": dataclasses.replace(model, layers=1)},
        device="cpu", dtype="float32", torch_version="2.13.0+cpu", cpu=CPUInfo("a CPU", 2, ["avx2"]), max_context=400,
        cache_slots=450, aot=AOTInfo("model.pt2", 512, {"target": 3.0, "draft": 2.0}, "avx2", ["avx2", "fma"]),
        kernel=KernelInfo("attention.so", "avx2", ["avx2"]), exactness={"compiled": record, "eager": record},
        method="egt", methods={"ar": {}, "chain": {"k": 4}}, profile={"widths": [1, 2]},
        calibration=CalibrationInfo("builtin", 2, 96, 20, 3.0, 4.8), planning={"context": 40},
        tokenizer=TokenizerInfo("tokenizer.json", None, None, [2]), files={"plan-free.bin": FileEntry("cd" * 32, 10)},
    )


def test_a_plan_reads_back_as_it_was_written():
    plan = a_plan()
    again = Plan.from_yaml(plan.to_yaml())
    assert again == plan
    assert again.exactness["compiled"].agree[1] is False and again.aot.cpu_flags == ["avx2", "fma"]
    assert list(yaml.safe_load(plan.to_yaml())) == [f.name for f in dataclasses.fields(Plan)]  # the file's order


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
