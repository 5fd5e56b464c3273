"""The cluster a run of the older codebase moves to, as its tools report it, and the error every part of
`mmldlm migrate` raises for input it cannot read."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmldlm.errors import UserError
from mmldlm.tools.check import Environment
from mmldlm.wording import counted

H100_MIB = 81559  # nvidia-smi --query-gpu=memory.total of an 80 GB H100
H100_NAME = "NVIDIA H100 80GB HBM3"


class MigrateError(UserError):
    """An older config or launcher that cannot be read; the message names the file and what was expected."""


@dataclass
class Cluster:
    nnodes: int
    gpus_per_node: int
    gpu_memory_mib: int = H100_MIB  # as nvidia-smi reports it: what the older launcher compares
    cpus_per_node: int = 32
    gpu_name: str = H100_NAME
    # Variables the scheduler sets in the launcher's environment, given by the user (--env NAME=VALUE).
    environ: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def gpu_memory_gib(self) -> float:
        return self.gpu_memory_mib / 1024

    def words(self) -> str:
        return (
            f"{counted(self.nnodes, 'node')} x {counted(self.gpus_per_node, 'GPU')} ({self.gpu_name}, "
            f"{self.gpu_memory_mib} MiB), {counted(self.cpus_per_node, 'CPU')} per node"
        )

    def environment(self, environ: dict[str, str] | None = None, source: str = "the environment") -> Environment:
        """The cluster as `mmldlm check` sees a machine (its disk is not known here: check measures it there)."""
        return Environment(
            device="cuda",
            device_memory_gib=self.gpu_memory_gib,
            cpus=self.cpus_per_node,
            nproc_per_node=self.gpus_per_node,
            nnodes=self.nnodes,
            free_disk_gib=float("inf"),
            fused_adamw=True,
            native_bf16=True,
            environ=dict(environ or {}),
            environ_source=source,
        )
