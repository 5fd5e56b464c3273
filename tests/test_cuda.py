"""What only a GPU can show: bf16 autocast over fp32 master weights, fp16 with its GradScaler, the
flash / memory-efficient attention kernel really selected, compile of checkpointed blocks, FSDP2
and DDP over NCCL in one process. Marked `cuda`: `pytest -m cuda` runs them where CUDA is present
(scripts/gpu_suite.sh does); on a machine without CUDA they are skipped, never failed."""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_perf import DIM, PAD_ID, VOCAB, RandomLoader, model_inputs, objective_for, tiny_model

from mmldlm.config import PerfConfig, load_config
from mmldlm.training.distributed import DistInfo, hsdp_mesh
from mmldlm.training.parallelize import apply_activation_checkpointing, apply_compile, apply_fsdp
from mmldlm.training.trainer import Trainer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda", 0)


class PackedLoader:
    """Packed micro-batches of random texts of 1-8 tokens in rows of 8 (data.packing), padded to 6 rows,
    one row per text past it (data.pack_rows=[6]): two shapes."""

    def __init__(self, micro):
        from mmldlm.data.dataset import PadCollate

        self.micro, self.collate = micro, PadCollate(PAD_ID, 8, None, 8, pack_rows=[6])
        self.generator = torch.Generator().manual_seed(0)

    def __iter__(self):
        while True:
            lengths = torch.randint(1, 9, (self.micro,), generator=self.generator).tolist()
            ids = [torch.randint(2, VOCAB, (n,), generator=self.generator).numpy() for n in lengths]
            yield self.collate(
                [(i, t, torch.randn(1, DIM, generator=self.generator).numpy()) for i, t in enumerate(ids)]
            )


def cuda_trainer(tmp_path, overrides, steps=6, loader=RandomLoader, attention="sdpa"):
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
            "train.device=cuda",
            *overrides,
        ],
    )
    model = tiny_model(attention=attention)
    return Trainer(cfg, model, objective_for(cfg), lambda micro: loader(micro), DistInfo(device=CUDA))


def on_cuda(inputs):
    return tuple(x.to(CUDA) for x in inputs)


def test_tensors_moved_together_reach_the_gpu_as_they_were_and_train_as_moved_one_by_one(tmp_path, monkeypatch):
    """`rng.to_device_together`: 50 rounds of every dtype a step moves, each round's pinned buffer
    freed as soon as its copy is queued, all compared once the device is done (the buffer must not be
    reused before its copy ran), each view 16-byte aligned; then a trainer whose batches and draws go
    in one copy each trains to the losses of one copy per tensor."""
    from mmldlm.diffusion import rng

    generator = torch.Generator().manual_seed(0)
    sent, received = [], []
    for _ in range(50):
        tensors = [
            torch.randint(0, 9, (8, 13), generator=generator),
            torch.rand(8, 13, generator=generator) > 0.5,
            torch.randn(8, 1, 7, generator=generator),
            torch.rand(8, generator=generator).to(torch.bfloat16),
            torch.empty(0, dtype=torch.int64),
        ]
        sent.append(tensors)
        received.append(rng.to_device_together(tensors, CUDA))
    torch.cuda.synchronize()
    for before, after in zip(sent, received):
        for x, y in zip(before, after):
            assert y.device == CUDA and y.dtype == x.dtype and torch.equal(y.cpu(), x)
            assert y.data_ptr() % rng.ALIGNMENT == 0

    overrides = ["objective.cond_drop_prob=0.5", "perf.text_row_buckets=4", "train.micro_batch_size=4"]
    trainer = cuda_trainer(tmp_path / "together", overrides)
    together = [trainer.train_step()["loss"] for _ in range(4)]
    one_copy_each = rng.to_device  # the path before: a pinning and a copy per tensor

    def moved_one_by_one(tensors, device):
        return [x if x is None else one_copy_each(x, device) for x in tensors]

    monkeypatch.setattr(rng, "to_device_together", moved_one_by_one)
    trainer = cuda_trainer(tmp_path / "one-by-one", overrides)
    one_by_one = [trainer.train_step()["loss"] for _ in range(4)]
    torch.testing.assert_close(torch.tensor(together), torch.tensor(one_by_one), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_keeps_fp32_masters_and_learns(tmp_path, precision):
    """Autocast computes in low precision while weights, gradients and AdamW state stay fp32; fp16
    runs through a GradScaler whose scale stays finite; the loss falls."""
    trainer = cuda_trainer(tmp_path, [f"train.precision={precision}"], steps=30)
    assert (trainer.scaler is not None) == (precision == "fp16")
    losses = [trainer.train_step()["loss"] for _ in range(30)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < sum(losses[:5])
    for p in trainer.raw_model.parameters():
        assert p.dtype == torch.float32 and p.device.type == "cuda"
        assert all(v.dtype == torch.float32 for v in trainer.optimizer.state[p].values() if v.dim() > 0)
    if trainer.scaler is not None:
        assert 0 < trainer.scaler.get_scale() < float("inf")
    with trainer._autocast():
        logits, _, _ = trainer.raw_model(*on_cuda(model_inputs()[:4]), text_pad_mask=model_inputs()[4].to(CUDA))
    assert logits.dtype == (torch.bfloat16 if precision == "bf16" else torch.float16)


def test_attention_runs_a_flash_or_memory_efficient_kernel(tmp_path):
    """With a padding mask and bf16, the trainer's set-up leaves SDPA the flash or memory-efficient
    kernel (cuDNN's rebuilds its plan for each new mask; the math fallback materialises the scores)."""
    trainer = cuda_trainer(tmp_path, ["train.precision=bf16"])
    model = trainer.raw_model
    tokens, latents, t_text, t_latent, pad_mask = on_cuda(model_inputs(batch=8))
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        with trainer._autocast():
            logits, out, _ = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
        (logits.float().logsumexp(-1).mean() + out.float().pow(2).mean()).backward()
        torch.cuda.synchronize()
    ops = {e.key for e in prof.key_averages()}
    attention = {
        op
        for op in ops
        if op.startswith("aten::_scaled_dot_product")
        or op.startswith("aten::_efficient")
        or op.startswith("aten::_flash")
    }
    assert attention & {"aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention"}, (
        ops
    )
    assert not any("cudnn" in op or "math" in op for op in attention), attention


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed-rows"])
def test_the_variable_length_kernel_gives_the_masked_attentions_outputs_and_gradients(packed):
    """model.attention=varlen through flash attention's own variable-length kernel (bf16 autocast):
    the outputs at real positions and every gradient are the masked attention's within bf16's
    rounding, with no NaN anywhere (the kernel leaves the rows outside its segments unwritten, which
    the model zeroes; tests/test_attention.py checks the same with a stand-in on a CPU)."""
    from test_packing import batch
    from test_packing import tiny_model as packing_model

    from mmldlm.model import attention
    from mmldlm.model.mmdit import Packing

    b = {
        key: value.to(CUDA) if isinstance(value, torch.Tensor) else value for key, value in batch(packed=packed).items()
    }
    g = torch.Generator(device=CUDA).manual_seed(2)
    N = b["tokens"].shape[0]
    t_text, t_latent = torch.rand(N, generator=g, device=CUDA), torch.rand(N, generator=g, device=CUDA)
    rows = b["pad_mask"].flatten().nonzero().squeeze(1)
    results = {}
    for kind in ("sdpa", "varlen"):
        model = packing_model(attention=kind).to(CUDA)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(
                b["tokens"],
                b["latents"],
                t_text,
                t_latent,
                text_pad_mask=b["pad_mask"],
                text_rows=rows,
                packing=Packing.from_batch(b) if packed else None,
                text_lengths=tuple(b["pad_mask"].sum(1).tolist()),
            )
        outputs = [out.text_logits.float(), out.latent.float()]
        sum(x.square().mean() for x in outputs).backward()
        results[kind] = outputs, {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert attention.varlen_supported(CUDA)
    (want, want_grads), (got, got_grads) = results["sdpa"], results["varlen"]
    for a, x in zip(want, got):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, a, rtol=0.05, atol=0.02)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert torch.isfinite(got_grads[name]).all(), name
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0.05, atol=0.02, msg=name)


def attention_ops(trainer) -> set[str]:
    """The SDPA operations one forward and backward of the trainer's model dispatch on a padded batch."""
    tokens, latents, t_text, t_latent, pad_mask = on_cuda(model_inputs(batch=8))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with trainer._autocast():
            logits, out, _ = trainer.raw_model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
        (logits.float().logsumexp(-1).mean() + out.float().pow(2).mean()).backward()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}


def test_cudnn_attention_reaches_cudnns_kernel_and_trains_to_the_default_kernels_losses(tmp_path):
    """perf.cudnn_attention=true: SDPA runs cuDNN's kernel on a padded batch (the default set-up
    turns it off), and four steps train to the losses of the default kernels, bf16 rounding apart;
    a later trainer without the switch turns it off again."""
    losses, ops = {}, {}
    try:
        for cudnn in (True, False):
            trainer = cuda_trainer(tmp_path / str(cudnn), ["train.precision=bf16", f"perf.cudnn_attention={cudnn}"])
            assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn
            ops[cudnn] = attention_ops(trainer)
            losses[cudnn] = [trainer.train_step()["loss"] for _ in range(4)]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as every other trainer in this process sets it
    assert any("cudnn" in op for op in ops[True]), ops[True]
    assert not any("cudnn" in op for op in ops[False]), ops[False]
    torch.testing.assert_close(losses[True], losses[False], rtol=2e-2, atol=1e-3)


def test_fused_text_loss_matches_the_head_then_the_loss_in_bf16_with_less_memory():
    """perf.fused_text_loss on a GPU: under bf16 autocast the loss and gradients of the head's logits
    then the SUBS cross-entropy, within bf16 rounding, at a lower allocator peak (2,000 rows of a
    30,522-token vocabulary: two chunks)."""
    from mmldlm.diffusion.masked import subs_cross_entropy, subs_linear_cross_entropy

    g = torch.Generator(device=CUDA).manual_seed(0)
    N, H, V = 2000, 256, 30522
    x = torch.randn(N, H, device=CUDA, generator=g)
    weight = 0.05 * torch.randn(V, H, device=CUDA, generator=g)
    targets = torch.randint(1, V, (N,), device=CUDA, generator=g)
    row_weights = torch.rand(N, device=CUDA, generator=g)
    results = []
    for fused in (False, True):
        leaves = x.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                loss = subs_linear_cross_entropy(*leaves, targets, row_weights, 0).weighted
            else:
                ce, _ = subs_cross_entropy(F.linear(*leaves), targets, 0)
                loss = (ce * row_weights).sum()
        loss.backward()
        torch.cuda.synchronize()
        results.append((loss.detach(), leaves[0].grad, leaves[1].grad, torch.cuda.max_memory_allocated() - before))
    (loss_a, gx_a, gw_a, peak_a), (loss_b, gx_b, gw_b, peak_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-3, atol=0)
    torch.testing.assert_close(gx_b, gx_a, rtol=2e-2, atol=2e-2 * gx_a.abs().max().item())
    torch.testing.assert_close(gw_b, gw_a, rtol=2e-2, atol=2e-2 * gw_a.abs().max().item())
    assert peak_b < 0.8 * peak_a, (peak_b, peak_a)


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_compiled_checkpointed_block_keeps_loss_and_gradients_on_cuda(checkpointing):
    """Inductor with Triton kernels: loss and gradients as eager (fp32, tolerance of TF32-free matmuls)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    plain = tiny_model(num_blocks=2).to(CUDA)
    compiled = copy.deepcopy(plain)
    apply_activation_checkpointing(compiled, PerfConfig(activation_checkpointing=checkpointing))
    counter = CompileCounterWithBackend("inductor")
    apply_compile(compiled, backend=counter)

    def run(model):
        tokens, latents, t_text, t_latent, pad_mask = on_cuda(model_inputs())
        logits, out, _ = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
        loss = F.cross_entropy(logits.transpose(1, 2), tokens) + out.pow(2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference, other = run(plain), run(compiled)
    torch.testing.assert_close(other[0], reference[0], rtol=1e-4, atol=1e-5)
    for name in reference[1]:
        torch.testing.assert_close(other[1][name], reference[1][name], rtol=1e-3, atol=1e-5, msg=name)
    assert counter.frame_count >= 1 and counter.op_count > 0


@pytest.mark.parametrize(
    "micro_batch, packed, attention",
    [(8, False, "sdpa"), (4, False, "sdpa"), (8, True, "sdpa"), (8, False, "varlen"), (8, True, "varlen")],
    ids=["micro-batch-8", "accumulating-4x2", "packed-rows", "varlen", "varlen-packed-rows"],
)
def test_cuda_graphs_replay_the_compiled_blocks_with_the_losses_of_compile_alone(
    tmp_path, micro_batch, packed, attention
):
    """perf.cuda_graphs: the compiled blocks' forward and backward are recorded and replayed (inductor
    skips no graph), and six steps train to the losses of the same blocks compiled without CUDA
    graphs (the same kernels, replayed), also accumulating two micro-batches a step (whose first
    gradients the second replay would overwrite without buffers of their own), on packed rows
    padded to few row counts (data.pack_rows: 6 or 8 rows), and through flash attention's
    variable-length kernel (model.attention=varlen), padded and packed."""
    from torch._dynamo.utils import counters

    losses = {}
    for graphs in (False, True):
        torch._dynamo.reset()
        counters.clear()
        overrides = [
            "perf.compile=true",
            "train.precision=bf16",
            f"train.micro_batch_size={micro_batch}",
            f"perf.cuda_graphs={str(graphs).lower()}",
            f"model.attention={attention}",
            *(["data.packing=true", "data.pack_rows=[6]"] if packed else []),
        ]
        loader = PackedLoader if packed else RandomLoader
        trainer = cuda_trainer(tmp_path / str(graphs), overrides, loader=loader, attention=attention)
        assert trainer.cuda_graphs is graphs
        records = [trainer.train_step() for _ in range(6)]
        losses[graphs] = [r["loss"] for r in records]
        if graphs:
            assert records[-1]["cuda_graph_skips"] == 0, dict(counters["inductor"])
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-3, atol=1e-4)


@pytest.fixture
def nccl_group():
    """A one-process NCCL group on this GPU, torn down after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=CUDA)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "hsdp"])
def test_one_process_nccl_wrap_matches_the_plain_model(nccl_group, wrap):
    """DDP's NCCL all-reduce, FSDP2's sharding and HSDP's (over a 1 x 1 mesh of NCCL groups) on one
    GPU give the plain model's loss and gradients: the collectives run, and change nothing with one rank."""
    plain = tiny_model().to(CUDA)
    wrapped = copy.deepcopy(plain)
    if wrap == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(wrapped, device_ids=[0], find_unused_parameters=True)
    else:
        apply_fsdp(wrapped, hsdp_mesh(1, 1, "cuda", timeout_s=60) if wrap == "hsdp" else None)

    def run(model):
        tokens, latents, t_text, t_latent, pad_mask = on_cuda(model_inputs())
        logits, out, _ = model(tokens, latents, t_text, t_latent, text_pad_mask=pad_mask)
        loss = F.cross_entropy(logits.transpose(1, 2), tokens) + out.pow(2).mean()
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[n.removeprefix("module.")] = g.detach().clone()
        return loss.detach(), grads

    reference, other = run(plain), run(wrapped)
    torch.testing.assert_close(other[0], reference[0], rtol=1e-5, atol=1e-6)
    assert reference[1].keys() == other[1].keys()
    for name in reference[1]:
        torch.testing.assert_close(other[1][name], reference[1][name], rtol=1e-4, atol=1e-6, msg=name)
