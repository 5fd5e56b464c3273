"""perf.compute_weights: the blocks and the adaLN modulation read bf16 copies of their weights in
training. The weights it trains are autocast's to the bit (accumulation, activation checkpointing and
every mode included), the float32 weights stay the model's parameters outside the step, and the casts
it removes are gone from the step's operations."""

import pytest
import torch

from mmldlm.data.synthetic import SyntheticShape, write_synthetic
from mmldlm.tools.bench import build_trainer
from mmldlm.tools.operations import step_operations
from mmldlm.training.compute_weights import compute_weights_off_reason, covered_parameters
from mmldlm.training.traffic import bytes_per_parameter


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    shape = SyntheticShape(vocab_size=300, min_length=8, max_length=24, latent_dim=32, num_samples=32)
    return write_synthetic(shape, tmp_path_factory.mktemp("compute-weights") / "data")


def trainer_for(data, run_dir, *overrides):
    overrides = [
        f"data.path={data}",
        "model=base-2k",
        "model.hidden_size=64",
        "model.num_heads=4",
        "model.num_blocks=3",
        "model.max_seq_len=24",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",  # two micro-batches: the copy, then the add
        "train.precision=bf16",
        "data.num_workers=0",
        "perf.activation_checkpointing=none",
        "train.ema_decay=0.9",
        *overrides,
    ]
    return build_trainer("optimized", overrides, str(run_dir))[2]


@pytest.mark.parametrize(
    "overrides",
    [
        ["objective.mode=random"],
        ["objective.mode=joint", "perf.activation_checkpointing=full"],
        ["objective.mode=l2t", "perf.activation_checkpointing=selective", "optim.grad_clip=0.01"],
        ["objective.mode=random", "perf.fused_text_loss=false"],
    ],
    ids=["random-modes", "joint-recomputed", "l2t-selective-clipped", "head-then-loss"],
)
def test_the_copies_train_the_weights_autocast_trains_to_the_bit(data, tmp_path, overrides):
    """Weights, AdamW moments, EMA, gradient norms and losses of four steps: equal, not close."""
    results = []
    for on in (False, True):
        trainer = trainer_for(data, tmp_path / str(on), f"perf.compute_weights={str(on).lower()}", *overrides)
        assert (trainer.compute_weights is not None) is on
        records = [trainer.train_step() for _ in range(4)]
        results.append((trainer, records))
    (plain, plain_records), (copies, copies_records) = results
    for field in ("loss", "grad_norm", "text_loss", "latent_loss"):
        assert [r[field] for r in copies_records] == [r[field] for r in plain_records], field
    want, got = plain.raw_model.state_dict(), copies.raw_model.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype == torch.float32, key
        assert torch.equal(got[key], want[key]), key
    want_ema, got_ema = plain.ema.module.state_dict(), copies.ema.module.state_dict()
    assert all(torch.equal(got_ema[k], want_ema[k]) for k in want_ema)
    want_state, got_state = plain.optimizer.state_dict()["state"], copies.optimizer.state_dict()["state"]
    for index, state in want_state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got_state[index][name], state[name]), (index, name)


def test_outside_a_step_the_model_holds_its_float32_weights_and_the_optimizer_trains_them(data, tmp_path):
    trainer = trainer_for(data, tmp_path, "perf.compute_weights=true", "objective.mode=joint")
    model = trainer.raw_model
    covered = covered_parameters(model, fused_text_loss=True)
    before = [module._parameters[name] for module, name in covered]
    names = {name for name, p in model.named_parameters() if any(p is q for q in before)}
    layers = ("qkv", "attn_proj", "mlp.fc", "mlp.proj", "q_norm", "k_norm")
    block = {f"blocks.{i}.{s}.{layer}.weight" for i in range(3) for s in ("text", "latent") for layer in layers}
    assert block | {"modulation.proj.weight", "modulation.proj.bias"} <= names
    # the fused loss's head gradient arrives in float32; embeddings are not autocast's
    assert not names & {"text_final.head.weight", "text_embed.weight"}
    assert "text_final.head.weight" in {
        name for name, p in model.named_parameters() for m, n in covered_parameters(model) if p is m._parameters[n]
    }
    trainer.train_step()
    share = trainer.compute_weights.share()
    assert 0.5 < share < 1.0
    assert trainer.bytes_per_parameter() == bytes_per_parameter(
        "bf16", accumulation_steps=2, clip="in_optimizer", ema=True, covered_share=share
    )
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    for (module, name), master in zip(covered, before):
        param = module._parameters[name]
        assert param is master and param.dtype == torch.float32 and id(param) in optimized, name
    assert {id(p) for p in trainer.raw_model.parameters()} == optimized
    # the copies are bf16 and hold no gradient between steps
    assert all(c.dtype == torch.bfloat16 and c.grad is None for c in trainer.compute_weights.copies)
    trainer.train_step()  # the copies follow the updated weights
    first = trainer.compute_weights
    with first.active():
        for copy, master in zip(first.copies, first.masters):
            assert torch.equal(copy, master.detach().to(torch.bfloat16))


def test_the_step_loses_two_casts_per_covered_weight(data, tmp_path):
    """Autocast's weight cast in forward and its gradient's cast back, per covered weight and micro-batch,
    become three operations a step (the copies' refresh, the gradients' copy, then add)."""
    counts = {}
    for on in (False, True):
        trainer = trainer_for(
            data, tmp_path / str(on), f"perf.compute_weights={str(on).lower()}", "objective.mode=joint"
        )
        counts[on] = step_operations(trainer)
    covered = len(trainer.compute_weights.copies)
    gains = sum(isinstance(module, torch.nn.RMSNorm) for module, _ in trainer.compute_weights.slots)
    casts = {on: counts[on].counts.get("_to_copy", 0) for on in counts}
    # two micro-batches; a stream's query and key gains are cast together, as one (2, head_dim) tensor
    assert casts[False] - casts[True] == 2 * 2 * (covered - gains // 2), casts
    assert counts[True].counts.get("_foreach_copy_", 0) - counts[False].counts.get("_foreach_copy_", 0) == 2
    assert counts[True].counts.get("_foreach_add_", 0) - counts[False].counts.get("_foreach_add_", 0) == 1
    assert counts[False].total - counts[True].total == casts[False] - casts[True] - 3  # nothing else added


def test_it_stays_off_where_it_cannot_apply_and_says_why(data, tmp_path, caplog):
    assert compute_weights_off_reason("bf16", distributed=False, step_in_backward=False) is None
    assert "precision" in compute_weights_off_reason("fp32", distributed=False, step_in_backward=False)
    assert "fp16" in compute_weights_off_reason("fp16", distributed=False, step_in_backward=False)
    assert "process" in compute_weights_off_reason("bf16", distributed=True, step_in_backward=False)
    assert "step_in_backward" in compute_weights_off_reason("bf16", distributed=False, step_in_backward=True)
    with caplog.at_level("INFO", logger="mmldlm.training.trainer"):
        trainer = trainer_for(data, tmp_path, "perf.compute_weights=true", "train.precision=fp32")
    assert trainer.compute_weights is None
    assert "perf.compute_weights: off: train.precision resolves to fp32" in caplog.text
