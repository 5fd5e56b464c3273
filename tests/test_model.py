"""MultimodalMMDiT on the tiny preset: joint attention, padding, heads, adaLN-Zero, size accounting."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mmldlm.cli import main
from mmldlm.config import load_model_preset
from mmldlm.model import MultimodalMMDiT, parameter_counts, training_flops_per_sample
from mmldlm.model.mmdit import StreamLayers, apply_rope, modulate, padded_row_count, rope_angles

VOCAB = 512
SHAPE = {"latent_dim": 384, "num_latents": 1}  # no dataset here: the default encoder's latent


def tiny(**overrides):
    return dataclasses.replace(load_model_preset("tiny"), **{**SHAPE, **overrides})


def randomised(cfg, seed=0):
    """A model whose zero-initialised parts (adaLN modulation, heads) are random too, so every path
    carries signal; a fresh model would output constants."""
    torch.manual_seed(seed)
    model = MultimodalMMDiT(cfg, VOCAB).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def inputs(cfg, B=3, L=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, L), generator=g)
    latents = torch.randn(B, cfg.num_latents, cfg.latent_dim, generator=g)
    return tokens, latents, torch.rand(B, generator=g), torch.rand(B, generator=g)


def pad_mask(B=3, L=16, lengths=(16, 11, 6)):
    return torch.arange(L)[None, :] < torch.tensor(lengths)[:B, None]  # (B, L), True = real token


@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
def test_joint_attention_flows_both_ways(pos_embedding):
    cfg = tiny(pos_embedding=pos_embedding)
    model = randomised(cfg)
    tokens, latents, t_text, t_latent = inputs(cfg)
    logits, latent_out, _ = model(tokens, latents, t_text, t_latent)

    other_latents = latents.clone()
    other_latents[0] += 1.0
    logits2, _, _ = model(tokens, other_latents, t_text, t_latent)
    assert (logits2[0] - logits[0]).abs().max() > 1e-3  # the text reads the latent
    torch.testing.assert_close(logits2[1:], logits[1:])  # and only its own sample's

    other_tokens = tokens.clone()
    other_tokens[0, 3] = (tokens[0, 3] + 1) % VOCAB
    _, latent_out2, _ = model(other_tokens, latents, t_text, t_latent)
    assert (latent_out2[0] - latent_out[0]).abs().max() > 1e-3  # the latent reads the text
    torch.testing.assert_close(latent_out2[1:], latent_out[1:])


@pytest.mark.parametrize("prefix", [0, 3])
def test_text_rows_give_the_full_logits_at_those_positions_and_the_same_gradients(prefix):
    """The training loss reads logits only at masked positions: computing only those must change
    nothing else, including gradients, and keep every parameter in the graph when none is selected."""
    cfg = tiny(num_prefix_tokens=prefix)
    model = randomised(cfg).train()
    tokens, latents, t_text, t_latent = inputs(cfg)
    mask = pad_mask()
    rows = (torch.rand(tokens.shape, generator=torch.Generator().manual_seed(5)) < 0.4) & mask  # (B, L)
    target = torch.randn(int(rows.sum()), VOCAB, generator=torch.Generator().manual_seed(6))

    def grads(select):
        model.zero_grad(set_to_none=True)
        index = rows.flatten().nonzero().squeeze(1) if select else None  # (N,) flat positions
        logits, latent_out, _ = model(tokens, latents, t_text, t_latent, mask, text_rows=index)
        chosen = logits if select else logits[rows]
        ((chosen * target).sum() + latent_out.sum()).backward()
        return chosen.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full_logits, full_grads = grads(False)
    row_logits, row_grads = grads(True)
    assert row_logits.shape == (int(rows.sum()), VOCAB)
    torch.testing.assert_close(row_logits, full_logits, rtol=1e-5, atol=1e-6)
    for name in full_grads:
        # Summation order differs (index_select vs a (B, L, V) head), so compare as vectors
        error = (row_grads[name] - full_grads[name]).norm() / full_grads[name].norm().clamp_min(1e-12)
        assert error < 1e-5, (name, float(error))

    model.zero_grad(set_to_none=True)
    logits, latent_out, _ = model(tokens, latents, t_text, t_latent, mask, text_rows=torch.zeros(0, dtype=torch.long))
    assert logits.shape == (0, VOCAB)
    (logits.sum() + latent_out.sum()).backward()
    length = {id(p) for p in model.length_head.parameters()}  # not asked for here (no length_from)
    assert all(p.grad is not None for p in model.parameters() if id(p) not in length)  # DDP finds no unused parameter


def test_text_head_rows_are_padded_to_few_sizes_at_most_an_eighth_larger():
    # oneDNN keeps memory for every matrix shape it has run: 4096 masked-row counts, 56 head shapes.
    sizes = {n: padded_row_count(n) for n in range(1, 64 * 64 + 1)}
    assert len(set(sizes.values())) == 56 and all(n <= size < n + 8 or size <= 1.125 * n for n, size in sizes.items())
    assert padded_row_count(0) == 0 and [padded_row_count(n) for n in (1, 63, 64, 65, 1000)] == [8, 64, 64, 72, 1024]


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
@pytest.mark.parametrize("prefix", [0, 2])
def test_padding_token_ids_change_no_real_output(attention, pos_embedding, prefix):
    cfg = tiny(attention=attention, pos_embedding=pos_embedding, num_prefix_tokens=prefix)
    model = randomised(cfg)
    tokens, latents, t_text, t_latent = inputs(cfg)
    mask = pad_mask()
    logits, latent_out, _ = model(tokens, latents, t_text, t_latent, text_pad_mask=mask)

    other_tokens = torch.where(mask, tokens, (tokens + 7) % VOCAB)
    logits2, latent_out2, _ = model(other_tokens, latents, t_text, t_latent, text_pad_mask=mask)
    torch.testing.assert_close(logits2[mask], logits[mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(latent_out2, latent_out, rtol=0, atol=1e-6)
    # Without the mask the same change is seen: the equality above is the mask's doing.
    unmasked, _, _ = model(tokens, latents, t_text, t_latent)
    unmasked2, _, _ = model(other_tokens, latents, t_text, t_latent)
    assert (unmasked2[1, :11] - unmasked[1, :11]).abs().max() > 1e-4


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
def test_sdpa_and_explicit_attention_agree(padded, pos_embedding):
    sdpa = randomised(tiny(attention="sdpa", pos_embedding=pos_embedding, num_heads=4))
    explicit = MultimodalMMDiT(tiny(attention="explicit", pos_embedding=pos_embedding, num_heads=4), VOCAB).eval()
    explicit.load_state_dict(sdpa.state_dict())
    tokens, latents, t_text, t_latent = inputs(sdpa.cfg)
    mask = pad_mask() if padded else None
    for a, b in zip(sdpa(tokens, latents, t_text, t_latent, mask), explicit(tokens, latents, t_text, t_latent, mask)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("adaln", ["per_block", "single"])
def test_fresh_block_leaves_residual_streams_unchanged(adaln):
    cfg = tiny(adaln=adaln)
    torch.manual_seed(0)
    model = MultimodalMMDiT(cfg, VOCAB)
    x_text, x_latent = torch.randn(2, 16, cfg.hidden_size), torch.randn(2, 1, cfg.hidden_size)
    c = torch.randn(2, cfg.hidden_size)
    for block, mod in zip(model.blocks, model.modulation(c)):
        out_text, out_latent = block(x_text, x_latent, mod)
        assert torch.equal(out_text, x_text) and torch.equal(out_latent, x_latent)
    # The zero heads start from uniform text logits and a zero latent prediction.
    logits, latent_out, _ = model(*inputs(cfg, B=2))
    assert torch.equal(logits, torch.zeros_like(logits)) and torch.equal(latent_out, torch.zeros_like(latent_out))


def test_single_adaln_shares_one_projection_and_learns_each_blocks_offset():
    """model.adaln=single: one (H, 12H) projection for every block instead of one per block, plus a
    (12, H) offset per block; each block's modulation is the shared one plus its own offset, and a
    step's gradient reaches both."""
    per_block, single = (MultimodalMMDiT(tiny(adaln=kind), VOCAB) for kind in ("per_block", "single"))
    H, blocks = single.cfg.hidden_size, single.cfg.num_blocks
    removed = sum(p.numel() for p in per_block.parameters()) - sum(p.numel() for p in single.parameters())
    assert removed == (blocks - 1) * 12 * H * (H + 1) - blocks * 12 * H
    model = randomised(tiny(adaln="single"))
    c = torch.randn(3, H)
    mods = model.modulation(c)
    shared = model.modulation.proj(F.silu(c)).view(3, 12, 1, H)
    for i, mod in enumerate(mods):
        expected = shared + model.modulation.table[i][None, :, None]
        torch.testing.assert_close(torch.stack(mod, 1), expected)
    assert not torch.allclose(torch.stack(mods[0], 1), torch.stack(mods[1], 1))  # the offsets tell blocks apart
    logits, latent, _ = model(*inputs(model.cfg))
    (logits.square().mean() + latent.square().mean()).backward()
    assert model.modulation.table.grad.abs().min(dim=-1).values.gt(0).all()  # every block and tensor
    assert model.modulation.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("num_heads", [2, 4])
def test_configured_head_count_is_honoured(num_heads):
    """Changing the queries of head 0 alone must change only head 0's slice of the attention output."""
    cfg = tiny(num_heads=num_heads)
    model = randomised(cfg)
    head_dim = cfg.hidden_size // num_heads
    block = model.blocks[0]
    seen = []
    hooks = [
        block.text.attn_proj.register_forward_hook(lambda m, args, out: seen.append(args[0])),
        block.latent.attn_proj.register_forward_hook(lambda m, args, out: seen.append(args[0])),
    ]
    tokens, latents, t_text, t_latent = inputs(cfg)
    model(tokens, latents, t_text, t_latent)
    with torch.no_grad():
        block.text.qkv.weight[:head_dim] += 0.5 * torch.randn(head_dim, cfg.hidden_size)  # rows of q, head 0
    model(tokens, latents, t_text, t_latent)
    for hook in hooks:
        hook.remove()
    text_before, latent_before, text_after, latent_after = seen  # (B, T, H) inputs of block 0's attn_proj
    changed = (text_after - text_before).abs().amax(dim=(0, 1))  # (H,) per attention output channel
    assert changed[:head_dim].min() > 1e-4
    assert changed[head_dim:].max() == 0
    assert torch.equal(latent_after, latent_before)  # latent queries do not involve text queries


def test_each_latent_slot_gets_its_own_output():
    cfg = tiny(num_latents=3)
    model = randomised(cfg)
    tokens, latents, t_text, t_latent = inputs(cfg)
    latents[:] = latents[:, :1]  # the same vector in every slot
    logits, latent_out, _ = model(tokens, latents, t_text, t_latent)
    assert logits.shape == (3, 16, VOCAB) and latent_out.shape == (3, 3, cfg.latent_dim)
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        assert (latent_out[:, i] - latent_out[:, j]).abs().max() > 1e-3  # told apart by slot position


def test_latent_null_replaces_the_latent_input():
    cfg = tiny()
    model = randomised(cfg)
    tokens, latents, t_text, t_latent = inputs(cfg)
    null = torch.tensor([True, False, True])
    a = model(tokens, latents, t_text, t_latent, latent_null=null)
    b = model(tokens, torch.randn_like(latents), t_text, t_latent, latent_null=null)
    for x, y in zip(a[:2], b[:2]):
        torch.testing.assert_close(x[null], y[null], rtol=0, atol=0)
        assert (x[1] - y[1]).abs().max() > 1e-3
    # The null latent is in the graph even when no row is dropped, so DDP never waits for it.
    model(tokens, latents, t_text, t_latent)[0].sum().backward()
    assert model.null_latent.grad is not None
    without = MultimodalMMDiT(tiny(null_latent=False), VOCAB)
    assert not any("null" in name for name, _ in without.named_parameters())
    with pytest.raises(ValueError, match="null_latent"):
        without(tokens, latents, t_text, t_latent, latent_null=null)


@pytest.mark.parametrize("skipped", ["text", "latent"])
@pytest.mark.parametrize("vocab_prior", [False, True])
def test_skipped_head_returns_none_and_its_parameters_get_no_gradient(skipped, vocab_prior):
    cfg = tiny(vocab_prior=vocab_prior)
    model = randomised(cfg).train()
    if vocab_prior:
        model.set_token_latents(
            torch.randn(VOCAB, cfg.num_latents, cfg.latent_dim, generator=torch.Generator().manual_seed(1))
        )
    tokens, latents, t_text, t_latent = inputs(cfg)
    mask = pad_mask()
    full = model(tokens, latents, t_text, t_latent, mask)
    logits, latent_out, length_logits = model(
        tokens,
        latents,
        t_text,
        t_latent,
        mask,
        length_from=latents,
        text_head=skipped != "text",
        latent_head=skipped != "latent",
    )
    kept = latent_out if skipped == "text" else logits
    assert (logits if skipped == "text" else latent_out) is None
    torch.testing.assert_close(kept, full[1] if skipped == "text" else full[0])  # the other head is unaffected

    model.zero_grad(set_to_none=True)
    (kept.square().mean() + length_logits.square().mean()).backward()
    idle = model.text_head_parameters() if skipped == "text" else model.latent_head_parameters()
    idle_ids = {id(p) for p in idle}
    assert all(p.grad is None for p in idle)
    # Every other parameter is in the graph: DDP can run with find_unused_parameters=False once the
    # trainer freezes the idle ones.
    missing = [n for n, p in model.named_parameters() if id(p) not in idle_ids and p.grad is None]
    assert not missing


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_fully_padded_text_row_gives_no_nan(attention):
    cfg = tiny(attention=attention)
    model = randomised(cfg).train()
    tokens, latents, t_text, t_latent = inputs(cfg)
    mask = pad_mask(lengths=(16, 0, 6))
    logits, latent_out, _ = model(tokens, latents, t_text, t_latent, mask)
    assert torch.isfinite(logits).all() and torch.isfinite(latent_out).all()
    (logits.logsumexp(-1)[mask].mean() + latent_out.square().mean()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_bad_shapes_are_refused():
    cfg = tiny()
    model = MultimodalMMDiT(cfg, VOCAB)
    tokens, latents, t_text, t_latent = inputs(cfg, L=cfg.max_seq_len + 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens, latents, t_text, t_latent)
    tokens, latents, t_text, t_latent = inputs(cfg)
    with pytest.raises(ValueError, match="latent_dim"):
        model(tokens, latents[..., :-1], t_text, t_latent)


@pytest.mark.parametrize("prefix", [0, 4])
@pytest.mark.parametrize("heads", [(True, True), (True, False), (False, True), "rows"])
def test_training_flops_match_torch_flop_counter(heads, prefix):
    """The formula against torch's own count of every matmul in a forward + backward (the explicit
    path: the counter does not see CPU SDPA). The formula counts a grad-input matmul for the first
    layers too, which autograd skips: a few hundred thousand FLOPs out of ~10^8."""
    cfg = tiny(attention="explicit", num_prefix_tokens=prefix)
    model = randomised(cfg).train()
    B, L = 2, 32
    tokens, latents, t_text, t_latent = inputs(cfg, B=B, L=L)
    rows = None
    if heads == "rows":  # the text head at 23 of the 64 positions, as in training at masked positions
        heads, rows = (True, True), torch.zeros(B, L, dtype=torch.bool)
        rows[0, :15], rows[1, 4:12] = True, True
    counter = FlopCounterMode(display=False)
    with counter:
        outputs = model(
            tokens,
            latents,
            t_text,
            t_latent,
            text_head=heads[0],
            latent_head=heads[1],
            text_rows=None if rows is None else rows.flatten().nonzero().squeeze(1),
            length_from=latents,
        )  # training runs the length head at every step
        sum(out.sum() for out in outputs if out is not None).backward()
    expected = training_flops_per_sample(
        model, L, text_head=heads[0], latent_head=heads[1], text_head_rows=None if rows is None else int(rows.sum()) / B
    )
    assert expected == pytest.approx(counter.get_total_flops() / B, rel=2e-3)


def test_model_info_prints_counts_and_tiny_is_under_5m(capsys):
    assert main(["model-info", "tiny", "--vocab-size", "8192", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    model = MultimodalMMDiT(tiny(), 8192)
    counts = parameter_counts(model)
    total = sum(p.numel() for p in model.parameters())
    assert counts["total"] == total == counts["text"] + counts["latent"] + counts["shared"]
    assert total < 5_000_000
    for part in ("text", "latent", "shared", "total"):
        assert f"{counts[part]:,}" in out
    assert "text length 32" in out and f"{training_flops_per_sample(model, 32):.4e}" in out
    # The vocabulary only grows the text stream.
    bigger = parameter_counts(MultimodalMMDiT(tiny(), 16384))
    assert bigger["text"] - counts["text"] == 2 * 8192 * 128 and bigger["latent"] == counts["latent"]


def test_vocab_prior_adds_a_latent_cosine_bonus_to_the_text_logits():
    """Logits with the prior = logits without it + s(t_latent) * cos(latent, token latent), s ~ 10 at the
    start; the same at text_rows; no bonus from the (zero) null latent."""
    cfg = tiny(vocab_prior=True)
    model = randomised(cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        model.vocab_prior_scale.weight.zero_()
        model.vocab_prior_scale.bias.fill_(10.0)
        model.null_latent.zero_()
    token_latents = torch.randn(VOCAB, 1, cfg.latent_dim)
    model.set_token_latents(token_latents)
    tokens, latents, t_text, t_latent = inputs(cfg)
    with_prior = model(tokens, latents, t_text, t_latent).text_logits
    plain = MultimodalMMDiT(tiny(), VOCAB)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.eval()
    without = plain(tokens, latents, t_text, t_latent).text_logits
    cosine = torch.nn.functional.cosine_similarity(
        latents.flatten(1)[:, None, :], token_latents.flatten(1)[None], dim=-1
    )
    expected = without + torch.nn.functional.softplus(torch.tensor(10.0)) * cosine[:, None, :]
    torch.testing.assert_close(with_prior, expected, rtol=1e-4, atol=1e-4)
    rows = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    at_rows = model(tokens, latents, t_text, t_latent, text_rows=rows.flatten().nonzero().squeeze(1)).text_logits
    torch.testing.assert_close(at_rows, with_prior[rows], rtol=1e-5, atol=1e-5)
    null = torch.ones(tokens.shape[0], dtype=torch.bool)
    dropped = model(tokens, latents, t_text, t_latent, latent_null=null).text_logits
    dropped_plain = plain(tokens, latents, t_text, t_latent, latent_null=null).text_logits
    torch.testing.assert_close(dropped, dropped_plain, rtol=1e-5, atol=1e-5)
    assert "token_latents" in model.state_dict()  # it travels with the weights
    with pytest.raises(ValueError, match="token latents of shape"):
        model.set_token_latents(torch.zeros(VOCAB + 1, 1, cfg.latent_dim))


def test_a_config_file_refines_a_model_preset(tmp_path):
    from mmldlm.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny\n  vocab_prior: true\n  num_blocks: 3\n")
    cfg = load_config(path)
    assert (cfg.model.vocab_prior, cfg.model.num_blocks, cfg.model.hidden_size) == (True, 3, tiny().hidden_size)
    # `model=NAME` on the command line swaps in that preset's architecture; keys it does not set stay.
    cfg = load_config(path, ["model=small"])
    small = load_model_preset("small")
    assert (cfg.model.vocab_prior, cfg.model.num_blocks, cfg.model.hidden_size) == (
        True,
        small.num_blocks,
        small.hidden_size,
    )
    path.write_text("model:\n  preset: [tiny]\n")
    with pytest.raises(ConfigError, match=r"'model.preset': got \['tiny'\]; expected the name of a model preset"):
        load_config(path)


def test_prefix_tokens_carry_the_latent_and_follow_the_null_latent():
    """With model.num_prefix_tokens the text stream reads the latent through the prefix as well: with
    the latent slot's values zeroed in every block (no path through joint attention), the text logits
    still change with the latent; a dropped row reads the null latent's prefix."""
    cfg = tiny(num_prefix_tokens=2)
    model = randomised(cfg)
    with torch.no_grad():
        for block in model.blocks:
            # latent slots lend no values (the rows are q, k, v head by head)
            block.latent.qkv.weight.view(cfg.num_heads, 3, -1, cfg.hidden_size)[:, 2].zero_()
    tokens, latents, t_text, t_latent = inputs(cfg)
    logits, _, _ = model(tokens, latents, t_text, t_latent, latent_head=False)
    other, _, _ = model(tokens, latents.roll(1, dims=0), t_text, t_latent, latent_head=False)
    assert (logits - other).abs().max() > 1e-3
    null = torch.tensor([True, False, False])
    dropped, _, _ = model(tokens, latents, t_text, t_latent, latent_null=null, latent_head=False)
    same_null, _, _ = model(tokens, latents.roll(1, dims=0), t_text, t_latent, latent_null=null, latent_head=False)
    torch.testing.assert_close(dropped[0], same_null[0])


def test_rotary_embedding_rotates_each_pair_by_its_positions_angle():
    """apply_rope against the rotation written as complex numbers (RoFormer eq. 34): pair j of position
    m, (x_j, x_{j + hd/2}) as x_j + i x_{j + hd/2}, multiplied by exp(i m theta_j), theta_j = 10000^(-2j/hd)."""
    L, nh, hd = 7, 3, 8
    x = torch.randn(2, L, nh, hd, dtype=torch.float64)
    cos, sin = rope_angles(L, hd, torch.device("cpu"))
    got = apply_rope(x, cos[:, None].double(), sin[:, None].double())
    theta = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
    turn = torch.polar(torch.ones(L, hd // 2, dtype=torch.float64), torch.arange(L)[:, None] * theta)  # (L, hd/2)
    rotated = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * turn[:, None]  # (2, L, nh, hd/2)
    want = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the tables are float32


def test_qk_rmsnorm_of_bf16_activations_keeps_the_fp32_mean_of_squares():
    """Under bf16 autocast q and k leave the projection in bf16 and are normalised together in one call:
    the fp32 computation rounded to bf16 (within two bf16 steps, the norm's and the gain's), not a bf16
    mean of squares; and q and k each get their own gain."""
    cfg = tiny()
    stream = StreamLayers(cfg)
    hd = cfg.hidden_size // cfg.num_heads
    with torch.no_grad():
        stream.q_norm.weight.uniform_(0.5, 1.5)
        stream.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 10, cfg.hidden_size) * 30
    shift, scale = torch.zeros(4, 1, cfg.hidden_size), torch.ones(4, 1, cfg.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qkv = stream.qkv(stream.attention_input(x, shift, scale))
        qk, v = stream.qk_heads(qkv)
        raw = stream.qkv(modulate(stream.norm_attn(x), shift, scale)).view(4, 10, cfg.num_heads, 3, hd)
    assert qk.dtype == v.dtype == torch.bfloat16 and qk.shape == (4, 10, cfg.num_heads, 2, hd)
    gains = (stream.q_norm.weight, stream.k_norm.weight)
    want = torch.stack([F.rms_norm(raw[..., i, :].float(), (hd,), w, cfg.norm_eps) for i, w in enumerate(gains)], 3)
    torch.testing.assert_close(qk.float(), want, rtol=3 * 2**-8, atol=0)


def earlier_layout(state: dict, num_blocks: int, num_heads: int) -> dict:
    """`state` as an earlier mmldlm wrote it: each block's streams their own adaLN modulation
    (`blocks.i.{text,latent}.modulation.1.*`: shift, scale, gate of the attention, then of the MLP) and
    every scale DiT's, multiplied as 1 + scale (the final layers' too); each qkv projection's rows q,
    k, v, each of them head by head."""
    state = dict(state)
    weight, bias = state.pop("modulation.proj.weight"), state.pop("modulation.proj.bias")
    H = weight.shape[1]
    bias = bias.view(num_blocks, 2, 2, 3, H).clone()
    bias[:, :, :, 1] -= 1.0
    weight, bias = weight.view(num_blocks, 2, 6 * H, H), bias.view(num_blocks, 2, 6 * H)
    for i in range(num_blocks):
        for s, stream in enumerate(("text", "latent")):
            state[f"blocks.{i}.{stream}.modulation.1.weight"] = weight[i, s]
            state[f"blocks.{i}.{stream}.modulation.1.bias"] = bias[i, s]
    for final in ("text_final", "latent_final"):
        final_bias = state[f"{final}.modulation.1.bias"].clone()
        final_bias[H:] -= 1.0
        state[f"{final}.modulation.1.bias"] = final_bias
    for key in [k for k in state if k.endswith(".qkv.weight")]:  # rows q (all heads), k, v; not head by head
        state[key] = state[key].view(num_heads, 3, H // num_heads, H).transpose(0, 1).reshape(3 * H, H)
    return state


def test_weights_of_the_earlier_per_block_modulation_load_and_give_the_same_outputs(tmp_path):
    """Runs and exports written before the blocks' modulations became one matrix still sample, evaluate
    and export: their weights are mapped into the current layout where weights are read."""
    from mmldlm.runs.trained import load_weights

    cfg = tiny()
    model = randomised(cfg)
    old = earlier_layout(model.state_dict(), cfg.num_blocks, cfg.num_heads)
    assert "modulation.proj.weight" not in old and "blocks.3.latent.modulation.1.bias" in old
    loaded = MultimodalMMDiT(cfg, VOCAB).eval()
    load_weights(loaded, tmp_path / "model.safetensors", old)
    x = inputs(cfg)
    for a, b in zip(model(*x, pad_mask()), loaded(*x, pad_mask())):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"vocab_prior": True, "length_head": True, "self_condition": True, "num_prefix_tokens": 2, "adaln": "single"}],
    ids=["default", "every-optional-part"],
)
def test_a_model_built_on_the_meta_device_materialises_to_the_initialisation_of_one_built_in_place(overrides):
    """On the meta device the model is built without initialising (there are no values: `mmldlm check`
    and `migrate` count its shapes); `to_empty` then `init_weights` gives every parameter and buffer the
    values a model built in place gets from `init_weights` with the same generator state."""
    cfg = tiny(**overrides)
    torch.manual_seed(0)
    in_place = MultimodalMMDiT(cfg, VOCAB)
    with torch.device("meta"):
        meta = MultimodalMMDiT(cfg, VOCAB)
    assert all(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    meta.to_empty(device="cpu")
    for model in (in_place, meta):
        torch.manual_seed(1)
        model.init_weights()
    assert meta.state_dict().keys() == in_place.state_dict().keys()
    for name, value in in_place.state_dict().items():
        assert torch.equal(meta.state_dict()[name], value), name
