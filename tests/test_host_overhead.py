"""What the host does in a training step, counted on a CPU before it costs a GPU anything: a step that
does not log never reads the device (no `nonzero`, boolean selection, `.item()` or blocking copy), so
the host can run ahead of the GPU."""

import collections
import re

import pytest
import torch
from data_support import prepared
from loader_support import SyntheticLoader
from test_attention import stand_in_for_the_varlen_kernel
from test_perf import DIM, LEN, PAD_ID, VOCAB, objective_for, tiny_model
from test_perf import model_inputs as model_inputs_of
from torch.utils._python_dispatch import TorchDispatchMode

from mmldlm.config import load_config
from mmldlm.model import attention as joint_attention
from mmldlm.tools.operations import step_operations
from mmldlm.training import trainer as trainer_module
from mmldlm.training.distributed import DistInfo
from mmldlm.training.run import build_trainer
from mmldlm.training.trainer import Trainer

aten = torch.ops.aten


class LoopAsFused(torch.optim.AdamW):
    """torch's fused AdamW does not run on meta tensors: its per-parameter loop stands in, and the
    trainer takes the fused path (the skip flag and clipping factor handed over as device tensors)."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr, foreach=False, fused=False)
        self.defaults["fused"] = True
        self.handed_over = []

    def step(self):
        given = {k: self.__dict__.pop(k) for k in ("grad_scale", "found_inf") if k in self.__dict__}
        self.handed_over.append({k: v.device.type for k, v in given.items()})
        try:
            super().step()
        finally:
            self.__dict__.update(given)


class HostToDevice(TorchDispatchMode):
    """Copies from the host to another device, each as (dtype, whether the host waits for it:
    non_blocking=False)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            if args[0].device.type == "cpu" and target is not None and target.type != "cpu":
                self.copies.append((args[0].dtype, not kwargs.get("non_blocking", False)))
        elif func is aten.copy_.default and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            self.copies.append((args[1].dtype, not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)

    @property
    def blocking(self) -> list:
        return [copy for copy in self.copies if copy[1]]


def meta_trainer(tmp_path, monkeypatch, mode, overrides=(), model_options=None):
    """The trainer with its model and batches on the meta device: any read of a device value (a sync on
    a GPU) raises there, as meta tensors hold no values."""
    monkeypatch.setattr(trainer_module, "build_optimizer", lambda model, cfg: LoopAsFused(model.parameters(), cfg.lr))
    cfg = load_config(
        None,
        [
            "logging.progress_bar=false",
            f"train.run_dir={tmp_path}",
            "train.steps=4",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "train.precision=fp32",  # autocast has no meta device; its casts read nothing
            f"objective.mode={mode}",
            *overrides,
        ],
    )
    model = tiny_model()
    for key, value in (model_options or {}).items():
        setattr(model.cfg, key, value)

    def loader(micro):
        return SyntheticLoader(micro, VOCAB, LEN, DIM, pad_id=PAD_ID, first_token=2)

    return Trainer(cfg, model, objective_for(cfg), loader, DistInfo(device=torch.device("meta")))


@pytest.mark.parametrize("mode", ["l2t", "t2l", "joint", "random"])
def test_a_step_that_does_not_log_never_waits_for_the_device(tmp_path, monkeypatch, mode):
    """Every mode, clipping on and classifier-free dropping on: two steps run to the end on the meta
    device (whose tensors hold no values, so a `nonzero`, a boolean selection or an `.item()` of a
    device tensor raises), with no blocking copy to the device; the fused optimizer is handed the skip
    flag and the clipping factor on the device."""
    trainer = meta_trainer(tmp_path, monkeypatch, mode, ["optim.grad_clip=1.0", "objective.cond_drop_prob=0.5"])
    with HostToDevice() as copies:
        pending = [trainer.run_step(), trainer.run_step()]
    assert copies.blocking == []
    assert [p.step for p in pending] == [1, 2]
    assert trainer.optimizer.handed_over == [{"grad_scale": "meta", "found_inf": "meta"}] * 2
    assert next(trainer.raw_model.parameters()).device.type == "meta"


@pytest.mark.parametrize("mode", ["l2t", "t2l", "joint", "random"])
def test_each_micro_batch_reaches_the_device_in_two_copies_its_batch_and_its_draws(tmp_path, monkeypatch, mode):
    """Two micro-batches a step, every draw of the objective in play (classifier-free dropping, the
    text head's rows filled to a count): each micro-batch's tensors go to the device in one copy of
    bytes and the objective's draws in another, where each tensor took a copy of its own (9-11 a
    micro-batch, and a pinning each on a CUDA device)."""
    overrides = ["optim.grad_clip=1.0", "objective.cond_drop_prob=0.5", "perf.text_row_buckets=4"]
    trainer = meta_trainer(tmp_path, monkeypatch, mode, [*overrides, "train.micro_batch_size=4"])
    trainer.run_step()  # the first also moves the latents' statistics, once
    with HostToDevice() as moved:
        pending = [trainer.run_step(), trainer.run_step()]
    assert [p.num_accum for p in pending] == [2, 2]
    assert [dtype for dtype, _ in moved.copies] == [torch.uint8] * 8, moved.copies


def test_tensors_laid_end_to_end_come_back_as_they_were_from_their_copy():
    """`laid_end_to_end` and `views_of`, the one copy of `to_device_together`: every dtype the step
    moves (and bf16, 0-d, empty and non-contiguous tensors) comes back equal from a copy of the
    buffer, each part starting at a multiple of 16 bytes."""
    from mmldlm.diffusion.rng import ALIGNMENT, laid_end_to_end, views_of

    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.tensor(0.25),
        torch.randint(0, 9, (5,), generator=g),
        torch.rand(3, 4, generator=g) > 0.5,
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
        torch.empty(0, dtype=torch.int64),
        torch.randn(4, 6, generator=g)[:, ::2],
        torch.randn(3, 1, 7, generator=g, dtype=torch.float64),
    ]
    buffer, places = laid_end_to_end(tensors)
    assert buffer.dtype == torch.uint8 and [offset % ALIGNMENT for offset, *_ in places] == [0] * len(tensors)
    back = views_of(buffer.clone(), places)
    for before, after in zip(tensors, back):
        assert after.dtype == before.dtype and after.shape == before.shape and torch.equal(after, before)


def through_one_copy(tensors, device):
    """`rng.to_device_together` as it goes to a GPU, on the host: the tensors (None passing through)
    come back as views of a copy of one buffer, whatever `device` is."""
    from mmldlm.diffusion import rng

    present = [x for x in tensors if x is not None]
    buffer, places = rng.laid_end_to_end(present)
    views = iter(rng.views_of(buffer.clone(), places))
    return [None if x is None else next(views) for x in tensors]


def test_the_objectives_draws_moved_together_give_the_losses_they_gave_moved_one_by_one(monkeypatch):
    """Each draw of the objective reaches the model as itself through the shared copy: on a CPU the
    draws do not move, so here they go through a copy of `laid_end_to_end`'s buffer on the host
    anyway, and every mode (with dropping and filled text rows) gives the losses and metrics of the
    draws as they were, bit for bit."""
    from mmldlm.diffusion import rng

    cfg = load_config(None, ["objective.cond_drop_prob=0.5", "perf.text_row_buckets=4"])
    objective, model = objective_for(cfg), tiny_model()
    tokens, latents, _, _, pad_mask = model_inputs_of(batch=6)
    batch = {"tokens": tokens, "pad_mask": pad_mask, "latents": latents}

    for mode in ("l2t", "t2l", "joint"):
        objective.cfg.mode = mode
        runs = []
        for patched in (False, True):
            if patched:
                monkeypatch.setattr(rng, "to_device_together", through_one_copy)
            loss, metrics = objective(model, batch, step=0, generator=torch.Generator().manual_seed(3))
            runs.append((loss, {k: v for k, v in metrics.items() if torch.is_tensor(v)}))
            monkeypatch.undo()
        (loss, metrics), (loss_copied, metrics_copied) = runs
        assert torch.equal(loss, loss_copied), mode
        assert metrics.keys() == metrics_copied.keys()
        assert all(torch.equal(metrics[k], metrics_copied[k]) for k in metrics), mode


@pytest.mark.parametrize(
    "config, extra",
    [
        ("default", []),
        ("optimized", []),
        ("optimized", ["data.packing=true", "data.pack_rows=[2]"]),
        ("optimized", ["model.attention=varlen"]),
        ("optimized", ["data.packing=true", "data.pack_rows=[2]", "model.attention=varlen"]),
    ],
    ids=["default", "optimized", "optimized-packed-rows", "optimized-varlen", "optimized-packed-rows-varlen"],
)
def test_the_presets_steps_on_real_batches_queue_without_reading_the_device(
    tmp_path, tmp_path_factory, monkeypatch, config, extra
):
    """The real loader, objective and model of a preset (the random mixture of modes, accumulation of
    two micro-batches, checkpointed blocks; packed rows padded to a row count; the variable-length
    kernel, whose CPU stand-in is tests/test_attention.py's, its segments built from the batch on the
    device), built on the meta device: three steps queue, and the record is where the host reads (a
    meta tensor has no value to read). Activation checkpointing is named: `auto` probes memory at
    start-up, which needs a real device."""
    monkeypatch.setattr(trainer_module, "build_optimizer", lambda model, cfg: LoopAsFused(model.parameters(), cfg.lr))
    built = []
    if "model.attention=varlen" in extra:
        stand_in_for_the_varlen_kernel(monkeypatch, record=False)
        real_segments = joint_attention.segments
        monkeypatch.setattr(joint_attention, "segments", lambda *args: built.append(args) or real_segments(*args))
    overrides = [
        f"data.path={prepared(tmp_path_factory)}",
        "model=tiny",
        "data.num_workers=0",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "perf.activation_checkpointing=selective",
        f"train.run_dir={tmp_path}",
        *extra,
    ]
    cfg = load_config(config, overrides)
    trainer = build_trainer(cfg, DistInfo(device=torch.device("meta")))
    with HostToDevice() as copies:
        pending = [trainer.run_step() for _ in range(3)]
    assert copies.blocking == [] and [p.num_accum for p in pending] == [2, 2, 2]
    assert {p.mode for p in pending} <= {"l2t", "t2l", "joint"}
    assert bool(built) == ("model.attention=varlen" in extra)  # the variable-length path was taken
    with pytest.raises(NotImplementedError, match="meta"):
        trainer.read_record(pending[-1])


class CyclingLengths:
    """Batches of 4 texts whose longest is each length of `lengths` in turn (a bucket each), the others
    shorter (every batch has padding), with the text lengths on the host as the loader gives them."""

    def __init__(self, lengths, micro: int = 4):
        self.lengths, self.micro, self.generator = lengths, micro, torch.Generator().manual_seed(0)

    def __iter__(self):
        while True:
            for L in self.lengths:
                lengths = torch.randint(1, L, (self.micro,), generator=self.generator)
                lengths[0] = L
                pad_mask = torch.arange(L)[None, :] < lengths[:, None]
                tokens = torch.randint(2, VOCAB, (self.micro, L), generator=self.generator).masked_fill(
                    ~pad_mask, PAD_ID
                )
                yield {"tokens": tokens, "pad_mask": pad_mask, "latents": torch.randn(self.micro, 1, DIM)}


@pytest.fixture
def dynamo_limits():
    """Dynamo's limit of graphs per code object as torch sets it (8), restored after the test (the
    trainer raises it for static shapes)."""
    with torch._dynamo.config.patch(recompile_limit=8):
        yield


def has_symbolic_shapes(counter) -> bool:
    """Whether a graph `counter` (dynamo's CompileCounterWithBackend) captured has a symbolic size."""
    return any(
        isinstance(dim, torch.SymInt)
        for graph in counter.graphs
        for node in graph.graph.nodes
        if isinstance(node.meta.get("example_value"), torch.Tensor)
        for dim in node.meta["example_value"].shape
    )


def compiled_functions(counter) -> set[str]:
    """The functions the graphs `counter` captured were compiled from: the outermost frame of their
    operations' stack traces."""
    return {
        re.match(r'\s*File "[^"]+", line \d+, in (\w+)', node.meta["stack_trace"]).group(1)
        for graph in counter.graphs
        for node in graph.graph.nodes
        if node.meta.get("stack_trace")
    }


def compiled_trainer(
    tmp_path, monkeypatch, lengths, overrides=(), loader=None, backend="aot_eager", attention_kind="sdpa"
):
    """A trainer whose blocks compile with a counting backend (aot_eager: forward and backward traced,
    no code generated) over batches cycling through `lengths`, the mode changing every round of them.
    `attention_kind` varlen: the variable-length kernel's CPU stand-in (tests/test_attention.py)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from mmldlm.config import MODES
    from mmldlm.training import parallelize

    counter = CompileCounterWithBackend(backend)
    real_compile = parallelize.apply_compile
    monkeypatch.setattr(parallelize, "apply_compile", lambda model, **options: real_compile(model, counter, **options))
    torch._dynamo.reset()
    counters.clear()
    cfg = load_config(
        None,
        [
            "logging.progress_bar=false",
            f"train.run_dir={tmp_path}",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.precision=fp32",
            "perf.compile=true",
            "perf.activation_checkpointing=selective",
            *overrides,
        ],
    )
    if attention_kind == "varlen":
        stand_in_for_the_varlen_kernel(monkeypatch, record=False)
    model = tiny_model(attention=attention_kind)
    model.cfg.max_seq_len = max(lengths)
    trainer = Trainer(cfg, model, objective_for(cfg), loader or CyclingLengths(lengths), DistInfo())
    monkeypatch.setattr(trainer.objective, "mode_at", lambda step: MODES[(step // len(lengths)) % len(MODES)])
    return trainer, counter, counters


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
def test_compiled_blocks_have_no_graph_break_and_stop_compiling_once_every_mode_and_length_was_seen(
    tmp_path, monkeypatch, dynamo_limits
):
    """torch.compile of each block (perf.compile): forward and backward in one graph each, no break;
    the first round over four length buckets and the three modes compiles every graph there will be
    (at most two per variant of the last block: the first length static, then one with the length
    dynamic, fewer than one per mode and length); the second round compiles nothing more."""
    from mmldlm.config import MODES

    lengths = (8, 16, 24, 32)
    trainer, counter, counters = compiled_trainer(tmp_path, monkeypatch, lengths)
    compiled = []
    for _ in range(2):  # every (mode, length) once a round
        for _ in range(len(MODES) * len(lengths)):
            trainer.train_step()
        compiled.append(counter.frame_count)
    assert dict(counters["graph_break"]) == {}
    assert compiled[0] == compiled[1] <= 2 * len(MODES) < len(MODES) * len(lengths), compiled


@pytest.mark.slow  # inductor generates and compiles C++ for each graph: tens of seconds cold
def test_inductor_trains_the_blocks_through_lengths_it_has_not_seen(tmp_path, monkeypatch, dynamo_limits):
    """The real backend, not a tracing one, without checkpointing (which recomputes what a backward
    needs instead of saving it): after the first length each block variant recompiles with the length
    dynamic, and the backward at every later length must read what its forward saved with that
    length's layout. The attention's queries and keys were once saved with the strides of the first
    length, and the first backward at another length stopped on inductor's stride assertion."""
    from mmldlm.config import MODES

    lengths = (8, 16, 24)
    overrides = ["perf.activation_checkpointing=none"]
    trainer, counter, counters = compiled_trainer(tmp_path, monkeypatch, lengths, overrides, backend="inductor")
    losses = [trainer.train_step()["loss"] for _ in range(len(MODES) * len(lengths))]  # each mode at each length
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert dict(counters["graph_break"]) == {}
    assert 3 <= counter.frame_count <= 2 * 3, counter.frame_count  # static then dynamic, three block variants


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
@pytest.mark.parametrize(
    "switch, attention_kind",
    [("perf.compile_dynamic=false", "sdpa"), ("perf.cuda_graphs=true", "sdpa"), ("perf.cuda_graphs=true", "varlen")],
    ids=["static", "cuda-graphs", "cuda-graphs-varlen"],
)
def test_static_shapes_compile_one_graph_per_length_bucket_and_block_variant_then_nothing(
    tmp_path, monkeypatch, dynamo_limits, switch, attention_kind
):
    """Static shapes (what CUDA graphs need; on a CPU perf.cuda_graphs compiles the same graphs
    without them): the first round over four lengths and the three modes compiles one graph per
    length for each of the three block variants (every block but the last; the last of l2t, of t2l;
    joint's last block is the first variant), 12 in all, past dynamo's default limit of 8 graphs per
    code object, which the trainer raises for the lengths its batches can have; the second round
    compiles nothing and the shapes stay static (no graph has a symbolic size). The same with the
    variable-length kernel, whose real positions differ from batch to batch of one length."""
    from mmldlm.config import MODES

    lengths = (8, 16, 24, 32)
    overrides = [switch, "data.pad_to_multiple=8", f"model.attention={attention_kind}"]
    trainer, counter, counters = compiled_trainer(
        tmp_path, monkeypatch, lengths, overrides, attention_kind=attention_kind
    )
    compiled = []
    for _ in range(2):
        for _ in range(len(MODES) * len(lengths)):
            trainer.train_step()
        compiled.append(counter.frame_count)
    assert dict(counters["graph_break"]) == {}
    assert compiled == [3 * len(lengths)] * 2
    assert not has_symbolic_shapes(counter)


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
def test_the_parts_outside_the_blocks_compile_once_whatever_the_lengths(tmp_path, monkeypatch, dynamo_limits):
    """perf.compile_outside_blocks under static shapes: over four lengths and the three modes, twice,
    the blocks compile their 12 graphs as without it, and the parts outside them one graph each,
    the same for every length and mode: the timestep MLPs (both in one graph), the adaLN modulation,
    the latent stream's input, the text head's modulation, the latent head and the length head. No
    graph breaks, and the second round compiles nothing."""
    from mmldlm.config import MODES
    from mmldlm.training.parallelize import outside_block_methods

    lengths = (8, 16, 24, 32)
    overrides = ["perf.compile_dynamic=false", "data.pad_to_multiple=8", "perf.compile_outside_blocks=true"]
    trainer, counter, counters = compiled_trainer(tmp_path, monkeypatch, lengths, overrides)
    trainer.objective.length_head = True  # the length head's loss on, as the trainer sets it for this model
    assert len(outside_block_methods(trainer.raw_model)) == 7
    compiled = []
    for _ in range(2):
        for _ in range(len(MODES) * len(lengths)):
            trainer.train_step()
        compiled.append(counter.frame_count)
    assert dict(counters["graph_break"]) == {}
    assert compiled == [3 * len(lengths) + 6] * 2
    outermost = compiled_functions(counter)
    assert {"forward", "projected", "latent_stream", "shift_scale", "checkpointed_forward"} == outermost, outermost


class CyclingPacked:
    """Packed batches of 4 texts (rows of 32 positions, data.pack_rows=[2]) that first-fit puts in 1,
    2, 3 and 4 rows in turn: padded to 2 rows, or one row per text past it, so the blocks see 2 shapes.
    `wide`: the same texts in one row (data.pack_length=128, data.pack_rows=[1]) as wide as the
    shortest of data.length_buckets=[64] that holds them, 64 for the first three, 128 for the last:
    2 shapes too."""

    FILLS = ((4, 5, 6, 7), (20, 9, 8, 5), (20, 17, 16, 3), (25, 26, 27, 28))  # 1, 2, 3, 4 rows of 32

    def __init__(self, wide: bool = False):
        from mmldlm.data.dataset import PadCollate

        layout = dict(buckets=[64], pack_rows=[1]) if wide else dict(pack_rows=[2])
        self.collate = PadCollate(PAD_ID, 8, None, 128 if wide else 32, **layout)
        self.generator = torch.Generator().manual_seed(0)

    def __iter__(self):
        while True:
            for fill in self.FILLS:
                samples = [
                    (i, torch.randint(2, VOCAB, (n,), generator=self.generator).numpy(), torch.randn(1, DIM).numpy())
                    for i, n in enumerate(fill)
                ]
                yield self.collate(samples)


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
@pytest.mark.parametrize(
    "attention_kind, wide",
    [("sdpa", False), ("varlen", False), ("varlen", True)],
    ids=["sdpa", "varlen", "varlen-wide"],
)
def test_packed_rows_padded_to_few_counts_compile_one_graph_per_count_and_block_variant_then_nothing(
    tmp_path, monkeypatch, dynamo_limits, attention_kind, wide
):
    """data.pack_rows with static shapes: packed batches that fill 1-4 rows reach the blocks as 2 or 4
    rows (the latent groups of a row rounded to data.pad_to_multiple=8), so the first round over them
    and the three modes compiles 2 graphs for each of the three block variants, the second none; the
    variable-length kernel's segments too, and one wide row of 64 or 128 positions (its width from
    data.length_buckets)."""
    from mmldlm.config import MODES

    overrides = ["perf.cuda_graphs=true", "data.pad_to_multiple=8", "data.packing=true"]
    overrides += (
        ["data.pack_length=128", "data.pack_rows=[1]", "data.length_buckets=[64]"] if wide else ["data.pack_rows=[2]"]
    )
    overrides.append(f"model.attention={attention_kind}")
    trainer, counter, counters = compiled_trainer(
        tmp_path, monkeypatch, (32,), overrides, CyclingPacked(wide), attention_kind=attention_kind
    )
    monkeypatch.setattr(trainer.objective, "mode_at", lambda step: MODES[(step // 4) % len(MODES)])
    compiled = []
    for _ in range(2):
        for _ in range(len(MODES) * len(CyclingPacked.FILLS)):
            trainer.train_step()
        compiled.append(counter.frame_count)
    assert dict(counters["graph_break"]) == {}
    assert compiled == [3 * 2] * 2


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
def test_static_shapes_compile_nothing_for_the_micro_batch_probe_or_evaluation(tmp_path, monkeypatch, dynamo_limits):
    """Under static shapes the blocks run eagerly where the shapes are not training's: the probes of
    train.micro_batch_size=auto (other batch sizes) and a forward of another batch size inside
    `eager_blocks` (what evaluation during training runs in) compile no graph; the training step
    after them compiles its own."""
    from mmldlm.training.parallelize import eager_blocks

    overrides = ["perf.compile_dynamic=false", "train.micro_batch_size=auto", "train.global_batch_size=8"]
    trainer, counter, _ = compiled_trainer(tmp_path, monkeypatch, (8,), overrides)
    assert trainer.micro_batch_size in (1, 2, 4, 8) and counter.frame_count == 0
    tokens, latents, t_text, t_latent, pad_mask = model_inputs_of(batch=3)
    with eager_blocks(trainer.cfg.perf):
        trainer.raw_model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
    assert counter.frame_count == 0
    trainer.train_step()
    assert counter.frame_count >= 1


def test_a_step_that_accumulates_under_cuda_graphs_adds_every_micro_batch_into_gradients_of_its_own(tmp_path):
    """Under CUDA graphs a micro-batch's gradients live in the graphs' memory until the next replay:
    before a step of two micro-batches every trained parameter has a zeroed .grad of its own (so the
    first micro-batch's gradient is added into it, not kept as it is), and the step's update is the
    one of the same step without CUDA graphs. (A CPU stands in: the trainer is told it replays.)"""
    updated = {}
    for graphs in (False, True):
        cfg = load_config(
            None,
            [
                "logging.progress_bar=false",
                f"train.run_dir={tmp_path / str(graphs)}",
                "train.global_batch_size=8",
                "train.micro_batch_size=4",
                "train.precision=fp32",
                "objective.mode=joint",
            ],
        )

        def loader(micro):
            return SyntheticLoader(micro, VOCAB, LEN, DIM, pad_id=PAD_ID, first_token=2)

        trainer = Trainer(cfg, tiny_model(), objective_for(cfg), loader, DistInfo())
        trainer.cuda_graphs = graphs
        buffered = []

        def look(model, args, buffered=buffered):
            buffered.append(all(p.grad is not None for p in model.parameters() if p.requires_grad))

        trainer.raw_model.register_forward_pre_hook(look)
        trainer.train_step()
        assert len(buffered) == 2 and buffered[0] is graphs  # the first micro-batch's forward
        updated[graphs] = [p.detach().clone() for p in trainer.raw_model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(updated[False], updated[True]))


def test_compile_options_follow_the_perf_switches():
    """perf.cuda_graphs is inductor's "reduce-overhead" on a CUDA device, with static shapes and a
    limit of graphs per code object that holds every length (12 variants each); elsewhere static
    shapes alone; perf.compile_dynamic otherwise passes through as torch.compile's `dynamic`, with a
    limit for the 12 variants dynamic, twice that where each first compiles for one length.
    perf.combo_kernels turns the mode into inductor's options, which torch.compile takes instead."""
    from mmldlm.config import PerfConfig
    from mmldlm.training.parallelize import compile_options

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    graphs = PerfConfig(compile=True, cuda_graphs=True)
    assert compile_options(graphs, cuda, 5) == {"dynamic": False, "mode": "reduce-overhead", "recompile_limit": 60}
    assert compile_options(graphs, cpu, 5) == {"dynamic": False, "recompile_limit": 60}
    assert compile_options(PerfConfig(compile=True), cuda, 5) == {"dynamic": None, "recompile_limit": 24}
    dynamic = PerfConfig(compile=True, compile_dynamic=True)
    assert compile_options(dynamic, cuda, 5) == {"dynamic": True, "recompile_limit": 12}
    # perf.combo_kernels: inductor's options, CUDA graphs among them in place of the mode
    combo = PerfConfig(compile=True, cuda_graphs=True, combo_kernels=True)
    combined, alone = {"combo_kernels": True, "triton.cudagraphs": True}, {"combo_kernels": True}
    assert compile_options(combo, cuda, 5) == {"dynamic": False, "options": combined, "recompile_limit": 60}
    assert compile_options(combo, cpu, 5) == {"dynamic": False, "options": alone, "recompile_limit": 60}


def older_depth(tmp_path) -> list[str]:
    """Overrides for the older codebase's depth (24) at width 64 on 16 synthetic texts of 8-24 tokens,
    bf16 autocast, 4 texts a step, no checkpointing: a step's operations counted in seconds."""
    from mmldlm.data.synthetic import SyntheticShape, write_synthetic

    shape = SyntheticShape(vocab_size=300, min_length=8, max_length=24, latent_dim=32, num_samples=16)
    data = write_synthetic(shape, tmp_path / "data")
    return [
        f"data.path={data}",
        "model=base-2k",
        "model.hidden_size=64",
        "model.num_heads=4",
        "model.max_seq_len=24",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "train.precision=bf16",
        "data.num_workers=0",
        "perf.activation_checkpointing=none",
    ]


@pytest.mark.parametrize("grouped", [False, True], ids=["linear-layers", "grouped-products"])
@pytest.mark.parametrize("compute_weights", [False, True], ids=["autocast-casts", "bf16-compute-weights"])
def test_a_step_at_the_older_shapes_depth_dispatches_under_2_45_times_a_plain_transformers_operations(
    tmp_path, compute_weights, grouped
):
    """bf16 autocast, depth 24 (the older codebase's), width 64 so that it runs in seconds: the ATen
    operations of one step of each mode over those of the plain transformer of the same dimensions
    that `bench --reference` measures (mmldlm/model/reference.py), same precision, optimizer and
    clipping, its rotary embeddings in bf16 as ours. Two streams make twice the reference's matrix
    products and their autograd plumbing (view, t, the weights' casts), and adaLN-Zero's modulations
    and gates (about 40 operations a block) and QK-norm (about 28) come on top: 2x is below the floor
    of this design in eager mode (docs/benchmarks.md, "Operations per block"). Before the blocks'
    modulations became one product and the step stopped reading the device: 3.5x (10,534 against
    2,958 in joint mode, the reference then rotating in float32); now 2.36-2.44x, and 2.56-2.66x of
    the operations that run a kernel (QK-norm's RMSNorm counted as the fused kernel a CUDA device
    runs: `dispatch_as_on_a_gpu`): 6,755 operations against 2,766 in joint mode. With bf16 compute
    weights (both rows) the casts of every weight go: 6,233 against 2,574. With the streams' products
    grouped (perf.grouped_linears): 2.16-2.21x (6,093 against 2,753 in joint mode), 2.32-2.40x the
    kernels; 2.19-2.25x and 2.42-2.51x beside bf16 compute weights."""
    from mmldlm.tools.bench import build_reference
    from mmldlm.tools.bench import build_trainer as build_bench_trainer

    common = [*older_depth(tmp_path), f"perf.compute_weights={str(compute_weights).lower()}"]
    _, _, reference, _ = build_reference("optimized", common, str(tmp_path / "reference"))
    common.append(f"perf.grouped_linears={str(grouped).lower()}")
    most, most_kernels = (2.26, 2.52) if grouped else (2.45, 2.7)
    assert (reference.compute_weights is not None) is compute_weights
    assert len(reference.raw_model.blocks) == 24
    reference_ops = step_operations(reference)
    for mode in ("l2t", "t2l", "joint"):
        _, _, trainer, _ = build_bench_trainer("optimized", [*common, f"objective.mode={mode}"], str(tmp_path / mode))
        ours = step_operations(trainer)
        message = (
            f"{mode}: {ours.total} operations ({ours.kernels} kernels) against {reference_ops.total} "
            f"({reference_ops.kernels})"
        )
        assert ours.total <= most * reference_ops.total and ours.kernels <= most_kernels * reference_ops.kernels, (
            message
        )


def test_packed_rows_add_few_operations_a_block_to_the_padded_step(tmp_path):
    """The same micro-batch padded and packed in rows (data.packing), depth 24, bf16 autocast: packing
    places each position's adaLN tensors and each text's latent keys, queries and values in the rows
    and takes the latent outputs back. Two gathers of a block's six text modulations (the shifts, which
    the backward does not keep, apart from the scales and gates) and one of its latent q, k and v
    together keep that to about 39 operations (12 kernels) a block; a gather per tensor made it 69 (25
    kernels), and one gather of all six would make it 28 (7) but keep the shifts for the backward."""
    from mmldlm.tools.bench import build_trainer as build_bench_trainer

    common = older_depth(tmp_path)
    for mode in ("l2t", "t2l", "joint"):
        counts = []
        for packing in ("false", "true"):
            overrides = [*common, f"objective.mode={mode}", f"data.packing={packing}"]
            _, _, trainer, _ = build_bench_trainer("optimized", overrides, str(tmp_path / f"{mode}-{packing}"))
            counts.append(step_operations(trainer))
        padded, packed = counts
        blocks = len(trainer.raw_model.blocks)
        extra, extra_kernels = (packed.total - padded.total) / blocks, (packed.kernels - padded.kernels) / blocks
        assert 0 < extra <= 42 and extra_kernels <= 13, (
            f"{mode}: {extra:.1f} operations, {extra_kernels:.1f} kernels a block"
        )


def test_operations_are_traced_to_the_lines_that_cause_them_forward_and_backward(tmp_path):
    """`step_operations(..., by_site=True)` (scripts/step_operations.py --sites): every operation of the
    step is counted once, at a line of the package (a backward one at the forward line whose gradient
    it computes), and counting by line changes nothing that is counted (two trainers of one seed: the
    same batches and masks, whose counts of masked rows change some operations from step to step)."""
    from mmldlm.data.synthetic import SyntheticShape, write_synthetic
    from mmldlm.tools.bench import build_trainer as build_bench_trainer

    shape = SyntheticShape(vocab_size=300, min_length=8, max_length=8, latent_dim=32, num_samples=8)
    overrides = [
        f"data.path={write_synthetic(shape, tmp_path / 'data')}",
        "model=tiny",
        "model.max_seq_len=8",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "train.precision=bf16",
        "data.num_workers=0",
        "perf.activation_checkpointing=none",
        "objective.mode=l2t",
    ]
    _, _, trainer, _ = build_bench_trainer("optimized", overrides, str(tmp_path / "plain"))
    plain = step_operations(trainer)
    _, _, trainer, _ = build_bench_trainer("optimized", overrides, str(tmp_path / "by-site"))
    by_site = step_operations(trainer, by_site=True)
    assert plain.sites is None
    assert by_site.counts == plain.counts
    assert sum(by_site.sites.values()) == by_site.total
    depth = len(trainer.raw_model.blocks)
    lines = {}
    for (site, _), n in by_site.sites.items():
        lines[site] = lines.get(site, 0) + n
    unplaced = [site for site in lines if not re.fullmatch(r"(forward|backward) [\w/]+\.py:\d+ \S+", site)]
    assert unplaced == []
    qkv = [site for site in lines if site.endswith(" qk_heads") and "model/mmdit.py" in site]
    assert {site.split()[0] for site in qkv} == {"forward", "backward"}
    # each block's attention runs once forward and once backward
    attention = {op: n for (site, op), n in by_site.sites.items() if "scaled_dot_product" in op}
    assert sorted(attention.values()) == [depth, depth], attention


def outermost_operations(profile) -> collections.Counter:
    """The ATen operations of a torch.profiler record that run under no other, by name."""
    from mmldlm.tools.operations import _under

    return collections.Counter(
        e.name for e in profile.events() if e.name.startswith("aten::") and not _under(e, ("aten::",))
    )


def test_the_gradient_norm_is_torchs_to_the_bit_in_three_host_operations_whatever_the_parameter_count():
    """`gradient_norm`, the clipping's norm: torch's get_total_norm of the gradients bit for bit, in one
    `_foreach_norm`, a stack and a norm for 3 gradients or 300, where get_total_norm adds a `Tensor.to`
    per gradient even where nothing moves (314 of a compiled step's 1,843 at 24 blocks); gradients of
    mixed dtypes take get_total_norm itself."""
    from mmldlm.training.optim import gradient_norm

    cpu = [torch.profiler.ProfilerActivity.CPU]
    g = torch.Generator().manual_seed(0)
    for n in (3, 300):
        grads = [torch.randn(int(size), generator=g) for size in torch.randint(1, 50, (n,), generator=g)]
        assert torch.equal(gradient_norm(grads), torch.nn.utils.get_total_norm(grads))
        with torch.profiler.profile(activities=cpu) as ours, torch.no_grad():
            gradient_norm(grads)
        assert outermost_operations(ours) == {"aten::_foreach_norm": 1, "aten::stack": 1, "aten::linalg_vector_norm": 1}
        with torch.profiler.profile(activities=cpu) as torchs:
            torch.nn.utils.get_total_norm(grads)
        assert outermost_operations(torchs)["aten::to"] == n
    mixed = [torch.randn(4, generator=g), torch.randn(5, generator=g).to(torch.bfloat16)]
    assert torch.equal(gradient_norm(mixed), torch.nn.utils.get_total_norm(mixed))


@pytest.mark.slow  # inductor generates and builds C++ for two graphs: about 10 s cold
def test_the_kernels_compiled_code_runs_are_counted_inductors_own_and_the_external_ones():
    """`counted_calls` (scripts/step_operations.py --host) of a compiled linear layer, GELU and sum,
    forward and backward: one compiled call each way, the two matrix products as external kernels,
    and the pointwise and reduction kernels inductor generated, which a GPU would launch too."""
    import torch._inductor.config

    from mmldlm.tools.operations import counted_calls

    torch._dynamo.reset()
    layer = torch.nn.Linear(8, 8, bias=False)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        f = torch.compile(lambda x: torch.nn.functional.gelu(layer(x)).sum(), backend="inductor")
        x = torch.randn(4, 8)
        f(x).backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            f(x).backward()
    calls = counted_calls(profile)
    assert calls.compiled_calls == 2
    assert calls.in_compiled["aten::mm"] == 2, calls.in_compiled  # the product, then the weight's gradient
    assert calls.fused_kernels >= 2  # GELU and the sum forward, GELU's gradient backward
    assert calls.compiled_kernels == calls.fused_kernels + 2


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
def test_a_compiled_steps_host_calls_are_counted_and_each_block_takes_its_adaln_tensors_as_one_input(
    tmp_path, monkeypatch, dynamo_limits
):
    """`host_operations` (scripts/step_operations.py --host) on a compiled step: every block runs one
    compiled call forward and one backward, the operations outside them are counted apart, and each
    block's graph takes its adaLN tensors as one input (B, 12, 1, H): twelve views as inputs had
    AOTAutograd detach the eight it saves for the backward, one host operation each per block call
    (189 of the 853 in compiled code of a joint step at depth 24, inductor; none since)."""
    from mmldlm.tools.operations import host_operations

    trainer, counter, counters = compiled_trainer(tmp_path, monkeypatch, (8,), ["perf.compile_dynamic=false"])
    assert trainer.raw_model.modulation.stacked
    calls = host_operations(trainer, warmup=3)
    assert dict(counters["graph_break"]) == {}
    blocks = len(trainer.raw_model.blocks)
    assert calls.compiled_calls == 2 * blocks
    B, H = 4, trainer.raw_model.cfg.hidden_size
    for graph in counter.graphs:
        inputs = [tuple(n.meta["example_value"].shape) for n in graph.graph.nodes if n.op == "placeholder"]
        # (B, 1, H): the latent stream (one latent), and no adaLN tensor beside it
        assert inputs.count((B, 12, 1, H)) == 1 and inputs.count((B, 1, H)) == 1, inputs
    assert calls.eager["aten::_foreach_norm"] == 1 and calls.eager["aten::_fused_adamw_"] >= 1, calls.eager
    assert calls.total == sum(calls.eager.values()) + sum(calls.in_compiled.values()) + 2 * blocks


@pytest.mark.slow  # inductor generates and compiles C++ for each graph: tens of seconds cold
def test_compiled_blocks_with_grouped_products_call_four_products_a_block_forward_and_eight_backward(
    tmp_path, monkeypatch, dynamo_limits
):
    """perf.grouped_linears under compile (bf16, which compiled grouped_mm takes): the external calls
    a compiled block makes are the plain transformer block's count, four products forward and eight
    backward, each a grouped_mm over both streams' rows, and no matrix product of one stream alone."""
    from mmldlm.tools.operations import host_operations

    overrides = ["perf.compile_dynamic=false", "train.precision=bf16", "perf.grouped_linears=true"]
    trainer, _, counters = compiled_trainer(tmp_path, monkeypatch, (8,), overrides, backend="inductor")
    monkeypatch.setattr(trainer.objective, "mode_at", lambda step: "joint")
    assert all(block.grouped_linears for block in trainer.raw_model.blocks)
    calls = host_operations(trainer, warmup=2)
    assert dict(counters["graph_break"]) == {}
    blocks = len(trainer.raw_model.blocks)
    assert calls.compiled_calls == 2 * blocks
    assert calls.in_compiled["aten::_grouped_mm"] == 12 * blocks, calls.in_compiled
    assert calls.in_compiled["aten::mm"] + calls.in_compiled["aten::addmm"] == 0, calls.in_compiled


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
@pytest.mark.parametrize("moved", ["one-by-one", "together"])
def test_the_whole_model_compiles_one_graph_per_mode_and_length_then_nothing(
    tmp_path, monkeypatch, dynamo_limits, moved
):
    """perf.compile_model under static shapes, the text head's rows filled to one count
    (perf.text_row_buckets=1): over four lengths and the three modes, twice, the model's forward is
    one graph per mode and length, its text head and fused loss inside, the blocks and the parts
    outside them not compiled apart; no graph break, static shapes, and the second round compiles
    nothing (the host's text lengths, which differ from batch to batch, are not in the graph). Its
    losses are those of the same steps uncompiled. `together`: the batch and the draws reach the
    model as views of one copy each, as they do on a GPU (`rng.to_device_together`): their sharing
    of one buffer, and their places in it, compile nothing more."""
    from mmldlm.config import MODES
    from mmldlm.diffusion import rng

    if moved == "together":
        monkeypatch.setattr(rng, "to_device_together", through_one_copy)

    lengths = (8, 16, 24, 32)
    overrides = [
        "perf.cuda_graphs=true",
        "data.pad_to_multiple=8",
        "perf.compile_model=true",
        "perf.text_row_buckets=1",
        "perf.fused_text_loss=true",
    ]
    trainer, counter, counters = compiled_trainer(tmp_path, monkeypatch, lengths, overrides)
    compiled, losses = [], []
    for _ in range(2):
        for _ in range(len(MODES) * len(lengths)):
            losses.append(trainer.train_step()["loss"])
        compiled.append(counter.frame_count)
    assert dict(counters["graph_break"]) == {}
    assert compiled == [len(MODES) * len(lengths)] * 2
    outermost = compiled_functions(counter)
    assert outermost == {"forward"}, outermost
    assert not has_symbolic_shapes(counter)
    eager, _, _ = compiled_trainer(tmp_path / "eager", monkeypatch, lengths, ["perf.compile=false", *overrides[1:2]])
    expected = [eager.train_step()["loss"] for _ in range(len(MODES) * len(lengths))]
    torch.testing.assert_close(torch.tensor(losses[: len(expected)]), torch.tensor(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # inductor generates and compiles C++ for each graph: tens of seconds cold
@pytest.mark.parametrize("grouped", [False, True], ids=["linear-layers", "grouped-products"])
def test_inductor_trains_the_whole_model_to_the_eager_losses(tmp_path, monkeypatch, dynamo_limits, grouped):
    """The real backend on the whole model's graph (perf.compile_model), its text rows filled to a few
    counts (perf.text_row_buckets=2), static shapes: each mode at one length, twice, trains to the
    losses of the same steps uncompiled, with no graph break; the same with the streams' products
    grouped (perf.grouped_linears), whose grouped_mm inductor calls as it is."""
    from mmldlm.config import MODES

    overrides = [
        "perf.compile_dynamic=false",
        "perf.activation_checkpointing=none",
        "perf.compile_model=true",
        "perf.text_row_buckets=2",
        "perf.fused_text_loss=true",
        f"perf.grouped_linears={str(grouped).lower()}",
        f"train.precision={'bf16' if grouped else 'fp32'}",  # compiled grouped_mm takes bf16 alone
    ]
    trainer, counter, counters = compiled_trainer(tmp_path, monkeypatch, (16,), overrides, backend="inductor")
    assert all(block.grouped_linears is grouped for block in trainer.raw_model.blocks)
    losses = [trainer.train_step()["loss"] for _ in range(2 * len(MODES))]
    assert dict(counters["graph_break"]) == {}
    assert len(MODES) <= counter.frame_count <= 2 * len(MODES) - 1  # l2t and joint: one or two row counts
    eager, _, _ = compiled_trainer(
        tmp_path / "eager", monkeypatch, (16,), ["perf.compile=false", *overrides[1:2], *overrides[3:]]
    )
    expected = [eager.train_step()["loss"] for _ in range(2 * len(MODES))]
    tolerance = 2e-3 if grouped else 1e-4  # bf16: inductor's fused kernels round elsewhere than eager ones
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=tolerance, atol=tolerance)


@pytest.mark.slow  # aot_eager traces forward and backward of each graph: 2-3 s a graph
def test_the_whole_model_on_one_packed_row_compiles_one_graph_per_mode_and_width_then_nothing(
    tmp_path, monkeypatch, dynamo_limits
):
    """perf.compile_model on a micro-batch packed in one row as wide as the shortest of 64 and 128 that
    holds it (data.pack_rows=[1], data.length_buckets=[64]), the text rows filled to one count: over
    the four fills and the three modes, twice, one graph per mode and shape, the shape being the
    row's width and the length of the padded layout the model takes and the loss reads (64 and 8, 64
    and 24, 128 and 32: the blocks alone would see two), 9 in all, none in the second round, no graph
    break; the losses are those of the same steps uncompiled."""
    from mmldlm.config import MODES

    overrides = [
        "perf.cuda_graphs=true",
        "data.pad_to_multiple=8",
        "data.packing=true",
        "data.pack_length=128",
        "data.pack_rows=[1]",
        "data.length_buckets=[64]",
        "perf.compile_model=true",
        "perf.text_row_buckets=1",
        "perf.fused_text_loss=true",
    ]
    runs = {}
    for name, switches in (("compiled", overrides), ("eager", ["perf.compile=false", *overrides[1:6]])):
        trainer, counter, counters = compiled_trainer(
            tmp_path / name, monkeypatch, (32,), switches, CyclingPacked(wide=True)
        )
        monkeypatch.setattr(trainer.objective, "mode_at", lambda step: MODES[(step // 4) % len(MODES)])
        compiled, losses = [], []
        for _ in range(2):
            for _ in range(len(MODES) * len(CyclingPacked.FILLS)):
                losses.append(trainer.train_step()["loss"])
            compiled.append(counter.frame_count)
        runs[name] = (compiled, losses)
        if name == "compiled":
            assert dict(counters["graph_break"]) == {}
            assert compiled == [len(MODES) * 3] * 2
            assert compiled_functions(counter) == {"forward"}
    torch.testing.assert_close(torch.tensor(runs["compiled"][1]), torch.tensor(runs["eager"][1]), rtol=1e-5, atol=1e-5)


def test_the_step_parts_script_times_each_part_of_a_real_step_outside_the_model(tmp_path_factory, capsys, monkeypatch):
    """`scripts/cpu_step_costs.py parts` (docs/benchmarks.md, "The host's work per step outside the
    model"): each part it names is really called within the timed steps, as often as a step calls it
    (AdamW once per parameter group), and the parts outside the model add up to less than the step."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import cpu_step_costs as script

    overrides = [f"data.path={prepared(tmp_path_factory)}", "model=tiny", "data.num_workers=0"]
    overrides += ["train.micro_batch_size=4", "train.global_batch_size=4", "perf.activation_checkpointing=none"]
    assert script.main(["parts", *overrides, "--config", "optimized", "--steps", "23", "--threads", "1"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert rows[0] == ["part of the step, 3 steps after 20", "ms per step (mean)", "calls per step"]
    parts = {label: (float(ms), float(calls)) for label, ms, calls in rows[2:-1]}
    assert [label for *_, label in script.PARTS] == list(parts)
    calls = {label: n for label, (_, n) in parts.items()}
    assert calls["the update (optimizer step, skip flag, zero_grad)"] == 1
    assert calls["of it: AdamW's parameter lists (Python, per group)"] == 2  # decayed and not
    assert calls["of it: fused AdamW (on a CPU: the arithmetic)"] == 2
    assert all(n >= 1 for n in calls.values()), calls
    assert rows[-1][0] == "the whole step"
    whole = float(rows[-1][1].split()[0])
    outside = [ms for label, (ms, _) in parts.items() if not label.startswith("of it: ")]  # not the update's pieces
    assert 0 < sum(outside) < whole


def test_the_operations_script_times_each_row_in_turns_beside_its_counts(capsys, monkeypatch):
    """`scripts/step_operations.py --time R`: every row's eager steps are timed in R rounds, the rows
    taking turns within each round (a slow spell of the machine falls on all alike), and the table gives
    each row's milliseconds per step and its ratio to the plain transformer beside the counts."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import step_operations as script

    calls = []

    class Trainer:
        def __init__(self, name):
            self.name = name

        def train_step(self):
            calls.append(self.name)

    names = ["reference: plain transformer", "l2t", "t2l"]
    times = script.step_times({name: Trainer(name) for name in names}, rounds=2, steps=3)
    assert calls == [name for _ in range(2) for name in names for _ in range(3)]
    assert {name: len(found) for name, found in times.items()} == dict.fromkeys(names, 2)

    tiny = ["model.num_blocks=2", "model.hidden_size=16", "model.num_heads=2"]
    tiny += ["train.micro_batch_size=1", "train.global_batch_size=1"]
    assert script.main(["--time", "2", "--steps", "2", "--vocab", "64", "--max-length", "16", *tiny]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert rows[0][-2:] == ["ms per step", "x reference"]
    table = {row[0]: row for row in rows[2:]}
    assert list(table) == ["reference: plain transformer", "l2t", "t2l", "joint"]
    assert table["reference: plain transformer"][-1] == "1.00"
    assert all(float(row[-2]) > 0 and float(row[-1]) > 0 for row in table.values())


def test_the_operations_scripts_stacked_layout_runs_the_models_step_without_stacking_parameters(tmp_path, monkeypatch):
    """`scripts/step_operations.py --stacked`: each grouped pair of the streams' weights and each
    stream's q and k gains come from one leaf tensor of their values, so the first step's loss is the
    model's own to the bit, and the step stacks no parameters: at least the four grouped pairs of
    every block fewer `stack` operations, and fewer operations and kernels in all."""
    from pathlib import Path

    from mmldlm.model import mmdit
    from mmldlm.tools.bench import build_trainer as build_bench_trainer

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    monkeypatch.setattr(mmdit, "stacked_parameters", mmdit.stacked_parameters)  # restored after the test
    import step_operations as script

    overrides = [*older_depth(tmp_path), "model.num_blocks=4", "objective.mode=joint", "perf.grouped_linears=true"]
    _, _, stored_apart, _ = build_bench_trainer("optimized", overrides, str(tmp_path / "apart"))
    first_apart = stored_apart.train_step()["loss"]
    apart = step_operations(stored_apart)
    script.store_stacked()
    _, _, stored_stacked, _ = build_bench_trainer("optimized", overrides, str(tmp_path / "stacked"))
    assert all(block.grouped_linears for block in stored_stacked.raw_model.blocks)
    assert stored_stacked.train_step()["loss"] == first_apart
    stacked = step_operations(stored_stacked)
    assert apart.counts["stack"] - stacked.counts.get("stack", 0) >= 4 * 4, (apart.counts, stacked.counts)
    assert stacked.total < apart.total and stacked.kernels < apart.kernels


def test_the_operations_scripts_stacked_layout_gives_parameters_that_take_freed_ones_ids_their_own_values(monkeypatch):
    """`--stacked` keys its leaves by the parameters' ids: a row's trainer freed, the next row's
    parameters may take those ids (CPython reuses them at once), and still get a leaf of their values.
    Every pair here gets one id, as if each took the freed pair's before it."""
    from pathlib import Path

    from mmldlm.model import mmdit

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    monkeypatch.setattr(mmdit, "stacked_parameters", mmdit.stacked_parameters)  # restored after the test
    import step_operations as script

    monkeypatch.setattr(script, "id", lambda obj: 0, raising=False)  # the script's `id`, not the builtin
    script.store_stacked()
    for i in range(3):
        a, b = torch.nn.Parameter(torch.full((3,), float(i))), torch.nn.Parameter(torch.full((3,), -float(i)))
        leaf = mmdit.stacked_parameters(a, b)
        assert torch.equal(leaf.detach(), torch.stack([a.detach(), b.detach()])), i
        assert leaf.requires_grad and leaf.grad is None
