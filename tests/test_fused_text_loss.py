"""perf.fused_text_loss: the text head fused with its SUBS cross-entropy, chunk by chunk of the masked
positions, gives the loss, metrics and gradients of the head followed by the loss (fp32, every mode,
both text losses, with the vocabulary prior, padded or packed), and never holds the (N, V) logits whole."""

import pytest
import torch
from test_packing import DIM, MASK_ID, PAD_ID, VOCAB
from test_packing import batch as packing_batch
from test_packing import tiny_model as packing_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmldlm.config import load_config
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.diffusion.masked import subs_cross_entropy, subs_linear_cross_entropy
from mmldlm.model.mmdit import TextLoss
from mmldlm.objective import Objective

ATOL = 1e-5


def head_then_loss(x, weight, targets, row_weights, excluded, prior=None, doc=None):
    logits = x @ weight.T
    if prior is not None:
        logits = logits + prior.index_select(0, doc)
    ce, predicted = subs_cross_entropy(logits, targets, excluded)
    return (ce * row_weights).sum(), ce, predicted


@pytest.mark.parametrize("chunk_rows", [1, 5, None], ids=["row-by-row", "chunks-of-5", "one-chunk"])
@pytest.mark.parametrize("with_prior", [False, True], ids=["head", "head+prior"])
def test_fused_head_and_loss_equal_the_head_then_the_loss(chunk_rows, with_prior):
    """Sum, cross-entropy, argmax and the gradients of x, the weight and the prior table; rows of weight
    0 (the head's padding) get no gradient."""
    g = torch.Generator().manual_seed(0)
    N, H, excluded, B = 23, 12, 7, 4
    x = torch.randn(N, H, generator=g)
    weight = torch.randn(VOCAB, H, generator=g)
    weight[excluded] *= 20  # the excluded column is never the answer, however large
    prior = torch.randn(B, VOCAB, generator=g) if with_prior else None
    doc = torch.randint(0, B, (N,), generator=g)
    targets = torch.randint(0, VOCAB, (N,), generator=g)
    targets[targets == excluded] = 0
    row_weights = torch.rand(N, generator=g)
    row_weights[-3:] = 0.0

    results = []
    for fused in (False, True):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, prior)]
        if fused:
            out = subs_linear_cross_entropy(
                leaves[0], leaves[1], targets, row_weights, excluded, leaves[2], doc, chunk_rows=chunk_rows
            )
        else:
            out = head_then_loss(leaves[0], leaves[1], targets, row_weights, excluded, leaves[2], doc)
        (2.5 * out[0]).backward()
        results.append((out, [t.grad if t is not None else None for t in leaves]))
    (want, want_grads), (got, got_grads) = results
    assert isinstance(got, TextLoss) and got.ce.dtype == torch.float32 and not got.ce.requires_grad
    torch.testing.assert_close(got.weighted, want[0], rtol=1e-6, atol=ATOL)
    torch.testing.assert_close(got.ce, want[1], rtol=1e-6, atol=ATOL)
    assert torch.equal(got.predicted, want[2]) and (got.predicted != excluded).all()
    for name, a, b in zip(("x", "weight", "prior"), want_grads, got_grads):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=ATOL, msg=name)
    assert (got_grads[0][-3:] == 0).all()


def test_no_rows_and_no_gradient_mode_are_handled():
    """No masked row: a zero sum, empty outputs, zero gradients; under no_grad the same values and no
    gradient computed (evaluation)."""
    weight = torch.randn(VOCAB, 6, requires_grad=True)
    none = subs_linear_cross_entropy(
        torch.zeros(0, 6, requires_grad=True), weight, torch.zeros(0, dtype=torch.long), torch.zeros(0), 1
    )
    assert none.weighted.item() == 0 and none.ce.shape == none.predicted.shape == (0,)
    none.weighted.backward()
    assert (weight.grad == 0).all()
    x, targets = torch.randn(9, 6), torch.randint(2, VOCAB, (9,))
    with torch.no_grad():
        quiet = subs_linear_cross_entropy(x, weight, targets, torch.ones(9), 1, chunk_rows=4)
    want = head_then_loss(x, weight.detach(), targets, torch.ones(9), 1)
    assert not quiet.weighted.requires_grad
    torch.testing.assert_close(quiet.ce, want[1], rtol=1e-6, atol=ATOL)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation returned while it was entered."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_fused_head_and_loss_never_hold_the_logits_whole():
    """Forward and backward in chunks of 8 rows of 64: no tensor of (N, V) elements, where the head
    followed by the loss makes several."""
    N, H, V = 64, 8, 256
    x = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets, row_weights = torch.randint(2, V, (N,)), torch.ones(N)
    for fused, bound in ((True, 8 * V), (False, None)):
        with LargestTensor() as seen:
            if fused:
                loss = subs_linear_cross_entropy(x, weight, targets, row_weights, 1, chunk_rows=8).weighted
            else:
                loss = head_then_loss(x, weight, targets, row_weights, 1)[0]
            loss.backward()
        if bound is not None:
            assert seen.largest <= bound, seen.largest
        else:
            assert seen.largest >= N * V


def tiny_model():
    model = packing_model(vocab_prior=True)
    model.set_token_latents(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)))
    return model


def objective(mode, loss, fused):
    cfg = load_config(None, [f"objective.mode={mode}", f"text_diffusion.loss={loss}"])
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=MASK_ID, pad_token_id=PAD_ID)
    latent = GaussianDiffusion(cfg.latent_diffusion, mean=torch.zeros(DIM), std=torch.ones(DIM))
    return Objective(cfg.objective, text, latent, length_head=True, fused_text_loss=fused)


def batch(packed):
    return packing_batch(packed=packed)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("loss", ["masked_ce", "elbo"])
@pytest.mark.parametrize("mode", ["l2t", "t2l", "joint"])
def test_training_loss_metrics_and_gradients_are_the_unfused_ones(mode, loss, packed):
    model, b = tiny_model(), batch(packed)
    heads = []  # what the model's text head returned: logits, or the fused loss
    model.register_forward_hook(lambda module, args, out: heads.append(type(out.text_logits)))
    results = []
    for fused in (False, True):
        total, metrics = objective(mode, loss, fused)(model, b, step=0, generator=torch.Generator().manual_seed(4))
        total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((total.detach(), metrics, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=ATOL)
    assert metrics_a.keys() == metrics_b.keys()
    for key in ("text_loss", "accuracy", "num_masked", "latent_loss", "length_loss"):
        if key in metrics_a:
            torch.testing.assert_close(
                torch.as_tensor(metrics_b[key]), torch.as_tensor(metrics_a[key]), rtol=1e-6, atol=ATOL
            )
    assert heads == ([type(None)] * 2 if mode == "t2l" else [torch.Tensor, TextLoss])
    assert grads_a.keys() == grads_b.keys()
    assert mode == "t2l" or {"text_final.head.weight", "vocab_prior_scale.weight"} <= grads_a.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=ATOL, msg=name)


def test_bf16_autocast_loss_is_the_unfused_one_within_bf16_rounding():
    """Under bf16 autocast the fused head runs its products in bf16, as autocast runs the head's."""
    model, b = tiny_model(), batch(False)
    losses = []
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, _ = objective("joint", "masked_ce", fused)(
                model, b, step=0, generator=torch.Generator().manual_seed(4)
            )
        losses.append(total.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)


def test_text_targets_need_the_rows_they_are_at():
    model = tiny_model()
    tokens = torch.randint(2, VOCAB, (2, 8))
    targets = MaskedDiffusion(load_config(None, []).text_diffusion, MASK_ID, PAD_ID).loss_targets(
        tokens, torch.rand(2), torch.tensor([0, 3])
    )
    with pytest.raises(ValueError, match="text_targets need text_rows"):
        model(tokens, torch.randn(2, 1, DIM), torch.rand(2), torch.rand(2), text_targets=targets)
