"""MultimodalMMDiT: one dual-stream transformer over text tokens and K sentence latents.

The two modalities keep separate weights (SD3's MMDiT, Esser et al. 2024, sec. 3.3) and meet in a
joint attention over the concatenated sequence [text; latent], so the text can read the latent and
the latent can read the text in every block. Both streams are conditioned on one vector
c = MLP_text(emb(t_text)) + MLP_latent(emb(t_latent)) through adaLN-Zero (DiT, Peebles & Xie 2023,
sec. 3.2): every block starts as the identity and the heads start at zero.

Shapes: B batch, L text length, K latent slots, D latent dim, H hidden size, nh heads, hd head dim,
S = L + K joint length, V vocabulary.

The model knows nothing of DDP, FSDP, compile, activation checkpointing or precision: the trainer
wraps each entry of `model.blocks` as it sees fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mmldlm.config import ConfigError, ModelConfig
from mmldlm.device import autocast_off, compute_dtype
from mmldlm.diffusion.masked import TextLoss, TextTargets, subs_linear_cross_entropy
from mmldlm.model.attention import JointAttention, rms_norm

# --------------------------------------------------------------------------------------------------
# Positions and timesteps.


def rope_angles(seq_len: int, head_dim: int, device: torch.device, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """The rotary tables of positions 0..seq_len-1 (RoFormer, Su et al. 2021, eq. 34), (L, hd) each:
    cos(theta_j) and (-sin(theta_j), sin(theta_j)) for the pairs (x_j, x_{j + hd/2}), j < hd/2.

    Computed on the fly in float32 rather than stored as a buffer: it costs O(L * hd) and leaves the
    model with no buffers to lose when it is built on the meta device or cast to another dtype."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (L, hd/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x_j, x_{j + hd/2}) of x (B, L, nh, hd) by the angles of each position:
    (x_j cos - x_{j+hd/2} sin, x_{j+hd/2} cos + x_j sin). cos and sin are `rope_angles`' tables rows
    of the positions, (L, 1, hd) or (B, L, 1, hd), in x's dtype: three kernels, no copy in float32
    (under bf16 autocast, rotary embeddings in bf16 as in current LMs)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class TimestepEmbedder(nn.Module):
    """t in [0, 1] (B,) -> sinusoidal features -> MLP -> (B, H), as DiT's TimestepEmbedder."""

    def __init__(self, freq_dim: int, hidden_size: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        # t is scaled to [0, 1000], the range of step indices the sinusoid periods were chosen for
        # (DDPM/DiT): with t in [0, 1] most features would be nearly constant over the whole range.
        args = (1000.0 * t.float())[:, None] * freqs[None, :]  # (B, half)
        features = torch.cat([args.cos(), args.sin()], dim=-1)  # (B, freq_dim)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


# --------------------------------------------------------------------------------------------------
# The block.


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: x * scale + shift; x (B, T, H) normalised elsewhere; shift, scale (B, 1, H) from each
    row's conditioning vector, or (B, T, H) per position in packed rows (`per_position`). `scale` is
    DiT's 1 + scale: the modulation's bias starts at 1 there, not 0 (`AdaLN`). (Not addcmul: its
    backward multiplies by its `value` factor, 1 here, in two more kernels.)"""
    return x * scale + shift


def per_position(mod: Sequence[Tensor], doc: Tensor | None) -> Sequence[Tensor]:
    """One stream's adaLN tensors of a block, each (N, 1, H) with one row per text, shaped for
    `modulate` and the gates: as they are when row b of the batch is text b (doc None), or gathered by
    the text each position of a packed row belongs to, (R, T, H) for doc (R, T) (padding: any valid text)."""
    if doc is None:
        return mod
    # Two gathers where one per tensor made six: the shifts, which the backward does not keep, apart
    # from the scales and gates, which it does (one gather of all six would keep the shifts' memory
    # too). index_select, not indexing: its backward (index_add) is about 4x faster on CPU than
    # indexing's (index_put with accumulate).
    shift_attn, scale_attn, gate_attn, shift_mlp, scale_mlp, gate_mlp = mod
    shifts = gathered((shift_attn, shift_mlp), doc)
    kept = gathered((scale_attn, gate_attn, scale_mlp, gate_mlp), doc)
    return shifts[0], kept[0], kept[1], shifts[1], kept[2], kept[3]


def gathered(mod: Sequence[Tensor], doc: Tensor) -> tuple[Tensor, ...]:
    """Tensors (N, 1, H) -> each (R, T, H) at the rows `doc` (R, T) names, in one index_select."""
    stacked = torch.stack(tuple(mod), dim=1)  # (N, n, 1, H)
    N, n, _, H = stacked.shape
    rows = stacked.view(N, n * H).index_select(0, doc.flatten())  # (R * T, n * H)
    return rows.view(*doc.shape, n, H).unbind(-2)


def group_ends(first: int, second: int, device: torch.device) -> Tensor:
    """grouped_mm's offsets (int32 ends of the two groups of rows), made on the device without a host
    copy (a copy from pageable host memory would wait for the device) and kept per shape in eager mode."""
    if torch.compiler.is_compiling():
        return torch.tensor([first, first + second], dtype=torch.int32, device=device)
    key = (first, second, device)
    ends = _GROUP_ENDS.get(key)
    if ends is None:
        ends = torch.full((2,), first, dtype=torch.int32, device=device)
        ends[1:].add_(second)  # a scalar operand: no tensor comes from the host
        if len(_GROUP_ENDS) >= 256:  # as many shapes as a run's buckets; forget the oldest beyond
            del _GROUP_ENDS[next(iter(_GROUP_ENDS))]
        _GROUP_ENDS[key] = ends
    return ends


_GROUP_ENDS: dict[tuple[int, int, torch.device], Tensor] = {}
# Public from torch 2.10 on (torch._grouped_mm before); None where this torch has neither.
grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_rows(rows: Tensor, first: nn.Linear, second: nn.Linear, num_first: int) -> Tensor:
    """rows (N, H): the first num_first through `first`, the rest through `second`, in one grouped
    matrix product (the two weights stacked, cast once to the compute dtype), where two linear layers
    would be two products, two casts and their gradients' each."""
    dtype = compute_dtype(rows)
    weight = stacked_parameters(first.weight, second.weight).to(dtype)  # (2, out, in)
    ends = group_ends(num_first, rows.shape[0] - num_first, rows.device)
    with autocast_off(rows.device.type):
        return grouped_mm(rows.to(dtype), weight.transpose(1, 2), offs=ends)


def stacked_parameters(*params: Tensor) -> Tensor:
    """Parameters of one shape as one tensor (n, ...) for an operation that takes them together: a
    copy each step, which the backward splits again (a stack forward; selects and a gradient per
    parameter backward). `scripts/step_operations.py --stacked` counts a step without that copy."""
    return torch.stack(params)


def joint_rows(a: Tensor, b: Tensor) -> tuple[Tensor, int]:
    """The rows of a (..., H) and b (..., H), of any leading shapes, in one (N, H) tensor (one copy),
    and how many are a's."""
    H = a.shape[-1]
    return torch.cat([a.reshape(-1, H), b.reshape(-1, H)]), a.numel() // H


def split_rows(out: Tensor, num_first: int, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """`joint_rows`'s inverse for outputs (N, F) of those rows: views (a's leading shape, F) and
    (b's leading shape, F)."""
    out_a, out_b = out.split([num_first, out.shape[0] - num_first])
    return out_a.view(*a.shape[:-1], -1), out_b.view(*b.shape[:-1], -1)


def paired_linear(a: Tensor, b: Tensor, first: nn.Linear, second: nn.Linear) -> tuple[Tensor, Tensor]:
    """(first(a), second(b)) for a (..., H) and b (..., H), by `grouped_rows` over their joint rows."""
    rows, num_a = joint_rows(a, b)
    return split_rows(grouped_rows(rows, first, second, num_a), num_a, a, b)


class AdaLN(nn.Module):
    """The adaLN-Zero modulation (DiT sec. 3.2) of every block and both streams: SiLU(c) (B, H) -> for
    each block, stream and sublayer (attention, MLP) a shift, a scale and a gate (B, num_blocks, 2, 2 * 3,
    1, H), in float32 (the residual stream's dtype, so that modulating and gating need no casts).

    `per_block` (DiT): every block's own (H, 12H) projection, all in one matrix product: each weight
    serves one row per text, so its cost is the launches and the reading of the weights, not the
    arithmetic. `single` (PixArt-alpha's adaLN-single, Chen et al. 2023, sec. 2.3): one (H, 12H)
    projection shared by every block, plus a learned offset per block (`table`, (num_blocks, 12, H)),
    so the weights read and updated each step shrink num_blocks-fold.

    The scale is DiT's 1 + scale (its bias starts at 1): `modulate` adds no 1 + scale. Weights and
    every other bias (and the offsets) start at 0, so every gate is 0 and each block starts as the identity.

    `stacked`: each block's 12 tensors handed over as one (B, 12, 1, H) tensor that the block unbinds
    itself, where they are otherwise twelve views: one argument of the block where there would be
    twelve (training/parallelize.py sets it where that matters). Off by default: unbinding in each
    block adds a stack per block to the backward. `copied` (with `stacked`): each block's tensor a
    copy of its own, where it is otherwise a view at the block's offset into one tensor: torch 2.11
    reuses a nested compile region's code only for inputs at equal storage offsets
    (training/parallelize.py)."""

    def __init__(self, hidden_size: int, num_blocks: int, kind: str = "per_block"):
        super().__init__()
        self.num_blocks = num_blocks
        self.stacked = False
        self.copied = False
        projected = num_blocks if kind == "per_block" else 1
        self.proj = nn.Linear(hidden_size, projected * 2 * 6 * hidden_size)
        self.table = nn.Parameter(torch.empty(num_blocks, 12, hidden_size)) if kind == "single" else None

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)
        with torch.no_grad():
            # (block or the shared one, stream, sublayer, shift/scale/gate, H)
            bias = self.proj.bias.view(-1, 2, 2, 3, self.proj.in_features)
            bias.zero_()
            bias[:, :, :, 1] = 1.0
        if self.table is not None:
            nn.init.zeros_(self.table)

    def forward(self, c: Tensor) -> list[tuple[Tensor, ...]] | tuple[Tensor, ...]:
        """c (B, H) -> per block 12 tensors (B, 1, H): the text stream's shift, scale and gate of the
        attention, then of the MLP, and the latent stream's likewise; `stacked`, per block one tensor
        (B, 12, 1, H) of them. (One unbind for all blocks: its backward is one stack, where an unbind
        per block and stream would be three.)"""
        B, H = c.shape
        if self.stacked:
            mods = self.projected(c).view(B, self.num_blocks, 12, 1, H).unbind(1)
            return tuple(m.clone() for m in mods) if self.copied else mods
        mods = self.projected(c).view(B, self.num_blocks * 12, 1, H).unbind(1)
        return [mods[12 * i : 12 * (i + 1)] for i in range(self.num_blocks)]

    def projected(self, c: Tensor) -> Tensor:
        """c (B, H) -> every block's modulation (B, blocks * 12 * H) or (B, blocks, 12, H), float32: the
        arithmetic of `forward`, without its views."""
        mods = self.proj(F.silu(c)).float()  # (B, blocks * 12 * H) or (B, 12 * H)
        if self.table is not None:
            mods = mods.view(c.shape[0], 1, 12, c.shape[1]) + self.table  # (B, blocks, 12, H)
        return mods


class MLP(nn.Module):
    def __init__(self, hidden_size: int, mlp_hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden_size, mlp_hidden, bias=False)
        self.proj = nn.Linear(mlp_hidden, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class StreamLayers(nn.Module):
    """One modality's weights inside a block: qkv, QK-RMSNorm, output projection, MLP (its adaLN
    modulation is computed for all blocks at once: `AdaLN`). Linear layers carry no bias, as in
    current LMs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.head_dim, self.eps = H // cfg.num_heads, cfg.norm_eps
        self.norm_attn = nn.LayerNorm(H, eps=cfg.norm_eps, elementwise_affine=False)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        # Per-head RMSNorm on q and k (SD3 sec. 5.3.2): bounds the attention logits, which otherwise
        # grow and make bf16 training diverge. Their gains are these modules' weights; `qk_heads`
        # normalises q and k together.
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.attn_proj = nn.Linear(H, H, bias=False)
        self.norm_mlp = nn.LayerNorm(H, eps=cfg.norm_eps, elementwise_affine=False)
        self.mlp = MLP(H, int(cfg.mlp_ratio * H))
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def attention_input(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """x (B, T, H) normalised and modulated for the qkv projection."""
        return modulate(self.norm_attn(x), shift, scale)

    def qk_heads(self, qkv: Tensor, queries: bool = True) -> tuple[Tensor, Tensor]:
        """The qkv projection's output (B, T, 3H) -> qk (B, T, nh, 2, hd), queries and keys normalised
        per head, and v (B, T, nh, hd); without `queries`, qk is the keys alone, (B, T, nh, 1, hd). The
        projection's rows are head by head (q, k, v of head 0, then of head 1, ...): positions and heads
        stay before q/k/v, so the joint sequence is concatenated along T, the variable-length kernel
        reads (positions, nh, hd) with no transposed copy, and the gains' gradient sums over leading
        dimensions only."""
        B, T, _ = qkv.shape
        qkv = qkv.view(B, T, self.num_heads, 3, self.head_dim)
        # split, not slices: its backward is one cat, where slices' are a zero-filled tensor each and a sum
        qk, v = qkv.split([2, 1], dim=3) if queries else qkv.split([1, 1, 1], dim=3)[1:]
        v = v.squeeze(3)  # (B, T, nh, hd)
        if self.q_norm is None:
            return qk, v
        # One RMSNorm over q and k at once, in the activations' dtype with an fp32 mean of squares and
        # outside autocast (`rms_norm`), then their gains.
        gain = stacked_parameters(self.q_norm.weight, self.k_norm.weight) if queries else self.k_norm.weight[None]
        normed = rms_norm(qk, self.eps)
        return normed * gain.to(qk.dtype), v

    def residual(self, x: Tensor, attn_out: Tensor, mod: tuple[Tensor, ...]) -> Tensor:
        """The gated attention and MLP residual updates of x (B, T, H); attn_out (B, T, H); mod the
        six adaLN tensors from `per_position`."""
        _, _, gate_attn, shift_mlp, scale_mlp, gate_mlp = mod
        x = x + gate_attn * self.dropout(self.attn_proj(attn_out))
        return x + gate_mlp * self.dropout(self.mlp(self.mlp_input(x, shift_mlp, scale_mlp)))

    def mlp_input(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """x (B, T, H) normalised and modulated for the MLP."""
        return modulate(self.norm_mlp(x), shift, scale)

    def output_parameters(self) -> list[nn.Parameter]:
        """The parameters that serve only this stream's own outputs (its queries, output projection
        and MLP); its keys and values (qkv, k_norm) also feed the other stream."""
        q_gain = [self.q_norm.weight] if self.q_norm is not None else []
        return [*q_gain, *self.attn_proj.parameters(), *self.mlp.parameters()]


class MMDiTBlock(nn.Module):
    """Per-modality weights, one joint attention over [text; latent]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.text = StreamLayers(cfg)
        self.latent = StreamLayers(cfg)
        self.dropout = cfg.dropout
        # Each pair of the two streams' linear layers as one grouped matrix product (`paired_linear`):
        # the same values, fewer operations (perf.grouped_linears sets it in training).
        self.grouped_linears = False

    def forward(
        self,
        x_text: Tensor,
        x_latent: Tensor,
        mod: Sequence[Tensor] | Tensor,
        attention: JointAttention | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        text_out: bool = True,
        latent_out: bool = True,
        text_doc: Tensor | None = None,
        latent_rows: LatentRows | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """x_text (B, L, H), x_latent (B, K, H), mod this block's 12 adaLN tensors (B, 1, H), or one
        (B, 12, 1, H) of them (`AdaLN`, `stacked`);
        attention: how the joint sequence of S = L + K positions is attended (model/attention.py:
        padding and packing live there); rope = (cos, sin) (L, 1, 1, hd) for the text positions
        (`rope_angles`), in the activations' dtype.

        Packed rows (`Packing`): x_text (R, L, H) holds several texts end to end, text_doc (R, L) the
        text of each position (modulated by its own text's adaLN tensors); x_latent (N, K, H) stays one
        row per text, and only its queries, keys and values are placed in the rows for the attention
        (latent_rows), S = L + M * K; rope (R, L, 1, 1, hd) at each position's place in its own text.

        A stream with `*_out=False` only lends its keys and values: its queries, attention output and
        MLP are not computed and it returns None (SD3's last "context_pre_only" block), so a head that
        is skipped leaves no parameter of the last block waiting for a gradient."""
        if isinstance(mod, Tensor):
            mod = mod.unbind(1)
        mod_text, mod_latent = per_position(mod[:6], text_doc), mod[6:]  # 6 x (B, 1, H) or (R, L, H)
        text, latent = self.text, self.latent
        h_text = text.attention_input(x_text, mod_text[0], mod_text[1])
        h_latent = latent.attention_input(x_latent, mod_latent[0], mod_latent[1])
        if self.grouped_linears:
            qkv_text, qkv_latent = paired_linear(h_text, h_latent, text.qkv, latent.qkv)
        else:
            qkv_text, qkv_latent = text.qkv(h_text), latent.qkv(h_latent)
        qk_text, v_text = text.qk_heads(qkv_text, text_out)  # (B, L, nh, 2|1, hd)
        if latent_rows is not None:  # packed: each text's latent slots into its row, q, k and v at once
            qkv_latent = latent_rows.to_rows(qkv_latent)  # (R, M * K, 3H)
        qk_latent, v_latent = latent.qk_heads(qkv_latent, latent_out)
        if rope is not None:
            # Only text positions rotate. Latent slots have no place in the token order; leaving
            # them unrotated is the same as putting them all at position 0, so a text token sees the
            # latent at an offset equal to its own position, and the slots are told apart by their
            # learned slot embeddings instead.
            qk_text = apply_rope(qk_text, *rope)

        v = torch.cat([v_text, v_latent], dim=1)  # (B, S, nh, hd)
        if text_out and latent_out:
            q, k = torch.cat([qk_text, qk_latent], dim=1).unbind(3)  # (B, S, nh, hd)
            queries = "all"
        else:  # a last block: Sq = L or K
            k = torch.cat([qk_text[..., -1, :], qk_latent[..., -1, :]], dim=1)
            q, queries = (qk_text[..., 0, :], "text") if text_out else (qk_latent[..., 0, :], "latent")
        L = x_text.shape[1]
        attention = attention if attention is not None else JointAttention("dense")  # no padding
        y = attention(q, k, v, queries, self.dropout if self.training else 0.0)  # (B, Sq, nh, hd)
        B, Sq = y.shape[:2]
        y = y.reshape(B, Sq, -1)  # (B, Sq, H)

        if text_out and latent_out:
            y_text, y_latent = y.split([L, Sq - L], dim=1)  # one cat in backward
        else:
            y_text = y_latent = y
        if latent_out and latent_rows is not None:
            y_latent = latent_rows.from_rows(y_latent)  # (N, K, H)
        if self.grouped_linears and text_out and latent_out:
            return self.grouped_residuals(x_text, x_latent, y_text, y_latent, mod_text, mod_latent)
        x_text = text.residual(x_text, y_text, mod_text) if text_out else None
        x_latent = latent.residual(x_latent, y_latent, mod_latent) if latent_out else None
        return x_text, x_latent

    def grouped_residuals(
        self,
        x_text: Tensor,
        x_latent: Tensor,
        y_text: Tensor,
        y_latent: Tensor,
        mod_text: Sequence[Tensor],
        mod_latent: Sequence[Tensor],
    ) -> tuple[Tensor, Tensor]:
        """Both streams' `StreamLayers.residual` with each pair of their products grouped
        (`grouped_linears`): the output projections, then the MLPs on the two streams' rows at once
        (one GELU)."""
        text, latent = self.text, self.latent
        a_text, a_latent = paired_linear(y_text, y_latent, text.attn_proj, latent.attn_proj)
        x_text = x_text + mod_text[2] * text.dropout(a_text)
        x_latent = x_latent + mod_latent[2] * latent.dropout(a_latent)
        rows, n_text = joint_rows(
            text.mlp_input(x_text, mod_text[3], mod_text[4]), latent.mlp_input(x_latent, mod_latent[3], mod_latent[4])
        )
        hidden = F.gelu(grouped_rows(rows, text.mlp.fc, latent.mlp.fc, n_text), approximate="tanh")
        out = text.dropout(grouped_rows(hidden, text.mlp.proj, latent.mlp.proj, n_text))
        m_text, m_latent = split_rows(out, n_text, x_text, x_latent)
        return x_text + mod_text[5] * m_text, x_latent + mod_latent[5] * m_latent


def padded_row_count(num_rows: int) -> int:
    """num_rows rounded up to one of 8 sizes per doubling (multiples of 8 below 64): at most 12.5%
    more rows, and a few dozen distinct sizes in all. oneDNN, which runs CPU bf16 matmuls, keeps
    about 1.6 MiB for every matrix shape it has run; one head shape per count of masked positions
    grew the default run's resident memory by 1.3 GiB (docs/troubleshooting.md)."""
    step = max(8, 1 << max(0, num_rows.bit_length() - 4))
    return -(-num_rows // step) * step


class FinalLayer(nn.Module):
    """adaLN-modulated final norm and output head of one stream (the modulation's scale is 1 + DiT's,
    as in `AdaLN`)."""

    def __init__(self, hidden_size: int, out_dim: int, eps: float, bias: bool):
        super().__init__()
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.norm = nn.LayerNorm(hidden_size, eps=eps, elementwise_affine=False)
        self.head = nn.Linear(hidden_size, out_dim, bias=bias)

    def reset_parameters(self) -> None:
        """Zero output (DiT's zero-initialised final layer), the modulation at shift 0 and scale 1."""
        for p in self.parameters():
            nn.init.zeros_(p)
        nn.init.ones_(self.modulation[-1].bias.view(2, -1)[1])

    def shift_scale(self, c: Tensor) -> tuple[Tensor, Tensor]:
        """c (B, H) -> shift, scale (B, H) in float32."""
        return self.modulation(c).float().chunk(2, dim=-1)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """x (B, T, H), c (B, H) -> (B, T, out_dim)."""
        shift, scale = self.shift_scale(c)  # (B, H) each
        return self.head(modulate(self.norm(x), shift[:, None], scale[:, None]))

    def at(self, x: Tensor, c: Tensor, doc: Tensor) -> Tensor:
        """x (N, H) single positions, c (B, H), doc (N,) the row of c of each -> (N, out_dim): the text
        head's training loss needs its logits only at masked positions, and (N, V) is the largest
        activation of a small model."""
        return self.head(self.head_input(x, c, doc))[: x.shape[0]]  # (N, out_dim)

    def head_input(self, x: Tensor, c: Tensor, doc: Tensor) -> Tensor:
        """What `at` gives the head: the normalised, modulated rows, padded with zero rows to
        `padded_row_count(N)`, (N', H)."""
        shift, scale = self.shift_scale(c)  # (B, H) each
        x = modulate(self.norm(x), shift.index_select(0, doc), scale.index_select(0, doc))  # (N, H)
        N = x.shape[0]
        return F.pad(x, (0, 0, 0, padded_row_count(N) - N))  # (N', H): zero rows, their outputs dropped


def upgrade_state_dict(state: dict[str, Tensor], num_heads: int) -> dict[str, Tensor]:
    """Weights written before every block's adaLN modulation was one matrix (`AdaLN`), in this layout:
    each block's streams had their own `blocks.i.{text,latent}.modulation.1.{weight,bias}` (6H rows:
    shift, scale, gate of the attention, then of the MLP), every modulation's scale was DiT's (so
    1 + scale multiplied), and each `qkv` projection's rows were q, k, v (each head by head). Those
    rows are stacked block by block, stream by stream, into `modulation.proj`, 1 is added to every
    scale bias (the final layers' too), and the qkv rows are reordered head by head (q, k, v of each
    head). Weights already in this layout come back as they are."""
    if "blocks.0.text.modulation.1.weight" not in state:
        return state
    state = dict(state)
    num_blocks = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("blocks."))
    for kind in ("weight", "bias"):
        rows = [
            state.pop(f"blocks.{i}.{stream}.modulation.1.{kind}")
            for i in range(num_blocks)
            for stream in ("text", "latent")
        ]
        state[f"modulation.proj.{kind}"] = torch.cat(rows)
    H = state["modulation.proj.weight"].shape[1]
    bias = state["modulation.proj.bias"].view(num_blocks, 2, 2, 3, H).clone()
    bias[:, :, :, 1] += 1.0
    state["modulation.proj.bias"] = bias.flatten()
    for final in ("text_final", "latent_final"):
        key = f"{final}.modulation.1.bias"
        state[key] = state[key] + torch.cat([torch.zeros(H), torch.ones(H)]).to(state[key].dtype)
    for key in [k for k in state if k.endswith(".qkv.weight")]:
        state[key] = state[key].view(3, num_heads, H // num_heads, H).transpose(0, 1).reshape(3 * H, H)
    return state


# --------------------------------------------------------------------------------------------------
# Packed rows.


class Packing(NamedTuple):
    """Where the N texts of a batch sit in R packed rows of P text positions (data.packing; built by the
    loader's collate, mmldlm/data/dataset.py). A packed row holds several texts end to end, and in the
    attention each text's K latent slots join its row as a group (M groups per row; the latent
    stream's other layers run on one row per text: `LatentRows`). Every position attends only within
    its own text (its tokens and its latent slots), is modulated by its own text's timesteps, and takes
    RoPE or learned positions from its place in its own text, so each text's outputs are those it
    gets alone in an unpadded row; padding positions (-1) attend only among themselves."""

    text_doc: Tensor  # (R, P) int64: the text (row of the padded batch) of each position, -1 = padding
    text_position: Tensor  # (R, P) int64: its position in that text
    latent_doc: Tensor  # (R, M) int64: the text of the row's m-th group of K latent slots, -1 = padding

    @classmethod
    def from_batch(cls, batch: dict) -> Packing | None:
        """The packing of a loader batch, or None for a batch of one text per row."""
        if "pack_doc" not in batch:
            return None
        return cls(batch["pack_doc"], batch["pack_position"], batch["pack_latent_doc"])

    def latent_slots(self, K: int) -> Tensor:
        """(R, M * K): for each latent position of a row, its index into the (N * K) latent slots, -1 = padding."""
        slots = self.latent_doc[:, :, None] * K + torch.arange(K, device=self.latent_doc.device)  # (R, M, K)
        return slots.masked_fill(self.latent_doc[:, :, None] < 0, -1).flatten(1)

    def latent_rows(self, N: int, K: int) -> LatentRows:
        """How the N texts' K latent slots are placed in the rows, and taken back."""
        slots = self.latent_slots(K)  # (R, M * K)
        return LatentRows(slots.clamp_min(0), self.unpacked_index(N * K, slots), K)

    def text_of(self, K: int) -> Tensor:
        """(R, S) int64, S = P + M * K: the text of each joint position of a row, -1 = padding."""
        return torch.cat([self.text_doc, self.latent_doc.repeat_interleave(K, dim=1)], dim=1)

    def text_slots(self, L: int) -> Tensor:
        """(R, P): for each packed position, its index into the padded batch's (N * L) text positions, -1 = padding."""
        return (self.text_doc * L + self.text_position).masked_fill(self.text_doc < 0, -1)

    def unpacked_index(self, num_slots: int, packed: Tensor) -> Tensor:
        """(num_slots,) the flat packed position of each of the padded batch's slots, given `packed`
        (R, T) (each slot's index, -1 = padding); slots in no row (padding of the batch) get 0.
        Padding positions write to one extra slot, cut off: no boolean selection, which reads the device."""
        flat = packed.flatten()
        slot = torch.where(flat >= 0, flat, num_slots)  # (R * T,)
        where = torch.zeros(num_slots + 1, dtype=torch.long, device=flat.device)
        return where.index_put_((slot,), torch.arange(flat.numel(), device=flat.device))[:num_slots]


class LatentRows(NamedTuple):
    """The latent stream's way into packed rows: its position-wise layers run on (N, K, H), one row
    per text with no padding; only the attention sees the slots in their texts' rows."""

    slots: Tensor  # (R, M * K) index into the (N * K) slots of each row's latent position (padding: 0)
    where: Tensor  # (N * K,) the flat (R * M * K) position of each slot
    K: int

    def to_rows(self, x: Tensor) -> Tensor:
        """(N, K, ...) -> (R, M * K, ...)."""
        N, K, *rest = x.shape
        rows = x.reshape(N * K, *rest).index_select(0, self.slots.flatten())  # (R * M * K, ...)
        return rows.view(*self.slots.shape, *rest)

    def from_rows(self, y: Tensor) -> Tensor:
        """(R, M * K, H) -> (N, K, H)."""
        H = y.shape[-1]
        return y.reshape(-1, H).index_select(0, self.where).view(-1, self.K, H)


# --------------------------------------------------------------------------------------------------
# The model.


class ModelOutput(NamedTuple):
    """What `MultimodalMMDiT.forward` returns; an output not asked for is None."""

    # (B, L, V), or (N, V) at text_rows; with text_targets, the loss the head is fused with (TextLoss)
    text_logits: Tensor | TextLoss | None
    latent: Tensor | None  # (B, K, D): the latent prediction (eps, x0 or v, per the diffusion config)
    length_logits: Tensor | None  # (B, max_seq_len): log-odds of text lengths 1..max_seq_len


class MultimodalMMDiT(nn.Module):
    """Text logits and a latent prediction from noised text, noised latents and their timesteps.

    Parameter names start with the stream they belong to (`text_*`, `latent_*`, `blocks.i.text.*`,
    `blocks.i.latent.*`); the timestep MLPs (`t_*`), the blocks' adaLN `modulation` and the null latent
    are shared (see mmldlm/model/info.py)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int | None = None):
        super().__init__()
        vocab_size = vocab_size if vocab_size is not None else cfg.vocab_size
        if vocab_size is None:
            raise ConfigError(
                "config key 'model.vocab_size': got None and no vocab_size was given; "
                "expected the vocabulary size of the prepared dataset's tokenizer"
            )
        for key in ("latent_dim", "num_latents"):
            if getattr(cfg, key) is None:
                raise ConfigError(
                    f"config key 'model.{key}': got None; expected an integer, the prepared dataset's "
                    f"(mmldlm.data.model_for_dataset fills it in)"
                )
        cfg.check()
        self.cfg = cfg
        self.vocab_size = vocab_size
        H, K, D = cfg.hidden_size, cfg.num_latents, cfg.latent_dim

        self.text_embed = nn.Embedding(vocab_size, H)
        self.text_pos = nn.Embedding(cfg.max_seq_len, H) if cfg.pos_embedding == "learned" else None
        self.latent_proj = nn.Linear(D, H)
        # Prefix tokens (model.num_prefix_tokens): the latent input as P text-stream tokens before the text.
        P = cfg.num_prefix_tokens
        self.text_prefix = nn.Linear(K * D, P * H) if P else None
        # Self-conditioning (Chen et al. 2022, "Analog Bits", sec. 3.2): an earlier x0 estimate of the
        # latent enters beside the noised latent; zero when there is none.
        self.latent_self_cond_proj = nn.Linear(D, H, bias=False) if cfg.self_condition else None
        # One learned position per latent slot: the K latents stay K tokens (never pooled away),
        # and this embedding is what tells them apart.
        self.latent_pos = nn.Parameter(torch.empty(K, H))
        self.t_text_embed = TimestepEmbedder(cfg.timestep_embed_dim, H)
        self.t_latent_embed = TimestepEmbedder(cfg.timestep_embed_dim, H)
        # Classifier-free guidance: a learned stand-in for "no latent", in the (standardised) input space.
        self.null_latent = nn.Parameter(torch.empty(K, D)) if cfg.null_latent else None

        self.modulation = AdaLN(H, cfg.num_blocks, cfg.adaln)  # every block's, both streams', in one product
        self.blocks = nn.ModuleList(MMDiTBlock(cfg) for _ in range(cfg.num_blocks))
        self.text_final = FinalLayer(H, vocab_size, cfg.norm_eps, bias=False)
        self.latent_final = FinalLayer(H, D, cfg.norm_eps, bias=True)
        # Text length given the clean latent (all K slots): the model has no end-of-text token, so a
        # sampler that decodes a latent without a source text takes the length from here.
        self.length_head = (
            nn.Sequential(nn.Linear(K * D, H), nn.SiLU(), nn.Linear(H, cfg.max_seq_len)) if cfg.length_head else None
        )
        # Vocabulary prior: text logits + s(t_latent) * cos(latent, token_latents[v]) for every token v.
        # The unit-length token latents (in the standardised space) are set by the training setup from
        # the dataset (`set_token_latents`) and travel with the weights as a buffer; s is a learned
        # function of the latent's noise level (how far the latent input can be trusted).
        if cfg.vocab_prior:
            self.register_buffer("token_latents", torch.zeros(vocab_size, K * D))
            self.vocab_prior_scale = nn.Linear(H, 1)
        else:
            self.token_latents = self.vocab_prior_scale = None
        if not self.latent_pos.is_meta:  # on the meta device (shapes only) there is nothing to set
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter; also the way to materialise a model built on the meta device."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        nn.init.normal_(self.latent_pos, std=std)
        if self.null_latent is not None:
            # Zero is the mean of the standardised latents: "no information" to start from.
            nn.init.zeros_(self.null_latent)
        # adaLN-Zero: zero modulation makes every gate 0, so each block starts as the identity, and
        # zero heads start from uniform text logits and a zero latent prediction (DiT sec. 3.2).
        self.modulation.reset_parameters()
        for final in (self.text_final, self.latent_final):
            final.reset_parameters()
        if self.latent_self_cond_proj is not None:
            # Zero: the model starts as the one without self-conditioning and learns how far to trust it.
            nn.init.zeros_(self.latent_self_cond_proj.weight)
        if self.length_head is not None:
            nn.init.zeros_(self.length_head[-1].weight)  # a uniform length distribution to start from
        if self.token_latents is not None:
            self.token_latents.zero_()  # until the training setup sets them (`set_token_latents`)
        if self.vocab_prior_scale is not None:
            # s = softplus(10) ~ 10 at every t to start: a cosine gap of 0.5 between a sentence's own words
            # and the rest is 5 logits, enough to matter from the first step; training adjusts it per t.
            nn.init.zeros_(self.vocab_prior_scale.weight)
            nn.init.constant_(self.vocab_prior_scale.bias, 10.0)

    def text_head_parameters(self) -> list[nn.Parameter]:
        """Parameters that get no gradient when the text head is skipped (t2l): the text final layer
        and the last block's text-only tail (text queries, output projection, MLP), and the vocabulary
        prior's scale (model.vocab_prior)."""
        prior = list(self.vocab_prior_scale.parameters()) if self.vocab_prior_scale is not None else []
        return [*self.blocks[-1].text.output_parameters(), *self.text_final.parameters(), *prior]

    def latent_head_parameters(self) -> list[nn.Parameter]:
        """Parameters that get no gradient when the latent head is skipped (l2t)."""
        return [*self.blocks[-1].latent.output_parameters(), *self.latent_final.parameters()]

    def forward(
        self,
        tokens: Tensor,
        latents: Tensor,
        t_text: Tensor,
        t_latent: Tensor,
        text_pad_mask: Tensor | None = None,
        latent_null: Tensor | None = None,
        *,
        text_head: bool = True,
        latent_head: bool = True,
        text_rows: Tensor | None = None,
        latent_self_cond: Tensor | None = None,
        length_from: Tensor | None = None,
        packing: Packing | None = None,
        text_lengths: Sequence[int] | None = None,
        text_targets: TextTargets | None = None,
    ) -> ModelOutput:
        """tokens (B, L) int64, latents (B, K, D) standardised and noised, t_text and t_latent (B,) in
        [0, 1]; text_pad_mask (B, L) bool, True = real token; latent_null (B,) bool, True = use the
        null latent. Returns ModelOutput(text logits (B, L, V), latent prediction (B, K, D), length
        logits); a head not asked for is not computed and returns None. text_rows (N,) int64, flat
        indices into the (B * L) text positions: text logits only there, (N, V) in that order (equal to
        the full logits.flatten(0, 1)[text_rows]); the training step decides them on the host.
        latent_self_cond (B, K, D): an earlier x0 estimate of the standardised latent (model.self_condition;
        None = no estimate yet, the same as zeros). length_from (B, K, D): clean standardised latents
        whose text lengths the length head predicts (training passes them so that the head is part of
        the one forward that DDP and FSDP2 see). packing: the blocks run on packed rows of the B texts
        (data.packing; inputs and outputs keep the padded layout, and equal those without packing).
        text_lengths: the real tokens of each text, known on the host (the loader's collate gives them):
        a batch with no padding then attends with no mask, which the device is not read to find out
        (model/attention.py).
        text_targets (with text_rows): the text head is fused with its loss at those rows, and
        ModelOutput.text_logits is that loss, a `TextLoss`, instead of logits (`text_loss`)."""
        L = tokens.shape[1]
        if text_targets is not None and text_rows is None:
            raise ValueError("text_targets need text_rows: the positions the targets are at")
        self.check_inputs(tokens, latents, text_head, latent_head, packing)

        # Conditioning: both timesteps, separate MLPs, summed into one vector.
        t_latent_emb = self.t_latent_embed(t_latent)  # (B, H)
        c = self.t_text_embed(t_text) + t_latent_emb  # (B, H)
        latents = self.latent_input(latents, latent_null)  # (B, K, D): the null latent where dropped
        x_latent = self.latent_stream(latents, latent_self_cond)  # (B, K, H)
        x_text, rope, text_doc, latent_rows = self.text_stream(tokens, latents, packing)
        last_queries = "all" if text_head and latent_head else "text" if text_head else "latent"
        attention = self.joint_attention(
            text_pad_mask, packing, text_lengths, tokens.shape[0], x_text.shape[1], last_queries
        )

        rope = self.rope_for_blocks(rope, x_text)
        last = len(self.blocks) - 1
        every_query = attention.all_queries()  # every block's but the last's, alike in every mode
        for i, (block, mod) in enumerate(zip(self.blocks, self.modulation(c))):
            x_text, x_latent = block(
                x_text,
                x_latent,
                mod,
                every_query if i < last else attention,
                rope,
                text_out=text_head or i < last,
                latent_out=latent_head or i < last,
                text_doc=text_doc,
                latent_rows=latent_rows,
            )

        if text_head and text_targets is not None:  # the head fused with its loss: no logits
            prior = None
            if self.token_latents is not None:
                prior = self.vocab_prior_table(latents, latent_null, t_latent_emb)
            logits = self.text_loss(x_text, c, text_rows, packing, L, text_targets, prior)
        elif text_head:
            logits = self.text_logits(x_text, c, text_rows, packing, L)  # (B, L, V) or (N, V)
            if self.token_latents is not None:
                logits = logits + self.vocab_prior(latents, latent_null, t_latent_emb, text_rows, L).to(logits.dtype)
        else:
            logits = None
        latent_out = self.latent_final(x_latent, c) if latent_head else None  # (B, K, D)
        lengths = self.length_logits(length_from) if length_from is not None else None  # (B, max_seq_len)
        return ModelOutput(logits, latent_out, lengths)

    @staticmethod
    def rope_for_blocks(rope: tuple[Tensor, Tensor] | None, x_text: Tensor) -> tuple[Tensor, Tensor] | None:
        """The RoPE tables (T, 1, hd) or (R, T, 1, hd) shaped for the blocks' (.., T, nh, 2, hd) queries and
        keys and cast once to the dtype the blocks compute them in (under autocast, its dtype)."""
        if rope is None:
            return None
        return tuple(table[..., None, :].to(compute_dtype(x_text)) for table in rope)

    def check_inputs(
        self, tokens: Tensor, latents: Tensor, text_head: bool, latent_head: bool, packing: Packing | None
    ) -> None:
        """Refuse inputs the model cannot run: one line naming the input and what was expected."""
        B, L = tokens.shape
        K, D = self.cfg.num_latents, self.cfg.latent_dim
        if L > self.cfg.max_seq_len:
            raise ValueError(f"text length {L} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if tuple(latents.shape) != (B, K, D):
            raise ValueError(
                f"latents have shape {tuple(latents.shape)}; expected (B, K, D) = ({B}, {K}, {D}) "
                "from model.num_latents and model.latent_dim"
            )
        if not (text_head or latent_head):
            raise ValueError("forward needs at least one of text_head, latent_head")
        if packing is not None and self.cfg.num_prefix_tokens:
            raise ValueError("packed rows take no prefix tokens (model.num_prefix_tokens); set data.packing=false")

    def latent_stream(self, latents: Tensor, latent_self_cond: Tensor | None) -> Tensor:
        """The latent stream's input (B, K, H) from the latent input (B, K, D), its slot positions and
        the self-conditioning estimate (model.self_condition)."""
        x_latent = self.latent_proj(latents) + self.latent_pos  # (B, K, H)
        if self.latent_self_cond_proj is not None:
            # Zeros rather than a skipped branch when there is no estimate: the weight is in every graph,
            # so DDP never waits for its gradient in vain (as with the null latent).
            if latent_self_cond is None:
                latent_self_cond = torch.zeros_like(latents)
            x_latent = x_latent + self.latent_self_cond_proj(latent_self_cond.to(latents.dtype))
        elif latent_self_cond is not None:
            raise ValueError("latent_self_cond was given but model.self_condition is false")
        return x_latent

    def text_stream(
        self, tokens: Tensor, latents: Tensor, packing: Packing | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None, Tensor | None, LatentRows | None]:
        """The text stream's input (prefix tokens first), its RoPE angles, and for packed rows
        (data.packing) the text each position belongs to and the latents' rows; None where unused."""
        B, L = tokens.shape
        if packing is None:
            x_text, rope = self.embed_text(tokens, torch.arange(L, device=tokens.device), L)  # (B, L, H)
            x_text, rope = self.with_prefix(x_text, rope, latents)
            return x_text, rope, None, None
        x_text, rope = self.embed_text(tokens.reshape(-1)[packing.text_slots(L).clamp_min(0)], packing.text_position, L)
        return x_text, rope, packing.text_doc.clamp_min(0), packing.latent_rows(B, self.cfg.num_latents)

    def joint_attention(
        self,
        text_pad_mask: Tensor | None,
        packing: Packing | None,
        text_lengths: Sequence[int] | None,
        B: int,
        T: int,
        last_queries: str,
    ) -> JointAttention:
        """How this forward's blocks attend (model/attention.py) to B texts, the text stream being T
        positions long: no mask where nothing is padded, else a mask or the real positions alone."""
        K, P = self.cfg.num_latents, self.cfg.num_prefix_tokens
        if packing is not None:
            text_of = packing.text_of(K)  # (R, S)
        elif text_pad_mask is None or (text_lengths is not None and min(text_lengths) == text_pad_mask.shape[1]):
            text_of = None  # no padding: every key of every row takes part
        else:
            # Prefix tokens and latent slots are always real, so every query (even in a fully padded
            # text row) has at least one key and the softmax never normalises over nothing.
            B = text_pad_mask.shape[0]
            keep = F.pad(text_pad_mask, (P, K), value=True)  # (B, S)
            text_of = torch.where(keep, torch.arange(B, device=keep.device)[:, None], -1)
        dropout_p = self.cfg.dropout if self.training else 0.0
        return JointAttention.build(
            self.cfg.attention,
            text_of,
            T,
            packing is not None,
            B,
            self.cfg.max_seq_len,
            P,
            K,
            last_queries,
            dropout_p,
            compute_dtype(self.text_embed.weight),
        )

    def latent_input(self, latents: Tensor, latent_null: Tensor | None) -> Tensor:
        """The latent input (B, K, D) with the null latent in the rows latent_null (B,) marks."""
        if self.null_latent is not None:
            # Always through torch.where (an all-False mask when no row is dropped) so the null
            # latent is in every graph and DDP never waits for its gradient in vain.
            if latent_null is None:
                latent_null = torch.zeros(latents.shape[0], dtype=torch.bool, device=latents.device)
            return torch.where(latent_null[:, None, None], self.null_latent.to(latents.dtype), latents)
        if latent_null is not None:
            raise ValueError("latent_null was given but model.null_latent is false: there is no null latent")
        return latents

    def embed_text(self, tokens: Tensor, positions: Tensor, L: int) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """Token embeddings (..., T, H) of tokens (..., T) at positions (T,) or (R, T) in their texts, and
        the RoPE angles (cos, sin) of those positions shaped to broadcast over heads (None: learned
        positions, added here)."""
        x = self.text_embed(tokens)
        if self.text_pos is not None:
            return x + self.text_pos(positions), None
        cos, sin = rope_angles(L, self.cfg.hidden_size // self.cfg.num_heads, tokens.device)  # (L, hd)
        return x, (cos[positions][..., None, :], sin[positions][..., None, :])  # (T, 1, hd) or (R, T, 1, hd)

    def with_prefix(
        self, x_text: Tensor, rope: tuple[Tensor, Tensor] | None, latents: Tensor
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The text stream with the prefix tokens (model.num_prefix_tokens) before it, and its RoPE angles."""
        L, P = x_text.shape[1], self.cfg.num_prefix_tokens
        if not P:
            return x_text, rope
        x_text = torch.cat([self.prefix_tokens(latents), x_text], dim=1)  # (B, P + L, H)
        if rope is not None:
            cos, sin = rope_angles(P + L, self.cfg.hidden_size // self.cfg.num_heads, x_text.device)
            rope = cos[:, None], sin[:, None]  # (P + L, 1, hd)
        return x_text, rope

    def text_logits(
        self, x_text: Tensor, c: Tensor, text_rows: Tensor | None, packing: Packing | None, L: int
    ) -> Tensor:
        """The text head on the last block's text stream: (B, L, V), or (N, V) at text_rows."""
        if text_rows is not None:
            return self.text_final.at(*self.text_positions(x_text, c, text_rows, packing, L))
        if packing is None:
            x_text = x_text[:, self.cfg.num_prefix_tokens :]  # (B, L, H): the prefix has no output
            return self.text_final(x_text, c)
        B, H = c.shape[0], x_text.shape[-1]
        where = packing.unpacked_index(B * L, packing.text_slots(L))  # (B * L,) into the packed positions
        return self.text_final(x_text.reshape(-1, H).index_select(0, where).view(B, L, H), c)

    def text_positions(
        self, x_text: Tensor, c: Tensor, text_rows: Tensor, packing: Packing | None, L: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The last block's text stream at text_rows (N,) (flat indices into the (B * L) text positions),
        (N, H), with c and the text of each row (N,): the text head's input there."""
        doc = torch.div(text_rows, L, rounding_mode="floor")  # (N,) the text of each
        H = x_text.shape[-1]
        if packing is None:
            x_text = x_text[:, self.cfg.num_prefix_tokens :]  # (B, L, H): the prefix has no output
            return x_text.reshape(-1, H).index_select(0, text_rows), c, doc
        where = packing.unpacked_index(c.shape[0] * L, packing.text_slots(L))  # (B * L,) into the packed positions
        return x_text.reshape(-1, H).index_select(0, where.index_select(0, text_rows)), c, doc

    def text_loss(
        self,
        x_text: Tensor,
        c: Tensor,
        text_rows: Tensor,
        packing: Packing | None,
        L: int,
        targets: TextTargets,
        prior: Tensor | None,
    ) -> TextLoss:
        """The text head fused with its SUBS cross-entropy at text_rows (`subs_linear_cross_entropy`,
        no (N, V) logits); prior (B, V) the vocabulary prior of each text or None. The head's rows past
        N (`FinalLayer.head_input`'s padding) get weight 0."""
        x, c, doc = self.text_positions(x_text, c, text_rows, packing, L)
        N = x.shape[0]
        x = self.text_final.head_input(x, c, doc)  # (N', H)
        pad = x.shape[0] - N
        tokens, weights = targets.tokens, targets.weights
        if pad:  # weight 0, and a token that is not the excluded one (its cross-entropy is infinite)
            tokens = F.pad(tokens, (0, pad), value=int(targets.excluded == 0))
            weights, doc = F.pad(weights, (0, pad)), F.pad(doc, (0, pad))
        loss = subs_linear_cross_entropy(
            x, self.text_final.head.weight, tokens, weights, targets.excluded, prior=prior, doc=doc
        )
        return TextLoss(loss.weighted, loss.ce[:N], loss.predicted[:N])

    def prefix_tokens(self, latents: Tensor) -> Tensor:
        """(B, P, H): the latent input (B, K, D) as the text stream's prefix (model.num_prefix_tokens).
        Rows with the null latent get the null latent's prefix, so guidance drops the prefix too."""
        B, P = latents.shape[0], self.cfg.num_prefix_tokens
        return self.text_prefix(latents.reshape(B, -1)).view(B, P, self.cfg.hidden_size)

    def set_token_latents(self, token_latents: Tensor) -> None:
        """The vocabulary prior's token latents (V, K, D), standardised like the model's latent input."""
        V, KD = self.token_latents.shape
        if token_latents.shape[0] != V or token_latents[0].numel() != KD:
            raise ValueError(
                f"token latents of shape {tuple(token_latents.shape)}; expected ({V}, {KD}) or "
                f"({V}, K, D) with K * D = {KD}"
            )
        with torch.no_grad():
            self.token_latents.copy_(F.normalize(token_latents.reshape(V, KD).float(), dim=-1))

    def vocab_prior(
        self, latents: Tensor, latent_null: Tensor | None, t_latent_emb: Tensor, text_rows: Tensor | None, L: int
    ) -> Tensor:
        """s(t_latent) * cos(latent, token latent of v): (B, 1, V), or (N, V) at text_rows like the logits.
        latents (B, K, D) the latent input; rows latent_null (B,) marks hold the null latent and get no
        prior: a dropped condition says nothing of the words. (The null latent starts at zero, where the
        cosine's gradient is 1/eps: through the prior, the first l2t step's gradient norm was ~1e11.)"""
        prior = self.vocab_prior_table(latents, latent_null, t_latent_emb)  # (B, V)
        if text_rows is None:
            return prior[:, None, :]
        batch = torch.div(text_rows, L, rounding_mode="floor")  # (N,)
        return prior.index_select(0, batch)

    def vocab_prior_table(self, latents: Tensor, latent_null: Tensor | None, t_latent_emb: Tensor) -> Tensor:
        """`vocab_prior` of each text, (B, V) float32."""
        B = latents.shape[0]
        scale = F.softplus(self.vocab_prior_scale(t_latent_emb))  # (B, 1)
        # No gradient into the latent input: its rows are data, and the null rows get no prior (below), so
        # theirs would be zero. One (B, V) x (V, K * D) product fewer in backward.
        cosine = F.normalize(latents.reshape(B, -1).detach().float(), dim=-1) @ self.token_latents.T  # (B, V)
        prior = scale.float() * cosine  # (B, V)
        if latent_null is not None:
            prior = prior.masked_fill(latent_null[:, None], 0.0)  # and a zero gradient into the null rows
        return prior

    def length_logits(self, latents: Tensor) -> Tensor:
        """(B, max_seq_len) log-odds of the text lengths 1..max_seq_len given clean standardised latents (B, K, D)."""
        if self.length_head is None:
            raise ValueError("this model has no length head (model.length_head=false); give the text length")
        return self.length_head(latents.reshape(latents.shape[0], -1))
