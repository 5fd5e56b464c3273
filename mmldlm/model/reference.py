"""PlainTransformer: the yardstick `mmldlm bench --reference` measures MultimodalMMDiT against.

A plain bidirectional pre-norm transformer built from the text stream's dimensions (width, depth,
heads, MLP ratio, vocabulary): token embedding, RoPE, and per block LayerNorm -> qkv -> SDPA without
a mask -> output projection, LayerNorm -> GELU MLP, each added to the residual; a final LayerNorm and
the vocabulary head, whose cross-entropy at every position is the loss. No latent stream, no
conditioning, no QK-norm, no padding: every row is a full-length text. What a GPU gives this model in
tokens per second, at the same precision, optimizer and compile as ours, is what our step is set
against (docs/benchmarks-gpu.md).

Shapes: B batch, L text length, H hidden size, nh heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mmldlm.config import ModelConfig
from mmldlm.device import compute_dtype
from mmldlm.model.attention import sdpa
from mmldlm.model.mmdit import MLP, apply_rope, rope_angles


class PlainBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.norm_attn = nn.LayerNorm(H, eps=cfg.norm_eps, elementwise_affine=False)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.attn_proj = nn.Linear(H, H, bias=False)
        self.norm_mlp = nn.LayerNorm(H, eps=cfg.norm_eps, elementwise_affine=False)
        self.mlp = MLP(H, int(cfg.mlp_ratio * H))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, L, H); cos, sin (L, 1, hd) the rotary tables in the dtype q and k are computed in."""
        B, L, H = x.shape
        q, k, v = self.qkv(self.norm_attn(x)).view(B, L, 3, self.num_heads, -1).unbind(2)  # (B, L, nh, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, nh, L, hd)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, L, H))
        return x + self.mlp(self.norm_mlp(x))


class PlainTransformer(nn.Module):
    """Logits (B, L, V) of tokens (B, L); see the module docstring."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.text_embed = nn.Embedding(vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.num_blocks))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=cfg.init_std)

    def forward(self, tokens: Tensor) -> Tensor:
        L = tokens.shape[1]
        x = self.text_embed(tokens)  # (B, L, H)
        # The tables in the dtype q and k are computed in (autocast's where it is on), as the
        # MultimodalMMDiT's are: rotated in bf16, not promoted to float32 and cast back for attention.
        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        cos, sin = (t[:, None].to(compute_dtype(x)) for t in rope_angles(L, head_dim, x.device))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    # The trainer asks every model which parameters a mode leaves idle: this one has one head, always used.
    def text_head_parameters(self) -> list[nn.Parameter]:
        return []

    def latent_head_parameters(self) -> list[nn.Parameter]:
        return []

    def training_flops(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one text of `seq_len` tokens, counted as `training_flops_per_sample`
        counts ours (model/info.py): 6 * sum(W.numel() * rows) + 12 * H * L^2 per block."""
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear)) * seq_len
        return 6 * matmul + 12 * self.cfg.hidden_size * seq_len * seq_len * self.cfg.num_blocks


class PlainObjective:
    """The reference's loss: cross-entropy of the logits at every position against the next token
    (the row rolled by one). The trainer's interface: `mode_at` and a call that returns (loss, metrics)."""

    mode = "reference"

    def mode_at(self, step: int) -> str:
        return self.mode

    def __call__(self, model, batch: dict, step: int, generator: torch.Generator | None = None):
        tokens = batch["tokens"]  # (B, L)
        logits = model(tokens)  # (B, L, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, dims=1).flatten())
        return loss, {"mode": self.mode, "loss": loss.detach()}
