"""The machines an artifact is built for, as the plan records them: the CPU (its model, threads and
vector instruction set) and, for a --device cuda artifact, the GPU. Their own module, so the
backends that describe their device (`ygg_runtime.backend.gpu_identity.info`) and the plan schema that
records it both import them, and no backend imports the plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class CPUInfo:
    model: str
    threads: int
    isa: list[str]  # vector instruction flags of the compiling CPU (what /proc/cpuinfo lists)


@dataclass
class GPUInfo:
    """The GPU an artifact was compiled on (`ygg_runtime.backend.gpu_identity.info`): its compiled code, profiles
    and exactness check are that GPU's."""
    name: str
    capability: str  # compute capability, "9.0"
    memory: int  # bytes
    cuda: str  # the CUDA torch was built with
    cublas: str
    driver: str

    def label(self) -> str:
        return f"{self.name} (compute capability {self.capability})"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is no /proc)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return set()
