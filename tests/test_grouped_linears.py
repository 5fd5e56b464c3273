"""perf.grouped_linears: each pair of the two streams' linear layers in a block as one grouped matrix
product over both streams' rows. The same values and gradients as the layers one by one, in every
mode and layout, fewer operations a step, and nothing that waits for the device."""

import logging
from types import SimpleNamespace

import pytest
import torch
from test_packing import batch, objective, tiny_model

from mmldlm.config import ModelConfig
from mmldlm.model.mmdit import MultimodalMMDiT, group_ends, grouped_rows, paired_linear
from mmldlm.tools.operations import OperationCounter
from mmldlm.training.parallelize import apply_activation_checkpointing
from mmldlm.training.trainer import Trainer


def losses_and_gradients(mode: str, packed: bool, grouped: bool, precision: torch.dtype = torch.float32):
    """One objective step of the packing tests' tiny model on their batch, its blocks' products
    grouped or not: the loss and every parameter's gradient (those that get one)."""
    model = tiny_model()
    for block in model.blocks:
        block.grouped_linears = grouped
    b = batch()
    if not packed:
        b = {k: v for k, v in b.items() if not k.startswith("pack_")}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
        loss, _ = objective(mode=mode)(model, b, step=0, generator=torch.Generator().manual_seed(4))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mode", ["joint", "l2t", "t2l"])
def test_grouped_products_give_the_layers_own_loss_and_gradients_to_the_bit(mode, packed):
    """fp32 on a CPU: grouped_mm computes each group's rows as the layer's own product does, so the
    loss and every gradient are equal to the bit, in every mode (l2t's and t2l's last block lends one
    stream's keys and values only, and keeps its idle layers out of the graph: the same parameters get
    gradients) and with texts packed in rows."""
    loss, grads = losses_and_gradients(mode, packed, grouped=False)
    grouped_loss, grouped_grads = losses_and_gradients(mode, packed, grouped=True)
    assert grouped_grads.keys() == grads.keys()
    assert torch.equal(grouped_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(grouped_grads[name], grad), name


def test_grouped_products_under_bf16_autocast_compute_in_bf16_as_the_layers_do():
    """Under bf16 autocast the grouped product casts both weights and the rows to bf16, as autocast
    casts a linear layer's: the same loss and gradients within bf16's rounding of the products."""
    loss, grads = losses_and_gradients("joint", True, grouped=False, precision=torch.bfloat16)
    grouped_loss, grouped_grads = losses_and_gradients("joint", True, grouped=True, precision=torch.bfloat16)
    torch.testing.assert_close(grouped_loss, loss, rtol=1e-3, atol=1e-3)
    assert grouped_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=2e-2, atol=2e-3, msg=name)


def test_a_paired_linear_is_each_layer_on_its_own_rows_whatever_their_leading_shapes():
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(8, 12, bias=False)
    a, b = torch.randn(3, 5, 8), torch.randn(2, 1, 8)
    out_a, out_b = paired_linear(a, b, first, second)
    assert out_a.shape == (3, 5, 12) and out_b.shape == (2, 1, 12)
    torch.testing.assert_close(out_a, first(a), rtol=0, atol=0)
    torch.testing.assert_close(out_b, second(b), rtol=0, atol=0)
    rows = torch.randn(7, 8)
    torch.testing.assert_close(grouped_rows(rows, first, second, 7), first(rows), rtol=0, atol=0)  # the second empty


def test_selective_checkpointing_keeps_the_grouped_products_and_recomputes_the_rest():
    """Under selective activation checkpointing a grouped product's output is saved as a linear
    layer's is: the backward computes each block's four grouped products' two gradients and runs
    none of them again, with the gradients of the blocks without checkpointing."""
    counts, grads = [], []
    for checkpointing in ("none", "selective"):
        model = tiny_model()
        for block in model.blocks:
            block.grouped_linears = True
        apply_activation_checkpointing(model, SimpleNamespace(activation_checkpointing=checkpointing))
        loss, _ = objective(mode="joint")(model, batch(), step=0, generator=torch.Generator().manual_seed(4))
        with OperationCounter() as counter:
            loss.backward()
        counts.append(counter.counts.get("_grouped_mm", 0))
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    depth = len(model.blocks)
    assert counts == [2 * 4 * depth] * 2, counts
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "device, precision, compiled, width, on",
    [
        ("cpu", "fp32", False, 36, True),
        ("cpu", "fp32", True, 32, False),
        ("cpu", "bf16", True, 32, True),
        ("cpu", "bf16", True, 36, False),
        ("cuda", "bf16", False, 32, True),
        ("cuda", "fp32", False, 32, False),
        ("cuda", "bf16", False, 36, False),
    ],
)
def test_the_trainer_groups_the_products_where_grouped_mm_has_kernels_for_them(
    caplog, device, precision, compiled, width, on
):
    """A CPU runs any precision and size eagerly; a CUDA device's grouped_mm and the compiled one
    (perf.compile) take bf16 alone, in rows of a multiple of 16 bytes: layer sizes of multiples of 8
    (off otherwise, and the log says why)."""
    cfg = ModelConfig(
        hidden_size=width,
        num_blocks=2,
        num_heads=2,
        max_seq_len=16,
        latent_dim=16,
        num_latents=1,
        timestep_embed_dim=16,
    )
    model = MultimodalMMDiT(cfg, vocab_size=50)
    trainer = SimpleNamespace(device=torch.device(device), precision=precision, raw_model=model)
    with caplog.at_level(logging.INFO, logger="mmldlm"):
        Trainer._group_linears(trainer, True, compiled)
    assert [block.grouped_linears for block in model.blocks] == [on] * len(model.blocks)
    assert ("perf.grouped_linears: off" in caplog.text) is (not on)


def test_the_group_offsets_are_made_on_the_device_once_per_shape_with_nothing_from_the_host():
    """grouped_mm's offsets are the one tensor a grouped product needs beyond its operands: made on
    the device from host integers with no copy from the host (which from pageable memory waits for
    the device), once per pair of row counts. (The meta device's grouped_mm takes bf16 alone, as a
    CUDA device's does, so the float32 step of the other no-sync tests cannot run it there.)"""
    from test_host_overhead import HostToDevice

    with HostToDevice() as copies:
        ends = group_ends(37, 5, torch.device("meta"))
    assert copies.copies == []
    assert ends.device.type == "meta" and ends.dtype == torch.int32 and ends.shape == (2,)
    assert group_ends(37, 5, torch.device("meta")) is ends
    assert group_ends(37, 5, torch.device("cpu")).tolist() == [37, 42]


def test_the_plain_transformers_blocks_of_bench_reference_are_left_alone():
    """`bench --reference` builds its plain transformer with the row's overrides: its blocks have no
    second stream to group, take no flag, and count no stacked weights in their bytes per parameter."""
    from mmldlm.model.reference import PlainTransformer

    cfg = ModelConfig(hidden_size=32, num_blocks=2, num_heads=2, max_seq_len=16, latent_dim=16, num_latents=1)
    model = PlainTransformer(cfg, vocab_size=50)
    Trainer._group_linears(SimpleNamespace(device=torch.device("cpu"), precision="fp32", raw_model=model), True, False)
    assert not any(hasattr(block, "grouped_linears") for block in model.blocks)


def test_a_torch_without_grouped_mm_trains_with_the_layers_one_by_one_and_says_why(caplog, monkeypatch):
    from mmldlm.training import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "grouped_mm", None)
    model = tiny_model()
    trainer = SimpleNamespace(device=torch.device("cpu"), precision="fp32", raw_model=model)
    with caplog.at_level(logging.INFO, logger="mmldlm"):
        Trainer._group_linears(trainer, True, False)
    assert not any(block.grouped_linears for block in model.blocks)
    assert f"perf.grouped_linears: off: torch {torch.__version__} has no grouped_mm" in caplog.text
