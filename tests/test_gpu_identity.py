"""What a GPU artifact knows of its GPU, checked without one: the exactness verdict names the GPU it
was checked on and what differs here, `ygg run` refuses compiled code for another GPU kind in one
line, the plan keeps the GPU, and the matmul settings that make a row's bits its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ygg_runtime.checks import exactness
from ygg_runtime.backend import gpu_identity as gpu
from ygg_runtime.errors import YggError
from ygg_runtime.checks.integrity import check_gpu
from ygg_runtime.schema.plan import ExactnessRecord, GPUInfo, Plan

H200 = GPUInfo(name="NVIDIA H200", capability="9.0", memory=150_000_000_000, cuda="13.0", cublas="13.1.0",
               driver="580.159.03")
WIDTHS = [1, 2, 4, 8, 16, 32, 64]


def record(min_width: int = 64) -> ExactnessRecord:
    agree = {w: w >= min_width for w in WIDTHS}
    return ExactnessRecord(min_width, WIDTHS, agree, {w: 0.0 if agree[w] else 0.25 for w in WIDTHS}, [37], 16, 1.0)


def test_a_gpu_verdict_says_the_rule_and_which_gpu_part_differs():
    here = exactness.Machine("2.11.0+cu130", "", (), 0, H200)
    exact, why = exactness.verdict(record(), here, here=here)
    assert exact and "every target forward runs at width 64, where a token's row has the same bits" in why
    for other, says in ((replace(H200, name="NVIDIA H100 80GB HBM3"), "GPU NVIDIA H200, not NVIDIA H100 80GB HBM3"),
                        (replace(H200, capability="8.0"), "compute capability 9.0, not 8.0"),
                        (replace(H200, cuda="12.8"), "CUDA 13.0, not 12.8"),
                        (replace(H200, cublas="12.9.1"), "cuBLAS 13.1.0, not 12.9.1"),
                        (replace(H200, driver="575.51.03"), "driver 580.159.03, not 575.51.03")):
        exact, why = exactness.verdict(record(), replace(here, gpu=other), here=here)
        assert not exact and why.startswith("not checked on this machine (") and says in why, why
    cpu = exactness.Machine("2.11.0+cu130", "AMD EPYC", ("avx2",), 2)
    assert "a CPU, not the GPU NVIDIA H200 (compute capability 9.0)" in exactness.verdict(record(), here, here=cpu)[1]
    assert exactness.verdict(record(2), here, here=here)[1].count("width 2 to 64") == 1  # the CPU's wording


def test_compiled_code_for_another_gpu_kind_is_refused_in_one_line():
    a10 = replace(H200, name="NVIDIA A10G", capability="8.6")
    with pytest.raises(YggError) as e:
        check_gpu(H200, a10)
    line = str(e.value)
    assert "\n" not in line and "compiled for the GPU NVIDIA H200 (compute capability 9.0)" in line
    assert "this is NVIDIA A10G (compute capability 8.6)" in line and "--calibration-from" in line
    with pytest.raises(YggError):
        check_gpu(H200, replace(H200, name="NVIDIA H100 80GB HBM3"))  # the same capability, another GPU's plan
    check_gpu(H200, replace(H200, driver="575.51.03", cublas="13.0.2"))  # its verdict says so; the code runs


def test_a_plan_keeps_its_gpu_and_a_plan_without_one_reads_as_a_cpu_artifact(artifact):
    plan = Plan.from_yaml((artifact / "plan.yaml").read_text())
    assert plan.gpu is None
    plan.gpu = H200
    back = Plan.from_yaml(plan.to_yaml())
    assert back.gpu == H200 and exactness.Machine.checked(back, record()).gpu == H200


def test_the_gpu_matmul_settings_leave_no_reduction_to_cublas_choice(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
             torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
    try:
        gpu.configure()
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        assert not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        if hasattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction_split_k"):
            assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction_split_k
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == gpu.WORKSPACE
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
         torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction) = saved
