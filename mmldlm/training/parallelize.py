"""The setup step that turns a plain `MultimodalMMDiT` into what the loop trains. The model file
knows nothing of this. The order is fixed (as in torchtitan): activation checkpointing of blocks,
then per-block `torch.compile`, then the data-parallel wrap (DDP, FSDP2, or FSDP2 over the 2-D
(replicate, shard) mesh of HSDP), because each step must see the modules the previous one produced.

Checkpointing and compile act on each block in place (its `forward` is replaced by a checkpointed
call, `nn.Module.compile` compiles its call), so parameter names stay `blocks.i....` in every mode:
checkpoints load across modes, and `model.blocks[-1].text` still names the last block's stream.
Under compile every block shares one graph: dynamo guards on the code, not on the module instance.

The idle output head. In l2t the latent head is not computed, in t2l the text head is not (and
neither is the last block's tail that only feeds it: `model.latent_head_parameters()` /
`model.text_head_parameters()`). Under DDP with find_unused_parameters=False every parameter must
receive a gradient in every backward, or the reducer waits for it forever and errors on the next
step. Instead of paying for find_unused_parameters=True (an autograd-graph walk every step), the
loop *anchors* the idle parameters into the loss: `loss + 0 * sum(p.sum())` gives each of them an
exact zero gradient, so every bucket fills and the all-reduce proceeds. Because AdamW would still
move a parameter with a zero gradient (momentum and weight decay), the loop then sets the idle
parameters' `.grad` to None before the optimizer step: AdamW skips them, exactly as in a single
process where they simply got no gradient. Since every parameter now receives a gradient on every
step whatever the mode, the set of used parameters never changes and DDP's static_graph is valid.

FSDP2 (and HSDP, FSDP2 over a 2-D mesh) needs no anchor: a parameter that took no part in the step
keeps a None gradient after the reduce-scatter (every rank runs the same mode at a given step), so
the idle head is skipped the same way.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mmldlm.config import DistributedConfig, PerfConfig
from mmldlm.model.mmdit import AdaLN
from mmldlm.training.distributed import DistInfo

aten = torch.ops.aten

# Selective checkpointing keeps the outputs of these ops: the matmuls and the attention kernels,
# whose recomputation would cost as much again as the forward. Everything else in a block (norms,
# adaLN modulate, GELU, RoPE, residual adds, softmax of the explicit path) is elementwise: cheap to
# recompute, and together it is most of a block's saved activations.
_SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._grouped_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed_blocks(num_blocks: int, cfg: PerfConfig) -> list[int]:
    """Indices of the blocks that activation checkpointing wraps."""
    if cfg.activation_checkpointing == "none":
        return []
    if cfg.activation_checkpointing == "auto":
        raise ValueError("perf.activation_checkpointing=auto is resolved by the trainer before the model is set up")
    step = cfg.checkpoint_every_k if cfg.activation_checkpointing == "every_k" else 1
    return list(range(0, num_blocks, step))


def apply_activation_checkpointing(model: nn.Module, cfg: PerfConfig) -> None:
    """Recompute the activations of the chosen blocks in backward instead of keeping them (in place;
    applying it again replaces what an earlier call set)."""
    for block in model.blocks:
        block.__dict__.pop("forward", None)  # back to the class's forward
    context_fn = None
    if cfg.activation_checkpointing == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    def checkpointed_forward(block: nn.Module, *args, **forward_kwargs):
        # Non-reentrant checkpoint: works with keyword arguments, inputs that need no grad, and compile.
        forward = plain_class(block).forward  # not a compile region's (blocks_as_one_region), which calls this
        return checkpoint(forward, block, *args, use_reentrant=False, **kwargs, **forward_kwargs)

    for i in checkpointed_blocks(len(model.blocks), cfg):
        # A bound method, not a functools.partial: dynamo traces a method through (the checkpoint
        # becomes one higher-order op in the block's graph) but skipped the partial's frame
        # entirely, so `perf.compile` silently compiled nothing in a checkpointed block.
        model.blocks[i].forward = types.MethodType(checkpointed_forward, model.blocks[i])


# Variants of a block's graph for one text length: every block but the last (and joint's last), and
# the last block of l2t and of t2l (a stream whose head is idle only lends its keys and values); each
# with a padding mask or none (a batch whose texts all fill the length), with and without grad.
GRAPHS_PER_SHAPE = 3 * 2 * 2


def compile_options(perf: PerfConfig, device: torch.device, num_shapes: int | None = None) -> dict:
    """torch.compile's options for the blocks: `dynamic` as perf.compile_dynamic says (false under
    perf.cuda_graphs), and CUDA graphs (inductor's "reduce-overhead") on a CUDA device under
    perf.cuda_graphs. Dynamo's limit of graphs per code object (8; past it the blocks run eagerly)
    is raised to what the variants need: with static shapes one graph per variant and shape
    (`num_shapes`: the text lengths or packed row counts the batches can have); with the lengths
    dynamic one per variant, and under dynamic=None (the default) one more each, compiled for the first
    length before the second makes it dynamic."""
    options: dict = {"dynamic": False if perf.cuda_graphs else perf.compile_dynamic}
    if perf.cuda_graphs and device.type == "cuda":
        options["mode"] = "reduce-overhead"
    if perf.combo_kernels:  # inductor's options, which torch.compile takes in place of a mode
        mode = options.pop("mode", None)
        options["options"] = {"combo_kernels": True, **(torch._inductor.list_mode_options(mode) if mode else {})}
    # The whole model's graph (perf.compile_model) has as many variants (its modes for the blocks'), and
    # with a fixed number of text rows one each per row count: up to text_row_buckets + 1.
    per_shape = GRAPHS_PER_SHAPE * (perf.text_row_buckets + 1 if perf.compile_model and perf.text_row_buckets else 1)
    if options["dynamic"] is not False:
        options["recompile_limit"] = per_shape * (1 if options["dynamic"] else 2)
    elif num_shapes is not None:
        options["recompile_limit"] = per_shape * num_shapes
    if perf.compile_model:
        options["whole_model"] = True
    return options


def eager_blocks(perf: PerfConfig) -> contextlib.AbstractContextManager:
    """A context in which compiled blocks run eagerly, where they compile static shapes: the probes of
    other micro-batches and evaluation's batches would each compile (and record CUDA graphs) for a
    shape that training never sees again, past the limit of graphs that `compile_options` sized for
    training's lengths."""
    if perf.compile and (perf.cuda_graphs or perf.compile_dynamic is False):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def apply_compile(
    model: nn.Module,
    backend: str | Callable = "inductor",
    dynamic: bool | None = None,
    mode: str | None = None,
    recompile_limit: int | None = None,
    outside_blocks: bool = False,
    whole_model: bool = False,
    options: dict | None = None,
) -> None:
    """torch.compile each block in place (one graph per shape shared by all blocks; few shapes with
    padding to 64 or data.length_buckets), and with `outside_blocks` (perf.compile_outside_blocks) the
    model's parts whose shapes are the batch size's alone (`OUTSIDE_BLOCKS`); with `whole_model`
    (perf.compile_model) the model's forward as one graph instead (`compile_whole_model`). `backend`:
    inductor; tests pass a counting backend to see that graphs are really captured (`mode` and
    `options` are inductor's). `dynamic`, `mode`, `recompile_limit`, `options`: `compile_options`."""
    if recompile_limit is not None and recompile_limit > torch._dynamo.config.recompile_limit:
        torch._dynamo.config.recompile_limit = recompile_limit
    kwargs = {"mode": mode} if mode is not None else {}
    if options is not None:
        kwargs["options"] = options
    if whole_model:
        compile_whole_model(model, backend=backend, dynamic=dynamic, **kwargs)
        return
    if isinstance(getattr(model, "modulation", None), AdaLN):
        # Each block's adaLN tensors as one input of its graph: given as twelve views, AOTAutograd
        # detaches the eight it saves for the backward at every call, and CUDA graphs copy each input
        # that is not a parameter into the graph's memory at every replay (twelve copies for one).
        model.modulation.stacked = True
    for block in model.blocks:
        block.compile(backend=backend, dynamic=dynamic, **kwargs)
    if outside_blocks:
        for module, name in outside_block_methods(model):
            # The bound method, compiled, in the instance's place: the module's hooks (FSDP2's gathering)
            # stay outside the graph, the parameters and their names are untouched.
            module.__dict__[name] = torch.compile(getattr(module, name), backend=backend, dynamic=dynamic, **kwargs)


def compile_whole_model(model: nn.Module, **options) -> None:
    """torch.compile `model.forward` as one graph per mode and shape, in the instance's place (its
    hooks, DDP's included, stay outside; parameter names are untouched). The text lengths a batch
    brings as host ints (`text_lengths`) stay outside the graph, which would otherwise hold them as
    constants and compile again for every batch: they only say whether the batch has padding at
    all, which the call then says by giving no padding mask.

    The blocks' code is traced and compiled once and called for every block (`blocks_as_one_region`),
    not once per block: a graph's compile grows little with depth (on a CPU 51-54 s at 4 blocks, 61-63 s
    at 12; docs/benchmarks.md)."""
    blocks_as_one_region(model)
    compiled = torch.compile(model.forward, **options)

    def forward(*args, text_lengths=None, **kwargs):
        tokens = args[0] if args else kwargs["tokens"]
        if text_lengths is not None and min(text_lengths) == tokens.shape[1]:
            # Every text fills the length: no mask to attend with (a mask given by position beside
            # text_lengths is refused by the call as given twice, not dropped).
            kwargs["text_pad_mask"] = None
        return compiled(*args, **kwargs)

    model.__dict__["forward"] = forward


def blocks_as_one_region(model: nn.Module) -> None:
    """Make each block's forward torch.compile's nested compile region (hierarchical compilation): in
    the whole model's graph the blocks that run the same code with inputs of the same kinds share one
    compiled subgraph, forward and backward, where the graph would otherwise hold every block's
    operations and compile each anew. Checkpointed blocks (their checkpoint inside the region) and the
    others are a region each; the last block, where it skips a stream (returning None for it), is
    compiled apart: traced into the graph itself (torch 2.13) or a subgraph of its own (2.11).

    The region is the forward of a subclass of the block's class, which the block takes (as FSDP2's
    fully_shard does), not a method of the instance: torch 2.13 reuses a region bound to an instance
    with the first block's parameters for every block. It reuses its code only for inputs it can
    compare: tensors, constants and tuples of them (the attention's `JointAttention` is one) and no two
    inputs that are views of one tensor, so each block's adaLN tensors come as one tensor
    (`AdaLN.stacked`). torch 2.11 (the GPU machines' image) also compares the inputs' storage offsets:
    given views into the tensor of all blocks' modulation, at a different offset in every block, it
    compiled each block's code anew, so each block takes a copy of its own (`AdaLN.copied`: 16 MB
    copied a step at the small preset and micro-batch 64, 64 x 10 blocks x 12 x 512 float32). Eagerly
    a region is the plain call."""
    if isinstance(getattr(model, "modulation", None), AdaLN):
        model.modulation.stacked = model.modulation.copied = True
    classes: dict[tuple[type, Callable], type] = {}
    for block in model.blocks:
        cls = plain_class(block)
        checkpointed = block.__dict__.pop("forward", None)  # activation checkpointing's, in the instance
        forward = checkpointed.__func__ if checkpointed is not None else cls.forward
        if (cls, forward) not in classes:
            region = torch.compiler.nested_compile_region(forward)
            namespace = {"forward": region, "plain_class": cls, "__module__": cls.__module__}
            classes[cls, forward] = type(cls.__name__, (cls,), namespace)
        block.__class__ = classes[cls, forward]


def plain_class(block: nn.Module) -> type:
    """The block's own class, under the subclass `blocks_as_one_region` may have given it."""
    return getattr(type(block), "plain_class", type(block))


# The methods perf.compile_outside_blocks compiles, as (attribute of the model or '' for the model,
# method): each runs on tensors of the batch size's shapes alone ((B,), (B, H), (B, K, D), (B, K, H)),
# so each compiles once whatever the text lengths. Each returns whole tensors (shift_scale: two views
# of one), not the blocks' many views of the modulation: a graph's output that is a view is rebuilt
# outside it, one operation each.
OUTSIDE_BLOCKS = (
    ("t_text_embed", "forward"),
    ("t_latent_embed", "forward"),
    ("modulation", "projected"),
    ("", "latent_stream"),
    ("text_final", "shift_scale"),
    ("latent_final", "forward"),
    ("length_head", "forward"),
)


def outside_block_methods(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, method name) of each of `OUTSIDE_BLOCKS` that `model` has (none of the plain transformer
    of `bench --reference`, whose blocks alone compile)."""
    found = []
    for path, name in OUTSIDE_BLOCKS:
        module = getattr(model, path, None) if path else model
        if isinstance(module, nn.Module) and callable(getattr(module, name, None)):
            found.append((module, name))
    return found


def parallelize(
    model: nn.Module,
    perf: PerfConfig,
    cfg: DistributedConfig,
    info: DistInfo,
    accumulates: bool = False,
    num_shapes: int | None = None,
) -> nn.Module:
    """Apply activation checkpointing, then compile, to `model` (already on its device), then wrap it
    for data-parallel training; a single process trains it unwrapped. `accumulates`: a step may run
    several micro-batches (no_sync() before all but the last); `num_shapes`: the text lengths (or
    packed row counts) its batches can have (`compile_options`).

    DDP's static graph ("auto": on unless find_unused_parameters or `accumulates`) cannot run under
    no_sync(): torch 2.13 fails the first backward with an "expect_autograd_hooks_" internal assert
    (pytorch/pytorch#143580) and, once past it, stops all-reducing gradients."""
    apply_activation_checkpointing(model, perf)
    if perf.compile:
        apply_compile(
            model, **compile_options(perf, info.device, num_shapes), outside_blocks=perf.compile_outside_blocks
        )
    if not info.distributed:
        return model
    if cfg.shards_model:
        return apply_fsdp(model, info.mesh)
    return DistributedDataParallel(
        model,
        device_ids=[info.device.index] if info.device.type == "cuda" else None,
        # Off: the idle head is anchored instead (see the module doc); on: baseline recipe.
        find_unused_parameters=cfg.find_unused_parameters,
        gradient_as_bucket_view=True,  # grads live in the all-reduce buckets: no copy, less memory
        # broadcast_buffers=False under its current name: no buffer broadcast before every forward
        # (the model has no buffers that training changes).
        forward_sync_buffers=False,
        static_graph=cfg.static_graph
        if cfg.static_graph != "auto"
        else not (cfg.find_unused_parameters or accumulates),
    )


def apply_fsdp(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard `model` with FSDP2 in place (also the EMA copy, so that it is sharded like the model):
    over all ranks (`mesh` None), or HSDP over a 2-D (replicate, shard) mesh: sharded along "shard",
    replicated along "replicate", gradients reduce-scattered within a shard group and all-reduced
    across the groups."""
    # Per block first, then the root (embeddings, heads, timestep MLPs): each block's parameters
    # are gathered just before it runs and freed after, overlapping with the neighbours' compute. The
    # blocks' adaLN modulation (a third of the base preset's parameters, used once at the start) is a
    # unit of its own, so that it is not held gathered with the root's for the whole step.
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    if isinstance(getattr(model, "modulation", None), nn.Module):
        fully_shard(model.modulation, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # nn.Linear returns a view for a 3-D input, so the latent head's output is one, and FSDP2 warns at
    # every run that an in-place op on it would skip its pre-backward hook. Nothing here modifies a
    # model output in place (the objective and the samplers only read them).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    return model


def uses_anchor(cfg: DistributedConfig, info: DistInfo) -> bool:
    """Whether the loop must anchor idle-head parameters into the loss (DDP without the unused-parameter search)."""
    return info.distributed and cfg.strategy == "ddp" and not cfg.find_unused_parameters


def anchor(loss: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    """`loss` plus an exact zero that depends on every parameter in `params` (see the module doc)."""
    if not params:
        return loss
    return loss + 0.0 * sum(p.sum() for p in params)


def no_grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-step: on non-final micro-steps the gradient all-reduce / reduce-scatter
    is skipped and gradients accumulate locally; the final micro-step synchronises them all."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
