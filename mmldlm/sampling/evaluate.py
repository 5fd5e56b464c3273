"""Evaluation of a trained run on its validation split: likelihood bounds, reconstructions, retrieval.

1. ELBO per mode: the training objective itself (`Objective`, forced to one mode, no condition
   dropping) on validation batches, averaged over `num_t_draws` draws of t and noise per batch.
   The text term is MDLM's NELBO (whatever text_diffusion.loss trained with) with its prior and
   reconstruction terms (masked.py), per text. Given the true length it bounds -log p(x | L, latent)
   (`text_nats_per_token_given_length`, also under the older key `text_nats_per_token`). The length
   is then paid for (`length_nats_per_text`): in l2t by the length head, -log p_head(L | latent) over
   the lengths 1..max_length (a model without a head: as joint); in joint by -log p(L) under the
   validation split's length distribution, the one joint generation draws from (fitted on the same
   split, so slightly optimistic). `nats_per_text` and `nats_per_token_with_length` bound
   -log p(x | latent) in l2t, and in joint the text term of the joint loss (the latent noised at its
   own t) with the length paid. bits = nats / ln 2; exp(nats per token) bounds the perplexity from
   above; with the length paid it is comparable to an autoregressive model's perplexity over the same
   tokenizer's tokens that pays for its end-of-text token (the length term plays that token's role).
   `per_text` keeps the arrays (nats given the length, length nats, tokens) for intervals. The
   latent term is the configured latent loss.
2. l2t reconstruction: text sampled from the first N validation latents (each text's true length is
   given, see sampler.py), re-encoded with the dataset's sentence encoder; mean cosine to the source
   latent, and the exact-match rate of the decoded text against the source text. The cosine rewards
   the right content words in any order (the encoder pools over words: a shuffled sentence keeps a
   cosine of about 0.9 to the original), so two word-level figures stand beside it: word F1, the
   overlap of the decoded text's words with the source's (lowercase letter runs, counted with
   multiplicity), and the real-word rate, the share of decoded words that occur in the training texts.
3. t2l: latents from the first N validation texts; mean cosine to the true latent, and retrieval@1:
   the share whose nearest (cosine) latent among the first `retrieval_pool` validation latents is
   their own. Both read the posterior mean (latent_sampler "mean": t2l used as an encoder); the
   sampler's own samples are what the latent fidelity (6.) reads.
4. Length: the length head's prediction (argmax) from the first N validation latents against the
   true text lengths: exact accuracy and mean absolute error in tokens.
5. References beside the figures, on the same samples: chance retrieval (1 / pool); the cosine of
   the training-set mean latent to each target, what a t2l model that ignores its input gets; the
   cosine of each target to another sample's latent, what decoding a real but unrelated sentence
   gets in l2t (a cyclic shift of the samples), and the word F1 of that other sentence.
6. Latent fidelity (latent_fidelity.py) of t2l's and joint generation's latents against as many real
   validation latents: Fréchet distance, k-NN precision and recall, the per-dimension std ratio and
   the spread, each beside real latents against a disjoint real set of the same size.
7. Speed: samples per second of each sampler at the given step count (one measurement, noisy on a
   shared machine).
With several guidance scales, 2. and 3. are repeated per scale (`guidance`); the l2t and t2l entries
hold the first scale's figures.
The report is a JSON-able dict; `markdown` renders it, `flat` turns it into eval_* metric keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from mmldlm.config import EvalConfig
from mmldlm.data.dataset import PadCollate, PreparedDataset
from mmldlm.diffusion import MaskedDiffusion
from mmldlm.objective import Objective
from mmldlm.sampling import latent_fidelity as lf
from mmldlm.sampling import text_metrics as tm
from mmldlm.sampling.run import TrainedRun, dataset_texts
from mmldlm.sampling.sampler import SamplingOptions, length_masks
from mmldlm.sampling.text_metrics import word_f1, words

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
    """{mode: {text_nats_per_token_given_length, nats_per_token_with_length, nats_per_text, ...,
    latent_loss}} (module docstring, 1)."""
    out = {}
    for m, mode in enumerate(modes):
        objective = eval_objective(run, mode)
        text_nats, length_nats, tokens = [], [], []
        latent = samples = 0.0
        for b, batch in enumerate(val_batches(run, num_samples, batch_size)):
            batch = {k: v.to(run.device) for k, v in batch.items()}
            B = batch["tokens"].shape[0]
            nats = torch.zeros(B, dtype=torch.float64)
            for draw in range(num_t_draws):
                _, metrics = objective(run.model, batch, step=0, generator=_generator(seed, m, b, draw))
                if "nats_per_text" in metrics:
                    nats += metrics["nats_per_text"].double().cpu() / num_t_draws
                if "latent_loss" in metrics:
                    latent += float(metrics["latent_loss"]) * B
                    samples += B
            if mode != "t2l":
                text_nats.append(nats)
                tokens.append(batch["pad_mask"].sum(dim=1).cpu())
                length_nats.append(length_cost(run, mode, batch))
        result = {}
        if text_nats:
            result = text_bound(run, torch.cat(text_nats), torch.cat(length_nats), torch.cat(tokens))
        if samples:
            result["latent_loss"] = latent / samples
        out[mode] = result
    return out


def length_cost(run: TrainedRun, mode: str, batch: dict) -> torch.Tensor:
    """(B,) float64 nats: -log p(L) of each text's length (module docstring, 1): the length head's over
    1..max_length given the clean latent in l2t, else the validation split's length distribution."""
    lengths = batch["pad_mask"].sum(dim=1).clamp(1, run.max_length).cpu() - 1  # (B,) class index
    if mode == "l2t" and getattr(run.model, "length_head", None) is not None:
        logits = run.model.length_logits(run.latent.standardize(batch["latents"].float()))[:, : run.max_length]
        return -torch.log_softmax(logits.double(), dim=1).cpu().gather(1, lengths[:, None])[:, 0]
    counts = run.length_counts.double()
    return -torch.log(counts / counts.sum())[lengths]


def text_bound(run: TrainedRun, text_nats: torch.Tensor, length_nats: torch.Tensor, tokens: torch.Tensor) -> dict:
    """The likelihood figures of texts from their diffusion terms (nats per text, given the length),
    length costs and real tokens, all (N,): the prior term is added here."""
    prior = run.text.prior_nats_per_token(run.cfg.model.vocab_size or run.val.vocab_size)  # the model's V
    given = text_nats + prior * tokens.double()  # (N,) nats given the length
    paid = given + length_nats  # (N,) nats with the length paid
    num_tokens = float(tokens.sum())
    given_per_token, paid_per_token = float(given.sum()) / num_tokens, float(paid.sum()) / num_tokens
    return {
        "text_nats_per_token_given_length": given_per_token,
        "text_nats_per_token": given_per_token,
        "text_bits_per_token": given_per_token / math.log(2),
        "text_ppl_bound": math.exp(min(given_per_token, 700.0)),
        "nats_per_token_with_length": paid_per_token,
        "bits_per_token_with_length": paid_per_token / math.log(2),
        "ppl_bound_with_length": math.exp(min(paid_per_token, 700.0)),
        "nats_per_text": float(paid.mean()),
        "length_nats_per_text": float(length_nats.mean()),
        "prior_nats_per_token": prior,
        "num_tokens": int(num_tokens),
        "num_texts": len(tokens),
        "per_text": {
            "nats_given_length": given.tolist(),
            "length_nats": length_nats.tolist(),
            "tokens": tokens.tolist(),
        },
    }


# --------------------------------------------------------------------------------------------------
# 2.-3. sampling


def _first_val(run: TrainedRun, num: int) -> tuple[list[list[int]], torch.Tensor]:
    """Token ids (cut as in training) and latents (N, K, D) of the first `num` validation samples."""
    n = min(num, len(run.val))
    samples = [run.val[i] for i in range(n)]
    ids = [s[1][: run.max_length].tolist() for s in samples]
    return ids, torch.stack([torch.from_numpy(s[2].astype("float32")) for s in samples])


def l2t_reconstruction(
    run: TrainedRun,
    options: SamplingOptions,
    num_samples: int,
    batch_size: int,
    seed: int = 0,
    use_encoder: bool = True,
    num_examples: int = 5,
    predicted_length: bool = False,
    fluency: tm.NgramReference | None = None,
) -> dict:
    """Text from the first N validation latents vs. the source texts (module docstring, 2), at each
    source's own length, or with `predicted_length` at the length head's (its `length_candidates` most
    likely lengths, the encoder choosing), the length a user of `decode` gets."""
    ids, latents = _first_val(run, num_samples)
    sampler = run.sampler(options)
    sources, generated = [], []
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        tokens, pad_mask = run.batch_of(ids[b : b + batch_size])
        if predicted_length:
            pad_mask = length_masks(run.candidate_lengths(latents[b : b + batch_size], options.length_candidates))
        out = sampler.l2t(latents[b : b + batch_size], pad_mask, _generator(seed, 1, b))
        sources += run.decode(tokens, tokens != run.text.pad_token_id)
        generated += run.decode(out, out != run.text.pad_token_id)
    seconds = time.perf_counter() - start
    result = {
        "num_samples": len(ids),
        **writing_figures(run, generated, sources, fluency),
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


def writing_figures(run: TrainedRun, generated: list[str], sources: list[str], fluency=None) -> dict:
    """Exact match, word F1, BLEU, repetition, real-word rate and n-gram perplexity of texts against
    their sources (text_metrics.py)."""
    known = run.known_words
    decoded_words = [words(g) for g in generated]
    out = {
        "exact_match": sum(g == s for g, s in zip(generated, sources)) / len(generated),
        "word_f1": float(np.mean([word_f1(w, words(s)) for w, s in zip(decoded_words, sources)])),
        "bleu": tm.bleu(generated, sources),
        "repetition": tm.repetition(generated, 2) or 0.0,  # None: no text has a bigram, so none repeats
        "real_word_rate": sum(w in known for ws in decoded_words for w in ws)
        / max(1, sum(len(ws) for ws in decoded_words)),
    }
    if fluency is not None:
        out["ngram_perplexity"] = fluency.perplexity(generated)
    return out


def joint_generation(
    run: TrainedRun,
    options: SamplingOptions,
    num_samples: int,
    batch_size: int,
    seed: int = 0,
    fluency: tm.NgramReference | None = None,
    num_examples: int = 5,
) -> dict:
    """Joint samples at lengths drawn from the validation split: consistency (cosine of each text's
    re-encoding to its own sampled latent), repetition, distinct-1/2, copy rate against the training
    texts, n-gram perplexity."""
    sampler = run.sampler(options)
    lengths = run.sample_lengths(num_samples, _generator(seed, 3))
    texts, latents = [], []
    start = time.perf_counter()
    for b in range(0, num_samples, batch_size):
        batch_texts, z = run.joint_batch(sampler, lengths[b : b + batch_size], _generator(seed, 4, b))
        texts += batch_texts
        latents.append(z)
    seconds = time.perf_counter() - start
    latents = torch.cat(latents)
    fidelity = latent_fidelity(run, latents)
    consistency = F.cosine_similarity(run.encode_latents(texts).flatten(1), latents.flatten(1), dim=-1)
    out = {
        "num_samples": num_samples,
        "consistency": consistency.mean().item(),
        "repetition": tm.repetition(texts, 2) or 0.0,
        "distinct_1": tm.distinct(texts, 1) or 0.0,
        "distinct_2": tm.distinct(texts, 2) or 0.0,
        "samples_per_s": num_samples / seconds,
        "latent_fidelity": fidelity,
        "examples": [{"generated": t, "consistency": round(c, 4)} for t, c in zip(texts, consistency.tolist())][
            :num_examples
        ],
    }
    if run.dataset_dir is not None:
        out["copy_rate"] = tm.copy_rate(texts, dataset_texts(str(run.dataset_dir), "train"))
    if fluency is not None:
        out["ngram_perplexity"] = fluency.perplexity(texts)
    return out


@functools.lru_cache(maxsize=2)
def _ngram_lm(dataset_dir: str, split: str) -> tm.NgramReference:
    return tm.NgramReference.fit(list(dataset_texts(dataset_dir, split)))


def fluency_reference(run: TrainedRun) -> tm.NgramReference | None:
    """The n-gram model fitted on the training texts alone: the run's training split, or, for an exported
    model evaluated on the validation split of a prepared dataset, that dataset's training split; None
    when no training text is at hand (the evaluated texts themselves are never fitted)."""
    if run.dataset_dir is not None:
        return _ngram_lm(str(run.dataset_dir), "train")
    if getattr(run.val, "split", None) == "val":
        return _ngram_lm(str(run.val.path), "train")
    return None


def t2l_retrieval(
    run: TrainedRun, options: SamplingOptions, num_samples: int, batch_size: int, pool_size: int = 1000, seed: int = 0
) -> dict:
    """Latents from the first N validation texts vs. the true latents (module docstring, 3): cosine and
    retrieval of the posterior mean (latent_sampler "mean", t2l as an encoder), the fidelity and speed of
    the latents `options` sample."""
    _, pool = _first_val(run, max(pool_size, num_samples))
    ids = _first_val(run, num_samples)[0]
    means, _ = t2l_latents(run, dataclasses.replace(options, latent_sampler="mean"), ids, batch_size, seed)
    sampled, seconds = t2l_latents(run, options, ids, batch_size, seed)
    means = means.flatten(1)  # (N, K*D)
    pool = pool.flatten(1)  # (P, K*D), P >= N: sample i is pool row i
    cosine = F.cosine_similarity(means, pool[: len(ids)], dim=-1)
    similarity = F.normalize(means, dim=-1) @ F.normalize(pool, dim=-1).T  # (N, P)
    hits = similarity.argmax(dim=1) == torch.arange(len(ids))
    return {
        "num_samples": len(ids),
        "cosine_mean": cosine.mean().item(),
        "retrieval_at_1": hits.float().mean().item(),
        "retrieval_latents": "posterior mean",
        "pool_size": pool.shape[0],
        "samples_per_s": len(ids) / seconds,
        "latent_fidelity": latent_fidelity(run, sampled),
    }


def t2l_latents(
    run: TrainedRun, options: SamplingOptions, ids: list[list[int]], batch_size: int, seed: int
) -> tuple[torch.Tensor, float]:
    """(latents (N, K, D) t2l samples for the texts `ids`, on the CPU; the seconds it took)."""
    sampler = run.sampler(options)
    generated = []
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        tokens, pad_mask = run.batch_of(ids[b : b + batch_size])
        generated.append(sampler.t2l(tokens, pad_mask, _generator(seed, 2, b)).cpu())
    return torch.cat(generated), time.perf_counter() - start


def latent_fidelity(run: TrainedRun, generated: torch.Tensor) -> dict | None:
    """The fidelity figures (latent_fidelity.py) of generated latents (N, K, D) in encoder space against
    the first validation latents, in the standardised space, beside two disjoint sets of real latents
    at the same N (N is cut to half the validation split when it has fewer than 2N); None below N = 2."""
    n = min(len(generated), len(run.val) // 2)
    if n < 2:
        return None
    _, real = _first_val(run, 2 * n)
    standard = lambda x: run.latent.standardize(x.float()).flatten(1).double().numpy()  # noqa: E731
    return lf.fidelity(standard(generated[:n].cpu()), standard(real[:n]), standard(real[n : 2 * n]))


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


def references(run: TrainedRun, num_samples: int, pool_size: int, fluency: tm.NgramReference | None = None) -> dict:
    """What trivial predictors and real text score on the same samples (module docstring, 5)."""
    ids, targets = _first_val(run, num_samples)
    targets = targets.flatten(1)  # (N, K*D), encoder space
    mean = run.latent.mean
    out = {"chance_retrieval_at_1": 1.0 / min(pool_size, len(run.val))}
    if mean is not None:
        constant = mean.float().repeat(run.model.cfg.num_latents)[None, :]  # (1, K*D)
        out["mean_latent_cosine"] = F.cosine_similarity(constant, targets, dim=-1).mean().item()
    texts = run.decode(*run.batch_of(ids))
    out["real_repetition"] = tm.repetition(texts, 2) or 0.0
    if len(targets) > 1:
        others = texts[1:] + texts[:1]
        out["other_sentence_cosine"] = F.cosine_similarity(targets.roll(-1, dims=0), targets, dim=-1).mean().item()
        out["other_sentence_word_f1"] = float(np.mean([word_f1(words(a), words(b)) for a, b in zip(others, texts)]))
        out["other_sentence_bleu"] = tm.bleu(others, texts)
    if fluency is not None:
        out["real_ngram_perplexity"] = fluency.perplexity(texts)
        out["shuffled_ngram_perplexity"] = fluency.perplexity(tm.shuffled_words(texts))
    return out


def nearest_training_text(run: TrainedRun, num_samples: int) -> dict | None:
    """The l2t reference of retrieval: for each validation latent, the training text whose latent is
    nearest (cosine); its word F1, BLEU and exact match against the source, and that cosine. A decoder
    that writes no better than this could be a lookup table. None without the run's training split."""
    if run.dataset_dir is None:
        return None
    ids, targets = _first_val(run, num_samples)
    train = PreparedDataset(run.dataset_dir, "train")
    pool = torch.from_numpy(np.concatenate([latents for *_, latents in train.arrays]).astype(np.float32))
    pool = pool.flatten(1)  # (T, K*D), in sample order
    similarity = F.normalize(targets.flatten(1), dim=-1) @ F.normalize(pool, dim=-1).T  # (N, T)
    best = similarity.max(dim=1)
    nearest = [dataset_texts(str(run.dataset_dir), "train")[i] for i in best.indices.tolist()]
    sources = run.decode(*run.batch_of(ids))
    return {
        "word_f1": float(np.mean([word_f1(words(a), words(b)) for a, b in zip(nearest, sources)])),
        "bleu": tm.bleu(nearest, sources),
        "exact_match": sum(a == b for a, b in zip(nearest, sources)) / len(sources),
        "cosine_mean": best.values.mean().item(),
    }


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
    with the budget of `cfg`; the samplers once per guidance scale (default: options.guidance_scale);
    with cfg.writing also the writing figures (`writing`)."""
    if options is None:  # evaluation during training: what the model writes alone, without the encoder's help
        options = SamplingOptions.defaults(run.cfg.text_diffusion, run.cfg.latent_diffusion, cfg.num_steps)
        options = dataclasses.replace(options, best_of=1, correction_rounds=0)
    scales = list(guidance_scales) if guidance_scales else [options.guidance_scale]
    was_training = run.model.training
    run.model.eval()
    try:
        fluency = fluency_reference(run) if cfg.writing else None
        report = {
            "checkpoint": str(run.checkpoint) if run.checkpoint else None,
            "step": run.step,
            "weights": run.weights,
            "sampling": dataclasses.replace(options, guidance_scale=scales[0]).to_dict(),
            "num_t_draws": num_t_draws,
            "elbo": elbo(run, cfg.num_elbo_batches * cfg.batch_size, cfg.batch_size, num_t_draws, seed),
            **guidance_sweep(run, cfg, options, scales, seed, fluency),
        }
        length = length_prediction(run, cfg.num_samples)
        if length is not None:
            report["length"] = length
        if cfg.writing:
            report.update(writing(run, cfg, dataclasses.replace(options, guidance_scale=scales[0]), seed, fluency))
        report["references"] = references(run, cfg.num_samples, cfg.retrieval_pool, fluency)
        if cfg.writing and fluency is None:
            report["references"]["ngram_perplexity"] = "not measured: no training texts at hand"
    finally:
        run.model.train(was_training)
    return report


def guidance_sweep(run: TrainedRun, cfg: EvalConfig, options, scales: list[float], seed: int, fluency) -> dict:
    """{"l2t", "t2l"} at the first guidance scale, and {"guidance": [...]} side by side when several."""
    sweep = []
    for scale in scales:
        scaled = dataclasses.replace(options, guidance_scale=scale)
        l2t = l2t_reconstruction(run, scaled, cfg.num_samples, cfg.batch_size, seed, cfg.encoder, fluency=fluency)
        t2l = t2l_retrieval(run, scaled, cfg.num_samples, cfg.batch_size, cfg.retrieval_pool, seed)
        sweep.append({"guidance_scale": scale, "l2t": l2t, "t2l": t2l})
    out = {"l2t": sweep[0]["l2t"], "t2l": sweep[0]["t2l"]}
    if len(sweep) > 1:
        kept = ("cosine_mean", "exact_match", "word_f1", "bleu", "repetition", "real_word_rate")
        out["guidance"] = [
            {
                "guidance_scale": entry["guidance_scale"],
                "l2t": {k: v for k, v in entry["l2t"].items() if k in kept},
                "t2l": {k: entry["t2l"][k] for k in ("cosine_mean", "retrieval_at_1")},
            }
            for entry in sweep
        ]
    return out


def writing(run: TrainedRun, cfg: EvalConfig, options: SamplingOptions, seed: int, fluency) -> dict:
    """l2t at the length head's lengths (where the model has a length head), joint generation (where the
    encoder is used) and the nearest-training-text reference."""
    out = {}
    if getattr(run.model, "length_head", None) is not None:
        out["l2t_predicted_length"] = l2t_reconstruction(
            run, options, cfg.num_samples, cfg.batch_size, seed, cfg.encoder, predicted_length=True, fluency=fluency
        )
    if cfg.encoder:
        out["joint"] = joint_generation(run, options, cfg.num_samples, cfg.batch_size, seed, fluency)
        out["joint"]["reference"] = pair_consistency(run, cfg.num_samples)
    nearest = nearest_training_text(run, cfg.num_samples)
    if nearest is not None:
        out["nearest_training_text"] = nearest
    return out


def pair_consistency(run: TrainedRun, num_samples: int) -> dict:
    """The joint consistency of real validation pairs (each text re-encoded against its own stored
    latent) and of shuffled pairs (against the next sample's latent)."""
    ids, latents = _first_val(run, num_samples)
    encoded = run.encode_latents(run.decode(*run.batch_of(ids))).flatten(1)
    latents = latents.flatten(1)
    return {
        "real_pairs": F.cosine_similarity(encoded, latents, dim=-1).mean().item(),
        "shuffled_pairs": F.cosine_similarity(encoded, latents.roll(-1, dims=0), dim=-1).mean().item(),
    }


def flat(report: dict) -> dict:
    """The report's numbers as eval_* keys (for metrics.jsonl): eval_elbo_l2t_text_nats_per_token, ..."""
    out = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}_{key}", value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{prefix}_{key}"] = value

    parts = ("elbo", "l2t", "t2l", "length", "references", "l2t_predicted_length", "joint", "nearest_training_text")
    walk("eval", {k: report[k] for k in parts if k in report})
    return out


def table_cell(text: str) -> str:
    """`text` as one markdown table cell: no line breaks, no bare column separator."""
    return " ".join(text.split()).replace("|", "\\|")


def _figures(r: dict) -> str:
    """BLEU, repetition and n-gram perplexity of one l2t entry, as a clause."""
    text = f"BLEU {r['bleu']:.1f}, repetition {r['repetition']:.3f}" if "bleu" in r else ""
    if "ngram_perplexity" in r:
        text += f", n-gram perplexity {r['ngram_perplexity']:.1f}"
    return text


def writing_lines(report: dict) -> list[str]:
    """The writing figures beside their references, in a few lines of markdown."""
    ref, l2t = report.get("references", {}), report["l2t"]
    lines = ["", f"l2t writing at the source lengths: {_figures(l2t)}"]
    if "real_repetition" in ref:
        real = f"real validation texts: repetition {ref['real_repetition']:.3f}"
        if "real_ngram_perplexity" in ref:
            real += (
                f", n-gram perplexity {ref['real_ngram_perplexity']:.1f} "
                f"(their words shuffled: {ref['shuffled_ngram_perplexity']:.1f})"
            )
        lines += [
            "",
            real
            + (
                f"; an unrelated sentence: BLEU {ref['other_sentence_bleu']:.1f}"
                if "other_sentence_bleu" in ref
                else ""
            ),
        ]
    if "l2t_predicted_length" in report:
        r = report["l2t_predicted_length"]
        lines += [
            "",
            f"l2t at the length head's lengths (what `decode` gives): exact match {r['exact_match']:.1%}, "
            f"word F1 {r['word_f1']:.3f}, {_figures(r)}"
            + (f", cosine {r['cosine_mean']:.4f}" if "cosine_mean" in r else ""),
        ]
    if "nearest_training_text" in report:
        r = report["nearest_training_text"]
        lines += [
            "",
            f"reference, the training text with the nearest latent: word F1 {r['word_f1']:.3f}, BLEU {r['bleu']:.1f}, "
            f"exact match {r['exact_match']:.1%}, cosine {r['cosine_mean']:.4f}",
        ]
    if "joint" in report:
        j, pairs = report["joint"], report["joint"]["reference"]
        lines += [
            "",
            f"joint ({j['num_samples']} samples): consistency {j['consistency']:.4f} (real pairs "
            f"{pairs['real_pairs']:.4f}, shuffled pairs {pairs['shuffled_pairs']:.4f}), repetition "
            f"{j['repetition']:.3f}, distinct-1/2 {j['distinct_1']:.3f}/{j['distinct_2']:.3f}"
            + (f", copy rate {j['copy_rate']:.1%}" if "copy_rate" in j else "")
            + (f", n-gram perplexity {j['ngram_perplexity']:.1f}" if "ngram_perplexity" in j else ""),
            "",
            "| joint sample | consistency |",
            "|---|---|",
            *[f"| {table_cell(e['generated'])} | {e['consistency']:.3f} |" for e in j["examples"]],
        ]
    return lines


def fidelity_lines(report: dict) -> list[str]:
    """The "latent fidelity" section: t2l's and joint generation's latents against real ones."""
    rows = [(mode, report[mode]["latent_fidelity"]) for mode in ("t2l", "joint") if mode in report]
    rows = [(mode, f) for mode, f in rows if f is not None]
    if not rows:
        return []
    lines = [
        "",
        f"Latent fidelity (standardised space, {rows[0][1]['dims']} dims; each generated set against as many "
        "real validation latents, and real against another disjoint real set of the same size; k-NN precision "
        f"and recall at k = {rows[0][1]['k']}):",
        "",
        "| latents | n | Fréchet distance (real vs real) | precision (real) | recall (real) | std ratio median "
        "[min, max] | spread (real) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in rows:
        lines.append(
            f"| {name} | {f['num_samples']} | {f['frechet_distance']:.1f} ({f['frechet_distance_real_vs_real']:.1f}) "
            f"| {f['precision']:.2f} ({f['precision_real_vs_real']:.2f}) | {f['recall']:.2f} "
            f"({f['recall_real_vs_real']:.2f}) | {f['std_ratio_median']:.2f} [{f['std_ratio_min']:.2f}, "
            f"{f['std_ratio_max']:.2f}] | {f['spread']:.1f} ({f['spread_real']:.1f}) |"
        )
    if any(f["num_samples"] <= f["dims"] for _, f in rows):
        lines += [
            "",
            "With n at most the dimension the covariances are mostly estimation noise, and a narrower sample has "
            "less of it: read the std ratio and the spread before the Fréchet distance (docs/quality.md).",
        ]
    return lines


def markdown(report: dict) -> str:
    """A short human summary of the report."""
    lines = [
        f"# Evaluation of {report['checkpoint']} (step {report['step']}, {report['weights']} weights)",
        "",
        f"Sampling: {report['sampling']}",
        "",
        'Likelihood bounds (upper bounds; "with length" pays for the length, comparable to an autoregressive '
        "perplexity that pays for its end of text):",
        "",
        "| mode | text nats/token given length | nats/token with length | nats/text with length | "
        "length nats/text | perplexity bound with length | latent loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["elbo"].items():
        cell = lambda k, f, r=r: format(r[k], f) if k in r else "-"  # noqa: E731
        lines.append(
            f"| {mode} | {cell('text_nats_per_token_given_length', '.4f')} | "
            f"{cell('nats_per_token_with_length', '.4f')} | {cell('nats_per_text', '.2f')} | "
            f"{cell('length_nats_per_text', '.2f')} | {cell('ppl_bound_with_length', '.2f')} | "
            f"{cell('latent_loss', '.4f')} |"
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
        f"t2l ({t2l['num_samples']} validation texts, the posterior mean): mean cosine to the true latent "
        f"{t2l['cosine_mean']:.4f}"
        f"{reference('mean_latent_cosine', 'the training-set mean latent:')}, "
        f"retrieval@1 among {t2l['pool_size']} {t2l['retrieval_at_1']:.1%}{chance}, "
        f"{t2l['samples_per_s']:.1f} samples/s",
    ]
    lines += writing_lines(report)
    lines += fidelity_lines(report)
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
