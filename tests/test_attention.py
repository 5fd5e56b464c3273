"""The joint attention's kernels (mmldlm/model/attention.py): a batch with no padding takes no mask,
and model.attention=varlen attends over each text's real positions in the variable-length kernel's
segments, which gives every real position exactly what the masked attention gives it (forward and
gradients), padded or packed, with prefix tokens, several latent slots, and the last block's queries
of one stream alone.

The variable-length kernel itself is CUDA's (tests/test_cuda.py compares it there); here a kernel of
plain torch operations stands in for it (`kernel_on_segments`), keeping its contract: each segment
attends within itself, and the rows no segment covers are neither read nor written, forward or
backward (NaN here, so that a caller relying on them fails). The reordering, the segment bounds, the
zeroed padding and the way back are checked on a CPU, and their shapes follow the batch's shape alone."""

import pytest
import torch
from test_packing import LENGTHS, PAD_ID, batch, inputs, tiny_model

from mmldlm.model import attention
from mmldlm.model.mmdit import Packing

ATOL = 1e-5


class _UnwrittenGradient(torch.autograd.Function):
    """Identity forward; backward, NaN in the rows `inside` (T,) is False at: what a kernel leaves
    in a gradient it does not write."""

    @staticmethod
    def forward(ctx, x, inside):
        ctx.save_for_backward(inside)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad.where(inside[:, None, None], float("nan")), None


def kernel_on_segments(q, k, v, cu_q, cu_k, max_q, max_k):
    """The variable-length kernel's result, q (Tq, nh, hd), k and v (Tk, nh, hd) -> (Tq, nh, hd): each
    query of segment i attends to the keys of segment i; rows past the last segment are left NaN in
    the output and in the gradients of q, k and v. Static shapes (compiles as the model's code does)."""
    N = cu_q.numel() - 1
    assert cu_k.numel() == N + 1

    def segment_of(x, cu):
        return torch.searchsorted(cu[1:], torch.arange(x.shape[0], device=x.device, dtype=cu.dtype), right=True)

    seg_q, seg_k = segment_of(q, cu_q), segment_of(k, cu_k)
    in_q, in_k = seg_q < N, seg_k < N
    assert max_q >= 1 and max_k >= 1
    q, k, v = (_UnwrittenGradient.apply(x, inside) for x, inside in ((q, in_q), (k, in_k), (v, in_k)))
    # Queries outside every segment attend to every key, so that their (discarded) softmax is finite.
    mask = ((seg_q[:, None] == seg_k[None, :]) & in_k[None, :]) | ~in_q[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)
    return out.where(in_q[:, None, None], float("nan"))


def stand_in_for_the_varlen_kernel(monkeypatch, record: bool = True) -> list:
    """The CPU stands in for a CUDA device with the variable-length kernel (`kernel_on_segments`); with
    `record`, the calls' (rows, real positions of the queries, longest segment bound) are recorded
    (without, compiled blocks trace the stand-in itself)."""
    calls = []

    def recording(q, k, v, cu_q, cu_k, max_q, max_k):
        calls.append((q.shape[0], cu_q[-1], max_q))
        return kernel_on_segments(q, k, v, cu_q, cu_k, max_q, max_k)

    monkeypatch.setattr(attention, "varlen_supported", lambda device: True)
    monkeypatch.setattr(attention, "varlen_kernel", recording if record else kernel_on_segments)
    return calls


@pytest.fixture
def varlen_calls(monkeypatch):
    return stand_in_for_the_varlen_kernel(monkeypatch)


def outputs_and_grads(model, b, packed, text_head=True, latent_head=True):
    """The outputs at real positions and the parameters' gradients of a loss that reads them all."""
    model.zero_grad()
    rows = (torch.rand(b["tokens"].shape, generator=torch.Generator().manual_seed(3)) < 0.5) & b["pad_mask"]
    lengths = tuple(b["pad_mask"].sum(1).tolist())
    out = model(
        **inputs(b),
        text_rows=rows.flatten().nonzero().squeeze(1) if text_head else None,
        text_head=text_head,
        latent_head=latent_head,
        packing=Packing.from_batch(b) if packed else None,
        text_lengths=lengths,
    )
    real = [x for x in (out.text_logits, out.latent) if x is not None]
    sum(x.square().sum() for x in real).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return real, grads


@pytest.mark.parametrize("heads", ["both", "text", "latent"])
@pytest.mark.parametrize(
    "layout,overrides",
    [
        ("padded", {}),
        ("packed", {}),
        ("padded", {"num_prefix_tokens": 2}),
        ("packed", {"num_latents": 2}),
        ("one-wide-row", {}),
    ],
    ids=["padded", "packed", "prefix", "packed-two-latents", "one-wide-row"],
)
def test_attention_over_real_positions_alone_equals_the_masked_attention(varlen_calls, layout, overrides, heads):
    packed = layout != "padded"
    masked = tiny_model(attention="sdpa", **overrides)
    varlen = tiny_model(attention="varlen", **overrides)
    wide = {"rows": [1], "widths": [56]} if layout == "one-wide-row" else {}  # 8 texts in one row of 56
    b = batch(num_latents=masked.cfg.num_latents, packed=packed, **wide)
    flags = {"text_head": heads != "latent", "latent_head": heads != "text"}
    want, want_grads = outputs_and_grads(masked, b, packed, **flags)
    assert varlen_calls == []  # model.attention=sdpa keeps the mask
    got, got_grads = outputs_and_grads(varlen, b, packed, **flags)
    assert len(varlen_calls) == masked.cfg.num_blocks  # every block took the variable-length path
    for a, g in zip(want, got):
        torch.testing.assert_close(g, a, rtol=0, atol=ATOL)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=ATOL, msg=name)


def test_the_variable_length_kernels_segments_cover_the_real_positions_in_shapes_of_the_batchs_shape(
    varlen_calls,
):
    """Two padded batches of one shape and other lengths (the longest 16 and 9): the kernel gets every
    position of the rows (the rows' shape, not the real count, so one static graph and one CUDA graph
    serve both), its segments end at the real positions' count, and its longest-segment bound is the
    rows' width, not the batch's longest text."""
    model = tiny_model(attention="varlen")
    K, L = model.cfg.num_latents, model.cfg.max_seq_len
    seen = []
    for lengths in (LENGTHS.tolist(), [9, 1, 2, 3, 4, 5, 6, 7]):  # both padded to 16, as to a length bucket
        b = batch(lengths=lengths, packed=False)
        padding = L - b["tokens"].shape[1]
        b = {
            **b,
            "tokens": torch.nn.functional.pad(b["tokens"], (0, padding), value=PAD_ID),
            "pad_mask": torch.nn.functional.pad(b["pad_mask"], (0, padding), value=False),
        }
        varlen_calls.clear()
        outputs_and_grads(model, b, packed=False)
        assert [int(real) for _, real, _ in varlen_calls] == [sum(lengths) + len(lengths) * K] * model.cfg.num_blocks
        seen.append({(rows, bound) for rows, _, bound in varlen_calls})
    assert seen[0] == seen[1] == {(len(LENGTHS) * (L + K), L + K)}, seen


def test_a_batch_with_no_padding_attends_with_no_mask(monkeypatch):
    """Every text as long as the batch: SDPA gets no mask (on a GPU, the flash kernel); without the
    host's lengths the model cannot know it and keeps the mask."""
    masks = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    model = tiny_model()
    b = batch(lengths=[6, 6, 6], packed=False)
    x = inputs(b)
    unmasked = model(**x, text_lengths=(6, 6, 6))
    assert masks and all(m is None for m in masks)
    masks.clear()
    with_mask = model(**x)
    assert masks and all(m is not None for m in masks)
    for a, g in zip(with_mask, unmasked):
        torch.testing.assert_close(g, a, rtol=0, atol=ATOL)


def test_under_bf16_autocast_a_cpu_attends_in_fp32_and_returns_bf16():
    """torch's CPU flash kernel is several times slower in bf16 than in fp32 (docs/benchmarks.md): on a
    CPU, under bf16 autocast, every block's attention kernel reads fp32 q, k, v, forward and backward,
    and the block goes on in bf16; the outputs are those of the bf16 kernel within bf16's rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class KernelDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                self.seen.append((func.__name__, args[0].dtype))
            return func(*args, **(kwargs or {}))

    model = tiny_model(attention="sdpa")
    b = batch(packed=False)
    x = inputs(b)
    with torch.autocast("cpu", dtype=torch.bfloat16), KernelDtypes() as kernels:
        out = model(**x)
        out.text_logits.float().square().sum().backward()
    assert out.text_logits.dtype == torch.bfloat16
    forward = [dtype for name, dtype in kernels.seen if "backward" not in name]
    backward = [dtype for name, dtype in kernels.seen if "backward" in name]
    assert len(forward) == len(backward) == model.cfg.num_blocks
    assert set(forward) == set(backward) == {torch.float32}

    # The same step with the bf16 kernel (what autocast alone would run) agrees within bf16's rounding.
    want = model(**x).text_logits.detach()  # fp32 throughout: the reference of both
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(**x).text_logits.float()
        with attention.dispatch_as_on_a_gpu():  # the bf16 kernel
            bf16_kernel = model(**x).text_logits.float()
    assert (got - want).abs().max() <= (bf16_kernel - want).abs().max() * 1.5 + 1e-2


def test_every_block_but_the_last_takes_the_same_segments_in_every_mode(varlen_calls):
    """The variable-length kernel's segments of all queries go to every block, and those of the last
    block's queries (the text's or the latent's alone where one head is skipped) to the last alone:
    compiled, a block is one graph for every mode at a length, where a dictionary of segments that
    changed with the mode made torch 2.11's checkpoint guards compile three."""
    model = tiny_model(attention="varlen")
    b = batch(packed=True)
    taken = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: taken.append(sorted(args[3].segments)))
    for heads in ("both", "text", "latent"):
        taken.clear()
        outputs_and_grads(model, b, True, text_head=heads != "latent", latent_head=heads != "text")
        last = {"both": ["all"], "text": ["all", "text"], "latent": ["all", "latent"]}[heads]
        assert taken == [["all"]] * (len(model.blocks) - 1) + [last], heads


@pytest.mark.parametrize("packed", [False, True])
def test_the_mask_is_made_once_per_forward_not_once_per_block(packed):
    """SDPA turns a boolean mask into an additive one (a `where` over the whole mask) at every call:
    the forward builds the additive mask once, in the queries' dtype, so the blocks add no `where`
    (bf16 autocast, counted as a GPU dispatches); the outputs are those of the boolean mask."""
    import dataclasses

    from mmldlm.model import MultimodalMMDiT
    from mmldlm.tools.operations import OperationCounter

    b = batch(packed=packed)
    base = tiny_model()
    counts = {}
    for num_blocks in (2, 4):
        model = MultimodalMMDiT(dataclasses.replace(base.cfg, num_blocks=num_blocks), vocab_size=base.vocab_size)
        with attention.dispatch_as_on_a_gpu(), torch.autocast("cpu", dtype=torch.bfloat16), OperationCounter() as ops:
            model(**inputs(b))
        counts[num_blocks] = ops.counts.get("where", 0)
    assert counts[2] == counts[4], counts
    text_of = torch.tensor([[0, 0, -1, 0], [1, -1, -1, 1]])  # (R, S): two texts, padding -1
    made = attention.JointAttention.build("sdpa", text_of, 3, False, 2, 3, 0, 1, dtype=torch.bfloat16)
    assert made.kind == "mask" and made.mask.dtype == torch.bfloat16
    assert made.mask[:, 0, 0].tolist() == [[0, 0, float("-inf"), 0], [0, float("-inf"), float("-inf"), 0]]
    q, k, v = (torch.randn(2, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    boolean = attention.JointAttention("mask", 3, mask=(text_of >= 0)[:, None, None, :])
    torch.testing.assert_close(made(q, k, v), boolean(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_counted_as_a_gpu_dispatches_it_computes_what_torch_does(dtype):
    """QK-norm's RMSNorm: one fused operation forward and one backward on a CUDA device, about twenty
    on a CPU. Counted as on a GPU (`dispatch_as_on_a_gpu`), a CPU dispatches the two fused operations,
    and its values and gradients are torch's composed RMSNorm's."""
    from mmldlm.tools.operations import OperationCounter

    x = torch.randn(4, 6, 2, 2, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    expected = torch.nn.functional.rms_norm(x, (16,), eps=1e-6).to(dtype)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    with attention.dispatch_as_on_a_gpu(), OperationCounter() as ops:
        out = attention.rms_norm(x, 1e-6)
        (out_grad,) = torch.autograd.grad(out, x, grad)
    assert ops.counts == {"_fused_rms_norm": 1, "_fused_rms_norm_backward": 1}, ops.counts
    assert out.dtype == dtype and out_grad.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        out_grad, expected_grad, **({} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02})
    )
    # outside the counting, a CPU runs torch's composition itself
    with OperationCounter() as composed:
        attention.rms_norm(x, 1e-6)
    assert "_fused_rms_norm" not in composed.counts and composed.counts["rsqrt"] == 1


def test_rms_norm_runs_outside_autocast_in_the_activations_dtype(monkeypatch):
    """torch >= 2.12 puts rms_norm on CUDA autocast's fp32 list: under autocast a bf16 input would be
    copied to fp32 and its output cast back. QK-norm calls it with autocast off (the kernel's mean of
    squares is fp32 anyway) and returns the activations' dtype."""
    seen = []
    real = torch.nn.functional.rms_norm

    def recording(x, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "rms_norm", recording)
    x = torch.randn(3, 5, 2, 2, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention.rms_norm(x, 1e-6)
        assert torch.is_autocast_enabled("cpu")  # restored after the call
    assert seen == [(False, torch.bfloat16)] and out.dtype == torch.bfloat16
