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
from mmldlm.objective import Objective
from mmldlm.tools.check import Environment, estimate
from mmldlm.training.batch_size import full_length_batch
from mmldlm.training.run import build_model_and_objective

MICRO = 8
# The probe may exceed the heaviest real batch by this much: it runs every row at its real length
# with random masking like a real step, so the two differ only by the masked rows' text-head logits.
MARGIN = 1.15


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
    joint = Objective(
        dataclasses.replace(objective.cfg, mode="joint"),
        objective.text,
        objective.latent,
        objective.self_condition,
        objective.length_head,
    )
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss, _ = joint(model, batch, step=0, generator=torch.Generator().manual_seed(0))
        loss.backward()
    model.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("bucket_batches", [1, 4])
def test_the_heaviest_batch_is_the_largest_batch_the_loader_yields(data_dir, bucket_batches):
    cfg = run_config(data_dir, f"data.bucket_batches={bucket_batches}")
    dataset = open_dataset(data_dir, "train")
    data = resolve_for_model(cfg.data, cfg.model, dataset)
    real = [tuple(batch["tokens"].shape) for batch in build_loader(dataset, data, MICRO)]
    probe = heaviest_batch(dataset, data, MICRO)
    rows, length = probe["tokens"].shape
    assert rows * length == max(b * n for b, n in real)
    assert length < data.max_length  # shorter than the longest text the model takes: what it used to probe
    longest = int(probe["pad_mask"].sum(dim=1).max())
    assert -(-longest // data.pad_to_multiple) * data.pad_to_multiple == length  # a real text that long


@pytest.mark.parametrize("bucket_batches", [1, 4])
def test_the_probe_bounds_the_measured_peak_of_every_real_batch(data_dir, bucket_batches):
    cfg = run_config(data_dir, f"data.bucket_batches={bucket_batches}")
    dataset = open_dataset(data_dir, "train")
    data = resolve_for_model(cfg.data, cfg.model, dataset)
    torch.manual_seed(0)
    model, objective = build_model_and_objective(cfg, dataset)
    real = [measured_peak(model, objective, batch) for batch in build_loader(dataset, data, MICRO)]
    probe = measured_peak(model, objective, heaviest_batch(dataset, data, MICRO))
    assert max(real) <= probe <= MARGIN * max(real), (probe, max(real))
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
