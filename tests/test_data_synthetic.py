"""The synthetic dataset of `mmldlm bench --synthetic-*`: an ordinary prepared dataset whose texts
have the stated lengths, vocabulary and latent width, the same for the same shape."""

import numpy as np

from mmldlm.data.dataset import open_dataset
from mmldlm.data.synthetic import SyntheticShape, write_synthetic


def test_synthetic_texts_have_the_stated_lengths_ids_and_latent_width(tmp_path):
    shape = SyntheticShape(vocab_size=50, min_length=10, max_length=30, latent_dim=6, num_samples=200)
    dataset = open_dataset(write_synthetic(shape, tmp_path / "data"))
    lengths = dataset.lengths()
    assert len(dataset) == 200 and lengths.min() >= 10 and lengths.max() <= 30
    assert len(set(lengths.tolist())) > 10  # spread over the range, not one length
    ids = np.concatenate([dataset[i][1] for i in range(len(dataset))])
    assert ids.min() >= 2 and ids.max() < 50  # never [PAD] (0) or [MASK] (1)
    assert (dataset.vocab_size, dataset.pad_id, dataset.mask_id) == (50, 0, 1)
    assert dataset.latent_dim == 6 and dataset.num_latents == 1 and dataset[0][2].shape == (1, 6)
    assert dataset.tokenizer().decode([2, 49]) == "w2 w49"
    assert len(open_dataset(tmp_path / "data", "val")) > 0


def test_the_same_spec_writes_the_same_texts_and_a_rewrite_replaces_the_old(tmp_path):
    shape = SyntheticShape(vocab_size=50, min_length=4, max_length=8, latent_dim=2, num_samples=20)
    first = open_dataset(write_synthetic(shape, tmp_path / "a"))
    second = open_dataset(write_synthetic(shape, tmp_path / "b"))
    assert all(np.array_equal(first[i][1], second[i][1]) for i in range(20))
    longer = SyntheticShape(vocab_size=50, min_length=40, max_length=40, latent_dim=2, num_samples=5)
    rewritten = open_dataset(write_synthetic(longer, tmp_path / "a"))
    assert len(rewritten) == 5 and set(rewritten.lengths().tolist()) == {40}
