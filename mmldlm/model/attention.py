"""The joint attention's kernels: which one a batch reaches, and the layout each one needs.

Every block attends over the joint sequence [text; latent] of each row, S positions, of which some
are padding: the tail of a text shorter than the batch's longest, or, in packed rows
(data.packing), the row's unfilled end, and there several texts share a row and must not see each
other. Three exact ways to compute it, chosen once per forward by `JointAttention.build`:

- no padding at all (every text as long as the batch): SDPA with no mask, which on a GPU is the
  flash kernel (a mask rules flash out and leaves the slower memory-efficient kernel);
- `model.attention=varlen` on a CUDA device: every position of the rows reordered text by text
  (padding last) and handed to flash attention's variable-length kernel (`torch.nn.attention.varlen`),
  whose segments cover each text's real positions alone, so it computes no padding and no cross-text
  block; the outputs are put back in place (zero at padding);
- otherwise SDPA with a mask, additive (0 or -inf, in the queries' dtype, made once per forward):
  (B, 1, 1, S) for a padded batch, (R, 1, S, S) block-diagonal for packed rows (and
  `model.attention=explicit`, the baseline recipe, with the same masks as booleans).

Which is exact and which is fastest is measured on one GPU by scripts/attention_kernels.py.

The variable-length path's shapes are the rows' shapes alone: the reordering is built on the device
from each position's text (argsort of a key), the segments' bounds too, and the kernel's longest
segment is bounded by the rows' width and the model's longest text, not read from the batch. So it
never waits for the GPU, and batches of one shape (data.length_buckets, data.pack_rows) compile one
static graph and record one CUDA graph whatever their texts' lengths. The kernel reads and writes
only the positions its segments cover: padding, at the end of the order, is zeroed on the way in
(which also zeroes the gradient the kernel leaves unwritten there) and on the way out.

Layout: q, k, v (R, T, nh, hd) rows first, heads third, as the qkv projection leaves them; the
output likewise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mmldlm import baseline
from mmldlm.device import autocast_off, compute_dtype

try:  # flash attention's variable-length kernel; absent from older torch builds
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None


class Segments(NamedTuple):
    """Every position of a set of rows in the order a variable-length kernel reads them: text by text,
    then the padding, which no segment covers."""

    index: Tensor  # (T,) int64: the flat (rows * positions) index of each position, text by text, padding last
    cu_seqlens: Tensor  # (N + 1,) int32: where each text's positions start in `index`, and where the last ends
    inside: Tensor  # (T, 1, 1) bool: whether the position at that place in the order is a text's (not padding)
    max_len: int  # a bound on a text's positions (a host int from the shapes: the kernel's launch needs it)


def segments(text_of: Tensor, num_texts: int, max_len: int) -> Segments:
    """Segments of positions whose text is text_of (R, T) int64 in [0, num_texts), -1 = padding;
    `max_len` bounds a text's positions. Built on the device; every shape follows text_of's."""
    flat = text_of.flatten()  # (R * T,)
    n = flat.numel()
    position = torch.arange(n, device=flat.device)
    # Text by text, in position order within each; padding sorts after every text.
    key = torch.where(flat >= 0, flat * n + position, num_texts * n + position)
    index = torch.argsort(key)
    real = (flat >= 0).to(torch.int32)
    counts = torch.zeros(num_texts, dtype=torch.int32, device=flat.device).scatter_add_(0, flat.clamp_min(0), real)
    cu_seqlens = F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))  # (N + 1,)
    inside = (position < cu_seqlens[-1])[:, None, None]
    return Segments(index, cu_seqlens, inside, min(max_len, text_of.shape[1]))


def varlen_supported(device: torch.device) -> bool:
    """Whether the variable-length flash kernel can run on `device` (CUDA with a torch that has it)."""
    return varlen_attn is not None and device.type == "cuda"


class JointAttention(NamedTuple):
    """One forward's way of attending (the module docstring): no mask, a mask for SDPA, or the segments
    of the variable-length kernel. Calling it attends all queries, or only the text stream's or the
    latent stream's (the last block computes only the streams whose head is used).

    A tuple of tensors and constants, as every argument of a block is: torch.compile can then compile
    the blocks of the whole model's graph once and call that code for each (`nested_compile_region`
    reuses a region only for inputs it can compare)."""

    kind: str
    text_length: int = 0
    mask: Tensor | None = None
    segments: dict[str, Segments] | None = None

    @classmethod
    def build(
        cls,
        attention: str,
        text_of: Tensor | None,
        text_length: int,
        packed: bool,
        num_texts: int,
        max_text: int,
        num_prefix: int,
        num_latents: int,
        last_queries: str = "all",
        dropout_p: float = 0.0,
        dtype: torch.dtype = torch.float32,
    ) -> JointAttention:
        """The attention of rows whose joint positions [prefix; text; latent slots] belong to the texts
        text_of (R, S) int64 (-1 = padding; None: no padding at all), the first `text_length`
        positions of each row being the text stream's; `packed`: rows hold several texts each (else
        row b is text b); `num_texts`: how many texts (text_of's values are 0 .. num_texts - 1);
        `max_text`: the longest text in tokens the model takes (model.max_seq_len);
        each text adds `num_prefix` + `num_latents` positions of its own. `attention`: model.attention;
        `last_queries`: the queries of the last block ("all", "text" or "latent"), the others' are all;
        `dtype`: the queries' (autocast's where it is on). Everything is built here, before the blocks
        run (compiled blocks then see plain tensors); SDPA's mask is additive (0 or -inf) in `dtype`,
        which SDPA would otherwise make of a boolean one in every block (one more kernel each, over the
        (R, 1, S, S) mask of packed rows)."""
        if text_of is None:
            return cls("explicit" if attention == "explicit" else "dense", text_length)
        if packed:  # block-diagonal (R, 1, S, S); padding attends among itself, so no query is left without keys
            mask = text_of[:, None, :, None] == text_of[:, None, None, :]
        else:
            mask = (text_of >= 0)[:, None, None, :]  # (R, 1, 1, S)
        usable = attention == "varlen" and dropout_p == 0.0 and varlen_supported(text_of.device)
        if not usable:
            if attention == "explicit":  # the baseline recipe fills its scores where the mask is False
                return cls("explicit", text_length, mask=mask)
            additive = torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)
            return cls("mask", text_length, mask=additive)
        P, K = num_prefix, num_latents
        longest = {"all": max_text + P + K, "text": max_text + P, "latent": K}  # a text's positions in each set
        parts = {"all": text_of, "text": text_of[:, :text_length], "latent": text_of[:, text_length:]}
        built = {queries: segments(parts[queries], num_texts, longest[queries]) for queries in {"all", last_queries}}
        return cls("varlen", text_length, segments=built)

    def all_queries(self) -> JointAttention:
        """This attention with the segments of all queries alone: what every block but the last takes,
        the same in every mode. A compiled block is then one graph for all modes at a length: torch
        2.11's checkpoint guards every entry of its inputs, and a block's graph of one mode failed on
        another mode's last-block segments (three graphs a length where one serves)."""
        if self.segments is None or len(self.segments) == 1:
            return self
        return self._replace(segments={"all": self.segments["all"]})

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, queries: str = "all", dropout_p: float = 0.0) -> Tensor:
        """q (R, Sq, nh, hd) of the query set `queries`, k and v (R, S, nh, hd) -> (R, Sq, nh, hd)."""
        if self.kind == "varlen":
            return self._varlen(q, k, v, queries)
        mask = self.mask
        if mask is not None and mask.shape[2] > 1 and queries != "all":  # packed: the rows of the queries asked for
            mask = mask[:, :, : self.text_length] if queries == "text" else mask[:, :, self.text_length :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (R, nh, T, hd): views
        if torch.compiler.is_compiling():
            # Queries and keys are every other slice of one concatenation: with the length dynamic,
            # inductor (torch 2.13, CPU) saved them for the attention's backward with the strides of
            # the first length it compiled, and the first backward at another length stopped on its
            # stride assertion. Eager dispatch keeps the views (no copies).
            q, k = q.contiguous(), k.contiguous()
        if self.kind == "explicit":  # baseline recipe
            return baseline.explicit_attention(q, k, v, mask, dropout_p).transpose(1, 2)
        return sdpa(q, k, v, mask, dropout_p).transpose(1, 2)

    def _varlen(self, q: Tensor, k: Tensor, v: Tensor, queries: str) -> Tensor:
        R, Sq, nh, hd = q.shape
        keys, rows = self.segments["all"], self.segments[queries]
        # In the kernel's order, padding last and zeroed: the kernel neither reads nor writes the rows no
        # segment covers, so the zero also stands for the gradient it leaves unwritten there.
        q_all = q.reshape(R * Sq, nh, hd).index_select(0, rows.index).where(rows.inside, 0.0)  # (Tq, nh, hd)
        k_all = k.reshape(-1, nh, hd).index_select(0, keys.index).where(keys.inside, 0.0)  # (Tk, nh, hd)
        v_all = v.reshape(-1, nh, hd).index_select(0, keys.index).where(keys.inside, 0.0)
        out = varlen_kernel(q_all, k_all, v_all, rows.cu_seqlens, keys.cu_seqlens, rows.max_len, keys.max_len)
        # Padding queries get zero: their outputs reach no loss, and no real position attends to them.
        out = out.where(rows.inside, 0.0)
        # `index` is a permutation of every position: each row of the result is written, none left to fill
        return torch.empty_like(out).index_copy(0, rows.index, out).view(R, Sq, nh, hd)


_cpu_detour = True  # `sdpa` attends in fp32 on a CPU, `rms_norm` is torch's; off inside `dispatch_as_on_a_gpu`


@contextlib.contextmanager
def dispatch_as_on_a_gpu() -> Iterator[None]:
    """Within it, `sdpa` and `rms_norm` on a CPU dispatch what they dispatch on a GPU (no fp32 detour;
    RMSNorm's fused operations): for counting a GPU step's operations on a CPU
    (mmldlm/tools/operations.py)."""
    global _cpu_detour
    before, _cpu_detour = _cpu_detour, False
    try:
        yield
    finally:
        _cpu_detour = before


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """F.scaled_dot_product_attention of q, k, v (R, nh, T, hd). On a CPU, under bf16 autocast or for
    inputs below fp32, the kernel runs in fp32 and the output is returned in the dtype it would have had:
    torch's CPU flash kernel is 2-5x slower in bf16 than in fp32, forward and backward, at the main
    job's short texts (2x at 66 positions; measured on avx512_bf16 without AMX), and autocast would
    cast fp32 inputs back to bf16, so it is off around the call (docs/benchmarks.md: the main job's
    step about 15% faster under bf16 autocast)."""
    dtype = compute_dtype(q)
    if q.device.type != "cpu" or dtype == torch.float32 or not _cpu_detour:
        if mask is not None and mask.is_floating_point() and mask.dtype != dtype:
            mask = mask.to(dtype)  # an additive mask built for another dtype than the queries'
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if mask is not None and mask.is_floating_point():
        mask = mask.float()
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p)
    return out.to(dtype)


def rms_norm(x: Tensor, eps: float) -> Tensor:
    """F.rms_norm of x over its last dimension, no gain, in x's dtype (its mean of squares in fp32
    whatever x's dtype). Outside autocast: since torch 2.12 CUDA autocast casts rms_norm's input to fp32,
    a full-size fp32 copy and a cast back around a kernel that accumulates in fp32 anyway.

    On a CUDA device F.rms_norm is one fused kernel forward and one backward (`_fused_rms_norm` and its
    backward); on a CPU torch composes it of seven operations forward and about fifteen backward.
    Within `dispatch_as_on_a_gpu` a CPU dispatches the two fused operations as a GPU does (each still
    computed by torch's composition), so that counted operations are a GPU's."""
    device = x.device.type
    with autocast_off(device):
        if device != "cpu" or _cpu_detour:
            return F.rms_norm(x, (x.shape[-1],), eps=eps)
        return _FusedRMSNorm.apply(x, eps)


class _FusedRMSNorm(torch.autograd.Function):
    """`rms_norm` as a GPU dispatches it: `_fused_rms_norm` forward, `_fused_rms_norm_backward` backward."""

    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():  # the composite would otherwise decompose before dispatch
            out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)
        ctx.save_for_backward(x, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        x, rstd = ctx.saved_tensors
        _cpu_rms_norm_backward()
        grad_x, _ = torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, None, [True, False])
        return grad_x, None


@functools.cache
def _cpu_rms_norm_backward() -> torch.library.Library | None:
    """Give `aten::_fused_rms_norm_backward` a CPU kernel, once: torch's own decomposition of it (torch
    registers the op for CUDA and a few other devices only). The registration lives as long as the
    library object returned (kept by the cache)."""
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm_backward", "CPU"):
        return None
    from torch._decomp import decomposition_table

    library = torch.library.Library("aten", "IMPL")
    op = torch.ops.aten._fused_rms_norm_backward.default
    library.impl("_fused_rms_norm_backward", decomposition_table[op], "CPU")
    return library


def varlen_kernel(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> Tensor:
    """Flash attention's variable-length kernel: q (Tq, nh, hd), k and v (Tk, nh, hd) -> (Tq, nh, hd)."""
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k)
