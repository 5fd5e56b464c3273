"""Which attention kernel each kind of batch reaches, and what it costs: forward + backward of one
joint attention at a given shape (default: the older codebase's, 16 heads of 64, 2048 text positions
plus 1 latent slot, micro-batch 4), bf16 on a GPU.

    python scripts/attention_kernels.py [--batch 4] [--heads 16] [--head-dim 64] [--length 2048] [--latents 1]

Cases: SDPA without a mask (a batch with no padding), SDPA with the (B, 1, 1, S) key mask of a padded
batch (the same mask in every call, and a new one of the same shape in each, as in training with
data.length_buckets), SDPA with a packed batch's block-diagonal (B, 1, S, S) mask, and FlexAttention
with the block masks of the padded and packed batches. For each SDPA case every backend is tried alone: the one that
refuses says why (torch's own warning), and the default's time is next to each backend's. Medians of
--iters timed calls after --warmup, with CUDA events; on a CPU it runs at the size given (seconds at
tiny shapes) so that every path is exercised before a lease.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup: int, iters: int, cuda: bool) -> float:
    """Median milliseconds of fn() (forward + backward)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def varlen_rows(q, k, v, grad, keep, doc, args, cuda: bool) -> list[str]:
    """The padded and packed batches through the model's own path (model.attention=varlen): the rows'
    positions reordered text by text, flash attention's variable-length kernel over the real ones, the
    outputs put back in place."""
    from mmldlm.model.attention import JointAttention, varlen_supported

    if not varlen_supported(q.device):
        return ["| real positions | varlen | n/a | no variable-length kernel on this device |"]
    B, L, K = args.batch, args.length, args.latents
    lengths = keep[:, :L].sum(1).tolist()
    padded_of = torch.where(keep, torch.arange(B, device=keep.device)[:, None], -1)
    rows = []
    for case, text_of, packed, lens in (
        ("padded: real positions", padded_of, False, lengths),
        ("packed: real positions", doc[None].expand(B, -1), True, None),
    ):
        if packed:  # each row the same texts of doc_len tokens: B * docs texts in all
            docs = int(doc.max()) + 1
            text_of = torch.where(doc[None] >= 0, doc[None] + docs * torch.arange(B, device=doc.device)[:, None], -1)
            lens = [int((doc[:L] == d).sum()) for d in range(docs)] * B
        attention = JointAttention.build("varlen", text_of, L, packed, len(lens), L, 0, K)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        g = grad.transpose(1, 2)

        def fn(attention=attention, qt=qt, kt=kt, vt=vt, g=g):
            attention(qt, kt, vt).backward(g)

        ms = timed(fn, args.warmup, args.iters, cuda)
        rows.append(f"| {case} | varlen | {ms:.3f} | {sum(lens) + len(lens) * K} real positions |")
    return rows


def refusal(caught: list, backend: str, err: Exception) -> str:
    """Why SDPA refused `backend`: torch's warning about that backend (it warns about each one it
    skipped, the disabled ones too), else the error."""
    words = {"flash_attention": "flash", "efficient_attention": "memory efficient", "cudnn_attention": "cudnn"}
    messages = [" ".join(str(w.message).split()) for w in caught]
    own = [m for m in messages if words.get(backend, backend) in m.lower() and "runtime disabled" not in m]
    return ((own or messages or [str(err).splitlines()[0]])[0])[:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048, help="text positions of the padded batch")
    parser.add_argument("--latents", type=int, default=1, help="latent slots K joined to the text")
    parser.add_argument("--real", type=float, default=0.66, help="share of real positions in a padded batch")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    B, nh, hd, L, K = args.batch, args.heads, args.head_dim, args.length, args.latents
    S = L + K
    g = torch.Generator().manual_seed(0)

    def qkv():
        return [torch.randn(B, nh, S, hd, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]

    q, k, v = qkv()
    grad = torch.randn(B, nh, S, hd, generator=g).to(device, dtype)
    # A padded batch: row b has lengths spread around the real share; the latent slots always take part.
    lengths = torch.linspace(args.real * 0.5, 1.0, B).mul(L).long().clamp(1, L)
    lengths[-1] = L
    keep = torch.cat([torch.arange(L)[None] < lengths[:, None], torch.ones(B, K, dtype=torch.bool)], 1).to(device)
    key_mask = keep[:, None, None, :]  # (B, 1, 1, S)
    # A packed batch: each row holds texts of about L / 3 tokens end to end, each with its own K slots.
    doc_len = max(1, L // 3)
    text_doc = torch.arange(L) // doc_len
    docs = int(text_doc.max()) + 1
    latent_doc = torch.arange(docs).repeat_interleave(K)[: max(0, S - L)]
    if latent_doc.numel() < S - L:
        latent_doc = torch.cat([latent_doc, torch.full((S - L - latent_doc.numel(),), -1)])
    doc = torch.cat([text_doc, latent_doc]).to(device)  # (S,)
    block_mask = (doc[:, None] == doc[None, :])[None, None].expand(B, 1, S, S)

    real_tokens = int(keep.sum())
    lines = [
        f"# attention kernels: B={B} heads={nh}x{hd} S={S} (L={L} + K={K}) {dtype} on "
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}",
        f"padded batch: {real_tokens / (B * S):.0%} of key positions real; packed: texts of {doc_len} positions",
        "",
        "| case | backend | fwd+bwd ms | note |",
        "|---|---|---|---|",
    ]

    def sdpa_call(mask):
        def fn():
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            y.backward(grad)

        return fn

    backends = [
        None,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ]
    for case, mask in (("no mask", None), ("padded: key mask", key_mask), ("packed: block-diagonal mask", block_mask)):
        for backend in backends:
            name = "default" if backend is None else backend.name.lower()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if backend is None:
                        ms = timed(sdpa_call(mask), args.warmup, args.iters, cuda)
                    else:
                        with sdpa_kernel([backend]):
                            ms = timed(sdpa_call(mask), args.warmup, args.iters, cuda)
                lines.append(f"| {case} | {name} | {ms:.3f} | |")
            except RuntimeError as err:
                lines.append(f"| {case} | {name} | refused | {refusal(caught, name, err)} |")
            q.grad = k.grad = v.grad = None

    # Training's case: each batch brings a new key mask of the same shape (data.length_buckets): does a
    # backend's per-call cost stay at the fixed mask's? (cuDNN rebuilt its execution plan per mask in
    # training on batches of every length.) The mask is made on the device inside each call.
    positions = torch.arange(S, device=device)

    def fresh_mask_call():
        lengths = torch.randint(max(1, L // 2), L + 1, (B, 1), device=device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=((positions < lengths) | (positions >= L))[:, None, None])
        y.backward(grad)

    for backend in (None, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        name = "default" if backend is None else backend.name.lower()
        try:
            with (
                warnings.catch_warnings(record=True) as caught,
                sdpa_kernel(backends[1:] if backend is None else [backend]),
            ):
                warnings.simplefilter("always")
                ms = timed(fresh_mask_call, args.warmup, args.iters, cuda)
            lines.append(f"| padded: a new key mask each call | {name} | {ms:.3f} | the mask made in the call |")
        except RuntimeError as err:
            lines.append(f"| padded: a new key mask each call | {name} | refused | {refusal(caught, name, err)} |")
        q.grad = k.grad = v.grad = None

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        padded_keep = keep

        def padded_mod(b, h, qi, ki):
            return padded_keep[b, ki]

        def packed_mod(b, h, qi, ki):
            return doc[qi] == doc[ki]

        for case, mod in (("padded: flex block mask", padded_mod), ("packed: flex block mask", packed_mod)):
            bm = create_block_mask(mod, B, None, S, S, device=str(device))

            def fn(bm=bm):
                y = flex(q, k, v, block_mask=bm)
                y.backward(grad)

            started = time.perf_counter()
            fn()
            compile_s = time.perf_counter() - started
            q.grad = k.grad = v.grad = None
            ms = timed(fn, args.warmup, args.iters, cuda)
            note = f"first call {compile_s:.1f} s; blocks {bm.sparsity():.0f}% sparse"
            lines.append(f"| {case} | flex_attention | {ms:.3f} | {note} |")
    except Exception as err:  # noqa: BLE001 - a report line, whatever stopped FlexAttention here
        lines.append(f"| flex | flex_attention | not run | {type(err).__name__}: {str(err).splitlines()[0][:200]} |")

    lines += varlen_rows(q, k, v, grad, keep, doc, args, cuda)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
