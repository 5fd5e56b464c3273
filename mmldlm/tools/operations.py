"""The ATen operations a training step dispatches: the host's share of a step, which on a GPU is paid
per launch whatever a kernel's size. Counted under a dispatch mode, on any device (a CPU suffices:
within `dispatch_as_on_a_gpu` it dispatches what a CUDA device does where the two differ: no fp32
detour around bf16 attention, `mmldlm.model.attention.sdpa`, and QK-norm's RMSNorm as the two fused
operations a CUDA device runs, `mmldlm.model.attention.rms_norm`), for `scripts/step_operations.py`
and the tests that hold the count down."""

from __future__ import annotations

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


class OperationCounter(TorchDispatchMode):
    """ATen operations dispatched while it is entered, by name (the overload packet: 'mm', 'gelu')."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def kernels(self) -> int:
        """The operations that run a kernel (all but METADATA_OPS)."""
        return sum(n for name, n in self.counts.items() if name not in METADATA_OPS)


def step_operations(trainer) -> OperationCounter:
    """The operations of one queued training step (`Trainer.run_step`, no record read), after one
    step of warm-up (first-step work: the optimizer's state, cached statistics)."""
    with dispatch_as_on_a_gpu():
        trainer.train_step()
        with OperationCounter() as counter:
            trainer.run_step()
    return counter
