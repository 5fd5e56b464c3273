"""The performance switches change speed and memory, never the numbers: activation checkpointing
(each mode) and compile give the plain model's loss and gradients, the baseline's switches train to
the optimized switches' losses, auto micro-batch keeps the effective batch; the presets differ only
in performance keys; the profiler writes a trace."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from loader_support import SyntheticLoader

from mmldlm.config import ConfigError, ModelConfig, PerfConfig, flat_keys, load_config, to_dict
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.objective import Objective
from mmldlm.tools.operations import OperationCounter
from mmldlm.training.batch_size import (
    candidate_sizes,
    fit_to_data,
    full_length_batch,
    largest_fitting,
    per_process_micro_batch,
    probe_peak_bytes,
    spaced_sizes,
)
from mmldlm.training.distributed import DistInfo
from mmldlm.training.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    blocks_as_one_region,
    checkpointed_blocks,
)
from mmldlm.training.trainer import Trainer, accumulation_steps

VOCAB, LEN, DIM = 40, 8, 16
MASK_ID, PAD_ID = 1, 0


def tiny_model(num_blocks=3, attention="sdpa", seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        hidden_size=32,
        num_blocks=num_blocks,
        num_heads=2,
        max_seq_len=LEN,
        latent_dim=DIM,
        num_latents=1,
        timestep_embed_dim=16,
        attention=attention,
    )
    model = MultimodalMMDiT(cfg, vocab_size=VOCAB)
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: give the blocks work to do
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def model_inputs(batch=3):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, VOCAB, (batch, LEN), generator=g)
    pad_mask = torch.ones(batch, LEN, dtype=torch.bool)
    pad_mask[0, 5:] = False
    return (
        tokens,
        torch.randn(batch, 1, DIM, generator=g),
        torch.rand(batch, generator=g),
        torch.rand(batch, generator=g),
        pad_mask,
    )


def loss_and_grads(model):
    tokens, latents, t_text, t_latent, pad_mask = model_inputs()
    logits, out, _ = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
    loss = F.cross_entropy(logits.transpose(1, 2), tokens) + out.pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(reference, other):
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def backward_op_counts(model):
    tokens, latents, t_text, t_latent, pad_mask = model_inputs()
    logits, out, _ = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
    loss = F.cross_entropy(logits.transpose(1, 2), tokens) + out.pow(2).mean()
    with OperationCounter() as counter:
        loss.backward()
    return counter.counts


@pytest.mark.parametrize("mode", ["full", "every_k", "selective"])
def test_activation_checkpointing_keeps_loss_and_gradients(mode):
    plain = tiny_model()
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, PerfConfig(activation_checkpointing=mode, checkpoint_every_k=2))
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert_same(loss_and_grads(plain), loss_and_grads(checkpointed))


def test_checkpointing_modes_recompute_what_they_promise():
    """full recomputes each block's forward in backward (its matmuls run again); selective keeps the
    matmul outputs (no extra matmul) and recomputes only the elementwise ops (GELU runs again)."""
    assert checkpointed_blocks(5, PerfConfig(activation_checkpointing="every_k", checkpoint_every_k=2)) == [0, 2, 4]
    counts = {}
    for mode in ("none", "full", "selective"):
        model = tiny_model()
        apply_activation_checkpointing(model, PerfConfig(activation_checkpointing=mode))
        counts[mode] = backward_op_counts(model)
    none, full, selective = counts["none"], counts["full"], counts["selective"]
    assert none.get("gelu", 0) == 0 and full["gelu"] > 0 and selective["gelu"] == full["gelu"]
    assert full["mm"] > none["mm"]
    assert selective["mm"] == none["mm"]


@pytest.mark.slow  # inductor from a cold cache: tens of seconds each
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_compiled_block_keeps_loss_and_gradients(checkpointing):
    """Inductor on this machine's C++ compiler: one tiny block, one shape (tens of seconds cold).
    The counting backend shows the block's graph was really captured, checkpointed or not (compile
    of a checkpointed block once fell back to eager without a word)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    plain = tiny_model(num_blocks=1)
    compiled = copy.deepcopy(plain)
    apply_activation_checkpointing(compiled, PerfConfig(activation_checkpointing=checkpointing))
    counter = CompileCounterWithBackend("inductor")
    apply_compile(compiled, backend=counter)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert_same(loss_and_grads(plain), loss_and_grads(compiled))
    assert counter.frame_count >= 1 and counter.op_count > 0


@pytest.mark.slow  # inductor from a cold cache: tens of seconds
def test_combo_kernels_reach_inductor_and_keep_loss_and_gradients(monkeypatch):
    """perf.combo_kernels: each block's torch.compile is given inductor's combo_kernels option, and the
    blocks inductor compiles with it keep the eager loss and gradients. (A CPU's generated code runs
    such kernels' loops in one function already: this checks the path, not a gain.)"""
    from mmldlm.training.parallelize import compile_options

    given = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: given.append(kwargs) or real_compile(*args, **kwargs))
    torch._dynamo.reset()
    plain = tiny_model(num_blocks=2)
    compiled = copy.deepcopy(plain)
    apply_compile(compiled, **compile_options(PerfConfig(compile=True, combo_kernels=True), torch.device("cpu")))
    assert len(given) == 2 and all(kwargs["options"] == {"combo_kernels": True} for kwargs in given), given
    assert_same(loss_and_grads(plain), loss_and_grads(compiled))


@pytest.mark.slow  # inductor from a cold cache: tens of seconds
def test_compiled_blocks_through_the_variable_length_kernel_keep_loss_and_gradients(monkeypatch):
    """model.attention=varlen with the blocks compiled by inductor in static shapes (the kernel's CPU
    stand-in, tests/test_attention.py, which leaves NaN where the real kernel writes nothing): the
    loss and every gradient of the eager blocks, on a batch with padding, and none of them NaN."""
    from test_attention import stand_in_for_the_varlen_kernel
    from torch._dynamo.testing import CompileCounterWithBackend

    stand_in_for_the_varlen_kernel(monkeypatch, record=False)
    plain = tiny_model(attention="varlen")
    compiled = copy.deepcopy(plain)
    counter = CompileCounterWithBackend("inductor")
    apply_compile(compiled, backend=counter, dynamic=False)
    reference = loss_and_grads(plain)
    assert torch.isfinite(reference[0]) and all(torch.isfinite(g).all() for g in reference[1].values())
    assert_same(reference, loss_and_grads(compiled))
    assert counter.frame_count >= 1 and counter.op_count > 0


@pytest.mark.slow  # inductor from a cold cache: tens of seconds
def test_compiled_parts_outside_the_blocks_keep_loss_and_gradients():
    """perf.compile_outside_blocks with inductor: the loss and every gradient as eager, the length
    head's too, with the parameters' names unchanged; every part outside the blocks was compiled (a
    graph each, the two timestep MLPs sharing one) beside the blocks' graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from mmldlm.training.parallelize import outside_block_methods

    def loss_and_grads_with_length(model):
        tokens, latents, t_text, t_latent, pad_mask = model_inputs()
        logits, out, lengths = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask, length_from=latents)
        loss = F.cross_entropy(logits.transpose(1, 2), tokens) + out.pow(2).mean() + lengths.logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch._dynamo.reset()
    plain = tiny_model(num_blocks=2)
    compiled = copy.deepcopy(plain)
    counter = CompileCounterWithBackend("inductor")
    apply_compile(compiled, backend=counter, outside_blocks=True)
    assert len(outside_block_methods(compiled)) == 7
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    reference = loss_and_grads_with_length(plain)
    assert "length_head.0.weight" in reference[1]
    assert_same(reference, loss_and_grads_with_length(compiled))
    assert counter.frame_count == 1 + 6, counter.frame_count


def test_blocks_given_their_adaln_tensors_stacked_give_the_same_loss_and_gradients_to_the_bit():
    """Where the blocks compile, each takes its 12 adaLN tensors as one (B, 12, 1, H) tensor and unbinds
    it itself (`AdaLN.stacked`, one input of its graph): eagerly, the loss and every gradient are those
    of the twelve views handed over one by one, bit for bit."""
    plain = tiny_model(num_blocks=2)
    stacked = copy.deepcopy(plain)
    stacked.modulation.stacked = True
    mods = stacked.modulation(torch.randn(3, 32))
    assert len(mods) == 2 and mods[0].shape == (3, 12, 1, 32)
    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(plain), loss_and_grads(stacked)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_the_reference_models_blocks_compile_alone_with_the_parts_outside_them_asked_for():
    """`bench --reference` beside perf.compile_outside_blocks: the plain transformer has none of the
    parts outside the blocks (compiling it once failed on the first one it lacks); its blocks compile."""
    from mmldlm.model.reference import PlainTransformer
    from mmldlm.training.parallelize import outside_block_methods

    plain = PlainTransformer(ModelConfig(hidden_size=32, num_blocks=2, num_heads=2, max_seq_len=LEN), VOCAB)
    assert outside_block_methods(plain) == []
    apply_compile(plain, backend="eager", outside_blocks=True)
    assert all(block._compiled_call_impl is not None for block in plain.blocks)  # nn.Module.compile's


@pytest.mark.parametrize("switch", ["compile_outside_blocks", "combo_kernels"])
def test_compiling_outside_the_blocks_and_combo_kernels_need_compile(switch):
    """perf.compile_outside_blocks compiles beside the blocks, and combo kernels are inductor's:
    each refused with perf.compile=false."""
    assert getattr(load_config("compiled", [f"perf.{switch}=true"]).perf, switch)
    message = rf"'perf.{switch}': got True; expected false with perf.compile=false"
    with pytest.raises(ConfigError, match=message):
        load_config("optimized", [f"perf.{switch}=true"])


def test_compiling_the_whole_model_is_refused_where_it_cannot_run():
    """perf.compile_model chooses what compile compiles: refused without perf.compile, beside
    perf.compile_outside_blocks (its graph holds those parts), with static shapes (CUDA graphs, or
    compile_dynamic=false) without perf.text_row_buckets (each masked count would compile a graph) and
    under FSDP2 (per-block hooks)."""
    whole = ["perf.compile_model=true"]
    assert load_config("compiled", whole).perf.compile_model
    assert load_config("compiled", [*whole, "perf.cuda_graphs=true", "perf.text_row_buckets=16"]).perf.compile_model
    refusals = {
        ("perf.compile=false",): r"'perf.compile_model': got True; expected false with perf.compile=false",
        (
            "perf.compile_outside_blocks=true",
        ): r"'perf.compile_outside_blocks': got True; expected false with perf.compile_model",
        ("perf.cuda_graphs=true",): r"'perf.text_row_buckets': got None; expected an integer such as 16 .*cuda_graphs",
        (
            "perf.compile_dynamic=false",
        ): r"'perf.text_row_buckets': got None; expected an integer such as 16 .*compile_dynamic=false",
        (
            "distributed.strategy=fsdp2",
        ): r"'perf.compile_model': got True; expected false with distributed.strategy=fsdp2",
        (
            "distributed.strategy=hsdp",
        ): r"'perf.compile_model': got True; expected false with distributed.strategy=hsdp",
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            load_config("compiled", [*whole, *overrides])


def test_the_whole_model_compiles_in_its_own_place_and_keeps_its_parameter_names():
    """apply_compile(whole_model=True): the model's forward is compiled in the instance's place, not the
    blocks'; parameter names and outputs are the uncompiled model's, and the host's text lengths
    reach no graph (two batches of other lengths at one shape compile once)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = tiny_model()
    names = [name for name, _ in model.named_parameters()]
    tokens, latents, t_text, t_latent, pad_mask = model_inputs()
    expected = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
    counter = CompileCounter()
    apply_compile(model, backend=counter, dynamic=False, whole_model=True)
    assert "forward" in model.__dict__ and all(block._compiled_call_impl is None for block in model.blocks)
    assert [name for name, _ in model.named_parameters()] == names
    lengths = tuple(pad_mask.sum(dim=1).tolist())
    got = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask, text_lengths=lengths)
    torch.testing.assert_close(got.text_logits, expected.text_logits)
    torch.testing.assert_close(got.latent, expected.latent)
    shorter = pad_mask & (torch.arange(pad_mask.shape[1]) < pad_mask.shape[1] - 1)
    model(tokens, latents, t_text, t_latent, text_pad_mask=shorter, text_lengths=tuple(shorter.sum(dim=1).tolist()))
    assert counter.frame_count == 1
    full = torch.ones_like(pad_mask)  # no padding: the call gives no mask, one more graph
    model(tokens, latents, t_text, t_latent, text_pad_mask=full, text_lengths=(tokens.shape[1],) * tokens.shape[0])
    assert counter.frame_count == 2


# Dynamo and AOT autograd trace five blocks forward and backward: 6-10 s a case on an avx2-only CPU.
# The plain case stays in the fast tier; the others, which add a region or a last block of its own, are slow.
@pytest.mark.parametrize(
    "checkpointing,every_k,regions,heads",
    [
        ("none", 1, 1, "both"),
        pytest.param("none", 1, 1, "text", marks=pytest.mark.slow),
        pytest.param("every_k", 2, 2, "both", marks=pytest.mark.slow),
        pytest.param("selective", 1, 1, "text", marks=pytest.mark.slow),
    ],
)
def test_the_whole_models_graph_compiles_the_blocks_code_once(checkpointing, every_k, regions, heads):
    """perf.compile_model: the blocks are one nested compile region, so the whole model's graph calls
    one subgraph for every block that runs the same code (checkpointed or not: a region each, its
    checkpoint inside); a last block that skips a stream (the text head alone) returns no tensor for
    it, and its code is compiled apart. Every block's own adaLN tensors are given at the same storage
    offset, without which torch 2.11 compiled each block anew. Gradients are the eager ones."""
    from torch._dynamo import lookup_backend

    torch._dynamo.reset()
    graphs = []

    def inspecting(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    num_blocks = 5
    model = tiny_model(num_blocks=num_blocks)
    perf = PerfConfig(activation_checkpointing=checkpointing, checkpoint_every_k=every_k)
    apply_activation_checkpointing(model, perf)
    compiled = copy.deepcopy(model)
    apply_compile(compiled, backend=inspecting, dynamic=False, whole_model=True)
    tokens, latents, t_text, t_latent, pad_mask = model_inputs()

    def loss_and_grads(m):
        out = m(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask, latent_head=heads == "both")
        loss = F.cross_entropy(out.text_logits.transpose(1, 2), tokens)
        if heads == "both":
            loss = loss + out.latent.pow(2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    assert_same(loss_and_grads(model), loss_and_grads(compiled))
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    subgraphs = {call.args[0].target for call in calls}  # the get_attr of the subgraph each call runs
    # The blocks' code, compiled: each subgraph, and a last block traced into the graph itself
    # (torch 2.13; 2.11 makes it a subgraph of its own). The last block's differs where it skips a stream;
    # where none skips, every block runs in a subgraph.
    inlined = num_blocks - len(calls)
    assert inlined == 0 if heads == "both" else inlined in (0, 1)
    assert len(subgraphs) + inlined == regions + (heads == "text")


def test_every_block_takes_its_adaln_tensors_at_the_same_storage_offset():
    """In the whole model's graph each block's adaLN tensors are a copy of its own, not a view at the
    block's offset into all blocks' modulation: torch 2.11 reuses a region's compiled code only for
    inputs at equal storage offsets, and compiled every block anew. The values are the views'."""
    model = tiny_model(num_blocks=4)
    c = torch.randn(3, model.modulation.proj.in_features)
    with torch.no_grad():
        model.modulation.proj.weight.normal_()
        views = [torch.stack(mod, dim=1) for mod in model.modulation(c)]  # per block (B, 12, 1, H)
    blocks_as_one_region(model)
    with torch.no_grad():
        copies = model.modulation(c)
    assert len(copies) == len(views) == 4
    assert {m.storage_offset() for m in copies} == {0}
    assert len({m.untyped_storage().data_ptr() for m in copies}) == 4
    for copy_, view in zip(copies, views):
        torch.testing.assert_close(copy_, view, rtol=0, atol=0)


def test_the_plain_transformers_blocks_share_their_compiled_code_each_with_its_own_weights():
    """`bench --reference` compiles the plain transformer as ours: its blocks one region too. Each call
    of the shared subgraph takes its own block's weights (a region bound to each instance took the
    first block's for all of them: outputs off by the size of the outputs themselves)."""
    from torch._dynamo import lookup_backend

    from mmldlm.model.reference import PlainTransformer

    torch._dynamo.reset()
    graphs = []

    def inspecting(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_blocks=3, num_heads=2, max_seq_len=LEN, latent_dim=DIM, num_latents=1)
    model = PlainTransformer(cfg, VOCAB)
    tokens = torch.randint(0, VOCAB, (2, LEN))
    expected = model(tokens)
    apply_compile(model, backend=inspecting, dynamic=False, whole_model=True)
    torch.testing.assert_close(model(tokens), expected)
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    assert len(calls) == 3 and len({call.args[0].target for call in calls}) == 1
    weights = [{str(a) for a in call.args if "qkv" in str(a)} for call in calls]
    assert all(len(w) == 1 for w in weights) and len(set.union(*weights)) == 3  # each block's own


# ------------------------------------------------------------------------------------------- the loop


def RandomLoader(micro):
    """Padded micro-batches (random lengths) of a fixed random set, resumable."""
    return SyntheticLoader(micro, VOCAB, LEN, DIM, pad_id=PAD_ID, first_token=2)


def objective_for(cfg):
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=MASK_ID, pad_token_id=PAD_ID)
    return Objective(
        cfg.objective,
        text,
        GaussianDiffusion(cfg.latent_diffusion, mean=torch.zeros(DIM), std=torch.ones(DIM)),
        fused_text_loss=cfg.perf.fused_text_loss,
        text_row_buckets=cfg.perf.text_row_buckets,
    )


def run_losses(tmp_path, overrides, steps=4, attention="sdpa"):
    cfg = load_config(
        None,
        [
            "train.log_every=1",
            "logging.progress_bar=false",
            "schedule.kind=constant",
            "schedule.warmup_steps=0",
            "optim.lr=3e-3",
            f"train.run_dir={tmp_path}",
            f"train.steps={steps}",
            "train.global_batch_size=8",
            *overrides,
        ],
    )
    trainer = Trainer(
        cfg, tiny_model(attention=attention), objective_for(cfg), lambda micro: RandomLoader(micro), DistInfo()
    )
    return [trainer.train_step()["loss"] for _ in range(steps)], trainer


def test_baseline_switches_train_to_the_optimized_switches_losses(tmp_path):
    """Explicit-softmax attention + per-parameter-loop AdamW + per-step re-freezing (the baseline's)
    against SDPA + fused AdamW + selective checkpointing, over steps of every mode (in fp32: under
    bf16 the two attention paths round differently, by more than the tolerance on some weights)."""
    optimized, _ = run_losses(
        tmp_path / "o", ["train.micro_batch_size=4", "perf.activation_checkpointing=selective", "train.precision=fp32"]
    )
    baseline, trainer = run_losses(
        tmp_path / "b",
        [
            "train.micro_batch_size=4",
            "optim.fused=false",
            "optim.foreach=false",
            "perf.refreeze_every_step=true",
            "train.precision=fp32",
        ],
        attention="explicit",
    )
    assert trainer.optimizer.defaults["foreach"] is False and trainer.optimizer.defaults["fused"] is False
    assert {trainer.objective.mode_at(s) for s in range(4)} >= {"l2t", "t2l"}
    torch.testing.assert_close(torch.tensor(baseline), torch.tensor(optimized), rtol=1e-4, atol=1e-5)
    assert optimized[-1] != optimized[0]  # it trained


class PerSampleObjective:
    """The real objective's modes with noise fixed per sample (not per micro-batch), so every split of
    a batch into micro-batches gives the same loss and gradient."""

    def __init__(self, objective):
        self.objective = objective

    def mode_at(self, step):
        return self.objective.mode_at(step)

    def __call__(self, model, batch, step, generator=None):
        losses = []
        for i, index in enumerate(batch["index"].tolist()):
            row = {key: value[i : i + 1] for key, value in batch.items()}
            loss, metrics = self.objective(model, row, step, generator=torch.Generator().manual_seed(index))
            losses.append(loss)
        loss = torch.stack(losses).mean()
        return loss, {"loss": loss.detach(), "mode": metrics["mode"]}


def test_auto_micro_batch_keeps_the_effective_batch(tmp_path, monkeypatch):
    """auto picks the largest divisor of the per-process batch under the cap, derives the
    accumulation from it, and trains exactly the steps of the same effective batch in one micro-batch."""
    import mmldlm.training.batch_size as batch_size

    monkeypatch.setattr(batch_size, "probe_peak_bytes", lambda model, objective, size, *args: size * 2**30)
    losses = {}
    for name, micro in (("auto", "auto"), ("whole", 8)):
        cfg = load_config(
            None,
            [
                "logging.progress_bar=false",
                "schedule.kind=constant",
                "schedule.warmup_steps=0",
                "optim.lr=3e-3",
                f"train.run_dir={tmp_path / name}",
                "train.global_batch_size=8",
                f"train.micro_batch_size={micro}",
                "train.memory_cap_gib=2.5",
                "train.precision=fp32",
            ],
        )  # equal losses across batch splits need fp32
        trainer = Trainer(cfg, tiny_model(), PerSampleObjective(objective_for(cfg)), RandomLoader, DistInfo())
        records = [trainer.train_step() for _ in range(3)]
        losses[name] = [r["loss"] for r in records]
        assert all(r["global_batch_size"] == 8 for r in records)
        if name == "auto":
            assert trainer.micro_batch_size == 2  # 2 GiB <= 2.5 GiB < 4 GiB
            assert all(r["micro_batch_size"] * r["accumulation_steps"] == 8 for r in records)
    torch.testing.assert_close(torch.tensor(losses["auto"]), torch.tensor(losses["whole"]), rtol=1e-5, atol=1e-6)


def test_a_micro_batch_too_large_for_the_world_size_becomes_each_process_share_of_the_global_batch():
    assert per_process_micro_batch(64, [64], world_size=2) == 32  # configs/default.yaml under torchrun
    assert per_process_micro_batch(64, [64], world_size=8) == 8
    assert per_process_micro_batch(16, [16, 48], world_size=2) == 8  # the smallest scheduled batch decides
    assert per_process_micro_batch(16, [64], world_size=2) == 16  # fits: accumulation 2, unchanged
    assert per_process_micro_batch(64, [64], world_size=1) == 64
    # Not evenly split: left to the trainer's refusal, which names the keys.
    assert per_process_micro_batch(64, [64], world_size=3) == 64
    assert per_process_micro_batch(4, [12, 20], world_size=4) == 4  # a share of 3 does not divide 20 / 4
    with pytest.raises(ConfigError, match=r"= 64 x 3 = 192 \(or, smaller than that, a multiple of the world size"):
        accumulation_steps(64, 64, 3, "train.global_batch_size")


def test_a_global_batch_larger_than_the_training_split_is_lowered_to_what_it_fills():
    assert fit_to_data(64, [64], num_samples=49, world_size=1) == (49, [49])  # the README's fine-tuning example
    assert fit_to_data(64, [64], num_samples=49, world_size=2) == (24, [48])  # whole micro-batches on each process
    assert fit_to_data(16, [64], num_samples=49, world_size=1) == (16, [48])  # the micro-batch fits: kept
    assert fit_to_data(8, [16, 64], num_samples=49, world_size=2) == (8, [16, 48])  # only the sizes too large
    assert fit_to_data("auto", [64], num_samples=49, world_size=2) == ("auto", [48])
    assert fit_to_data(64, [64], num_samples=64, world_size=1) == (64, [64])  # filled: unchanged
    assert fit_to_data(64, [64], num_samples=1, world_size=2) == (64, [64])  # the loader refuses it, naming the keys


def test_auto_micro_batch_search_is_the_largest_divisor_that_fits():
    assert candidate_sizes([96, 64]) == [1, 2, 4, 8, 16, 32]
    probed = []

    def fits(size):
        probed.append(size)
        return size <= 12

    assert largest_fitting(candidate_sizes([96]), fits) == 12
    # Logarithmic, not a scan, and nothing probed far above the first size that does not fit.
    assert len(probed) <= 6 and max(probed) == 16
    assert largest_fitting([1, 2, 4], lambda size: False) is None
    assert largest_fitting([1, 2, 4], lambda size: True) == 4
    # Every answer is found, whatever the limit.
    sizes = spaced_sizes(512)
    assert sizes[:9] == list(range(1, 10)) and sizes[-1] == 512
    assert all(b - a <= max(1, a // 8) for a, b in zip(sizes, sizes[1:]))
    for limit in range(0, 520, 7):
        probed.clear()
        best = largest_fitting(sizes, lambda size, limit=limit: probed.append(size) or size <= limit)
        assert best == max([s for s in sizes if s <= limit], default=None)
        assert max(probed) <= 2.25 * (best or 1) + 1  # never far above what fits


def test_memory_probe_grows_with_the_micro_batch():
    cfg = load_config(None, [])
    model = tiny_model()
    objective = objective_for(cfg)
    batches = functools.partial(full_length_batch, seq_len=LEN, vocab_size=VOCAB, num_latents=1, latent_dim=DIM)
    small = probe_peak_bytes(model, objective, 1, batches, torch.device("cpu"))
    large = probe_peak_bytes(model, objective, 512, batches, torch.device("cpu"))
    assert large > small
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradients behind


def test_profiler_window_writes_a_trace(tmp_path):
    cfg = load_config(
        None,
        [
            "logging.progress_bar=false",
            f"train.run_dir={tmp_path}",
            "train.steps=3",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "checkpoint.every=1000",
            "perf.profiler.enabled=true",
            "perf.profiler.skip=1",
            "perf.profiler.warmup=1",
            "perf.profiler.active=1",
        ],
    )
    trainer = Trainer(cfg, tiny_model(), objective_for(cfg), RandomLoader(8), DistInfo())
    assert trainer.fit() == 0
    traces = list((tmp_path / "profiler").glob("rank0*.pt.trace.json*"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000


# ------------------------------------------------------------------------------------------- presets

PERFORMANCE_KEYS = {
    "model.attention",
    "optim.fused",
    "optim.foreach",
    "distributed.find_unused_parameters",
    "distributed.static_graph",
    "data.num_workers",
    "data.prefetch_factor",
    "data.persistent_workers",
    "data.pin_memory",
    "data.pad_to_multiple",
    "data.bucket_batches",
    "train.micro_batch_size",
    "train.run_dir",
    "train.precision",
    # the baseline recipe's latent loss: part of what the baseline reproduces
    "latent_diffusion.loss",
}


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_presets_differ_only_in_performance_keys(size):
    baseline = flat_keys(to_dict(load_config("baseline", [f"model={size}"])))
    optimized = flat_keys(to_dict(load_config("optimized", [f"model={size}"])))
    differ = {key for key in baseline if baseline[key] != optimized[key]}
    differ = {key for key in differ if not key.startswith("perf.")}
    assert differ <= PERFORMANCE_KEYS, differ - PERFORMANCE_KEYS
    size_default = load_config(None, [f"model={size}"]).model
    assert baseline["model.hidden_size"] == optimized["model.hidden_size"] == size_default.hidden_size
    assert baseline["train.global_batch_size"] == optimized["train.global_batch_size"]
    assert baseline["model.attention"] == "explicit" and optimized["model.attention"] == "sdpa"
    assert baseline["train.precision"] == "fp32" and optimized["train.precision"] == "auto"
    assert baseline["latent_diffusion.loss"] == "normalized_mse"
    assert baseline["distributed.find_unused_parameters"] and baseline["perf.refreeze_every_step"]
    assert baseline["data.num_workers"] == 16 and not baseline["data.persistent_workers"]


def test_compiled_preset_adds_only_compile_and_its_padding():
    optimized = flat_keys(to_dict(load_config("optimized", [])))
    compiled = flat_keys(to_dict(load_config("compiled", [])))
    assert {key for key in compiled if compiled[key] != optimized[key]} == {
        "perf.compile",
        "data.pad_to_multiple",
        "train.run_dir",
    }
    assert compiled["perf.compile"] and compiled["data.pad_to_multiple"] == 64


def test_cuda_graphs_are_refused_where_shapes_change_with_every_batch():
    """perf.cuda_graphs records a graph per shape: it needs compile and static shapes, and refuses the
    batches whose shapes change every step (packed rows in as many rows as they fill); the
    variable-length kernel's shapes are the batch's (tests/test_attention.py), so it is taken."""
    assert load_config("compiled", ["perf.cuda_graphs=true", "data.length_buckets=[64,128]"]).perf.cuda_graphs
    for taken in (["model.attention=varlen"], ["data.packing=true", "data.pack_rows=[4]", "model.attention=varlen"]):
        assert load_config("compiled", ["perf.cuda_graphs=true", *taken]).perf.cuda_graphs
    refusals = {
        "perf.compile=false": r"'perf.cuda_graphs': got True; expected false with perf.compile=false",
        "perf.compile_dynamic=true": r"'perf.compile_dynamic': got True; expected null or false with perf.cuda_graphs",
        "data.packing=true": r"'perf.cuda_graphs': got True; expected false with data.packing=True",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            load_config("compiled", ["perf.cuda_graphs=true", override])


def test_auto_checkpointing_picks_the_least_that_fits(tmp_path, monkeypatch):
    """auto probes none, then selective, then full, and keeps the first whose peak fits the cap."""
    import mmldlm.training.batch_size as batch_size

    real_probe = batch_size.probe_peak_bytes
    seen = []

    def probe(model, *args, **kwargs):
        real_probe(model, *args, **kwargs)  # the real probe runs: checkpointing as applied
        checkpointed = sum("forward" in block.__dict__ for block in model.blocks)
        seen.append(checkpointed)
        return {0: 3 * 2**30, len(model.blocks): 1 * 2**30}[checkpointed]  # none: 3 GiB, else 1 GiB

    monkeypatch.setattr(batch_size, "probe_peak_bytes", probe)
    for cap, expected in (("4", "none"), ("2", "selective"), ("0.5", "full")):
        seen.clear()
        _, trainer = run_losses(
            tmp_path / cap,
            ["perf.activation_checkpointing=auto", f"train.memory_cap_gib={cap}", "train.micro_batch_size=4"],
            steps=1,
        )
        assert trainer.activation_checkpointing == expected
        assert len(seen) == {"none": 1, "selective": 2, "full": 3}[expected]
        wrapped = sum("forward" in block.__dict__ for block in trainer.raw_model.blocks)
        assert wrapped == (0 if expected == "none" else len(trainer.raw_model.blocks))


def test_auto_checkpointing_trains_like_no_checkpointing(tmp_path):
    """With room to spare auto checkpoints nothing, and the run's losses are those of `none`."""
    auto, trainer = run_losses(tmp_path / "auto", ["perf.activation_checkpointing=auto", "train.memory_cap_gib=1000"])
    plain, _ = run_losses(tmp_path / "none", ["perf.activation_checkpointing=none"])
    assert trainer.activation_checkpointing == "none"
    assert auto == plain


SIB = ["train.precision=fp32", "optim.grad_clip=0", "train.micro_batch_size=8"]


def test_step_in_backward_gives_the_ordinary_steps_parameters(tmp_path):
    """fp32, no clipping, no accumulation: updating each parameter inside backward is the same AdamW
    update as the ordinary step after it (to 1e-6 relative), step after step."""
    ordinary, plain = run_losses(tmp_path / "ordinary", SIB, steps=3)
    fused, inside = run_losses(tmp_path / "inside", [*SIB, "optim.step_in_backward=true"], steps=3)
    assert inside.step_in_backward and not plain.step_in_backward
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(ordinary), rtol=1e-6, atol=0)
    for (name, a), (_, b) in zip(plain.raw_model.named_parameters(), inside.raw_model.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    states = [plain.optimizer.state_dict()["state"], inside.optimizer.state_dict()["state"]]
    assert states[0].keys() == states[1].keys() and len(states[0]) > 0


def test_step_in_backward_never_holds_every_gradient(tmp_path):
    """During backward each gradient is freed once its parameter is updated: a hook that runs after
    the trainer's finds no parameter holding a gradient; in the ordinary step they pile up."""
    most = {}
    for name, extra in (("ordinary", []), ("inside", ["optim.step_in_backward=true"])):
        _, trainer = run_losses(tmp_path / name, [*SIB, *extra], steps=1)
        params = [p for p in trainer.raw_model.parameters() if p.requires_grad]
        most[name] = 0

        def count(_param, params=params, name=name):
            most[name] = max(most[name], sum(p.grad is not None for p in params))

        for p in params:
            p.register_post_accumulate_grad_hook(count)
        trainer.train_step()
    assert most["inside"] == 0
    assert most["ordinary"] > len(params) // 2


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optim.step_in_backward=true", "optim.grad_clip=1.0"], "optim.grad_clip"),
        (["optim.step_in_backward=true", "optim.grad_clip=0", "train.precision=fp16"], "optim.step_in_backward"),
    ],
)
def test_step_in_backward_refuses_what_it_cannot_do_in_the_config(overrides, key):
    from mmldlm.config import ConfigError

    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, overrides)


def test_step_in_backward_refuses_gradient_accumulation(tmp_path):
    from mmldlm.config import ConfigError

    with pytest.raises(ConfigError, match="optim.step_in_backward.*accumulation.*micro-batches of 4"):
        run_losses(tmp_path, ["optim.step_in_backward=true", "optim.grad_clip=0", "train.micro_batch_size=4"], steps=1)


def test_lean_preset_is_the_optimized_one_with_the_step_in_backward():
    optimized = flat_keys(to_dict(load_config("optimized", [])))
    lean = flat_keys(to_dict(load_config("lean", [])))
    assert {key for key in lean if lean[key] != optimized[key]} == {
        "optim.step_in_backward",
        "optim.grad_clip",
        "optim.state_dtype",
        "train.micro_batch_size",
        "train.run_dir",
    }
    assert lean["train.micro_batch_size"] == lean["train.global_batch_size"]


@pytest.mark.slow  # torchao compiles its 8-bit AdamW step: inductor from a cold cache
def test_int8_optimizer_state_resumes_exactly_through_a_checkpoint(tmp_path):
    """torchao's 8-bit AdamW moments go through the checkpoint (sharded-state API, torch.save with
    weights_only loading) and a resumed run repeats the uninterrupted one bit for bit. The tiny
    model's 128 x 32 MLP weights are large enough to be quantized; smaller tensors keep fp32 moments."""
    from torchao.optim.subclass_8bit import OptimState8bit

    def trainer_at(run_dir, seed=0):
        cfg = load_config(
            None,
            [
                "train.log_every=1",
                "logging.progress_bar=false",
                f"train.run_dir={run_dir}",
                "train.steps=4",
                "train.global_batch_size=8",
                "optim.state_dtype=int8",
                "train.precision=fp32",
            ],
        )
        model = tiny_model(seed=seed)
        model.length_head.requires_grad_(False)  # this objective trains no length head: no state to save
        return Trainer(cfg, model, objective_for(cfg), lambda micro: RandomLoader(micro), DistInfo())

    straight = trainer_at(tmp_path / "straight")
    full = [straight.train_step()["loss"] for _ in range(4)]
    assert type(straight.optimizer).__name__ == "AdamW8bit"
    assert any(isinstance(v, OptimState8bit) for s in straight.optimizer.state.values() for v in s.values())

    half = trainer_at(tmp_path / "half")
    first = [half.train_step()["loss"] for _ in range(2)]
    half.save(blocking=True)
    resumed = trainer_at(tmp_path / "half", seed=1)
    resumed.resume("auto")
    rest = [resumed.train_step()["loss"] for _ in range(2)]
    assert first + rest == full
    for (name, a), (_, b) in zip(straight.raw_model.named_parameters(), resumed.raw_model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # torchao compiles its 8-bit AdamW step: inductor from a cold cache
def test_low_bit_state_follows_the_fp32_state_over_a_short_run(tmp_path):
    """int8 moments change the updates by their rounding only: 12 steps track the fp32 state's losses."""
    fp32, _ = run_losses(tmp_path / "fp32", ["train.precision=fp32"], steps=12)
    int8, _ = run_losses(tmp_path / "int8", ["train.precision=fp32", "optim.state_dtype=int8"], steps=12)
    torch.testing.assert_close(torch.tensor(int8), torch.tensor(fp32), rtol=0.05, atol=0.0)
    assert fp32 != int8


def test_bytes_per_parameter_count_the_casts_gradients_clipping_and_adamw_of_a_step(tmp_path):
    """Under bf16 autocast one micro-batch with clipping by its own pass moves 58 bytes per parameter
    (a 6-byte cast each way, four 2-byte reads and writes by the products, the norm, the clipping pass,
    AdamW's 28); the fused AdamW that divides as it reads saves the clipping pass's 8; accumulation adds
    a micro-batch and an accumulation each; fp32 has no casts. The trainer counts its own choices."""
    from mmldlm.training.traffic import bytes_per_parameter

    assert bytes_per_parameter("bf16") == 58
    assert bytes_per_parameter("bf16", clip="in_optimizer") == 50
    assert bytes_per_parameter("bf16", accumulation_steps=2) == 58 + 18 + 12
    assert bytes_per_parameter("fp32") == 52 and bytes_per_parameter("bf16", ema=True) == 70
    assert bytes_per_parameter("bf16", recomputed_share=1.0) == 58 + 8
    assert bytes_per_parameter("bf16", recomputed_share=1.0, recomputes_products=False) == 58 + 6
    assert bytes_per_parameter("bf16", state_dtype="int8") < 58 - 10
    # bf16 compute weights: the same bytes for one micro-batch, fewer where a step accumulates or recomputes
    assert bytes_per_parameter("bf16", covered_share=1.0) == 58
    assert bytes_per_parameter("bf16", accumulation_steps=2, covered_share=1.0) == 58 + 6 + 10
    assert bytes_per_parameter("bf16", accumulation_steps=2, covered_share=0.5) == 58 + (18 + 12 + 6 + 10) / 2
    assert bytes_per_parameter("bf16", recomputed_share=1.0, covered_share=1.0) == 58 + 2
    assert bytes_per_parameter("fp32", covered_share=1.0) == 52
    # grouped products: every use stacks the weights as the products take them, recomputed uses too
    assert bytes_per_parameter("bf16", stacked_share=1.0) == 58 + 8
    assert bytes_per_parameter("bf16", accumulation_steps=2, recomputed_share=0.5, stacked_share=0.5) == (
        bytes_per_parameter("bf16", accumulation_steps=2, recomputed_share=0.5) + 0.5 * 8 * 2 * 1.5
    )
    assert bytes_per_parameter("bf16", covered_share=1.0, stacked_share=1.0) == 58 + 4
    _, trainer = run_losses(tmp_path, ["train.micro_batch_size=4", "train.precision=bf16"], steps=1)
    assert trainer.clip_in_optimizer  # fused AdamW, one process
    assert trainer.bytes_per_parameter() == bytes_per_parameter("bf16", accumulation_steps=2, clip="in_optimizer")
    blocks = trainer.raw_model.blocks
    grouped = sum(m.weight.numel() for m in blocks.modules() if isinstance(m, torch.nn.Linear))
    for block in blocks:
        block.grouped_linears = True
    share = grouped / sum(p.numel() for p in trainer.raw_model.parameters())
    assert 0.3 < share < 1
    assert trainer.bytes_per_parameter() == bytes_per_parameter(
        "bf16", accumulation_steps=2, clip="in_optimizer", stacked_share=share
    )
