"""Load and validate a compiled artifact directory (docs/design.md, "The artifact"). Nothing here unpickles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ygg_runtime.model.compiled import CompiledForward
from ygg_runtime.decoding.decoder import Decoder
from ygg_runtime.backend import gpu_identity as gpu, native
from ygg_runtime.errors import YggError, first_line
from ygg_runtime.checks.integrity import check_machine, check_memory, verify_files
from ygg_runtime.model.transformer import load_model
from ygg_runtime.options import DEFAULT_DIR
from ygg_runtime.schema.params import EGTParams
from ygg_runtime.schema.plan import PLAN_FILE, Plan, plan_bytes
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.retrieval import AdjacencyTable
from ygg_runtime.model.runner import ModelRunner
from ygg_runtime.text import TextCodec


def plan_sha256(directory: str | Path) -> str:
    """The hash that identifies an artifact: plan.yaml's sha256. The plan lists every other file's
    sha256, so pinning it (`ygg run --expect-plan`) pins the compiled code and weights too."""
    return hashlib.sha256((Path(directory) / PLAN_FILE).read_bytes()).hexdigest()


def native_files(plan: Plan) -> set[str]:
    """The artifact's files that are native code a process executes: the compiled forwards and
    the kernels' library (what `--eager` runs without)."""
    files = {plan.kernel.file} if plan.kernel else set()
    if plan.aot:
        files |= {f"{role}/{plan.aot.package}" for role in plan.models}
    return files


def read_plan(directory: Path, expect_plan: str | None = None, eager: bool = False) -> Plan:
    """The plan of an artifact, refusing anything that is not a complete, unchanged artifact of
    this format. With expect_plan (a plan sha256), refuse any other plan before parsing it, and
    hash every file afresh: the size-and-mtime shortcut of verify_files trusts the file's mtime,
    which whoever can write the artifact can also set. eager=True leaves the native code out of
    the check: it will not be loaded."""
    directory = Path(directory)
    path = directory / PLAN_FILE
    raw = plan_bytes(directory, expect_plan)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YggError(f"{path} is corrupt: {first_line(e)}") from e
    plan = Plan.from_yaml(text, str(path))
    skip = native_files(plan) if eager else set()
    verify_files(directory, {f: e for f, e in plan.files.items() if f not in skip}, rehash=expect_plan is not None)
    return plan


def load(directory: str | Path = DEFAULT_DIR, device: str | None = None, predictor: bool = True,
         eager: bool = False, dtype: str | None = None, expect_plan: str | None = None) -> Decoder:
    """Load an artifact written by `ygg compile` into a ready Decoder. Its native code (compiled
    forwards, kernels' library) runs unless eager=True, which runs the models eager and builds the
    kernels from this package's sources (cached; needs a C++ compiler) instead of loading the
    artifact's copy: no code the artifact carries is executed. predictor=False leaves egt's depth
    predictor out (egt then keeps its planned fixed depth); device and dtype, when given, must be
    the artifact's. expect_plan, a plan sha256, refuses any other artifact before any of its code
    is loaded (a deployment pins the artifact it tested)."""
    directory = Path(directory)
    plan = read_plan(directory, expect_plan, eager=eager)
    device = device or plan.device
    aot = None if eager else plan.aot
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu.configure()  # before the first matmul: cuBLAS reads its workspace setting once
    check_machine(plan, device, dtype, compiled=aot is not None, kernel=not eager)
    check_memory(directory, plan, device)
    if plan.kernel:
        native.load(native.build() if eager else directory / plan.kernel.file)
    if plan.triton is not None and device.startswith("cuda") and not eager:  # its kernels, compiled: nothing compiles now
        shipped = sorted(f"{name} {entry.sha256}" for name, entry in plan.files.items()
                         if name.startswith(plan.triton.directory + "/"))
        gpu.use_compiled(directory / plan.triton.directory, "\n".join(shipped))
    runners = {}
    for role in ("target", "draft"):
        if not (directory / role).is_dir():
            continue
        runner = runners[role] = ModelRunner(load_model(directory / role, device, invariant=role == "target"),
                                             plan.cache_slots)
        runner.widths = tuple(plan.profile.compiled_widths(role))
        if aot is not None:
            runner.compiled = CompiledForward(directory / role / aot.package, runner.model, aot.min_width.get(role, 1))
    egt = plan.methods.get("egt")
    policy = egt.depth_policy if isinstance(egt, EGTParams) else None
    pred = DepthPredictor.load(directory / policy.file) if predictor and policy is not None and policy.file else None
    tables = {p.graft.file for p in plan.methods.values() if getattr(p, "graft", None) is not None} - {None}
    adjacency = AdjacencyTable.load(directory / tables.pop()) if tables else None
    tok = plan.tokenizer
    codec = TextCodec(directory / tok.file, tok.chat_prefix, tok.chat_suffix)
    forwards = ("compiled ahead of time" if aot is not None else
                "eager (--eager: kernels built from source)" if eager else
                f"eager (the compile left its compiled forwards out: {plan.aot_skipped})" if plan.aot_skipped else
                "eager (the artifact has no compiled forwards)")
    if device.startswith("cuda"):
        forwards += ", replayed as CUDA graphs (one per forward width)"
    return Decoder(
        runners["target"],
        runners.get("draft"),
        codec,
        methods=plan.methods,
        default_method=plan.method,
        eos_ids=frozenset(tok.eos_token_ids),
        plan=plan,
        forwards=forwards,
        predictor=pred,
        adjacency=adjacency,
    )
