"""Sequence packing (data.packing): texts laid end to end in rows with block-diagonal attention give
each text exactly what it gets unpacked (forward, loss and gradients, in fp32 to atol 1e-5), no text
ever sees another, the collate's layout places every token once, and training runs the same steps."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from data_support import prepared

from mmldlm.config import ConfigError, ModelConfig, load_config
from mmldlm.data.dataset import PadCollate, pack_rows, packed_layout
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.errors import UserError
from mmldlm.model.mmdit import MultimodalMMDiT, Packing
from mmldlm.objective import Objective
from mmldlm.training.distributed import DistInfo
from mmldlm.training.run import build_trainer

VOCAB, DIM, MASK_ID, PAD_ID = 50, 16, 1, 0
LENGTHS = np.array([5, 12, 1, 9, 16, 3, 7, 2])  # 55 tokens: 4 rows of 16
PACK = 16
ATOL = 1e-5  # fp32: packed and padded rows sum the same products in a different blocking


def tiny_model(**overrides):
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=32,
        num_blocks=3,
        num_heads=2,
        max_seq_len=16,
        latent_dim=DIM,
        timestep_embed_dim=16,
        **{"num_latents": 1, **overrides},
    )
    model = MultimodalMMDiT(cfg, vocab_size=VOCAB)
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: give the blocks work to do
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(lengths=LENGTHS, num_latents=1, packed=True, seed=1, rows=None, widths=None):
    """A batch of texts of these lengths, packed in rows of PACK positions (padded to the row counts
    `rows`), or with `widths` in rows as wide as the shortest that holds them, at most 64."""
    g = np.random.default_rng(seed)
    samples = [
        (i, g.integers(2, VOCAB, n), g.standard_normal((num_latents, DIM), dtype=np.float32))
        for i, n in enumerate(lengths)
    ]
    pack = (64 if widths is not None else PACK) if packed else None
    return PadCollate(PAD_ID, 1, None, pack, buckets=widths, pack_rows=rows)(samples)


def inputs(b, seed=2):
    g = torch.Generator().manual_seed(seed)
    N = b["tokens"].shape[0]
    return dict(
        tokens=b["tokens"],
        latents=b["latents"],
        t_text=torch.rand(N, generator=g),
        t_latent=torch.rand(N, generator=g),
        text_pad_mask=b["pad_mask"],
    )


def test_the_packed_layout_places_every_token_once_in_rows_of_the_pack_length():
    b = batch()
    doc, position, latent_doc = b["pack_doc"], b["pack_position"], b["pack_latent_doc"]
    assert doc.shape == (4, PACK)  # 55 tokens in 4 rows of 16: no row more than first-fit needs
    for i, n in enumerate(LENGTHS):
        assert sorted(position[doc == i].tolist()) == list(range(n))  # each token once
        assert (latent_doc == i).sum() == 1  # one latent group per text
        rows = (doc == i).any(dim=1).nonzero().flatten().tolist()
        assert rows == (latent_doc == i).any(dim=1).nonzero().flatten().tolist()  # its latents in its row
    assert (doc < 0).sum() == 4 * PACK - LENGTHS.sum()
    assert all(sum(LENGTHS[row]) <= PACK for row in pack_rows(LENGTHS, PACK))
    with pytest.raises(UserError, match="a text of 16 tokens does not fit data.pack_length=8"):
        packed_layout(LENGTHS, 8)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"pos_embedding": "learned"}, {"num_latents": 2}, {"vocab_prior": True}],
    ids=["rope", "learned", "two-latents", "vocab-prior"],
)
def test_packed_forward_equals_the_padded_forward(overrides):
    model = tiny_model(**overrides)
    if model.token_latents is not None:
        model.set_token_latents(torch.randn(VOCAB, model.cfg.num_latents, DIM))
    b = batch(num_latents=model.cfg.num_latents)
    x = inputs(b)
    rows = (torch.rand(b["tokens"].shape, generator=torch.Generator().manual_seed(3)) < 0.5) & b["pad_mask"]
    kwargs = dict(text_rows=rows.flatten().nonzero().squeeze(1), length_from=b["latents"])
    padded = model(**x, **kwargs)
    packed = model(**x, **kwargs, packing=Packing.from_batch(b))
    for name, a, p in zip(padded._fields, padded, packed):
        torch.testing.assert_close(p, a, rtol=0, atol=ATOL, msg=name)
    full_padded = model(**x).text_logits[b["pad_mask"]]
    full_packed = model(**x, packing=Packing.from_batch(b)).text_logits[b["pad_mask"]]
    torch.testing.assert_close(full_packed, full_padded, rtol=0, atol=ATOL)


def objective(**overrides):
    cfg = load_config(None, ["objective.mode=joint", *[f"objective.{k}={v}" for k, v in overrides.items()]])
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=MASK_ID, pad_token_id=PAD_ID)
    latent = GaussianDiffusion(cfg.latent_diffusion, mean=torch.zeros(DIM), std=torch.ones(DIM))
    return Objective(cfg.objective, text, latent, length_head=True)


def test_packed_rows_pad_to_the_fewest_row_count_that_holds_them_else_one_row_per_text():
    """data.pack_rows: the 4 rows first-fit fills, padded with empty rows (every position and latent
    group -1) to the next count; past the last count one row per text; the texts' places unchanged."""
    plain = batch()
    groups = plain["pack_latent_doc"].shape[1]  # the most texts in a row: 3
    for rows, expected in (([4], 4), ([2, 6, 7], 6), ([3], len(LENGTHS))):
        b = batch(rows=rows)
        assert b["pack_doc"].shape == (expected, PACK) and b["pack_latent_doc"].shape == (expected, groups)
        for key in ("pack_doc", "pack_position", "pack_latent_doc"):
            assert torch.equal(b[key][:4], plain[key]) and (b[key][4:] == (0 if key == "pack_position" else -1)).all()
        collate = PadCollate(PAD_ID, 1, None, PACK, pack_rows=rows)
        assert collate.positions(LENGTHS) == expected * (PACK + groups)  # the cost the micro-batch probe sizes


def test_one_wide_row_is_as_wide_as_the_shortest_length_bucket_that_holds_its_texts():
    """data.length_buckets with data.packing: the rows' widths. A micro-batch in one row of at most 64
    positions (data.pack_rows=[1]) is 40 wide where its texts fill 40 or fewer, 48 up to 48, else 64;
    the texts' padded layout keeps its own length (the longest text), and the micro-batch probe
    counts the positions the blocks compute."""
    for lengths, width in (([5, 12, 1, 9], 40), ([16, 16, 8], 40), ([16, 16, 16], 48), (LENGTHS, 64)):
        lengths = np.array(lengths)
        collate = PadCollate(PAD_ID, 1, None, 64, buckets=[40, 48], pack_rows=[1])
        samples = [(i, np.arange(2, 2 + n), np.zeros((1, DIM), dtype=np.float32)) for i, n in enumerate(lengths)]
        b = collate(samples)
        assert b["pack_doc"].shape == (1, width) and b["tokens"].shape == (len(lengths), lengths.max())
        assert (b["pack_doc"] >= 0).sum() == lengths.sum()
        assert collate.positions(lengths) == width + len(lengths)  # one row: its width and its latent groups
    with pytest.raises(UserError, match="a text of 16 tokens does not fit data.pack_length=8"):
        packed_layout(LENGTHS, 8, widths=[4])


@pytest.mark.parametrize("mode", ["joint", "l2t", "t2l"])
@pytest.mark.parametrize(
    "rows, widths",
    [(None, None), ([6], None), ([3], None), ([1], [48, 56])],
    ids=["as-filled", "padded-rows", "row-per-text", "one-wide-row"],
)
def test_packed_loss_and_gradients_equal_the_padded_ones(mode, rows, widths):
    model = tiny_model()
    b = batch(rows=rows, widths=widths)
    if widths is not None:
        assert b["pack_doc"].shape == (1, 56)  # 55 tokens
    unpacked = {k: v for k, v in b.items() if not k.startswith("pack_")}
    results = []
    for one in (unpacked, b):
        loss, metrics = objective(mode=mode)(model, one, step=0, generator=torch.Generator().manual_seed(4))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((loss.detach(), metrics, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=ATOL)
    for key in ("text_loss", "latent_loss", "length_loss"):
        if key in metrics_a:
            torch.testing.assert_close(metrics_b[key], metrics_a[key], rtol=0, atol=ATOL)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=ATOL, msg=name)


def test_attention_never_crosses_texts():
    """Changing one text's tokens and latent leaves every other text's outputs bit for bit the same."""
    model = tiny_model()
    b = batch()
    packing = Packing.from_batch(b)
    x = inputs(b)
    before = model(**x, packing=packing)
    changed = 1  # 12 tokens, sharing its row with others
    assert (packing.text_doc[(packing.text_doc == changed).any(dim=1)] != changed).any()
    x["tokens"] = x["tokens"].clone()
    x["tokens"][changed, : LENGTHS[changed]] = torch.randint(2, VOCAB, (LENGTHS[changed],))
    x["latents"] = x["latents"].clone()
    x["latents"][changed] += 1.0
    after = model(**x, packing=packing)
    others = torch.arange(len(LENGTHS)) != changed
    real = b["pad_mask"]
    assert not torch.equal(after.text_logits[changed], before.text_logits[changed])
    assert torch.equal(after.text_logits[others][real[others]], before.text_logits[others][real[others]])
    assert torch.equal(after.latent[others], before.latent[others])


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.attention=explicit", "model.attention"),
        ("model.num_prefix_tokens=2", "model.num_prefix_tokens"),
        ("distributed.strategy=fsdp2", "distributed.strategy"),
    ],
)
def test_packing_refuses_what_it_does_not_support_in_one_line(override, key):
    with pytest.raises(ConfigError, match=rf"config key 'data.packing'.*false with {key}="):
        load_config(None, ["data.packing=true", override])


def test_pack_rows_takes_ascending_counts_of_packed_rows_and_lets_cuda_graphs_take_packing():
    for rows in ("[]", "[4, 4]", "[0, 2]"):
        with pytest.raises(ConfigError, match=r"config key 'data.pack_rows'.*non-empty ascending list"):
            load_config(None, ["data.packing=true", f"data.pack_rows={rows}"])
    with pytest.raises(ConfigError, match=r"config key 'data.pack_rows'.*null with data.packing=false"):
        load_config(None, ["data.pack_rows=[4]"])
    graphs = ["perf.compile=true", "perf.cuda_graphs=true", "data.packing=true"]
    with pytest.raises(ConfigError, match=r"config key 'perf.cuda_graphs'.*or packed rows to data.pack_rows"):
        load_config(None, graphs)
    assert load_config(None, [*graphs, "data.pack_rows=[4, 6]"]).data.pack_rows == [4, 6]


def test_training_packed_takes_the_same_steps_as_padded(tmp_path_factory, tmp_path):
    data = prepared(tmp_path_factory)
    losses = {}
    for packing in (False, True):
        cfg = load_config(
            None,
            [
                f"data.path={data}",
                "data.num_workers=0",
                f"data.packing={packing}",
                "data.bucket_batches=4",
                "model.hidden_size=32",
                "model.num_heads=2",
                "model.num_blocks=2",
                "model.max_seq_len=128",
                "train.precision=fp32",
                "train.micro_batch_size=8",
                "train.global_batch_size=8",
                "objective.mode=random",
                "logging.progress_bar=false",
                f"train.run_dir={tmp_path / str(packing)}",
            ],
        )
        trainer = build_trainer(cfg, DistInfo())
        trainer.resume(None)
        losses[packing] = [trainer.train_step()["loss"] for _ in range(4)]
        trainer.metrics.close()
    np.testing.assert_allclose(losses[True], losses[False], rtol=0, atol=ATOL)


def test_a_pack_length_shorter_than_the_longest_text_is_refused(tmp_path_factory):
    from mmldlm.data.dataset import open_dataset, resolve_for_model

    dataset = open_dataset(prepared(tmp_path_factory), "train")
    cfg = load_config(None, ["data.packing=true", "data.pack_length=64", "data.max_length=128"])
    with pytest.raises(ConfigError, match=r"'data.pack_length': got 64; expected null or >= data.max_length=128"):
        resolve_for_model(cfg.data, dataclasses.replace(cfg.model, max_seq_len=128), dataset)


@pytest.mark.slow  # torchrun on 2 processes and a reference run in a subprocess
def test_ddp_trains_packed_batches_as_one_process_does(tmp_path_factory, tmp_path):
    """Two DDP processes of one text each match one process accumulating the same two micro-batches
    (the loader strides samples over ranks); the packed layout passes through DDP's forward."""
    data = prepared(tmp_path_factory)
    repo = Path(__file__).resolve().parent.parent
    args = [
        f"data.path={data}",
        "data.packing=true",
        "data.bucket_batches=1",  # bucketed batches are cut per rank: 1 x 2 accumulation steps != 2 ranks
        "data.num_workers=0",
        "model=tiny",
        "model.hidden_size=64",
        "model.num_blocks=2",
        "model.max_seq_len=128",
        "train.precision=fp32",
        "train.deterministic=true",
        "train.steps=4",
        "train.log_every=1",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "checkpoint.every=1000",
        "logging.progress_bar=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    losses = {}
    for nproc in (1, 2):
        run_dir = tmp_path / str(nproc)
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run"]
        if nproc > 1:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            launcher += ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        proc = subprocess.run(
            [*launcher, str(repo / "tests" / "train_worker.py"), *args, f"train.run_dir={run_dir}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=repo,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        losses[nproc] = [json.loads(line)["loss"] for line in lines if '"loss"' in line]
    assert len(losses[1]) == 4
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5, atol=1e-6)
