"""perf.text_row_buckets: the text head's rows filled up to a few fixed counts (`pad_rows`), the filling
rows weighted 0, give the loss, metrics and gradients of exactly the masked rows, in every mode, both
text losses, fused or not, padded or packed; and the head sees only those few counts."""

import pytest
import torch
from test_fused_text_loss import ATOL, batch, tiny_model
from test_packing import DIM, MASK_ID, PAD_ID

from mmldlm.config import ConfigValueError, load_config
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.diffusion.masked import pad_rows
from mmldlm.objective import Objective


def objective(mode, loss, fused, buckets):
    cfg = load_config(None, [f"objective.mode={mode}", f"text_diffusion.loss={loss}"])
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=MASK_ID, pad_token_id=PAD_ID)
    latent = GaussianDiffusion(cfg.latent_diffusion, mean=torch.zeros(DIM), std=torch.ones(DIM))
    return Objective(cfg.objective, text, latent, length_head=True, fused_text_loss=fused, text_row_buckets=buckets)


def test_pad_rows_fills_to_the_next_multiple_with_position_zero():
    rows, valid = pad_rows(torch.tensor([3, 5, 9, 11, 12]), 4)
    assert rows.tolist() == [3, 5, 9, 11, 12, 0, 0, 0] and valid.tolist() == [True] * 5 + [False] * 3
    rows, valid = pad_rows(torch.tensor([1, 2, 3, 4]), 4)  # already a multiple: nothing added
    assert rows.tolist() == [1, 2, 3, 4] and valid.all()
    rows, valid = pad_rows(torch.zeros(0, dtype=torch.long), 4)  # none masked: one step of filling
    assert rows.tolist() == [0, 0, 0, 0] and not valid.any()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("loss", ["masked_ce", "elbo"])
@pytest.mark.parametrize("mode", ["l2t", "joint"])
def test_filled_rows_give_the_loss_metrics_and_gradients_of_the_masked_ones(mode, loss, fused, packed):
    model, b = tiny_model(), batch(packed)
    seen = []  # the text head's row counts
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["text_rows"].shape[0]), with_kwargs=True
    )
    results = []
    for buckets in (None, 3):
        total, metrics = objective(mode, loss, fused, buckets)(
            model, b, step=0, generator=torch.Generator().manual_seed(4)
        )
        total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((total.detach(), metrics, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    B, L = b["tokens"].shape
    step = -(-B * L // 3)
    assert seen[0] == metrics_a["num_masked"] and seen[1] % step == 0 and seen[1] > seen[0]
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=ATOL)
    assert metrics_a.keys() == metrics_b.keys()
    assert metrics_b["num_masked"] == metrics_a["num_masked"] and isinstance(metrics_b["num_masked"], int)
    for key in ("text_loss", "accuracy", "latent_loss", "length_loss"):
        if key in metrics_a:
            torch.testing.assert_close(metrics_b[key], metrics_a[key], rtol=1e-6, atol=ATOL, msg=key)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=ATOL, msg=name)


def test_the_head_sees_a_few_row_counts_across_steps():
    """Twenty steps' masked counts vary; filled to 4 buckets of the batch's positions, at most 5 counts."""
    model, b = tiny_model(), batch(False)
    counts = {None: set(), 4: set()}
    for buckets in counts:
        model._forward_pre_hooks.clear()
        model.register_forward_pre_hook(
            lambda module, args, kwargs, found=counts[buckets]: found.add(kwargs["text_rows"].shape[0]),
            with_kwargs=True,
        )
        run = objective("l2t", "elbo", True, buckets)
        for step in range(20):
            with torch.no_grad():
                run(model, b, step=step, generator=torch.Generator().manual_seed(step))
    assert len(counts[None]) > 5 and len(counts[4]) <= 5


def test_bad_bucket_count_names_the_key():
    with pytest.raises(ConfigValueError, match="perf.text_row_buckets"):
        load_config(None, ["perf.text_row_buckets=0"])
