"""The text head and its loss, forward + backward, two ways: the head's logits then the SUBS
cross-entropy (`subs_cross_entropy`), and the two fused chunk by chunk of rows
(`subs_linear_cross_entropy`, perf.fused_text_loss). Default shape: the older codebase's at micro-batch
8 (about 5,300 masked positions of 1,024 wide, a vocabulary of 30,522), bf16 on a GPU.

    python scripts/text_loss.py [--rows 5300] [--hidden 1024] [--vocab 30522] [--texts 8]

Prints, per way, the median milliseconds of --iters calls after --warmup (CUDA events on a GPU) and
the peak memory above what was allocated before the call (on a GPU the allocator's peak; on a CPU the
operations' outputs alive together, counted under a dispatch mode). The vocabulary prior's (texts, V)
table is added to the logits, as the model does with model.vocab_prior.
"""

from __future__ import annotations

import argparse
import sys
import weakref

import torch
from attention_kernels import timed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The most bytes of operation outputs alive at once while it is entered (a CPU's peak)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t._base is None and t.untyped_storage().nbytes():
                size = t.untyped_storage().nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, size)
        return out

    def _freed(self, size: int) -> None:
        self.live -= size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=5300, help="masked positions N")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--texts", type=int, default=8, help="rows of the vocabulary prior's table")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)

    from mmldlm.diffusion.masked import subs_cross_entropy, subs_linear_cross_entropy

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    N, H, V = args.rows, args.hidden, args.vocab
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(N, H, device=device, generator=g, requires_grad=True)  # the head's input, float32
    weight = (0.02 * torch.randn(V, H, device=device, generator=g)).requires_grad_()
    prior = torch.randn(args.texts, V, device=device, generator=g, requires_grad=True)
    doc = torch.randint(0, args.texts, (N,), device=device, generator=g)
    targets = torch.randint(1, V, (N,), device=device, generator=g)
    row_weights = torch.ones(N, device=device)

    def unfused():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = torch.nn.functional.linear(x, weight)
            logits = logits + prior.index_select(0, doc).to(logits.dtype)
        ce, _ = subs_cross_entropy(logits, targets, 0)
        (ce * row_weights).sum().backward()

    def fused():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = subs_linear_cross_entropy(x, weight, targets, row_weights, 0, prior=prior, doc=doc)
        loss.weighted.backward()

    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, N {N}, H {H}, V {V}, bf16 autocast")
    print("| way | ms (median) | peak MiB above the inputs |")
    print("|---|---|---|")
    for name, fn in (("head, then the loss", unfused), ("fused, chunk by chunk", fused)):
        ms = timed(fn, args.warmup, args.iters, cuda)
        for t in (x, weight, prior):
            t.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            with LiveBytes() as live:
                fn()
            peak = live.peak
        for t in (x, weight, prior):
            t.grad = None
        print(f"| {name} | {ms:.2f} | {peak / 2**20:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
