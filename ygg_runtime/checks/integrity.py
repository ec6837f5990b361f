"""Is this artifact the one that was compiled, and can this machine run it? (docs/design.md, "The artifact")

Every file's sha256 is in plan.yaml. Hashing a few GB of weights takes seconds, so a file whose
size and modification time are those of its last successful check is not hashed again (the record
lives in the user cache, keyed by the file's absolute path). The machine checks cover what the
compiled code depends on: device, dtype, torch version and the CPU instructions it was built for,
and whether its weights fit in the memory left.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from ygg_runtime.backend import gpu_identity as gpu
from ygg_runtime.errors import YggError
from ygg_runtime.files import cache_dir, sha256_of, size, write_atomic
from ygg_runtime.machine import CPUInfo, GPUInfo, cpu_flags
from ygg_runtime.schema.plan import FileEntry, Plan


def file_entry(path: Path) -> FileEntry:
    """What plan.yaml records of one artifact file."""
    return FileEntry(sha256_of([path]), path.stat().st_size)


def verify_files(directory: Path, files: dict[str, FileEntry], rehash: bool = False) -> None:
    """Refuse an artifact with a missing or changed file (one line naming it); rehash=True hashes
    every file even when its size and mtime match the last successful check."""
    record_path = cache_dir() / "verified.json"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}
    changed = False
    for rel, meta in files.items():
        f = directory / rel
        if not f.is_file():
            raise YggError(f"artifact file {rel} is missing from {directory}: recompile")
        st = f.stat()
        if st.st_size != meta.bytes:
            raise YggError(f"artifact file {rel} has changed since compile (size differs): recompile")
        key, stamp = str(f.resolve()), [st.st_size, st.st_mtime_ns, meta.sha256]
        if record.get(key) == stamp and not rehash:
            continue
        if sha256_of([f]) != meta.sha256:
            raise YggError(f"artifact file {rel} has changed since compile (sha256 differs): recompile")
        record[key], changed = stamp, True
    if changed:
        try:  # best effort: a read-only cache only costs the next run a rehash
            record_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(record_path, json.dumps(record).encode())
        except OSError:
            pass


def cpu_info() -> CPUInfo:
    """This CPU as plan.yaml records the compiling one: its model name, torch's thread count, and
    its vector instruction flags (the ones that decide which kernels run)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
                break
    except OSError:
        pass
    isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return CPUInfo(model, torch.get_num_threads(), isa)


def check_machine(plan: Plan, device: str, dtype: str | None, compiled: bool, kernel: bool = True) -> None:
    """Refuse, in one line, to run an artifact on a device, dtype, torch, CPU or GPU it was not
    built for. compiled / kernel: whether its ahead-of-time graphs / its kernels' library are about
    to be loaded. The torch, CPU and GPU checks apply to that native code only (`--eager` loads
    neither, so it runs on any torch, CPU and GPU; its exactness verdict then says where it was
    checked)."""
    kind, built = device.split(":")[0], plan.device.split(":")[0]
    if kind != built:
        raise YggError(f"artifact was compiled for {plan.device}, not {device}: recompile with --device {device}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise YggError(f"artifact was compiled for {plan.device} but CUDA is not available here")
    if dtype is not None and dtype != plan.dtype:
        raise YggError(f"artifact holds {plan.dtype} weights, not {dtype}: recompile with --dtype {dtype}")
    if kind == "cuda" and compiled and plan.aot and plan.gpu is not None:
        check_gpu(plan.gpu, gpu.info(device))
    native = [part for part in ((plan.aot if compiled else None), (plan.kernel if kernel else None)) if part]
    if not native:
        return
    hint = " (or run with --eager)"
    if plan.torch_version != str(torch.__version__):
        raise YggError(f"artifact was compiled with torch {plan.torch_version} but this is torch {torch.__version__}: "
                       f"recompile{hint}")
    have = cpu_flags()
    lacking = sorted({f for part in native for f in part.cpu_flags if have and f not in have})
    if lacking:
        raise YggError(f"this CPU lacks {', '.join(lacking)}, which the artifact's compiled code uses: "
                       f"recompile on this machine{hint}")


def check_gpu(built: GPUInfo, here: GPUInfo) -> None:
    """Refuse an artifact compiled for another kind of GPU: its compiled code is built for that
    GPU's compute capability, and its plan (measured latency) and exactness check are that GPU's."""
    if (built.name, built.capability) != (here.name, here.capability):
        raise YggError(f"artifact was compiled for the GPU {built.label()}, and this is {here.label()}: recompile "
                       "with --device cuda on this GPU (--calibration-from the artifact reuses its calibration), "
                       "or run it with --eager")


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes a new allocation on `device` can still get. A GPU's: its free memory. The host's:
    /proc/meminfo's MemAvailable plus free swap, capped by the cgroup's limit (a container's
    memory.max); None where neither can be read."""
    if torch.device(device).type == "cuda":
        return gpu.free_memory(device)
    have = None
    try:
        info = {k: int(v.split()[0]) * 1024 for k, _, v in
                (line.partition(":") for line in Path("/proc/meminfo").read_text().splitlines()) if v.strip()}
        have = info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = max(0, int(limit) - used)
            have = room if have is None else min(have, room)
    except (OSError, ValueError):
        pass
    return have


def check_memory(directory: Path, plan: Plan, device: str = "cpu") -> None:
    """Refuse, before reading them, weights that cannot fit: the models' files are read whole into
    the device's memory (on a CPU the kernel's OOM killer would otherwise end the run with no
    message; on a GPU the allocation fails halfway through loading)."""
    need = sum(e.bytes for f, e in plan.files.items() if f.endswith("/model.safetensors"))  # the models' weights
    have = available_memory(device)
    if have is not None and need > have:
        where = f"free on {device}" if torch.device(device).type == "cuda" else "of memory is available"
        raise YggError(f"artifact {directory} holds {size(need)} of weights and {size(have)} {where}: free memory, "
                       "or compile smaller weights (--weights int8/int4 on a CPU)")
