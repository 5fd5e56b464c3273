"""`mmldlm sample` and `mmldlm eval` end to end on a small run trained here on a real prepared dataset
(real tokenizer and sentence encoder), evaluation records during training, and the ELBO of
`mmldlm eval` against the MDLM formula written out on the same batch."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from data_support import trained_run

from mmldlm.cli import main
from mmldlm.config import load_config
from mmldlm.evaluation import evaluate, text_metrics
from mmldlm.evaluation.evaluate import elbo, val_batches
from mmldlm.evaluation.figures import FIGURES
from mmldlm.evaluation.intervals import Rate
from mmldlm.evaluation.report import eval_metrics, figure_text
from mmldlm.export.pretrained import load_trained
from mmldlm.runs.trained import load_run
from mmldlm.training.run import train

RUN = [
    "model=tiny",
    "model.hidden_size=64",
    "model.num_blocks=2",
    "model.timestep_embed_dim=32",
    "train.steps=20",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.log_every=5",
    "logging.progress_bar=false",
    "schedule.warmup_steps=2",
    "data.num_workers=0",
    "checkpoint.every=1000",
    "eval.every=10",
    "eval.num_samples=4",
    "eval.num_steps=4",
    "eval.num_elbo_batches=1",
    "eval.batch_size=4",
    "eval.retrieval_pool=12",
    "train.ema_decay=0.9",
]
FAST = ["--steps", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory, RUN)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_writes_eval_records_every_eval_every_steps(run_dir):
    records = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in records if "eval_l2t_exact_match" in r]
    assert [r["step"] for r in evals] == [10, 20]
    for r in evals:
        for key in (
            "eval_elbo_l2t_text_nats_per_token",
            "eval_elbo_t2l_latent_loss",
            "eval_elbo_joint_latent_loss",
            "eval_l2t_cosine_mean",
            "eval_t2l_cosine_mean",
            "eval_t2l_retrieval_at_1",
        ):
            assert math.isfinite(r[key]), key
        assert 0 <= r["eval_t2l_retrieval_at_1"] <= 1 and r["eval_t2l_pool_size"] == 12
    assert [r["step"] for r in records if "loss" in r] == [1, 5, 10, 15, 20]  # training records intact


def test_sample_l2t_from_text_validation_and_latent_file(run_dir, tmp_path):
    out = tmp_path / "l2t.jsonl"
    assert (
        main(
            [
                "sample",
                "--run",
                str(run_dir),
                "--mode",
                "l2t",
                "--text",
                "a small dog",
                "--text",
                "to run fast",
                "--out",
                str(out),
                *FAST,
            ]
        )
        == 0
    )
    records = read_jsonl(out)
    assert [r["source"] for r in records] == ["a small dog", "to run fast"]
    assert all(r["text"] for r in records)

    assert main(["sample", "--run", str(run_dir), "--mode", "l2t", "--num", "3", "--out", str(out), *FAST]) == 0
    run = load_run(run_dir, device="cpu")
    sources = [r["source"] for r in read_jsonl(out)]  # cut to the length training used, as the model saw them
    assert sources == run.decode(*run.batch_of([run.val[i][1][: run.max_length].tolist() for i in range(3)]))

    np.save(tmp_path / "z.npy", run.val[0][2][0].astype(np.float32)[None].repeat(2, 0))  # (2, D)
    assert (
        main(
            [
                "sample",
                "--run",
                str(run_dir),
                "--mode",
                "l2t",
                "--latents",
                str(tmp_path / "z.npy"),
                "--length",
                "5",
                "--out",
                str(out),
                *FAST,
            ]
        )
        == 0
    )
    assert [r["length"] for r in read_jsonl(out)] == [5, 5]
    # Without --length the model's length head gives each latent its length.
    assert (
        main(
            [
                "sample",
                "--run",
                str(run_dir),
                "--mode",
                "l2t",
                "--latents",
                str(tmp_path / "z.npy"),
                "--out",
                str(out),
                *FAST,
            ]
        )
        == 0
    )
    predicted = run.predict_lengths(torch.from_numpy(np.load(tmp_path / "z.npy"))[:, None, :])
    assert [r["length"] for r in read_jsonl(out)] == predicted and 1 <= predicted[0] <= run.max_length


@pytest.mark.parametrize("mode", ["l2t", "t2l"])
def test_sample_says_which_source_texts_were_cut_and_l2t_encodes_the_cut_text(run_dir, tmp_path, capsys, mode):
    run = load_run(run_dir, device="cpu")
    long = " ".join(["a small dog that barks at the postman every morning."] * 20)
    out = tmp_path / "out.jsonl"
    argv = ["sample", "--run", str(run_dir), "--mode", mode, "--text", long, "--text", "a small dog"]
    assert main([*argv, "--out", str(out), "--latents-out", str(tmp_path / "z.npy"), *FAST]) == 0
    records = read_jsonl(out)
    over = len(run.tokenizer.encode(long).ids) - run.max_length
    assert [(r["cut"], r["num_tokens_cut"]) for r in records] == [(True, over), (False, 0)]
    assert f"1 of 2 texts longer than the model's {run.max_length} tokens" in capsys.readouterr().err
    if mode == "l2t":  # the latent, the length and the source are of the same words
        assert records[0]["source"] == run.tokenizer.decode(run.tokenizer.encode(long).ids[: run.max_length])
        assert records[0]["length"] == run.max_length


def test_sample_and_eval_use_the_ema_weights_unless_told_otherwise(run_dir):
    ema, raw = load_run(run_dir, device="cpu"), load_run(run_dir, device="cpu", use_ema=False)
    assert ema.weights == "ema" and raw.weights == "raw"
    differs = [not torch.equal(a, b) for a, b in zip(ema.model.parameters(), raw.model.parameters())]
    assert any(differs)


def test_sample_t2l_and_joint_write_latents_and_a_text_files_records_keep_its_line_numbers(run_dir, tmp_path, capsys):
    # A byte order mark is not text; a blank line is skipped and keeps its number.
    (tmp_path / "lines.txt").write_text("\ufeffa small dog\n\nthe act of running\nblue\n", encoding="utf-8")
    z_file = tmp_path / "z.npy"
    assert (
        main(
            [
                "sample",
                "--run",
                str(run_dir),
                "--mode",
                "t2l",
                "--text-file",
                str(tmp_path / "lines.txt"),
                "--latents-out",
                str(z_file),
                "--guidance-scale",
                "1.5",
                *FAST,
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["index"], r["text"]) for r in records] == [(0, "a small dog"), (2, "the act of running"), (3, "blue")]
    z = np.load(z_file)
    assert z.shape == (3, 1, 384) and np.isfinite(z).all()

    assert (
        main(
            [
                "sample",
                "--run",
                str(run_dir),
                "--mode",
                "joint",
                "--num",
                "2",
                "--latent-sampler",
                "ddpm",
                "--latents-out",
                str(z_file),
                "--out",
                str(tmp_path / "joint.jsonl"),
                *FAST,
            ]
        )
        == 0
    )
    joint = read_jsonl(tmp_path / "joint.jsonl")
    assert len(joint) == 2 and all(1 <= r["length"] <= 64 for r in joint) and np.load(z_file).shape == (2, 1, 384)
    # The latent's own time grid (--latent-shift): the same seed, other times for the latent stream.
    z_grid = tmp_path / "z-grid.npy"
    args = ["sample", "--run", str(run_dir), "--mode", "joint", "--num", "2", "--latent-sampler", "ddpm", *FAST]
    assert main([*args, "--latent-shift", "4", "--latents-out", str(z_grid), "--out", str(tmp_path / "g.jsonl")]) == 0
    assert np.isfinite(np.load(z_grid)).all() and not np.allclose(np.load(z_grid), np.load(z_file))


def test_sample_says_what_it_wrote_and_leaves_stdout_to_the_records_where_they_go_there(run_dir, tmp_path, capsys):
    pairs, z_file = tmp_path / "pairs.jsonl", tmp_path / "z.npy"
    joint = ["sample", "--run", str(run_dir), "--mode", "joint", *FAST]
    assert main([*joint, "--num", "2", "--out", str(pairs)]) == 0
    out, err = capsys.readouterr()
    assert out == f"mmldlm sample: wrote 2 records to {pairs}\n" and len(read_jsonl(pairs)) == 2
    assert "latents not written" in err
    assert main([*joint, "--num", "1", "--out", str(pairs), "--latents-out", str(tmp_path / "z")]) == 0
    assert capsys.readouterr().out == f"mmldlm sample: wrote 1 record to {pairs} and latents (1, 1, 384) to {z_file}\n"
    t2l = ["sample", "--run", str(run_dir), "--mode", "t2l", "--text", "a dog", "--latents-out", str(z_file), *FAST]
    assert main(t2l) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["text"] == "a dog"  # stdout holds the records alone
    assert err == f"mmldlm sample: wrote latents (1, 1, 384) to {z_file}\n"


def test_sample_errors_name_the_problem(run_dir, tmp_path, capsys):
    assert main(["sample", "--run", str(run_dir), "--mode", "t2l", *FAST]) == 2
    assert "needs --text" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.zeros((2, 7), dtype=np.float32))
    assert main(["sample", "--run", str(run_dir), "--mode", "l2t", "--latents", str(tmp_path / "bad.npy"), *FAST]) == 2
    assert "expected (N, 1, 384) or (N, 384) for this run" in capsys.readouterr().err


def bad_inputs(root):
    """Files that `sample` must refuse, in `root`."""
    (root / "latents.txt").write_text("0.1 0.2 0.3\n")
    nan = np.zeros((3, 384), dtype=np.float32)
    nan[1, 5], nan[2, 0] = np.nan, np.inf
    np.save(root / "nan.npy", nan)
    np.save(root / "none.npy", np.zeros((0, 384), dtype=np.float32))
    (root / "blank.txt").write_text("\n  \n")


# (command line after --run RUN, what the one line on stderr must say); FILE/ is the folder of bad_inputs.
REFUSED = {
    "latents-not-npy": (
        ["sample", "--mode", "l2t", "--latents", "FILE/latents.txt"],
        "--latents FILE/latents.txt: not a .npy file; expected a .npy array (N, 1, 384) or (N, 384)",
    ),
    "latents-missing": (
        ["sample", "--mode", "l2t", "--latents", "FILE/absent.npy"],
        "--latents FILE/absent.npy: No such file or directory; expected a .npy array",
    ),
    "latents-nan": (
        ["sample", "--mode", "l2t", "--latents", "FILE/nan.npy"],
        "--latents FILE/nan.npy: 2 of 3 latents hold NaN or inf (rows 1, 2); expected finite numbers",
    ),
    "latents-empty": (
        ["sample", "--mode", "l2t", "--latents", "FILE/none.npy"],
        "--latents FILE/none.npy: holds no latent; expected (N, 1, 384) or (N, 384) with N >= 1",
    ),
    "latents-and-text": (
        ["sample", "--mode", "l2t", "--latents", "FILE/nan.npy", "--text", "a dog"],
        "--latents and --text/--text-file are two sources of l2t; give one",
    ),
    "length-negative": (
        ["sample", "--mode", "l2t", "--num", "1", "--length", "-3"],
        "--length: got -3; expected an integer >= 1",
    ),
    "length-too-long": (
        ["sample", "--mode", "joint", "--num", "1", "--length", "100000"],
        "--length: got 100000; expected an integer in [1, 64] (model.max_seq_len of this run)",
    ),
    "steps-zero": (
        ["sample", "--mode", "l2t", "--num", "1", "--steps", "0"],
        "--steps: got 0; expected an integer >= 1",
    ),
    "steps-negative": (
        ["sample", "--mode", "joint", "--num", "1", "--steps", "-2"],
        "--steps: got -2; expected an integer >= 1",
    ),
    "latent-steps-zero": (
        ["sample", "--mode", "t2l", "--text", "a dog", "--latent-steps", "0"],
        "--latent-steps: got 0; expected an integer >= 1",
    ),
    "latent-shift-negative": (
        ["sample", "--mode", "joint", "--num", "1", "--latent-shift", "-1"],
        "--latent-shift: got -1.0; expected a number > 0, or None (equal steps of t)",
    ),
    "temperature-zero": (
        ["sample", "--mode", "l2t", "--num", "1", "--temperature", "0"],
        "--temperature: got 0.0; expected a number > 0",
    ),
    "remask-posterior-confidence-order": (
        ["sample", "--mode", "l2t", "--num", "1", "--remask", "posterior"],
        "--strategy: got 'confidence'; expected 'ancestral' with remask 'posterior'",
    ),
    "remask-cap-zero": (
        [
            "sample",
            "--mode",
            "l2t",
            "--num",
            "1",
            "--strategy",
            "ancestral",
            "--remask",
            "posterior",
            "--remask-cap",
            "0",
        ],
        "--remask-cap: got 0.0; expected a number in (0, 1]",
    ),
    "text-empty": (
        ["sample", "--mode", "l2t", "--text", ""],
        "--text: got ''; expected a text with at least one character that is not a space",
    ),
    "text-file-blank": (
        ["sample", "--mode", "t2l", "--text-file", "FILE/blank.txt"],
        "--text-file FILE/blank.txt: no line with text; expected one source text per line",
    ),
    "num-zero": (["sample", "--mode", "joint", "--num", "0"], "--num: got 0; expected an integer >= 1"),
    "out-in-missing-dir": (
        ["sample", "--mode", "joint", "--num", "1", "--out", "FILE/absent/pairs.jsonl"],
        "/absent/pairs.jsonl'; expected a file in an existing directory",
    ),
    "threads-negative": (
        ["sample", "--mode", "joint", "--num", "1", "--threads", "-1"],
        "--threads: got -1; expected auto (the CPUs other processes leave free), 0 (torch's default) or an "
        "integer >= 1",
    ),
    "batch-size-zero": (
        ["sample", "--mode", "l2t", "--num", "1", "--batch-size", "0"],
        "--batch-size: got 0; expected an integer >= 1",
    ),
    "eval-steps-zero": (["eval", "--num-samples", "4", "--steps", "0"], "--steps: got 0; expected an integer >= 1"),
    "eval-num-samples-zero": (["eval", "--num-samples", "0"], "--num-samples: got 0; expected an integer >= 1"),
    "eval-threads-negative": (
        ["eval", "--threads", "-2"],
        "--threads: got -2; expected auto (the CPUs other processes leave free), 0 (torch's default) or an "
        "integer >= 1",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_bad_input_is_refused_with_one_line_naming_it(run_dir, tmp_path, capsys, case):
    bad_inputs(tmp_path)
    argv, message = REFUSED[case]
    argv = [arg.replace("FILE", str(tmp_path)) for arg in argv]
    out = tmp_path / "out.jsonl"
    assert main([*argv[:1], "--run", str(run_dir), "--device", "cpu", "--out", str(out), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"mmldlm {argv[0]}: "), err
    assert message.replace("FILE", str(tmp_path)) in err and "Traceback" not in err
    assert not out.exists()


def test_debug_shows_the_traceback_of_a_refused_input(run_dir, capsys, monkeypatch):
    argv = ["sample", "--run", str(run_dir), "--mode", "l2t", "--num", "1", "--steps", "0", "--device", "cpu"]
    assert main(["--debug", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "OptionError" in err
    assert err.splitlines()[-1] == "mmldlm sample: --steps: got 0; expected an integer >= 1"
    monkeypatch.setenv("MMLDLM_DEBUG", "1")
    assert main(argv) == 2
    assert "Traceback" in capsys.readouterr().err


def test_eval_writes_report_and_summary(run_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "eval",
                "--run",
                str(run_dir),
                "--num-samples",
                "4",
                "--batch-size",
                "4",
                "--retrieval-pool",
                "12",
                "--guidance-scale",
                "0",
                "1.5",
                "--out",
                str(out),
                *FAST,
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["step"] == 20 and report["sampling"]["num_steps"] == 4 and report["weights"] == "ema"
    assert [g["guidance_scale"] for g in report["guidance"]] == [0.0, 1.5]
    assert report["guidance"][0]["t2l"]["retrieval_at_1"] == report["t2l"]["retrieval_at_1"]
    assert report["references"]["chance_retrieval_at_1"] == pytest.approx(1 / 12)
    assert -1 <= report["references"]["mean_latent_cosine"] <= 1
    assert report["length"]["num_samples"] == 4 and 0 <= report["length"]["accuracy"] <= 1
    l2t = report["elbo"]["l2t"]
    assert l2t["text_bits_per_token"] == pytest.approx(l2t["text_nats_per_token"] / math.log(2))
    assert l2t["text_ppl_bound"] == pytest.approx(math.exp(l2t["text_nats_per_token"]))
    assert set(report["elbo"]["t2l"]) == {"latent_loss", "latent_loss_interval", "num_samples", "per_text"}
    # Every figure carries its 95% interval and n, and the per-text values it was made from.
    assert np.array(report["elbo"]["l2t"]["per_text"]["text_nats"]).shape == (4, 2)  # texts x draws of t
    low, high = l2t["text_nats_per_token_interval"]
    assert low <= high and l2t["text_bits_per_token_interval"] == pytest.approx([low / math.log(2), high / math.log(2)])
    for key in ("exact_match", "word_f1", "bleu", "real_word_rate", "cosine_mean"):
        low, high = report["l2t"][f"{key}_interval"]
        assert low <= high, key
    assert len(report["l2t"]["per_text"]["word_f1"]) == report["l2t"]["num_samples"] == 4
    assert report["l2t"]["word_f1"] == pytest.approx(np.mean(report["l2t"]["per_text"]["word_f1"]))
    assert "selected_on" not in report["l2t"] and "l2t_without_selection" not in report  # best of 1: no selection
    assert -1 <= report["l2t"]["cosine_mean"] <= 1 and 0 <= report["l2t"]["exact_match"] <= 1
    assert report["t2l"]["pool_size"] == 12 and len(report["l2t"]["examples"]) == 4
    # The console holds the headline figures, the texts written and the paths; the .md file every figure.
    console, summary = capsys.readouterr().out, out.with_suffix(".md").read_text(encoding="utf-8")
    retrieval = f"- t2l retrieval@1 among 12: {figure_text(report['t2l'], 'retrieval_at_1', '.1%')} (chance"
    assert retrieval in console and report["l2t"]["examples"][-1]["generated"] in console
    assert f"wrote {out} and {out.with_suffix('.md')}" in console and "Likelihood bounds" not in console
    assert "retrieval@1 among 12" in summary and report["l2t"]["examples"][0]["source"] in summary
    assert f"word F1 {figure_text(report['l2t'], 'word_f1')}" in summary
    assert "(chance 8.3%)" in summary and "| 1.5 |" in summary and "length head" in summary
    # The figures a reader looks for come first, beside their references; the options read as keywords.
    assert summary.index(retrieval) < summary.index("Likelihood bounds") < summary.index("l2t reconstruction")
    assert "Sampling options: num_steps=" in summary and "{'num_steps'" not in summary
    # The writing figures beside their references.
    for entry in (report["l2t"], report["l2t_predicted_length"]):
        assert 0 <= entry["bleu"] <= 100 and 0 <= entry["repetition"] <= 1 and entry["ngram_perplexity"] > 1
    ref = report["references"]
    assert ref["real_ngram_perplexity"] < ref["shuffled_ngram_perplexity"] and 0 <= ref["real_repetition"] <= 1
    assert report["fluency_reference"]["num_texts"] > 0 and len(report["fluency_reference"]["sha256"]) == 64
    joint = report["joint"]
    assert joint["num_samples"] == 4 and 0 <= joint["copy_rate"] <= 1 and 0 <= joint["distinct_2"] <= 1
    assert joint["reference"]["real_pairs"] > joint["reference"]["shuffled_pairs"]
    # joint's distinct-n beside real text's at the same n (distinct-n falls as n grows)
    assert ref["num_samples"] == joint["num_samples"] and len(ref["per_text"]["real_texts"]) == 4
    real = text_metrics.distinct_of([text_metrics.word_ngrams(t, 2) for t in ref["per_text"]["real_texts"]])
    assert ref["real_distinct_2"] == pytest.approx(real) and f"(real text {ref['real_distinct_1']:.3f}/" in summary
    assert 0 <= report["nearest_training_text"]["word_f1"] <= 1
    assert (
        "joint (4 samples): repetition" in summary
        and "; consistency " in summary
        and "the training text with the nearest latent" in summary
    )
    # The latents' fidelity, each beside real latents at the same n.
    for entry in (report["t2l"]["latent_fidelity"], joint["latent_fidelity"]):
        assert entry["num_samples"] == 4 and entry["frechet_distance_real_vs_real"] > 0
        assert 0 <= entry["recall"] <= 1 and 0 < entry["std_ratio_min"] <= entry["std_ratio_median"]
    assert "Latent fidelity" in summary and "| joint | 4 |" in summary
    elbo_row = next(line for line in summary.splitlines() if line.startswith("| l2t ("))
    assert f"{report['elbo']['l2t']['nats_per_token_with_length']:.4f}" in elbo_row
    # The fluency reference is fitted on the training split alone.
    run = load_trained(run_dir)
    assert evaluate.fluency_reference(run) is evaluate._ngram_lm(str(run.dataset_dir), "train")


class Recording(torch.nn.Module):
    """The model, keeping what it was last given and what it returned."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.seen = model, {}

    def forward(self, tokens, latents, t_text, t_latent, *args, **kwargs):
        out = self.inner(tokens, latents, t_text, t_latent, *args, **kwargs)
        self.seen.update(tokens=tokens, t_text=t_text, logits=out.text_logits, text_rows=kwargs.get("text_rows"))
        return out


def test_elbo_is_the_mdlm_training_loss_formula_on_the_same_batch(run_dir):
    run = load_run(run_dir, device="cpu")
    run.model = Recording(run.model)
    report = elbo(run, num_samples=4, batch_size=4, modes=("l2t",))["l2t"]
    seen = run.model.seen
    batch = next(iter(val_batches(run, 4, 4)))
    tokens, pad_mask = batch["tokens"], batch["pad_mask"]
    # NELBO (MDLM eq. 11, loglinear schedule): sum over masked real tokens of -log p / t, per real token.
    masked = (seen["tokens"] == run.text.mask_token_id) & pad_mask
    assert masked.any() and torch.equal(seen["tokens"][~masked], tokens[~masked])
    # the model computed logits at exactly these positions (flat indices into the (B * L) positions)
    assert torch.equal(seen["text_rows"], masked.flatten().nonzero().squeeze(1))
    logits = seen["logits"].float()  # (N, V), row-major over the masked positions
    logits[..., run.text.mask_token_id] = float("-inf")
    nll = F.cross_entropy(logits, tokens[masked], reduction="none")  # (N,)
    weight = 1.0 / seen["t_text"].clamp_min(run.text.cfg.eps)  # (B,)
    # importance-sampled times t = u^2 (none here below eps), each text's nats weighted 2u = 2 sqrt(t)
    importance = 2.0 * seen["t_text"].double().sqrt()
    assert (seen["t_text"] > run.text.cfg.eps).all()
    nats = torch.zeros(masked.shape, dtype=torch.float64).masked_scatter_(
        masked, (nll * weight[:, None].expand_as(masked)[masked]).double()
    )
    expected = (nats.sum(dim=1) * importance).sum() / pad_mask.sum()
    prior = run.text.cfg.eps * math.log(run.val.vocab_size - 1)  # the t = 1 term (masked.py)
    assert report["text_nats_per_token_given_length"] == pytest.approx(expected.item() + prior, rel=1e-5)
    assert report["text_nats_per_token"] == report["text_nats_per_token_given_length"]
    assert report["num_tokens"] == int(pad_mask.sum())
    # The length paid: the length head's cross-entropy over 1..max_length, per text.
    per_text = report["per_text"]  # one draw of t: text nats per token (N, 1), tokens (N,)
    given = [row[0] * n for row, n in zip(per_text["text_nats"], per_text["num_tokens"])]
    assert len(given) == len(per_text["length_nats"]) == 4
    assert min(per_text["length_nats"]) > 0 and report["nats_per_token_with_length"] > report["text_nats_per_token"]
    paid = sum(given) + sum(per_text["length_nats"])
    assert report["nats_per_text"] == pytest.approx(paid / 4)
    assert report["nats_per_token_with_length"] == pytest.approx(paid / int(pad_mask.sum()))


def test_evaluation_leaves_the_training_trajectory_unchanged(run_dir, tmp_path):
    data = load_config(run_dir / "config.yaml").data.path
    assert train(load_config(None, [*RUN, f"data.path={data}", f"train.run_dir={tmp_path}", "eval.every=0"])) == 0
    plain = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert plain == [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow  # torchrun on 2 processes
def test_fsdp2_ranks_gather_for_rank0_evaluation_and_wait(run_dir, tmp_path):
    import os
    import subprocess
    from pathlib import Path

    from test_training_distributed import TORCHRUN, WORKER, free_port

    data = load_config(run_dir / "config.yaml").data.path
    cmd = [
        *TORCHRUN,
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(WORKER),
        *RUN,
        "train.steps=4",
        "train.micro_batch_size=4",
        "eval.every=2",
        "distributed.strategy=fsdp2",
        f"data.path={data}",
        f"train.run_dir={tmp_path}",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_t2l_cosine_mean" in r]
    assert [r["step"] for r in evals] == [2, 4]


SMALL_EVAL = ["--num-samples", "4", "--batch-size", "4", "--retrieval-pool", "12", *FAST]
RATES = {f.key for f in FIGURES if isinstance(f.recipe, Rate)}


def test_compare_of_a_run_with_itself_finds_no_difference_on_any_figure(run_dir, tmp_path, capsys):
    out = tmp_path / "same.json"
    assert main(["compare", str(run_dir), str(run_dir), *SMALL_EVAL, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    figures = {(r["section"], r["figure"]) for r in result["rows"]}
    assert {
        ("elbo l2t", "text_nats_per_token"),
        ("l2t", "bleu"),
        ("joint", "repetition"),
        ("t2l", "retrieval_at_1"),
    } <= figures
    assert "joint distinct_2" in result["without_interval"]  # no resampling interval, so not compared
    for row in result["rows"]:
        assert row["difference"] == 0.0 and not row["significant"], row
        # a rate that no text (or every text) reaches keeps its exact interval; every other figure is 0
        assert row["low"] == -row["high"] and (row["high"] == 0.0 or row["figure"] in RATES), row
    table = capsys.readouterr().out
    assert "| l2t word_f1 | 4 |" in table
    total = len(result["rows"])
    assert f"0 of {total} figures differ at 95%" in table and f"about {0.05 * total:.1f} of {total} on average" in table


def test_compare_of_two_reports_gives_each_figure_its_paired_difference(run_dir, tmp_path, capsys):
    ema, raw, fewer = tmp_path / "ema.json", tmp_path / "raw.json", tmp_path / "fewer.json"
    quick = ["--no-writing", "--num-t-draws", "1"]
    assert main(["eval", "--run", str(run_dir), *SMALL_EVAL, *quick, "--out", str(ema)]) == 0
    assert main(["eval", "--run", str(run_dir), "--no-ema", *SMALL_EVAL, *quick, "--out", str(raw)]) == 0
    capsys.readouterr()
    out = tmp_path / "compare.json"
    assert main(["compare", str(ema), str(raw), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["a"] == str(ema) and result["level"] == 0.95 and result["not_compared"] == []
    rows = {(r["section"], r["figure"]): r for r in result["rows"]}
    nats = rows[("elbo l2t", "text_nats_per_token")]
    a, b = (json.loads(p.read_text())["elbo"]["l2t"]["text_nats_per_token"] for p in (ema, raw))
    assert (
        nats["a"] == pytest.approx(a) and nats["b"] == pytest.approx(b) and nats["difference"] == pytest.approx(a - b)
    )
    assert nats["low"] <= nats["difference"] <= nats["high"] and nats["n"] == 4
    assert nats["significant"] == (nats["low"] > 0 or nats["high"] < 0)
    assert (
        "| figure | n | A | B | A - B | interval | significant |" in table
        and "| elbo l2t text_nats_per_token | 4 |" in table
    )
    assert len(result["null_flags"]) == 20 and "Measured on these texts: 20 comparisons" in table
    # Several runs per arm (here the EMA and raw weights stand for two seeds of a recipe): the arms' mean
    # figures, with the spread between the runs in the interval.
    assert main(["compare", "--a", str(ema), str(raw), "--b", str(ema), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    arms = {(r["section"], r["figure"]): r for r in json.loads(out.read_text())["rows"]}
    nats = arms[("elbo l2t", "text_nats_per_token")]
    assert nats["a"] == pytest.approx((a + b) / 2) and nats["runs_a"] == 2 and nats["runs_b"] == 1
    assert nats["seed_sd"] == pytest.approx(abs(a - b) / 2**0.5) and nats["low"] < nats["difference"] < nats["high"]
    assert "A = mean of 2 runs" in table and "| sd between seeds | detectable at 80% |" in table
    # 1 + 2 runs: 1 degree of freedom, the smallest difference found 80% of the time 16.3 standard errors
    assert nats["df"] == 1 and nats["detectable"] > 16 * (nats["high"] - nats["low"]) / (2 * 12.7)
    assert main(["compare", str(ema), "--a", str(raw), "--b", str(ema)]) == 2
    assert "expected either two runs A B, or --a RUN [RUN ...] and --b RUN [RUN ...]" in capsys.readouterr().err
    # Reports of other texts are refused: the i-th values must belong to the same text.
    args = ["eval", "--run", str(run_dir), *SMALL_EVAL, *quick, "--num-samples", "3", "--out", str(fewer)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["compare", str(ema), str(fewer)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scored different validation texts" in err and str(fewer) in err
    # Runs on different data compare each on its own texts: resampled independently, no pairing.
    assert main(["compare", str(ema), str(fewer), "--unpaired", "--out", str(out)]) == 0
    unpaired = json.loads(out.read_text())
    rows = {(r["section"], r["figure"]): r for r in unpaired["rows"]}
    assert unpaired["paired"] is False and rows[("l2t", "word_f1")]["n"] == 3  # the smaller of 4 and 3 texts
    assert rows[("l2t", "word_f1")]["n_a"] == 4 and rows[("l2t", "word_f1")]["n_b"] == 3
    table = capsys.readouterr().out
    assert "each on its own texts" in table and "| l2t word_f1 | 4 / 3 |" in table


def test_compare_labels_the_figures_of_other_decoders_and_refuses_arms_that_are_not_one_recipe(
    run_dir, tmp_path, capsys
):
    plain, best = tmp_path / "plain.json", tmp_path / "best.json"
    quick = [*SMALL_EVAL, "--no-writing", "--num-t-draws", "1", "--no-ema"]
    assert main(["eval", "--run", str(run_dir), *quick, "--temperature", "1.0", "--out", str(plain)]) == 0
    assert (
        main(["eval", "--run", str(run_dir), *quick, "--temperature", "0.7", "--best-of", "2", "--out", str(best)]) == 0
    )
    reports = [json.loads(path.read_text()) for path in (plain, best)]
    # each report records its decoder and what the run trained with
    assert [r["sampling"]["best_of"] for r in reports] == [1, 2] and [
        r["sampling"]["temperature"] for r in reports
    ] == [1.0, 0.7]
    assert (
        reports[0]["config"]["train"]["steps"] == reports[0]["step"]
        and reports[0]["config"]["model"]["num_blocks"] == 2
    )
    capsys.readouterr()
    out = tmp_path / "compare.json"
    assert main(["compare", str(plain), str(best), "--null-comparisons", "0", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["section"], r["figure"]): r for r in result["rows"]}
    assert rows[("l2t", "word_f1")]["decoders"] == "temperature 1.0 vs 0.7, best_of 1 vs 2"
    assert rows[("l2t", "cosine_mean")]["selected"] == "B max over 2 candidates"
    assert (
        "decoders" not in rows[("t2l", "retrieval_at_1")]
        and "decoders" not in rows[("elbo l2t", "text_nats_per_token")]
    )
    assert "A and B decoded with different options (temperature 1.0 vs 0.7, best_of 1 vs 2)" in table
    assert "| l2t cosine_mean (decoders differ) (selected: B max over 2 candidates) | 4 |" in table
    # Two seeds of one recipe share its config but the seed and the run directory; a report of a run trained
    # for 300 steps is not one of them.
    for name, changes in (("seed1", {"seed": 1, "run_dir": "runs/seed1"}), ("short", {"steps": 300})):
        report = json.loads(plain.read_text())
        report["config"]["train"].update(changes)
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    seeds = ["--a", str(plain), str(tmp_path / "seed1.json"), "--b", str(plain), str(tmp_path / "seed1.json")]
    assert main(["compare", *seeds]) == 0
    capsys.readouterr()
    assert main(["compare", "--a", str(plain), str(tmp_path / "short.json"), "--b", str(plain)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"mmldlm compare: --a: {plain} and {tmp_path / 'short.json'} are not seeds of one recipe: they differ in "
        f"train.steps ({reports[0]['step']} vs 300); expected the same config apart from train.seed and train.run_dir"
    )


def test_a_figure_the_decoder_selects_on_is_labelled_and_measured_without_selection(run_dir, tmp_path, capsys):
    out = tmp_path / "best-of.json"
    args = ["eval", "--run", str(run_dir), *SMALL_EVAL, "--no-writing", "--num-t-draws", "1", "--best-of", "2"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["l2t"]["selected_on"] == {"cosine_mean": "max over 2 candidates"}
    plain = report["l2t_without_selection"]
    assert "selected_on" not in plain and plain["num_samples"] == 4 and plain["encoded_per_sample"] == 0
    summary = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "re-encoded cosine" in summary and "(selected on: max over 2 candidates)" in summary
    assert f"without selection (best of 1) {figure_text(plain, 'cosine_mean', '.4f')}" in summary
    assert "eval_l2t_without_selection_cosine_mean_low" in eval_metrics(report)


def test_eval_scores_num_samples_texts_for_the_elbo_and_notes_a_retrieval_pool_of_one(run_dir, tmp_path, capsys):
    out = tmp_path / "one.json"
    # one text, as in a run prepared with a single validation text: its retrieval pool holds only itself
    args = ["eval", "--run", str(run_dir), "--num-samples", "1", "--batch-size", "64", "--retrieval-pool", "1"]
    assert main([*args, "--no-writing", "--num-t-draws", "2", *FAST, "--out", str(out)]) == 0
    report, summary = json.loads(out.read_text()), out.with_suffix(".md").read_text(encoding="utf-8")
    l2t = report["elbo"]["l2t"]
    assert l2t["num_samples"] == 1  # not the 64 of one batch
    assert "t2l retrieval@1 among 1 is 100% by construction: it measures nothing here" in summary
    assert "t2l retrieval@1 among 1 is 100% by construction" in capsys.readouterr().out  # on the console too
    assert "Texts: validation" in summary and "(1 validation latents)" in summary
    # per T + 1 tokens, as an autoregressive model paying for its end of text
    per_text = l2t["per_text"]
    tokens = np.asarray(per_text["num_tokens"])
    assert l2t["nats_per_token_with_end"] == pytest.approx(np.sum(per_text["nats_per_text"]) / (2 * np.sum(tokens + 1)))
    assert l2t["nats_per_token_with_end"] < l2t["nats_per_token_with_length"]
    assert l2t["largest_draw_share"] == pytest.approx(
        np.max(per_text["nats_per_text"]) / np.sum(per_text["nats_per_text"])
    )
    assert "bounds no marginal -log p(text)" in summary and "not of the decoder" in summary


def test_eval_keeps_a_report_of_more_samples_unless_told_where_else_to_write_or_to_replace_it(
    run_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    quick = ["eval", "--run", str(run), "--no-writing", "--num-t-draws", "1", "--batch-size", "4", *FAST]
    assert main([*quick, "--num-samples", "4"]) == 0
    report = run / "eval" / "step-0000020.json"  # the one the model card reads
    kept = report.read_text()
    capsys.readouterr()
    assert main([*quick, "--num-samples", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{report} holds an evaluation of 4 samples" in err
    assert "--out PATH" in err and "--replace" in err and report.read_text() == kept
    assert main([*quick, "--num-samples", "4"]) == 0  # as many: a repeat, replaced
    kept = report.read_text()
    assert main([*quick, "--num-samples", "2", "--out", str(tmp_path / "small.json")]) == 0
    assert report.read_text() == kept
    assert main([*quick, "--num-samples", "2", "--replace"]) == 0
    assert json.loads(report.read_text())["l2t"]["num_samples"] == 2
    # What `make train` runs again after a finished run: a report of at least as many samples stands.
    kept = report.read_text()
    capsys.readouterr()
    assert main([*quick, "--num-samples", "2", "--if-missing"]) == 0
    assert (
        capsys.readouterr().out.strip()
        == f"mmldlm eval: {report} already holds an evaluation of 2 samples of this checkpoint; kept"
    )
    assert report.read_text() == kept
    assert main([*quick, "--num-samples", "4", "--if-missing"]) == 0  # more than it holds: evaluated
    assert json.loads(report.read_text())["l2t"]["num_samples"] == 4
