"""The bytes each parameter moves through memory in one optimizer step: what the weights, their
gradients and the optimizer cost in memory traffic, beside the FLOPs the activations cost. A weight
that serves few rows (the latent stream's, the adaLN modulation's: one row per text) costs what it
costs to read it, so at the older codebase's shape this, not arithmetic, is a large part of a step.

Per parameter, in bytes, under bf16 autocast with fp32 weights (autocast's cast cache is off,
training/trainer.py says why), per micro-batch:

    cast the weight to bf16            read 4, write 2     6
    forward matrix product             read 2              2
    backward: input gradient           read 2              2
    backward: weight gradient (bf16)   write 2             2
    its cast to fp32                   read 2, write 4     6
    accumulate into .grad              read 8, write 4    12   (not the first micro-batch: it is kept)
    recompute (checkpointed blocks)    cast and forward    8   (the share of parameters in them)

and once per step: the gradient norm (read 4), clipping (read 4, write 4; 0 when the fused AdamW
divides as it reads), AdamW (read weight, gradient and two moments, write weight and moments: 28 in
fp32 moments; int8/int4 moments read and write a byte or half of one each, with their scales), the
EMA (read both, write one: 12). In fp32 the casts go and every read of a weight or gradient is 4
bytes. One micro-batch under bf16 autocast with clipping by a separate pass: 58 bytes.

With bf16 compute weights (perf.compute_weights, training/compute_weights.py) a covered parameter's
copy is written once a step (read 4, write 2: 6) and read as it is; its bf16 gradient is copied into
the float32 one after the first micro-batch (read 2, write 4: 6) and added after the others (read 2
and 4, write 4: 10); a recomputed forward reads the copy again (2) or nothing (selective). One
micro-batch moves what autocast's casts move (18 bytes before the step's own passes): the copies save
launches, and bytes only where a step accumulates or recomputes.

With the two streams' products grouped (perf.grouped_linears) each use of a block's linear layers
first stacks the pair's two weights into one tensor: it reads and writes each weight as the products
take it, 8 bytes in float32 (before autocast's cast), 4 as bf16 compute weights, at every forward and
recomputed forward. Launches go, bytes come: 8 more per grouped parameter and micro-batch.
"""

from __future__ import annotations

from mmldlm.training.optim import STATE_BYTES


def bytes_per_parameter(
    precision: str,
    accumulation_steps: int = 1,
    recomputed_share: float = 0.0,
    recomputes_products: bool = True,
    clip: str = "separate",
    ema: bool = False,
    state_dtype: str = "fp32",
    covered_share: float = 0.0,
    stacked_share: float = 0.0,
) -> float:
    """Bytes one parameter moves per optimizer step (the module docstring). precision: "bf16"/"fp16"
    (autocast over fp32 weights) or "fp32"; recomputed_share: the share of parameters in blocks whose
    forward activation checkpointing runs again, with its matrix products (full) or without them
    (selective: the casts alone); clip: "separate" (norm, then a pass that scales), "in_optimizer"
    (norm; the fused AdamW divides) or "none" (optim.grad_clip=0: the norm alone, for the record);
    covered_share: the share of parameters read through bf16 compute weights (16-bit precision only);
    stacked_share: the share of parameters whose weights grouped products stack at every use."""
    low = precision in ("bf16", "fp16")
    weight = 2 if low else 4  # the copy the products read
    cast = 6 if low else 0  # fp32 -> 16 bits, and back for the gradient
    forward = cast + weight
    backward = weight + weight + cast  # input gradient, weight gradient, its cast
    micro = forward + backward + recomputed_share * (forward if recomputes_products else cast)
    accumulate = 12 * (accumulation_steps - 1)
    if low and covered_share:
        copies = 6 + accumulation_steps * 3 * weight + 6 + 10 * (accumulation_steps - 1)
        copies += accumulation_steps * recomputed_share * (weight if recomputes_products else 0)
        cast_path = accumulation_steps * micro + accumulate
        micro, accumulate = 0.0, (1 - covered_share) * cast_path + covered_share * copies
    stack = (4 if low and covered_share else 8) * accumulation_steps * (1 + recomputed_share)
    norm = 4
    scale = {"separate": 8, "in_optimizer": 0, "none": 0}[clip]
    moments = STATE_BYTES[state_dtype]  # both moments, each read and written once
    adamw = 4 + 4 + 4 + 2 * moments  # read weight and gradient, write weight; moments read and written
    grouped = stacked_share * stack
    return accumulation_steps * micro + accumulate + grouped + norm + scale + adamw + (12 if ema else 0)
