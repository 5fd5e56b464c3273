"""The process set-up of the sampling commands: freed large blocks are reused, not faulted in again;
the autocast questions the model asks inside compiled code."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# Allocates and frees a 256 MiB tensor 8 times (a sampler's step does the like) and prints the minor
# page faults of each allocation.
REALLOCATE = """
import json, resource, sys, torch
from mmldlm.device import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(32 * 2**20, dtype=torch.float64)  # every page written
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([kept, faults]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator setting is glibc's")
def test_keep_freed_memory_reuses_freed_blocks_instead_of_faulting_them_in_at_every_step():
    root = str(Path(__file__).resolve().parent.parent)

    def faults(mode: str) -> tuple[bool, list[int]]:
        out = subprocess.run([sys.executable, "-c", REALLOCATE, mode], cwd=root, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return tuple(json.loads(out.stdout))

    pages = 256 * 2**20 // 4096
    kept, plain = faults("default")
    assert not kept and all(f > pages // 2 for f in plain)  # glibc unmaps each block: every page faults again
    kept, reused = faults("keep")
    # the heap settles within the first few blocks (where they land in it), then reuses the freed memory
    assert kept and all(f < pages // 20 for f in reused[-4:]), reused


def test_compiled_code_asks_torch_nothing_about_autocast_on_a_cpu_or_cuda_device(monkeypatch):
    """torch.compile before torch 2.13 cannot trace `torch.amp.is_autocast_available` and breaks the
    graph of every block that asks: CPU and CUDA, which always have autocast, are answered without it.
    Another device type still asks torch."""
    import torch

    from mmldlm.device import autocast_off, compute_dtype, has_autocast

    asked = []
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device: asked.append(device) or False)
    assert has_autocast("cpu") and has_autocast("cuda") and not asked
    x = torch.ones(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16
        with autocast_off("cpu"):
            assert compute_dtype(x) == torch.float32
    assert compute_dtype(x) == torch.float32 and not asked
    assert not has_autocast("meta") and asked == ["meta"]
