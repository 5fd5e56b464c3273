"""Memory sized by the real data: the batch that the memory probes of `auto` checkpointing and
micro-batch run is the heaviest one the loader really yields (the prepared dataset's lengths under
the configured bucketing), and its measured peak bounds the peaks of the real batches, closely."""

import dataclasses

import pytest
import torch
from data_support import prepared
from torch.distributed._tools.mem_tracker import MemTracker

from mmldlm.config import load_config
from mmldlm.data.dataset import build_loader, heaviest_batch, open_dataset, resolve_for_model
from mmldlm.tools.check import Environment, estimate
from mmldlm.training.batch_size import full_length_batch, joint_objective
from mmldlm.training.run import build_model_and_objective

MICRO = 8
# The probe's measured peak against the largest of the real batches': it runs the heaviest batch's
# shapes with random masking like a real step, so the two differ by the text head's logits at the
# masked positions (a few percent either way), and, packed, by the padded batch's own length.
LOWER, UPPER = 0.97, 1.15


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared(tmp_path_factory)


def run_config(data_dir, *overrides):
    return load_config(
        None,
        [
            f"data.path={data_dir}",
            "data.num_workers=0",
            "model.hidden_size=64",
            "model.num_heads=2",
            "model.num_blocks=2",
            "model.max_seq_len=128",
            "train.precision=fp32",
            *overrides,
        ],
    )


def measured_peak(model, objective, batch) -> int:
    """Peak bytes of live tensors (torch's own accounting, on CPU too) over one joint-mode forward and
    backward of `batch`, as the memory probe runs it."""
    joint = joint_objective(objective)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss, _ = joint(model, batch, step=0, generator=torch.Generator().manual_seed(0))
        loss.backward()
    model.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


LAYOUTS = ["data.bucket_batches=1", "data.bucket_batches=4", "data.packing=true"]


def computed_positions(batch) -> int:
    """Positions the blocks run on: the padded batch's text, or the packed rows' text and latent groups."""
    if "pack_doc" in batch:
        return batch["pack_doc"].numel() + batch["pack_latent_doc"].numel()
    return batch["tokens"].numel()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_heaviest_batch_is_the_largest_batch_the_loader_yields(data_dir, layout):
    cfg = run_config(data_dir, layout)
    dataset = open_dataset(data_dir, "train")
    data = resolve_for_model(cfg.data, cfg.model, dataset)
    real = [computed_positions(batch) for batch in build_loader(dataset, data, MICRO)]
    probe = heaviest_batch(dataset, data, MICRO)
    assert computed_positions(probe) == max(real)
    assert computed_positions(probe) < MICRO * data.max_length  # what the probe used to run
    if not data.packing:  # its longest text is a real one
        longest = int(probe["pad_mask"].sum(dim=1).max())
        assert -(-longest // data.pad_to_multiple) * data.pad_to_multiple == probe["tokens"].shape[1]


# Every batch of an epoch measured, 10 s a layout: the padded one in the fast tier, the others in the slow.
@pytest.mark.parametrize(
    "layout", [LAYOUTS[0], *(pytest.param(layout, marks=pytest.mark.slow) for layout in LAYOUTS[1:])]
)
def test_the_probe_bounds_the_measured_peak_of_every_real_batch(data_dir, layout):
    cfg = run_config(data_dir, layout)
    dataset = open_dataset(data_dir, "train")
    data = resolve_for_model(cfg.data, cfg.model, dataset)
    torch.manual_seed(0)
    model, objective = build_model_and_objective(cfg, dataset)
    real = [measured_peak(model, objective, batch) for batch in build_loader(dataset, data, MICRO)]
    probe = measured_peak(model, objective, heaviest_batch(dataset, data, MICRO))
    assert LOWER * max(real) <= probe <= UPPER * max(real), (probe, max(real))
    # What the probe used to run, every text at the longest length the model takes, overstates it.
    full = full_length_batch(MICRO, data.max_length, dataset.vocab_size, dataset.num_latents, dataset.latent_dim)
    assert measured_peak(model, objective, full) > 1.2 * probe


def test_check_sizes_activations_by_the_heaviest_batch_of_the_prepared_data(data_dir, tmp_path):
    cfg = run_config(data_dir, f"train.micro_batch_size={MICRO}", "train.global_batch_size=32")
    est = estimate(cfg, Environment())
    dataset = open_dataset(data_dir, "train")
    rows, length = heaviest_batch(dataset, resolve_for_model(cfg.data, cfg.model, dataset), MICRO)["tokens"].shape
    assert est.seq_len == rows * length / MICRO < 128
    assert str(data_dir) in est.seq_len_source
    unknown = estimate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path))), Environment())
    assert unknown.seq_len == 128 and unknown.activations_gib_per_sample > est.activations_gib_per_sample


def test_check_sizes_packed_batches_by_their_rows(data_dir):
    padded = run_config(data_dir, f"train.micro_batch_size={MICRO}", "train.global_batch_size=32")
    packed = run_config(data_dir, f"train.micro_batch_size={MICRO}", "train.global_batch_size=32", "data.packing=true")
    est_padded, est_packed = estimate(padded, Environment()), estimate(packed, Environment())
    assert est_packed.seq_len < est_padded.seq_len
    assert "rows x 128 tokens (8 texts)" in est_packed.seq_len_source
