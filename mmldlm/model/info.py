"""Parameter counts per part and training FLOPs per sample of a MultimodalMMDiT (used for MFU).

Both work from shapes only, so a model built on the meta device (no memory) is enough.
"""

from __future__ import annotations

import torch.nn as nn

from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.model.reference import PlainTransformer

PARTS = ("text", "latent", "shared")


def parameter_part(name: str) -> str:
    """The part a parameter belongs to, from its name (the model names everything by stream):
    text (`text_*`, `blocks.i.text.*`), latent (`latent_*`, `blocks.i.latent.*`) or shared (the
    timestep MLPs `t_*`, the blocks' adaLN `modulation`, which serves both streams, and the null latent)."""
    first = name.split(".")[0]
    if first == "blocks":
        return name.split(".")[2]
    if first.startswith("text_"):
        return "text"
    if first.startswith("latent_"):
        return "latent"
    return "shared"


def parameter_counts(model: MultimodalMMDiT) -> dict[str, int]:
    """{"text": n, "latent": n, "shared": n, "total": n} parameters."""
    counts = dict.fromkeys(PARTS, 0)
    for name, p in model.named_parameters():
        counts[parameter_part(name)] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def training_flops_per_sample(
    model: MultimodalMMDiT | PlainTransformer,
    seq_len: int,
    *,
    text_head: bool = True,
    latent_head: bool = True,
    text_head_rows: float | None = None,
) -> float:
    """Forward + backward FLOPs of one sample with `seq_len` text tokens and K latent slots:

        FLOPs = 6 * sum_linear(W.numel() * rows) + 12 * H * sum_blocks(S_q * S)

    - rows: the number of vectors the linear layer multiplies: L for the text stream (the text head
      included), K for the latent stream (the latent input projection and head included), 1 for the
      layers that act once per sample (timestep MLPs, adaLN modulations, the latent's conditioning
      MLP and the length head, which training runs at every step).
      6 = 2 (a multiply-add) x 3 (the forward matmul and the two backward ones, grad input and
      grad weight), as in Kaplan et al. 2020 / PaLM's MFU.
    - attention: q k^T and (attention) v cost 2 * S_q * S * H each in the forward, x3 for training,
      with S = L + K keys and S_q = S queries, except in the last block, whose queries come only
      from the streams whose head is computed. This is the dense count: padding is not subtracted.
    - a head that is skipped (and the last block's tail that only feeds it) counts 0.
    - text_head_rows: the positions the text head's output matmul runs at, if not all L (training
      computes logits only at masked positions; the mean per sample, since the count is linear).
    - the vocabulary prior (model.vocab_prior), with the text head: the cosine of the latent to every
      token latent, 2 * V * K * D in the forward and as much again for its input gradient (the token
      latents are a buffer: no weight gradient).
    - prefix tokens (model.num_prefix_tokens, P): the text stream's blocks run at L + P positions, the
      text head at L; the prefix projection acts once per sample.
    - not counted: the embedding lookup (a gather), norms, activations, softmax, RoPE, biases and
      adaLN modulate (all O(tokens * H), well under 1% at any preset size).
    """
    if isinstance(model, PlainTransformer):  # bench's reference row: the same count of its layers
        return model.training_flops(seq_len)
    cfg = model.cfg
    L, K, P = seq_len, cfg.num_latents, cfg.num_prefix_tokens
    idle = set()
    if not text_head:
        idle |= {id(p) for p in model.text_head_parameters()}
    if not latent_head:
        idle |= {id(p) for p in model.latent_head_parameters()}

    once_per_sample = {id(m) for m in model.length_head.modules()} if model.length_head is not None else set()
    matmul = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in idle:
            continue
        part = parameter_part(name)
        if part == "shared" or ".modulation." in f".{name}." or id(module) in once_per_sample:
            rows = 1
        elif module is model.text_prefix:
            rows = 1
        elif module is model.text_final.head:
            rows = L if text_head_rows is None else text_head_rows
        else:
            rows = L + P if part == "text" else K
        matmul += module.weight.numel() * rows

    S = L + P + K
    last_queries = (L + P if text_head else 0) + (K if latent_head else 0)
    attention = 12 * cfg.hidden_size * S * (S * (cfg.num_blocks - 1) + last_queries)
    prior = 4 * model.token_latents.numel() if text_head and model.token_latents is not None else 0
    return 6 * matmul + attention + prior
