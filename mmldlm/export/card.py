"""The model card (README.md) of an exported model, written from the run directory: what the model
is, its training data and licence, the training config and compute, the evaluation of the checkpoint,
intended use and limits. Metadata goes in the hub's YAML front matter (huggingface_hub.ModelCardData).

Everything is read from files the run already has: RUN/config.yaml, RUN/metrics.jsonl (the training
records: steps, batch sizes, step times, the memory keys that tell the device), the checkpoint's
meta.json (processes), RUN/eval/step-NNNNNNN.json (`mmldlm eval` of that checkpoint) and the prepared
dataset's meta.json (samples, corpus, encoder).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import ModelCardData

from mmldlm.config import to_dict
from mmldlm.data.corpus import DEFAULT_CORPUS
from mmldlm.data.format import META
from mmldlm.evaluation.figures import FIGURE, HEADLINE, REFERENCE_LABELS
from mmldlm.evaluation.report import figure_text, selected_label, table_cell
from mmldlm.runs.trained import TrainedRun

WORDNET_LICENCE = DEFAULT_CORPUS.parent / "LICENSE.wordnet"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _compute(run_dir: Path, step: int | None) -> dict:
    """Steps, samples seen, time in training steps and the device of the run up to `step`, from
    metrics.jsonl (each record's batch size and step time stand for the steps since the record before)."""
    records = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill during the write
                continue
            if isinstance(record, dict) and "loss" in record and (step is None or record["step"] <= step):
                records[record["step"]] = record
    samples = seconds = 0.0
    previous = 0
    for s in sorted(records):
        samples += records[s]["global_batch_size"] * (s - previous)
        seconds += records[s]["step_time_s"] * (s - previous)
        previous = s
    device = (
        "a CUDA GPU"
        if any("mem_allocated_gib" in r for r in records.values())
        else "CPU"
        if records
        else "not recorded"
    )
    return {"steps": step, "samples": int(samples), "seconds": seconds, "device": device, "logged": bool(records)}


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} hours" if seconds >= 3600 else f"{seconds / 60:.1f} minutes"


def _data_section(run: TrainedRun) -> tuple[list[str], dict]:
    """(markdown lines, front matter fields) of the training data and its licence."""
    meta = _read_json(run.dataset_dir / META) if run.dataset_dir is not None else None
    if meta is None:
        return ["The training dataset was not found, so it is not described here."], {}
    inputs = meta.get("prepare", {}).get("inputs") or ["not recorded"]
    bundled = inputs == ["default"]
    splits = meta.get("splits", {})
    lines = [
        f"{splits.get('train', '?')} training and {splits.get('val', '?')} validation texts "
        f"(`mmldlm prepare`, {meta['vocab_size']}-token byte-level BPE, latents from `{meta['encoder']}`"
        f"{', L2-normalised' if meta.get('encoder_normalize') else ''}) from "
        f"{'the corpus bundled with mmldlm' if bundled else ', '.join(map(str, inputs))}."
    ]
    if bundled:
        lines += [
            "",
            "That corpus holds the glosses and usage examples of **WordNet 3.0** (Princeton University): "
            "short English definitions and example sentences.",
            "",
            "Licence of the training data, the WordNet 3.0 licence:",
            "",
            "```",
            WORDNET_LICENCE.read_text(encoding="utf-8").strip(),
            "```",
        ]
        return lines, {"license": "other", "license_name": "wordnet-3.0", "language": ["en"]}
    lines += ["", "Licence of the training data: not recorded by mmldlm; the licences of the inputs above apply."]
    return lines, {}


# The figures a decoder may select its texts on, as the card names them measured again without selection.
WITHOUT_SELECTION = {"cosine_mean": "l2t re-encoded cosine", "consistency": "joint: consistency"}


def _rows(report: dict, section: str, key: str, *more: str) -> list[tuple[str, str, str]]:
    """(label, value [95% interval], reference) of a figure of `FIGURES`, the label marked where the decoder
    selected on the figure, the reference followed by `more` (those not empty); where it did select, a second
    row: the same decoder without selection, beside the figure's reference. No rows where it was not measured."""
    f, values, plain = FIGURE[section, key], report.get(section, {}), report.get(f"{section}_without_selection", {})
    if key not in values:
        return []
    ref = report.get("references", {})
    reference = f"{REFERENCE_LABELS[f.reference][0]} {ref[f.reference]:{f.number_format}}" if f.reference in ref else ""
    label = f.label.format(**values) + selected_label(values, key)
    rows = [(label, figure_text(values, key, f.number_format), "; ".join(r for r in (reference, *more) if r))]
    if key in values.get("selected_on", {}) and key in plain:
        label = f"{WITHOUT_SELECTION[key]} without selection (best of 1)"
        rows.append((label, figure_text(plain, key, f.number_format), reference))
    return rows


def writing_rows(report: dict) -> list[tuple[str, str, str]]:
    """The writing figures of a report from `mmldlm eval` (absent from one taken with --no-writing)."""
    nearest = report.get("nearest_training_text", {})
    near = f"the training text with the nearest latent {nearest['bleu']:.1f}" if "bleu" in nearest else ""
    rows = _rows(report, "l2t", "bleu", near) + _rows(report, "l2t", "repetition")
    return rows + _rows(report, "joint", "consistency", "real pairs 1.000") + _rows(report, "joint", "ngram_perplexity")


def _eval_rows(report: dict) -> list[tuple[str, str, str]]:
    """(figure, value [95% interval], reference) rows: the figures no decoder selects on first."""
    l2t, elbo = report["l2t"], report.get("elbo", {})
    rows = [row for f in HEADLINE[:3] for row in _rows(report, f.section, f.key)]
    words = f"{figure_text(l2t, 'real_word_rate', '.1%')} / {figure_text(l2t, 'exact_match', '.1%')}"
    rows.append(("l2t real-word rate / exact match", words, ""))
    rows += writing_rows(report)
    rows += _rows(report, "l2t", "cosine_mean")
    l2t_elbo = elbo.get("l2t", {})
    if "text_nats_per_token" in l2t_elbo:
        given = "upper bound on -log p(text | length, latent), of the model at temperature 1, not of the decoder above"
        rows.append(("l2t NELBO given the length (nats/token)", figure_text(l2t_elbo, "text_nats_per_token"), given))
    if "nats_per_token_with_length" in l2t_elbo:
        paid = (
            "upper bound on -log p(text | latent) per T tokens (per T + 1, as an autoregressive model paying for "
            f"its end of text: {figure_text(l2t_elbo, 'nats_per_token_with_end')})"
            if "nats_per_token_with_end" in l2t_elbo
            else "upper bound on -log p(text | latent)"
        )
        rows.append(("l2t NELBO, length paid (nats/token)", figure_text(l2t_elbo, "nats_per_token_with_length"), paid))
    if "length" in report:
        length = report["length"]
        accuracy, error = figure_text(length, "accuracy", ".1%"), figure_text(length, "mean_abs_error", ".1f")
        rows.append(("length head exact / mean abs. error", f"{accuracy} / {error} tokens", ""))
    return rows


def _eval_section(run_dir: Path, run: TrainedRun) -> list[str]:
    path = run_dir / "eval" / f"{run.checkpoint.name}.json"
    report = _read_json(path)
    if report is None:
        return [f"Not evaluated: the run has no `eval/{path.name}` (`mmldlm eval --run RUN` writes it)."]
    l2t, sampling = report["l2t"], report.get("sampling", {})
    lines = [
        f"`mmldlm eval` of this checkpoint ({report.get('weights')} weights) on {l2t['num_samples']} "
        f"validation samples, {sampling.get('num_steps')} sampling steps ({path.name}); in brackets the 95% "
        "bootstrap interval over those texts. A figure the decoder selected its texts on is marked so: it is "
        "the best of several candidates by construction.",
        "",
        "| figure | value | reference |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {value} | {reference} |" for name, value, reference in _eval_rows(report)]
    if l2t.get("examples"):
        lines += ["", "| source | decoded from its latent |", "|---|---|"]
        lines += [f"| {table_cell(e['source'])} | {table_cell(e['generated'])} |" for e in l2t["examples"][:3]]
    return lines


def _compute_line(run: TrainedRun, run_dir: Path) -> str:
    """Steps, samples, time and device of the training, from metrics.jsonl and the checkpoint's meta.json."""
    facts = _compute(run_dir, run.step)
    meta = _read_json(run.checkpoint / "meta.json") or {}
    processes = meta.get("world_size", "?")
    if meta.get("device"):  # checkpoints name the device they were trained on; older ones do not
        facts["device"] = meta["device"]
    wall = meta.get("wall_seconds")
    timing = f"{_duration(facts['seconds'])} in training steps (evaluation and checkpoints not counted)"
    if wall is not None:
        timing = f"{_duration(wall)} of training wall-clock time, {timing}"
    return (
        f"{facts['steps']} optimizer steps, {facts['samples']:,} samples seen, "
        f"{timing}, on {facts['device']}, {processes} {'process' if processes == 1 else 'processes'}"
        if facts["logged"]
        else f"{facts['steps']} optimizer steps; metrics.jsonl not found, so no further figures"
    )


def _description(run: TrainedRun) -> str:
    """The paragraph under the title: what the model is, its size, what it does, which weights."""
    cfg, m = run.cfg, run.cfg.model
    num_params = sum(p.numel() for p in run.model.parameters())
    weights = (
        f"the EMA of the weights (train.ema_decay {cfg.train.ema_decay})"
        if run.weights == "ema"
        else "the trained weights (no EMA)"
    )
    return (
        "A multimodal latent diffusion language model (mmldlm): one dual-stream MMDiT transformer "
        f"({num_params / 1e6:.1f}M parameters: hidden size {m.hidden_size}, {m.num_blocks} blocks, {m.num_heads} "
        f"heads, vocabulary {run.model.vocab_size}) that learns masked diffusion over text tokens (MDLM) jointly "
        f"with Gaussian diffusion over the text's sentence embedding from `{run.encoder_name}` ({m.num_latents} x "
        f"{m.latent_dim} latents). It turns text into latents (t2l), latents into text (l2t), and generates both "
        f"together (joint). Texts are at most {run.max_length} tokens; there is no end-of-text token, so a text's "
        f"length is given, predicted by the length head{'' if m.length_head else ' (absent in this model)'}, or "
        f"drawn from the training lengths. These weights are {weights}."
    )


USE_SECTION = [
    "## Use",
    "",
    "```python",
    "from mmldlm import MMLDLM",
    'm = MMLDLM.from_pretrained("path/to/this/folder")   # local folders only',
    'z = m.encode(["a small dog that barks"])             # t2l: latents (N, K, D), encoder space',
    "texts = m.decode(z)                                   # l2t",
    "texts, z = m.generate(4)                              # joint",
    'm.embed(["a small dog that barks"])                  # the sentence encoder itself',
    "```",
    "",
    'or `mmldlm sample --run path/to/this/folder --mode l2t --text "a small dog"`.',
]


def _training_section(run: TrainedRun, run_dir: Path) -> list[str]:
    """Objective, optimizer, compute and the resolved config of the training."""
    cfg = run.cfg
    mode = cfg.objective.mode
    modes = (
        f"{mode} with weights {cfg.objective.mode_weights}"
        if mode == "random"
        else f"{mode}, schedule {cfg.objective.mode_schedule}"
        if mode == "sequential"
        else mode
    )
    return [
        "## Training",
        "",
        f"Objective: mode {modes}; text loss {cfg.text_diffusion.loss}, latent prediction "
        f"{cfg.latent_diffusion.prediction} with loss {cfg.latent_diffusion.loss}. Optimizer AdamW, lr {cfg.optim.lr}, "
        f"global batch {cfg.train.global_batch_size}, precision {cfg.train.precision}."
        + (f" Fine-tuned: started from the weights of `{cfg.train.init_from}`." if cfg.train.init_from else ""),
        "",
        f"Compute: {_compute_line(run, run_dir)}.",
        "",
        "<details><summary>The resolved training config (config.yaml)</summary>",
        "",
        "```yaml",
        yaml.safe_dump(to_dict(cfg), sort_keys=False).strip(),
        "```",
        "",
        "</details>",
    ]


def _limits(run: TrainedRun) -> str:
    return (
        "For research on latent diffusion language models: encoding short texts into the sentence encoder's "
        "latent space, decoding latents (from this or another model) back into text, generating text-latent "
        "pairs. Limits: texts longer than the cut length are truncated; the decoded text of a small model is on "
        "topic rather than fluent (the figures above say how close); latents mean something only in the "
        f"space of `{run.encoder_name}`; the model knows only what its training texts hold, with their biases, "
        "and is not meant for factual, safety-critical or user-facing generation."
    )


def model_card(run: TrainedRun, run_dir: Path) -> str:
    """README.md of the exported model of `run`, trained in `run_dir`."""
    data_lines, licence = _data_section(run)
    front = ModelCardData(
        library_name="mmldlm", tags=["mmldlm", "masked-diffusion", "latent-diffusion", "sentence-embeddings"], **licence
    )
    lines = [
        "---",
        front.to_yaml(),
        "---",
        "",
        f"# MM-LDLM: {run_dir.resolve().name}, step {run.step}",
        "",
        _description(run),
        "",
        *USE_SECTION,
        "",
        "## Training data",
        "",
        *data_lines,
        "",
        *_training_section(run, run_dir),
        "",
        "## Evaluation",
        "",
        *_eval_section(run_dir, run),
        "",
        "## Intended use and limits",
        "",
        _limits(run),
    ]
    return "\n".join(lines) + "\n"
