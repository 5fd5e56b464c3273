"""Texts longer than the model or the sentence encoder reads: what `prepare` reports and stores for
each `--long-texts` choice, the warnings of `check` and `train`, the notes of the API, and the length
figures of evaluation. Paragraphs of the bundled corpus's lines, with the real tokenizer and encoder."""

import gzip
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from mmldlm.config import load_config
from mmldlm.data import long_texts
from mmldlm.data.corpus import DEFAULT_CORPUS
from mmldlm.data.dataset import open_dataset
from mmldlm.data.encoders import load_encoder
from mmldlm.data.errors import DataError
from mmldlm.data.prepare import PrepareOptions, prepare
from mmldlm.data.tokenizer import encode_texts
from mmldlm.evaluation import evaluate, report
from mmldlm.evaluation.text_metrics import words
from mmldlm.export.pretrained import MMLDLM
from mmldlm.runs.trained import TrainedRun
from mmldlm.sampling.sampler import SamplingOptions
from mmldlm.tools import check
from mmldlm.training.distributed import DistInfo
from mmldlm.training.run import build_model_and_objective, open_train_data

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 32
SMALL = dict(vocab_size=400, shard_size=8, val_fraction=0.2, seed=0, progress=False, max_chars=100_000)


def paragraphs() -> list[str]:
    """20 paragraphs of 2-12 consecutive corpus lines, and one of about 400 words (over the encoder's
    254 wordpieces)."""
    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        lines = [line.strip().rstrip(".") + "." for line in f.read().splitlines()[:2000:7]]
    out, start = [], 0
    for size in [2, 12, 3, 9, 5, 11, 4, 8, 2, 10, 6, 12, 3, 7, 9, 4, 11, 5, 8, 6]:
        out.append(" ".join(lines[start : start + size]))
        start += size
    return [*out, " ".join(lines[start : start + 60])]


def prepare_paragraphs(tmp_path_factory, name: str, **options) -> tuple[dict, list[str]]:
    root = tmp_path_factory.mktemp(name)
    corpus = root / "paragraphs.txt"
    corpus.write_text("\n".join(paragraphs()) + "\n", encoding="utf-8")
    said = []
    opts = PrepareOptions(inputs=[str(corpus)], out=str(root / "data"), **{**SMALL, **options})
    return prepare(opts, log=said.append), said


@pytest.fixture(scope="module")
def encoder():
    return load_encoder()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The paragraphs stored whole (only the one over the encoder's limit cut)."""
    return prepare_paragraphs(tmp_path_factory, "whole")


def stored(path, split="train") -> tuple[list[str], list[list[int]], np.ndarray]:
    dataset = open_dataset(path, split)
    ids = [dataset[i][1].tolist() for i in range(len(dataset))]
    latents = np.stack([dataset[i][2] for i in range(len(dataset))]).astype(np.float32)
    return dataset.tokenizer().decode_batch(ids), ids, latents


def all_stored(path) -> tuple[list[str], list[list[int]], np.ndarray]:
    parts = [stored(path, split) for split in ("train", "val")]
    return [t for p in parts for t in p[0]], [i for p in parts for i in p[1]], np.concatenate([p[2] for p in parts])


def assert_latents_are_the_stored_texts(path, encoder):
    texts, _, latents = all_stored(path)
    np.testing.assert_allclose(latents, encoder.encode(texts).astype(np.float16), atol=2e-3)


def test_prepare_reports_the_lengths_and_how_many_texts_the_limits_cut(whole, encoder):
    result, said = whole
    lengths = result["meta"]["lengths"]
    tokenizer = open_dataset(result["path"], "train").tokenizer()
    tokens = np.array([len(ids) for ids in encode_texts(tokenizer, paragraphs())])
    pieces = np.array(encoder.count_wordpieces(paragraphs()))
    assert lengths["num_texts"] == 21
    assert lengths["tokens"]["max"] == tokens.max() and lengths["tokens"]["min"] == tokens.min()
    assert lengths["wordpieces"]["max"] == pieces.max() > 254 == lengths["encoder_max_wordpieces"]
    assert lengths["over_encoder"]["texts"] == 1 and lengths["cut"] == 1
    assert lengths["over_model_length"]["64"]["texts"] == (tokens > 64).sum() > 0
    assert lengths["over_model_length"]["64"]["share"] == pytest.approx(np.maximum(tokens - 64, 0).sum() / tokens.sum())
    assert any("over the encoder's 254 wordpieces" in line and "1 texts" in line for line in said)
    assert any(f"64: {(tokens > 64).sum()} texts" in line for line in said)
    # The one text over the encoder's limit is stored as the start the encoder reads, its latent of those words.
    assert max(encoder.count_wordpieces(all_stored(result["path"])[0])) <= 254
    assert_latents_are_the_stored_texts(result["path"], encoder)


def test_cut_stores_the_start_that_fits_and_its_latent_describes_those_words(tmp_path_factory, encoder):
    result, said = prepare_paragraphs(tmp_path_factory, "cut", max_tokens=MAX_TOKENS, long_texts="cut")
    texts, ids, _ = all_stored(result["path"])
    assert len(texts) == 21 and max(len(x) for x in ids) <= MAX_TOKENS
    assert result["meta"]["lengths"]["cut"] == result["meta"]["lengths"]["over_model_length"]["32"]["texts"] > 0
    assert all(any(p.startswith(t) for p in paragraphs()) for t in texts)
    assert any("texts cut to their start that fits" in line for line in said)
    assert_latents_are_the_stored_texts(result["path"], encoder)


def test_split_makes_passages_that_each_fit_and_keep_every_word(tmp_path_factory, encoder):
    result, said = prepare_paragraphs(tmp_path_factory, "split", max_tokens=MAX_TOKENS, long_texts="split")
    texts, ids, _ = all_stored(result["path"])
    assert max(len(x) for x in ids) <= MAX_TOKENS
    assert max(encoder.count_wordpieces(texts)) <= encoder.max_wordpieces
    assert sorted(words(" ".join(texts))) == sorted(words(" ".join(paragraphs())))  # nothing lost
    lengths = result["meta"]["lengths"]
    assert len(texts) == 21 - lengths["split"] + lengths["passages"] > 21
    assert any(f"split into {lengths['passages']} passages" in line for line in said)
    assert_latents_are_the_stored_texts(result["path"], encoder)


def test_drop_leaves_out_the_texts_over_the_limits(tmp_path_factory, whole, encoder):
    val_ids = stored(whole[0]["path"], "val")[1]
    max_tokens = max(len(x) for x in val_ids)  # every val text stays, some train texts go
    tokens = [len(x) for x in encode_texts(open_dataset(whole[0]["path"]).tokenizer(), paragraphs())]
    fit = [n <= max_tokens and p <= 254 for n, p in zip(tokens, encoder.count_wordpieces(paragraphs()))]
    result, said = prepare_paragraphs(tmp_path_factory, "drop", max_tokens=max_tokens, long_texts="drop")
    texts, ids, _ = all_stored(result["path"])
    assert sorted(texts) == sorted(t for t, ok in zip(paragraphs(), fit) if ok) and not all(fit)
    assert result["meta"]["lengths"]["dropped"] == fit.count(False)
    assert any(f"{fit.count(False)} texts dropped" in line for line in said)


def test_drop_refuses_to_leave_a_split_empty(tmp_path_factory):
    with pytest.raises(DataError, match=r"no train sample left: --long-texts drop"):
        prepare_paragraphs(tmp_path_factory, "drop-all", max_tokens=8, long_texts="drop")


def config_on(path, *overrides):
    return load_config(None, ["model=tiny", "model.max_seq_len=32", f"data.path={path}", *overrides])


def test_check_warns_with_counts_and_its_fix_covers_99_percent_of_the_texts(whole):
    path = whole[0]["path"]
    cfg = config_on(path)
    lengths = open_dataset(path, "train").lengths()
    env = check.Environment()
    found, prepared = [f for f in check.audit(cfg, env)[0] if f.rule == "long_texts"]
    assert (found.severity, prepared.severity) == ("warning", "info")
    assert prepared.message.startswith("1 of the 21 texts read were cut when") and "254 wordpieces" in prepared.message
    assert f"{(lengths > 32).sum()} of {len(lengths)} training texts" in found.message
    assert "data.max_length=32" in found.message and "never trained on" in found.message
    fixed, _ = check.fix_config(cfg, env)
    assert fixed.model.max_seq_len >= np.percentile(lengths, 99) and fixed.model.max_seq_len % 8 == 0
    assert "--long-texts split --max-tokens 32" in found.fix and "GiB per process" in found.fix


def test_train_warns_once_when_its_data_are_longer_than_the_model(whole, caplog):
    path = whole[0]["path"]
    lengths = open_dataset(path, "train").lengths()
    with caplog.at_level(logging.WARNING, logger="mmldlm"):
        open_train_data(config_on(path, "data.num_workers=0"), DistInfo())
    [record] = [r for r in caplog.records if "never trained on" in r.getMessage()]
    assert f"{(lengths > 32).sum()} of {len(lengths)} texts" in record.getMessage()


def test_a_cut_that_loses_under_a_thousandth_of_the_tokens_or_one_text_in_a_hundred_is_a_note():
    default_job = np.array([12] * 48991 + [70] * 9)  # the bundled corpus's 50k subset under the tiny preset
    assert not long_texts.cut_is_worth_a_warning(default_job, 64)
    line = long_texts.cut_line(default_job, 64, "data")
    assert line.startswith("data: 9 of 49000 texts (under 0.1%) are longer than data.max_length=64 tokens; under 0.1%")
    assert line.endswith("(99% of the texts are at most 12 tokens)")  # a note: nothing to do
    assert long_texts.cut_is_worth_a_warning(np.array([12] * 90 + [65] * 10), 64)  # 10% of the texts, 0.6% of tokens
    assert not long_texts.cut_is_worth_a_warning(np.array([60] * 9800 + [65] * 200), 64)  # 2%, but 0.03% of tokens
    assert long_texts.cut_is_worth_a_warning(np.array([12] * 90 + [200] * 10), 64)


@pytest.fixture(scope="module")
def untrained(whole):
    """A model of the tiny preset, untrained, on the whole paragraphs, with texts cut at 32 tokens."""
    cfg = config_on(whole[0]["path"])
    dataset = open_dataset(whole[0]["path"], "train")
    torch.manual_seed(0)
    model, objective = build_model_and_objective(cfg, dataset)
    return TrainedRun.on_dataset(cfg, model.eval(), objective.text, objective.latent, whole[0]["path"])


def test_the_api_says_when_an_input_is_cut_and_not_otherwise(untrained):
    api, long = MMLDLM(untrained), paragraphs()[1]
    with pytest.warns(UserWarning, match=r"1 of 2 texts longer than the model's 32 tokens"):
        api.encode([long, "a small dog."], steps=2)
    with pytest.warns(UserWarning, match=r"1 of 1 texts longer than the sentence encoder's 254 wordpieces"):
        api.embed(paragraphs()[-1] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.encode("a small dog.", steps=2)
        api.embed(long)


def test_eval_scores_the_length_head_only_on_lengths_it_can_name_and_shows_the_stored_source(untrained):
    lengths = [len(untrained.val[i][1]) for i in range(len(untrained.val))]
    figures = evaluate.length_prediction(untrained, len(lengths))
    assert figures["num_over_max_length"] == sum(n > 32 for n in lengths) > 0
    assert figures["num_scored"] == sum(n <= 32 for n in lengths)
    assert "not scored" in report.length_line(figures)
    options = SamplingOptions.defaults(untrained.cfg.text_diffusion, untrained.cfg.latent_diffusion, 2)
    l2t = evaluate.l2t_reconstruction(untrained, options, 2, 2, use_encoder=False, num_examples=2)
    assert [e["source"] for e in l2t["examples"]] == stored(untrained.dataset_dir, "val")[0][:2]


def test_prepare_says_what_vocabulary_came_out_where_the_texts_hold_fewer_merges_than_asked(tmp_path_factory):
    result, said = prepare_paragraphs(tmp_path_factory, "large-vocab", vocab_size=16384)
    learned = result["meta"]["vocab_size"]
    note = f"tokenizer: {learned} entries, not the 16384 asked for (--vocab-size): the "
    assert learned < 16384 and any(line.startswith(note) and "hold no more merges" in line for line in said)
    assert f"tokens, vocab {learned}, latents 1x384" in said[-1]


@pytest.mark.slow
def test_prepare_passes_no_library_warning_on_a_text_longer_than_the_encoder_reads(tmp_path):
    # In a fresh process: the library warns once per tokenizer, and this session's encoder may have warned.
    corpus = tmp_path / "paragraphs.txt"
    long_text = " ".join(paragraphs()[:12])  # about 800 words: more wordpieces than the tokenizer's 256 positions
    corpus.write_text("\n".join([*paragraphs(), long_text]) + "\n", encoding="utf-8")
    args = ["--input", corpus, "--out", tmp_path / "data", "--vocab-size", 400, "--max-chars", 100_000, "--quiet"]
    done = subprocess.run(
        [sys.executable, "-m", "mmldlm", "prepare", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "Token indices sequence length" not in said
