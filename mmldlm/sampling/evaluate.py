"""Evaluation of a trained run on its validation split: likelihood bounds, reconstructions, retrieval.

1. ELBO per mode: the training objective itself (`Objective`, forced to one mode, no condition
   dropping) on validation batches, averaged over `num_t_draws` draws of t and noise per batch.
   The text term is MDLM's NELBO (whatever text_diffusion.loss trained with) in nats per real
   token, token-weighted over batches; bits = nats / ln 2; exp(nats) bounds the perplexity from
   above. In l2t it bounds -log p(text | latent); in joint it is the text term of the joint loss
   (the latent noised at its own t). The latent term is the configured latent loss.
2. l2t reconstruction: text sampled from the first N validation latents (each text's true length is
   given, see sampler.py), re-encoded with the dataset's sentence encoder; mean cosine to the source
   latent, and the exact-match rate of the decoded text against the source text. The cosine rewards
   the right content words in any order (the encoder pools over words: a shuffled sentence keeps a
   cosine of about 0.9 to the original), so two word-level figures stand beside it: word F1, the
   overlap of the decoded text's words with the source's (lowercase letter runs, counted with
   multiplicity), and the real-word rate, the share of decoded words that occur in the training texts.
3. t2l: latents sampled from the first N validation texts; mean cosine to the true latent, and
   retrieval@1: the share whose nearest (cosine) latent among the first `retrieval_pool` validation
   latents is their own.
4. Length: the length head's prediction (argmax) from the first N validation latents against the
   true text lengths: exact accuracy and mean absolute error in tokens.
5. References beside the figures, on the same samples: chance retrieval (1 / pool); the cosine of
   the training-set mean latent to each target, what a t2l model that ignores its input gets; the
   cosine of each target to another sample's latent, what decoding a real but unrelated sentence
   gets in l2t (a cyclic shift of the samples), and the word F1 of that other sentence.
6. Speed: samples per second of each sampler at the given step count (one measurement, noisy on a
   shared machine).
With several guidance scales, 2. and 3. are repeated per scale (`guidance`); the l2t and t2l entries
hold the first scale's figures.
The report is a JSON-able dict; `markdown` renders it, `flat` turns it into eval_* metric keys.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from mmldlm.config import EvalConfig
from mmldlm.data.dataset import PadCollate
from mmldlm.diffusion import MaskedDiffusion
from mmldlm.objective import Objective
from mmldlm.sampling.run import TrainedRun
from mmldlm.sampling.sampler import SamplingOptions

MODES = ("l2t", "t2l", "joint")


def _generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU generator of its own for each (seed, part...): results do not depend on the device or on
    what ran before."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, *parts]).generate_state(1)[0]))


def val_batches(run: TrainedRun, num_samples: int, batch_size: int):
    """Batches (the loader's format) of the first `num_samples` validation samples, in order."""
    collate = PadCollate(run.text.pad_token_id, run.cfg.data.pad_to_multiple, run.max_length)
    n = min(num_samples, len(run.val))
    for start in range(0, n, batch_size):
        yield collate([run.val[i] for i in range(start, min(start + batch_size, n))])


# --------------------------------------------------------------------------------------------------
# 1. ELBO


def eval_objective(run: TrainedRun, mode: str) -> Objective:
    """The training objective in one mode, with the MDLM ELBO as its text loss and no condition dropping."""
    text = MaskedDiffusion(
        dataclasses.replace(run.text.cfg, loss="elbo"), run.text.mask_token_id, run.text.pad_token_id
    )
    cfg = dataclasses.replace(run.cfg.objective, mode=mode, cond_drop_prob=0.0)
    return Objective(
        cfg, text, run.latent, self_condition=run.cfg.model.self_condition, length_head=run.cfg.model.length_head
    )


@torch.no_grad()
def elbo(
    run: TrainedRun,
    num_samples: int,
    batch_size: int,
    num_t_draws: int = 1,
    seed: int = 0,
    modes: tuple[str, ...] = MODES,
) -> dict:
    """{mode: {text_nats_per_token, text_bits_per_token, text_ppl_bound, latent_loss, ...}} (module docstring)."""
    out = {}
    for m, mode in enumerate(modes):
        objective = eval_objective(run, mode)
        nats = tokens = latent = samples = 0.0
        for b, batch in enumerate(val_batches(run, num_samples, batch_size)):
            batch = {k: v.to(run.device) for k, v in batch.items()}
            for draw in range(num_t_draws):
                _, metrics = objective(run.model, batch, step=0, generator=_generator(seed, m, b, draw))
                if "text_loss" in metrics:
                    n = float(metrics["num_tokens"])
                    nats += float(metrics["text_loss"]) * n
                    tokens += n
                if "latent_loss" in metrics:
                    B = batch["tokens"].shape[0]
                    latent += float(metrics["latent_loss"]) * B
                    samples += B
        result = {}
        if tokens:
            per_token = nats / tokens
            result.update(
                text_nats_per_token=per_token,
                text_bits_per_token=per_token / math.log(2),
                text_ppl_bound=math.exp(min(per_token, 700.0)),
                num_tokens=int(tokens / num_t_draws),
            )
        if samples:
            result["latent_loss"] = latent / samples
        out[mode] = result
    return out


# --------------------------------------------------------------------------------------------------
# 2.-3. sampling


def _first_val(run: TrainedRun, num: int) -> tuple[list[list[int]], torch.Tensor]:
    """Token ids (cut as in training) and latents (N, K, D) of the first `num` validation samples."""
    n = min(num, len(run.val))
    samples = [run.val[i] for i in range(n)]
    ids = [s[1][: run.max_length].tolist() for s in samples]
    return ids, torch.stack([torch.from_numpy(s[2].astype("float32")) for s in samples])


def words(text: str) -> list[str]:
    """The lowercase letter runs of `text`, in order."""
    return re.findall(r"[a-z]+", text.lower())


def word_f1(generated: list[str], source: list[str]) -> float:
    """F1 of the word multisets (0 when either is empty)."""
    common = sum((Counter(generated) & Counter(source)).values())
    if not common:
        return 0.0
    precision, recall = common / len(generated), common / len(source)
    return 2 * precision * recall / (precision + recall)


def l2t_reconstruction(
    run: TrainedRun,
    options: SamplingOptions,
    num_samples: int,
    batch_size: int,
    seed: int = 0,
    use_encoder: bool = True,
    num_examples: int = 5,
) -> dict:
    """Text from the first N validation latents vs. the source texts (module docstring, 2)."""
    ids, latents = _first_val(run, num_samples)
    sampler = run.sampler(options)
    sources, generated = [], []
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        tokens, pad_mask = run.batch_of(ids[b : b + batch_size])
        out = sampler.l2t(latents[b : b + batch_size], pad_mask, _generator(seed, 1, b))
        sources += run.decode(tokens, pad_mask)
        generated += run.decode(out, pad_mask)
    seconds = time.perf_counter() - start
    known = run.known_words
    decoded_words = [words(g) for g in generated]
    result = {
        "num_samples": len(ids),
        "exact_match": sum(g == s for g, s in zip(generated, sources)) / len(ids),
        "word_f1": float(np.mean([word_f1(w, words(s)) for w, s in zip(decoded_words, sources)])),
        "real_word_rate": sum(w in known for ws in decoded_words for w in ws)
        / max(1, sum(len(ws) for ws in decoded_words)),
        "samples_per_s": len(ids) / seconds,
        "model_calls_per_batch": sampler.num_forward / math.ceil(len(ids) / batch_size),
        "encoded_per_sample": sampler.num_encoded / len(ids),
    }
    cosines = None
    if use_encoder:
        cosines = F.cosine_similarity(run.encode_latents(generated).flatten(1), latents.flatten(1), dim=-1)
        result["cosine_mean"] = cosines.mean().item()
    result["examples"] = [
        {"source": s, "generated": g, **({"cosine": round(cosines[i].item(), 4)} if cosines is not None else {})}
        for i, (s, g) in enumerate(zip(sources[:num_examples], generated[:num_examples]))
    ]
    return result


def t2l_retrieval(
    run: TrainedRun, options: SamplingOptions, num_samples: int, batch_size: int, pool_size: int = 1000, seed: int = 0
) -> dict:
    """Latents from the first N validation texts vs. the true latents (module docstring, 3)."""
    _, pool = _first_val(run, max(pool_size, num_samples))
    ids = _first_val(run, num_samples)[0]
    sampler = run.sampler(options)
    generated = []
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        tokens, pad_mask = run.batch_of(ids[b : b + batch_size])
        generated.append(sampler.t2l(tokens, pad_mask, _generator(seed, 2, b)).cpu())
    seconds = time.perf_counter() - start
    generated = torch.cat(generated).flatten(1)  # (N, K*D)
    pool = pool.flatten(1)  # (P, K*D), P >= N: sample i is pool row i
    cosine = F.cosine_similarity(generated, pool[: len(ids)], dim=-1)
    similarity = F.normalize(generated, dim=-1) @ F.normalize(pool, dim=-1).T  # (N, P)
    hits = similarity.argmax(dim=1) == torch.arange(len(ids))
    return {
        "num_samples": len(ids),
        "cosine_mean": cosine.mean().item(),
        "retrieval_at_1": hits.float().mean().item(),
        "pool_size": pool.shape[0],
        "samples_per_s": len(ids) / seconds,
    }


# --------------------------------------------------------------------------------------------------
# 4.-5. length and references


@torch.no_grad()
def length_prediction(run: TrainedRun, num_samples: int) -> dict | None:
    """The length head's argmax from the first N validation latents vs their true (cut) lengths;
    None for a model without a length head."""
    if getattr(run.model, "length_head", None) is None:
        return None
    ids, latents = _first_val(run, num_samples)
    predicted = torch.tensor(run.predict_lengths(latents))
    true = torch.tensor([max(len(x), 1) for x in ids])
    return {
        "num_samples": len(ids),
        "accuracy": (predicted == true).float().mean().item(),
        "mean_abs_error": (predicted - true).abs().float().mean().item(),
    }


def references(run: TrainedRun, num_samples: int, pool_size: int) -> dict:
    """What trivial predictors score on the same samples (module docstring, 5)."""
    ids, targets = _first_val(run, num_samples)
    targets = targets.flatten(1)  # (N, K*D), encoder space
    mean = run.latent.mean
    out = {"chance_retrieval_at_1": 1.0 / min(pool_size, len(run.val))}
    if mean is not None:
        constant = mean.float().repeat(run.model.cfg.num_latents)[None, :]  # (1, K*D)
        out["mean_latent_cosine"] = F.cosine_similarity(constant, targets, dim=-1).mean().item()
    if len(targets) > 1:
        out["other_sentence_cosine"] = F.cosine_similarity(targets.roll(1, dims=0), targets, dim=-1).mean().item()
        texts = [words(text) for text in run.decode(*run.batch_of(ids))]
        out["other_sentence_word_f1"] = float(np.mean([word_f1(a, b) for a, b in zip(texts[1:] + texts[:1], texts)]))
    return out


# --------------------------------------------------------------------------------------------------
# The whole report.


def evaluate(
    run: TrainedRun,
    cfg: EvalConfig,
    options: SamplingOptions | None = None,
    num_t_draws: int = 1,
    seed: int = 0,
    guidance_scales: list[float] | None = None,
) -> dict:
    """ELBO per mode, l2t reconstruction, t2l retrieval, length prediction and the references of `run`
    with the budget of `cfg`; the samplers once per guidance scale (default: options.guidance_scale)."""
    options = options or SamplingOptions.defaults(run.cfg.text_diffusion, run.cfg.latent_diffusion, cfg.num_steps)
    scales = list(guidance_scales) if guidance_scales else [options.guidance_scale]
    was_training = run.model.training
    run.model.eval()
    try:
        report = {
            "checkpoint": str(run.checkpoint) if run.checkpoint else None,
            "step": run.step,
            "weights": run.weights,
            "sampling": dataclasses.replace(options, guidance_scale=scales[0]).to_dict(),
            "num_t_draws": num_t_draws,
            "elbo": elbo(run, cfg.num_elbo_batches * cfg.batch_size, cfg.batch_size, num_t_draws, seed),
        }
        sweep = []
        for scale in scales:
            scaled = dataclasses.replace(options, guidance_scale=scale)
            sweep.append(
                {
                    "guidance_scale": scale,
                    "l2t": l2t_reconstruction(run, scaled, cfg.num_samples, cfg.batch_size, seed, cfg.encoder),
                    "t2l": t2l_retrieval(run, scaled, cfg.num_samples, cfg.batch_size, cfg.retrieval_pool, seed),
                }
            )
        report["l2t"], report["t2l"] = sweep[0]["l2t"], sweep[0]["t2l"]
        if len(sweep) > 1:
            report["guidance"] = [
                {
                    "guidance_scale": entry["guidance_scale"],
                    "l2t": {
                        k: v
                        for k, v in entry["l2t"].items()
                        if k in ("cosine_mean", "exact_match", "word_f1", "real_word_rate")
                    },
                    "t2l": {k: entry["t2l"][k] for k in ("cosine_mean", "retrieval_at_1")},
                }
                for entry in sweep
            ]
        length = length_prediction(run, cfg.num_samples)
        if length is not None:
            report["length"] = length
        report["references"] = references(run, cfg.num_samples, cfg.retrieval_pool)
    finally:
        run.model.train(was_training)
    return report


def flat(report: dict) -> dict:
    """The report's numbers as eval_* keys (for metrics.jsonl): eval_elbo_l2t_text_nats_per_token, ..."""
    out = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}_{key}", value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{prefix}_{key}"] = value

    walk("eval", {k: report[k] for k in ("elbo", "l2t", "t2l", "length", "references") if k in report})
    return out


def table_cell(text: str) -> str:
    """`text` as one markdown table cell: no line breaks, no bare column separator."""
    return " ".join(text.split()).replace("|", "\\|")


def markdown(report: dict) -> str:
    """A short human summary of the report."""
    lines = [
        f"# Evaluation of {report['checkpoint']} (step {report['step']}, {report['weights']} weights)",
        "",
        f"Sampling: {report['sampling']}",
        "",
        "| mode | text nats/token | text bits/token | perplexity bound | latent loss |",
        "|---|---|---|---|---|",
    ]
    for mode, r in report["elbo"].items():
        cell = lambda k, f, r=r: format(r[k], f) if k in r else "-"  # noqa: E731
        lines.append(
            f"| {mode} | {cell('text_nats_per_token', '.4f')} | {cell('text_bits_per_token', '.4f')} | "
            f"{cell('text_ppl_bound', '.2f')} | {cell('latent_loss', '.4f')} |"
        )
    l2t, t2l, ref = report["l2t"], report["t2l"], report.get("references", {})
    cosine = f"{l2t['cosine_mean']:.4f}" if "cosine_mean" in l2t else "not measured"
    reference = lambda key, text: f" ({text} {ref[key]:.4f})" if key in ref else ""  # noqa: E731
    chance = f" (chance {ref['chance_retrieval_at_1']:.1%})" if "chance_retrieval_at_1" in ref else ""
    lines += [
        "",
        f"l2t reconstruction ({l2t['num_samples']} validation latents): exact match "
        f"{l2t['exact_match']:.1%}, mean cosine of the re-encoded text to the source latent {cosine}"
        f"{reference('other_sentence_cosine', 'an unrelated real sentence:')}, word F1 {l2t['word_f1']:.3f}"
        f"{reference('other_sentence_word_f1', 'an unrelated real sentence:')}, "
        f"real words {l2t['real_word_rate']:.1%}, {l2t['samples_per_s']:.1f} samples/s",
        "",
        f"t2l ({t2l['num_samples']} validation texts): mean cosine to the true latent {t2l['cosine_mean']:.4f}"
        f"{reference('mean_latent_cosine', 'the training-set mean latent:')}, "
        f"retrieval@1 among {t2l['pool_size']} {t2l['retrieval_at_1']:.1%}{chance}, "
        f"{t2l['samples_per_s']:.1f} samples/s",
    ]
    if "length" in report:
        length = report["length"]
        lines += [
            "",
            f"length head ({length['num_samples']} validation latents): exact {length['accuracy']:.1%}, "
            f"mean absolute error {length['mean_abs_error']:.2f} tokens",
        ]
    if "guidance" in report:
        lines += [
            "",
            "| guidance scale | l2t cosine | l2t word F1 | l2t real words | l2t exact match | t2l cosine "
            "| t2l retrieval@1 |",
            "|---|---|---|---|---|---|---|",
        ]
        for entry in report["guidance"]:
            g2, g1 = entry["l2t"], entry["t2l"]
            lines.append(
                f"| {entry['guidance_scale']:g} | {g2.get('cosine_mean', float('nan')):.4f} | "
                f"{g2['word_f1']:.3f} | {g2['real_word_rate']:.1%} | {g2['exact_match']:.1%} | "
                f"{g1['cosine_mean']:.4f} | {g1['retrieval_at_1']:.1%} |"
            )
    lines += ["", "| source | generated from its latent |", "|---|---|"]
    lines += [f"| {table_cell(e['source'])} | {table_cell(e['generated'])} |" for e in l2t["examples"]]
    return "\n".join(lines) + "\n"
