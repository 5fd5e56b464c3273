"""The ATen operations a training step dispatches: the host's share of a step, which on a GPU is paid
per launch whatever a kernel's size. Counted under a dispatch mode, on any device (a CPU suffices:
within `dispatch_as_on_a_gpu` it dispatches what a CUDA device does where the two differ: no fp32
detour around bf16 attention, `mmldlm.model.attention.sdpa`, and QK-norm's RMSNorm as the two fused
operations a CUDA device runs, `mmldlm.model.attention.rms_norm`), for `scripts/step_operations.py`
and the tests that hold the count down.

A dispatch mode sees every operation, views and no-ops below it included, but runs compiled code
eagerly; `host_operations` counts what the host calls in a compiled step too: the outermost ATen
operations that torch.profiler records (a no-op `Tensor.to` included, which reaches no dispatch mode),
outside compiled code and called by it, and the compiled calls themselves."""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmldlm.model.attention import dispatch_as_on_a_gpu

# Operations that only describe a tensor anew (a view, a transpose, a detach): no kernel runs.
METADATA_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "detach",
        "unsqueeze",
        "squeeze",
        "expand",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "unbind",
        "alias",
        "permute",
        "as_strided",
    }
)


PACKAGE = Path(__file__).resolve().parents[1]  # mmldlm/
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


class OperationCounter(TorchDispatchMode):
    """ATen operations dispatched while it is entered, by name (the overload packet: 'mm', 'gelu').

    With `by_site`, also by the line of the package's code that caused each one (`sites`, keyed
    (site, name)): a forward operation at the innermost frame in mmldlm/ outside mmldlm/tools/, a
    backward one at that of the forward operation whose autograd node runs it, which autograd records
    only in anomaly mode (`step_operations` turns it on, without its NaN checks)."""

    def __init__(self, by_site: bool = False):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.sites: dict[tuple[str, str], int] | None = {} if by_site else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.sites is not None:
            key = (operation_site(torch._C._current_autograd_node()), name)
            self.sites[key] = self.sites.get(key, 0) + 1
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def kernels(self) -> int:
        """The operations that run a kernel (all but METADATA_OPS)."""
        return sum(n for name, n in self.counts.items() if name not in METADATA_OPS)


def operation_site(node) -> str:
    """'forward model/mmdit.py:178 qk_heads' (the innermost frame of the package, outside mmldlm/tools/,
    of the operation running now), or 'backward ...' (that of the forward operation whose autograd node
    `node` runs now; the node's name where anomaly mode recorded no traceback)."""
    if node is None:
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack()]
    else:
        recorded = node.metadata.get("traceback_")
        if recorded is None:
            return f"backward {node.name()}"
        found = (_FRAME.search(entry) for entry in recorded)
        frames = [(m["file"], int(m["line"]), m["name"]) for m in found if m is not None]
    phase = "forward" if node is None else "backward"
    for file, line, name in reversed(frames):
        if (where := _in_package(file)) is not None:
            return f"{phase} {where}:{line} {name}"
    return f"{phase} (outside mmldlm)"


@functools.cache
def _in_package(file: str) -> str | None:
    """`file` relative to mmldlm/ ('model/mmdit.py'), or None outside it or inside mmldlm/tools/."""
    path = Path(file).resolve()
    if path.is_relative_to(PACKAGE) and not path.is_relative_to(PACKAGE / "tools"):
        return str(path.relative_to(PACKAGE))
    return None


def step_operations(trainer, by_site: bool = False) -> OperationCounter:
    """The operations of one queued training step (`Trainer.run_step`, no record read), after one
    step of warm-up (first-step work: the optimizer's state, cached statistics); with `by_site`, also
    where in the package each comes from (`OperationCounter`: under anomaly mode, slower)."""
    with dispatch_as_on_a_gpu(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        trainer.train_step()
        anomaly = torch.autograd.detect_anomaly(check_nan=False) if by_site else contextlib.nullcontext()
        with anomaly, OperationCounter(by_site) as counter:
            trainer.run_step()
    return counter


@dataclass
class HostOperations:
    """The host's calls in one training step: `eager`, outermost ATen operations run outside compiled
    code, by name ('aten::mm'); `in_compiled`, those that compiled code calls (inductor's external
    kernels: matrix products, attention); `compiled_calls`, the compiled graphs run, forward
    ('Torch-Compiled Region') and backward ('CompiledFunctionBackward'); `fused_kernels`, the kernels
    inductor generated that the compiled graphs ran (on a CPU, counted where the graphs were compiled
    with `torch._inductor.config.cpp.enable_kernel_profile`, else 0): with the external ones, the
    kernels a GPU would launch in compiled code, or replay under CUDA graphs."""

    eager: collections.Counter = field(default_factory=collections.Counter)
    in_compiled: collections.Counter = field(default_factory=collections.Counter)
    compiled_calls: int = 0
    fused_kernels: int = 0

    @property
    def compiled_kernels(self) -> int:
        """Kernels run in compiled code: inductor's own, and the external ones that are not views."""
        external = sum(n for op, n in self.in_compiled.items() if op.removeprefix("aten::") not in METADATA_OPS)
        return self.fused_kernels + external

    @property
    def total(self) -> int:
        """Every host call: the ATen operations, eager or called by compiled code, and the compiled calls."""
        return sum(self.eager.values()) + sum(self.in_compiled.values()) + self.compiled_calls


_COMPILED = ("Torch-Compiled Region", "CompiledFunctionBackward")
_FUSED_KERNEL = re.compile(r"(?:graph_\d+_)?cpp_fused_")  # inductor's CPU kernels, under enable_kernel_profile


def host_operations(trainer, warmup: int = 2) -> HostOperations:
    """The host's calls in one queued training step (`Trainer.run_step`) after `warmup` steps (compiles,
    the optimizer's state), recorded by torch.profiler, compiled or not (`HostOperations`). An eager
    step dispatches as on a GPU (`dispatch_as_on_a_gpu`); a compiled one as it is, its graphs holding
    the CPU's detours fused (and the GPU's fused RMSNorm would break them)."""
    eager = not trainer.cfg.perf.compile
    with dispatch_as_on_a_gpu() if eager else contextlib.nullcontext():
        for _ in range(warmup):
            trainer.train_step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            trainer.run_step()
    return counted_calls(profile)


def counted_calls(profile) -> HostOperations:
    """`HostOperations` of a torch.profiler record."""
    found = HostOperations()
    for event in profile.events():
        if event.name.startswith(_COMPILED) and not _under(event, _COMPILED):
            found.compiled_calls += 1
        if _FUSED_KERNEL.match(event.name):
            found.fused_kernels += 1
        if event.name.startswith("aten::") and not _under(event, ("aten::",)):
            (found.in_compiled if _under(event, _COMPILED) else found.eager)[event.name] += 1
    return found


def _under(event, prefixes: tuple[str, ...]) -> bool:
    """Whether a profiler event runs within one whose name starts with one of `prefixes`."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False
