"""The trained byte-level BPE is lossless; [PAD] and [MASK] are reserved and never produced by text."""

import pytest
from data_support import corpus_texts
from tokenizers import Tokenizer, models, pre_tokenizers

from mmldlm.data.errors import DataError
from mmldlm.data.tokenizer import (
    encode_texts,
    from_json,
    load_tokenizer,
    special_ids,
    token_dtype,
    train_bpe,
    vocab_size,
)


@pytest.fixture(scope="module")
def trained():
    return train_bpe(corpus_texts(), 400)


def test_text_tokens_text_is_exact(trained):
    texts = corpus_texts() + ["unseen: Ωmega ∑ 🚀  double  spaces\tand\nnewline "]
    for text, ids in zip(texts, encode_texts(trained, texts)):
        assert trained.decode(ids) == text


def test_special_tokens_reserved_and_not_made_from_text(trained):
    assert special_ids(trained) == {"pad_id": 0, "mask_id": 1}
    assert vocab_size(trained) == 400
    ids = encode_texts(trained, ["a literal [MASK] and [PAD]"])[0]
    assert 0 not in ids and 1 not in ids
    # The flag that keeps it so is not stored in tokenizer.json; from_json restores it.
    assert 1 not in encode_texts(from_json(trained.to_str()), ["[MASK]"])[0]


def test_token_dtype_is_narrowest():
    assert token_dtype(65536).name == "uint16" and token_dtype(65537).name == "uint32"


def test_loaded_tokenizer_gets_pad_and_mask(tmp_path):
    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.add_tokens(["hello"])
    folder = tmp_path / "hf"
    folder.mkdir()
    bare.save(str(folder / "tokenizer.json"))
    loaded = load_tokenizer(folder)  # a Hugging Face style folder
    assert loaded.token_to_id("[PAD]") is not None and loaded.token_to_id("[MASK]") is not None
    assert vocab_size(loaded) == 3


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer\.json: no such tokenizer file \(save a fast tokenizer"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(DataError, match=r"bad\.json: not a valid tokenizer\.json"):
        load_tokenizer(bad)
    with pytest.raises(DataError, match="needs at least 258"):
        train_bpe(["x"], 100)
