"""Evaluation of a trained run on its validation split: likelihood bounds, reconstructions, retrieval.

1. ELBO per mode: the training objective itself (`Objective`, forced to one mode, no condition
   dropping) on validation batches, averaged over `num_t_draws` draws of t and noise per batch; the
   text's times importance-sampled and stratified by draw (`importance_times`).
   The text term is MDLM's NELBO (whatever text_diffusion.loss trained with) with its prior and
   reconstruction terms (masked.py), per text. Given the true length it bounds -log p(x | L, latent)
   (`text_nats_per_token_given_length`, also under the older key `text_nats_per_token`). The length
   is then paid for (`length_nats_per_text`): in l2t by the length head, -log p_head(L | latent) over
   the lengths 1..max_length (a model without a head: as joint); in joint by -log p(L) under the
   validation split's length distribution, the one joint generation draws from (fitted on the same
   split, so slightly optimistic). `nats_per_text` and `nats_per_token_with_length` bound
   -log p(x | latent) in l2t; in joint they are the text term of the joint loss (the text given a
   noised copy of its own latent, at the latent's own t) with the length paid, which bounds no
   marginal -log p(x). bits = nats / ln 2; exp(nats per token) bounds the perplexity from above.
   Per token divides by a text's T tokens; `nats_per_token_with_end` divides by T + 1, as an
   autoregressive model that pays for its end-of-text token does (the length term plays that role):
   that is the l2t figure to set beside such a model given the same embedding. Every bound is of the
   continuous-time model at temperature 1, not of a tuned decoder. `largest_draw_share` is the largest
   share of the total held by one text-draw.
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
   the spread, each beside real latents against a disjoint real set of the same size. t2l's latents
   are paired with their texts' own latents (perfect: distance 0), so the constant training-mean
   latent stands beside them too.
7. Speed: samples per second of each sampler at the given step count (one measurement, noisy on a
   shared machine).
With several guidance scales, 2. and 3. are repeated per scale (`guidance`); the l2t and t2l entries
hold the first scale's figures.
7. Intervals: every figure is a statistic of per-text values (a mean, a ratio such as nats per token, or
   a figure of the texts as a whole such as corpus BLEU); each section keeps those values (`per_text`),
   and each figure `name` has `name_interval` [low, high], the 95% percentile bootstrap over the section's
   `num_samples` texts, each with its `num_t_draws` draws for the ELBO (intervals.py). `SECTIONS`
   names the recipe of every figure; `mmldlm compare` applies the same recipes to two reports, paired.
8. Selection: a decoder that keeps the candidate whose re-encoding is closest to the target (best_of > 1,
   correction rounds) maximises the l2t cosine and the joint consistency over its candidates. Those
   figures are labelled (`selected_on`) and measured again without selection (`l2t_without_selection`,
   `joint_without_selection`); word F1, exact match, BLEU and fluency, which no decoder selects on, are
   the headline of such a decoder.
The report is a JSON-able dict; `markdown` renders it, `flat` turns it into eval_* metric keys.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from mmldlm import progress
from mmldlm.config import EvalConfig
from mmldlm.data.dataset import PadCollate, PreparedDataset
from mmldlm.diffusion import MaskedDiffusion
from mmldlm.evaluation import latent_fidelity as lf
from mmldlm.evaluation import text_metrics as tm
from mmldlm.evaluation.intervals import MIN_TEXTS, Corpus, Mean, Rate
from mmldlm.evaluation.text_metrics import word_f1, words
from mmldlm.objective import Objective
from mmldlm.runs.trained import TrainedRun, dataset_texts
from mmldlm.sampling.sampler import SamplingOptions, length_masks

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
# Figures with intervals: each section keeps its per-text values, and a recipe per figure (intervals.py)
# says how the figure is made from them.


def _bleu(key: str) -> Corpus:
    def statistic(per_text: dict):
        rows = np.asarray(per_text[key], dtype=np.float64)
        return lambda idx: tm.bleu_of_statistics(rows[idx])

    return Corpus((key,), statistic)


def _perplexity(bits: str, counts: str) -> Corpus:
    def statistic(per_text: dict):
        b, c = np.asarray(per_text[bits], dtype=np.float64), np.asarray(per_text[counts], dtype=np.float64)
        return lambda idx: tm.perplexity_of(b[idx], c[idx])

    return Corpus((bits, counts), statistic)


def _distinct(n: int, key: str = "texts") -> Corpus:
    def statistic(per_text: dict):
        grams = [tm.word_ngrams(text, n) for text in per_text[key]]
        return lambda idx: tm.distinct_of([grams[i] for i in idx]) or 0.0

    return Corpus((key,), statistic, resampled=False)


ELBO = {
    "text_nats_per_token": Mean("text_nats", "num_tokens"),
    "nats_per_token_with_length": Mean("nats_with_length", "num_tokens"),
    "nats_per_token_with_end": Mean("nats_with_end", "num_tokens_with_end"),
    "nats_per_text": Mean("nats_per_text"),
    "length_nats_per_text": Mean("length_nats"),
    "latent_loss": Mean("latent_loss"),
}
L2T = {
    "exact_match": Rate("exact"),
    "word_f1": Mean("word_f1"),
    "bleu": _bleu("bleu_statistics"),
    "repetition": Mean("repetition", "has_bigram"),
    "real_word_rate": Mean("real_word_share", "num_words"),
    "ngram_perplexity": _perplexity("ngram_bits", "ngram_words"),
    "cosine_mean": Mean("cosine"),
}
T2L = {"cosine_mean": Mean("cosine"), "retrieval_at_1": Rate("hit")}
LENGTH = {"accuracy": Rate("correct"), "mean_abs_error": Mean("abs_error")}
JOINT = {
    "consistency": Mean("consistency"),
    "repetition": Mean("repetition", "has_bigram"),
    "distinct_1": _distinct(1),
    "distinct_2": _distinct(2),
    "copy_rate": Rate("copied"),
    "ngram_perplexity": _perplexity("ngram_bits", "ngram_words"),
}
PAIRS = {"real_pairs": Mean("real_pairs"), "shuffled_pairs": Mean("shuffled_pairs")}
NEAREST = {
    "word_f1": Mean("word_f1"),
    "bleu": _bleu("bleu_statistics"),
    "exact_match": Rate("exact"),
    "cosine_mean": Mean("cosine"),
}
REFERENCES = {
    "mean_latent_cosine": Mean("mean_latent_cosine"),
    "real_repetition": Mean("real_repetition", "real_has_bigram"),
    "real_distinct_1": _distinct(1, "real_texts"),  # distinct-n grows as n falls: joint's at the same n
    "real_distinct_2": _distinct(2, "real_texts"),
    "other_sentence_cosine": Mean("other_sentence_cosine"),
    "other_sentence_word_f1": Mean("other_sentence_word_f1"),
    "other_sentence_bleu": _bleu("other_sentence_bleu_statistics"),
    "real_ngram_perplexity": _perplexity("real_ngram_bits", "real_ngram_words"),
    "shuffled_ngram_perplexity": _perplexity("shuffled_ngram_bits", "shuffled_ngram_words"),
}
# The report's sections with per-text values, by key, and the figures of each.
SECTIONS = {
    "l2t": L2T,
    "l2t_without_selection": L2T,
    "l2t_predicted_length": L2T,
    "t2l": T2L,
    "length": LENGTH,
    "joint": JOINT,
    "joint_without_selection": JOINT,
    "nearest_training_text": NEAREST,
    "references": REFERENCES,
}


def summarise(figures: dict, per_text: dict, **fixed) -> dict:
    """A report section: `fixed` entries, then each figure of `figures` whose per-text values are at
    hand as `name` and `name_interval` [low, high] (95% bootstrap over the texts, each with its draws
    for 2-D values; intervals.py), and the per-text values themselves under `per_text` (`mmldlm compare` reads them)."""
    out = dict(fixed)
    for name, recipe in figures.items():
        if all(key in per_text for key in recipe.keys):
            estimate = recipe.estimate(per_text)
            out[name] = estimate.value
            if math.isfinite(estimate.low) and math.isfinite(estimate.high):
                out[f"{name}_interval"] = [estimate.low, estimate.high]
    out["per_text"] = {key: np.asarray(v).tolist() if not _is_texts(v) else list(v) for key, v in per_text.items()}
    return out


def _is_texts(values) -> bool:
    return isinstance(values, list) and bool(values) and isinstance(values[0], str)


def sections(report: dict) -> list[tuple[str, dict, dict]]:
    """(name, section, figures) of every section of `report` that keeps per-text values."""
    out = [(f"elbo {mode}", entry, ELBO) for mode, entry in report.get("elbo", {}).items() if "per_text" in entry]
    out += [(key, report[key], figures) for key, figures in SECTIONS.items() if "per_text" in report.get(key, {})]
    if "per_text" in report.get("joint", {}).get("reference", {}):
        out.append(("joint reference", report["joint"]["reference"], PAIRS))
    return out


def selection(options: SamplingOptions, length_candidates: bool = False) -> str | None:
    """What a decoder with `options` selects its texts by, in words (the re-encoded cosine to the
    target, or a joint sample's consistency, is then its maximum over the candidates); None when it
    keeps the sampler's one text. `length_candidates`: the lengths are candidates too (l2t at the
    length head's lengths)."""
    parts = []
    lengths = options.length_candidates if length_candidates else 1
    if options.best_of * lengths > 1:
        each = f" ({options.best_of} at each of {lengths} lengths)" if options.best_of > 1 and lengths > 1 else ""
        parts.append(f"max over {options.best_of * lengths} candidates{each}")
    if options.correction_rounds > 0:
        parts.append(f"{options.correction_rounds} correction rounds kept where the cosine rose")
    return ", ".join(parts) or None


# --------------------------------------------------------------------------------------------------
# 1. ELBO


def eval_objective(run: TrainedRun, mode: str) -> Objective:
    """The training objective in one mode, with the MDLM ELBO as its text loss, no condition dropping,
    and each sample's loss among its metrics."""
    text = MaskedDiffusion(
        dataclasses.replace(run.text.cfg, loss="elbo"), run.text.mask_token_id, run.text.pad_token_id
    )
    cfg = dataclasses.replace(run.cfg.objective, mode=mode, cond_drop_prob=0.0)
    return Objective(
        cfg,
        text,
        run.latent,
        self_condition=run.cfg.model.self_condition,
        length_head=run.cfg.model.length_head,
        per_sample=True,
    )


def _elbo_per_text(run: TrainedRun, objective: Objective, m: int, num_samples, batch_size, num_t_draws, seed):
    """Per-text values of one mode's objective: text_nats (N, draws), the NELBO given the length per token
    with the prior term; length_nats (N,), -log p(L) (`length_cost`); nats_with_length (N, draws), both per
    token; nats_per_text (N, draws), both per text; num_tokens (N,); latent_loss (N, draws)."""
    text, tokens, lengths, latent = [], [], [], []
    prior = _prior_nats_per_token(run)
    for b, batch in enumerate(val_batches(run, num_samples, batch_size)):
        batch = {k: v.to(run.device) for k, v in batch.items()}
        draws, weights = [], []
        for d in range(num_t_draws):
            generator = _generator(seed, m, b, d)
            t_text, weight = importance_times(batch["tokens"].shape[0], d, num_t_draws, generator)
            draws.append(objective(run.model, batch, step=0, generator=generator, t_text=t_text)[1])
            weights.append(weight)
        if "nats_per_sample" in draws[0]:
            count = draws[0]["num_tokens_per_sample"].float().clamp_min(1).cpu()
            nats = [d["nats_per_sample"].cpu() * w / count for d, w in zip(draws, weights)]
            text.append(torch.stack(nats, dim=1) + prior)  # (B, draws)
            tokens.append(count.cpu())
            lengths.append(length_cost(run, objective.cfg.mode, batch))
        if "latent_loss_per_sample" in draws[0]:
            latent.append(torch.stack([d["latent_loss_per_sample"] for d in draws], dim=1).cpu())
        progress.advance(batch["tokens"].shape[0] * num_t_draws)
    per_text = {}
    if text:
        text_nats, num_tokens, length_nats = torch.cat(text).double(), torch.cat(tokens).double(), torch.cat(lengths)
        per_text.update(
            text_nats=text_nats.numpy(),
            length_nats=length_nats.numpy(),
            nats_with_length=(text_nats + (length_nats / num_tokens)[:, None]).numpy(),
            nats_per_text=(text_nats * num_tokens[:, None] + length_nats[:, None]).numpy(),
            num_tokens=num_tokens.numpy(),
        )
        # An autoregressive model that pays for its end-of-text token divides a text's nats by T + 1.
        per_text["nats_with_end"] = per_text["nats_per_text"] / (num_tokens.numpy() + 1.0)[:, None]
        per_text["num_tokens_with_end"] = num_tokens.numpy() + 1.0
    if latent:
        per_text["latent_loss"] = torch.cat(latent).numpy()
    return per_text


def importance_times(batch_size: int, draw: int, num_draws: int, generator: torch.Generator):
    """(t (B,) float32, weight (B,) float64): the text's times of draw `draw` of `num_draws` per text, and
    the weight that keeps the bound's estimate unbiased. The bound integrates f(t) over t in [0, 1], f
    weighted 1/t: a uniform t rarely lands near 0, and when it does with a masked token one draw holds
    a large share of the total. Drawn as t = u^2, density q(t) = 1 / (2 sqrt(t)), weight 1 / q(t) = 2u
    (E_q[f(t) 2u] = the integral of f), u stratified by draw (draw d of D in [d/D, (d+1)/D)): more
    draws where the weight 1/t is large, each worth less."""
    u = (draw + torch.rand(batch_size, generator=generator, dtype=torch.float64)) / num_draws
    return (u**2).float(), 2.0 * u


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
    latent_loss}} (module docstring, 1), each with its interval over the texts and the draws of t."""
    out = {}
    for m, mode in enumerate(modes):
        per_text = _elbo_per_text(run, eval_objective(run, mode), m, num_samples, batch_size, num_t_draws, seed)
        n = len(next(iter(per_text.values())))
        result = summarise(ELBO, per_text, num_samples=n)
        if "text_nats_per_token" in result:
            result.update(_bound_figures(result))
            result["largest_draw_share"] = largest_share(per_text["nats_per_text"])
            result.update(prior_nats_per_token=_prior_nats_per_token(run), num_tokens=int(per_text["num_tokens"].sum()))
            result["num_texts"] = n
        out[mode] = result
    return out


def _bound_figures(result: dict) -> dict:
    """The bound in bits and as a perplexity, given the length and with the length paid, from the nats per
    token of `result` (and their intervals where it has them: a resample that was not finite has none)."""
    nats, paid = result["text_nats_per_token"], result["nats_per_token_with_length"]
    out = {
        "text_nats_per_token_given_length": nats,
        "text_bits_per_token": nats / math.log(2),
        "text_ppl_bound": math.exp(min(nats, 700.0)),
        "bits_per_token_with_length": paid / math.log(2),
    }
    if "text_nats_per_token_interval" in result:
        low, high = result["text_nats_per_token_interval"]
        out["text_nats_per_token_given_length_interval"] = [low, high]
        out["text_bits_per_token_interval"] = [low / math.log(2), high / math.log(2)]
        out["text_ppl_bound_interval"] = [math.exp(min(low, 700.0)), math.exp(min(high, 700.0))]
    for per_token, ppl in (
        ("nats_per_token_with_length", "ppl_bound_with_length"),
        ("nats_per_token_with_end", "ppl_bound_with_end"),
    ):
        if per_token in result:
            out[ppl] = math.exp(min(result[per_token], 700.0))
        if f"{per_token}_interval" in result:
            low, high = result[f"{per_token}_interval"]
            out[f"{ppl}_interval"] = [math.exp(min(low, 700.0)), math.exp(min(high, 700.0))]
    return out


def largest_share(nats_per_text) -> float:
    """The largest share of the total bound held by one text-draw, nats_per_text (n, draws): a bound
    estimated by draws of t weighted 1/t can rest on one draw at a small t, and its interval then on
    whether a resample holds that draw."""
    nats = np.asarray(nats_per_text, dtype=np.float64)
    return float(nats.max() / nats.sum()) if nats.sum() > 0 else math.nan


def length_cost(run: TrainedRun, mode: str, batch: dict) -> torch.Tensor:
    """(B,) float64 nats: -log p(L) of each text's length (module docstring, 1): the length head's over
    1..max_length given the clean latent in l2t, else the validation split's length distribution."""
    lengths = batch["pad_mask"].sum(dim=1).clamp(1, run.max_length).cpu() - 1  # (B,) class index
    if mode == "l2t" and getattr(run.model, "length_head", None) is not None:
        logits = run.model.length_logits(run.latent.standardize(batch["latents"].float()))[:, : run.max_length]
        return -torch.log_softmax(logits.double(), dim=1).cpu().gather(1, lengths[:, None])[:, 0]
    # Add-one smoothed: a length the validation split lacks (other data, --data) costs log(N + max_length)
    # nats, not infinity; on the run's own split every length drawn has a count, and the smoothing moves
    # each cost by at most log(1 + max_length / N).
    counts = run.length_counts.double() + 1.0
    return -torch.log(counts / counts.sum())[lengths]


def _prior_nats_per_token(run: TrainedRun) -> float:
    """The bound's prior term per real token (MaskedDiffusion.prior_nats_per_token) at the model's V."""
    return run.text.prior_nats_per_token(run.cfg.model.vocab_size or run.val.vocab_size)


def elbo_with_progress(run: TrainedRun, num_samples: int, batch_size: int, num_t_draws: int, seed: int) -> dict:
    """`elbo` under one progress bar over every mode's samples and draws (mmldlm/progress.py)."""
    with progress.stage("ELBO", len(MODES) * min(num_samples, len(run.val)) * num_t_draws):
        return elbo(run, num_samples, batch_size, num_t_draws, seed)


# --------------------------------------------------------------------------------------------------
# 2.-3. sampling


def stage_name(name: str, options: SamplingOptions) -> str:
    """The progress bar's name of a sampling stage: with its guidance scale where guidance is on."""
    return f"{name}, guidance {options.guidance_scale:g}" if options.guidance_scale else name


def _first_val(run: TrainedRun, num: int) -> tuple[list[list[int]], torch.Tensor]:
    """Token ids (cut as in training) and latents (N, K, D) of the first `num` validation samples."""
    n = min(num, len(run.val))
    samples = [run.val[i] for i in range(n)]
    ids = [s[1][: run.max_length].tolist() for s in samples]
    return ids, torch.stack([torch.from_numpy(s[2].astype("float32")) for s in samples])


def texts_digest(run: TrainedRun, *counts: int) -> str:
    """sha256 of how many validation texts each part scored (`counts`), and of the first max(counts)
    texts (as decoded) and their latents: two reports with the same digest and seed scored the same texts."""
    ids, latents = _first_val(run, max(counts))
    digest = hashlib.sha256(repr([min(c, len(run.val)) for c in counts]).encode("utf-8"))
    digest.update("\n".join(run.decode(*run.batch_of(ids))).encode("utf-8"))
    digest.update(latents.numpy().tobytes())
    return digest.hexdigest()


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
    with progress.stage(stage_name("l2t, predicted lengths" if predicted_length else "l2t", options), len(ids)):
        for b in range(0, len(ids), batch_size):
            tokens, pad_mask = run.batch_of(ids[b : b + batch_size])
            if predicted_length:
                pad_mask = length_masks(run.candidate_lengths(latents[b : b + batch_size], options.length_candidates))
            out = sampler.l2t(latents[b : b + batch_size], pad_mask, _generator(seed, 1, b))
            sources += run.decode(tokens, tokens != run.text.pad_token_id)
            generated += run.decode(out, out != run.text.pad_token_id)
    seconds = time.perf_counter() - start
    per_text = writing_per_text(run, generated, sources, fluency)
    cosines = None
    if use_encoder:
        cosines = F.cosine_similarity(run.encode_latents(generated).flatten(1), latents.flatten(1), dim=-1)
        per_text["cosine"] = cosines.numpy()
    result = summarise(
        L2T,
        per_text,
        num_samples=len(ids),
        samples_per_s=len(ids) / seconds,
        model_calls_per_batch=sampler.num_forward / math.ceil(len(ids) / batch_size),
        encoded_per_sample=sampler.num_encoded / len(ids),
    )
    selected = selection(options, length_candidates=predicted_length)
    if use_encoder and selected:
        result["selected_on"] = {"cosine_mean": selected}
    result["examples"] = [
        {"source": s, "generated": g, **({"cosine": round(cosines[i].item(), 4)} if cosines is not None else {})}
        for i, (s, g) in enumerate(zip(_stored_texts(run, num_examples), generated[:num_examples]))
    ]
    return result


def _stored_texts(run: TrainedRun, num: int) -> list[str]:
    """The first `num` validation texts as stored, the words their latents came from: whole, where a text
    longer than the model reads is cut for sampling and for the figures."""
    return run.tokenizer.decode_batch([run.val[i][1].tolist() for i in range(min(num, len(run.val)))])


def known_words(run: TrainedRun) -> frozenset[str]:
    """The lowercase words of the run's training texts (the real-word rate of evaluation); for an
    exported model, which carries no texts, the words of the data it is evaluated on."""
    if run.dataset_dir is not None:
        return dataset_words(str(run.dataset_dir), "train")
    return dataset_words(str(run.val.path), run.val.split)


@functools.lru_cache(maxsize=4)
def dataset_words(dataset_dir: str, split: str) -> frozenset[str]:
    """The lowercase letter runs of every text of a split ("all": both) of a prepared dataset."""
    return frozenset(words(" ".join(dataset_texts(dataset_dir, split))))


def writing_per_text(run: TrainedRun, generated: list[str], sources: list[str], fluency=None) -> dict:
    """Per-text values of exact match, word F1, BLEU, repetition, real-word rate and n-gram perplexity
    of texts against their sources (text_metrics.py; the figures: `L2T`)."""
    known = known_words(run)
    decoded_words = [words(g) for g in generated]
    repetition = tm.repetition_per_text(generated, 2)
    out = {
        "exact": np.array([g == s for g, s in zip(generated, sources)], dtype=np.float64),
        "word_f1": np.array([word_f1(w, words(s)) for w, s in zip(decoded_words, sources)]),
        "bleu_statistics": tm.bleu_statistics(generated, sources),
        "repetition": np.array([r or 0.0 for r in repetition]),
        "has_bigram": np.array([r is not None for r in repetition], dtype=np.float64),
        "real_word_share": np.array([sum(w in known for w in ws) / max(1, len(ws)) for ws in decoded_words]),
        "num_words": np.array([len(ws) for ws in decoded_words], dtype=np.float64),
    }
    if fluency is not None:
        out["ngram_bits"], out["ngram_words"] = fluency.bits_per_text(generated)
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
    with progress.stage("joint", num_samples):
        for b in range(0, num_samples, batch_size):
            batch_texts, z = run.joint_batch(sampler, lengths[b : b + batch_size], _generator(seed, 4, b))
            texts += batch_texts
            latents.append(z)
    seconds = time.perf_counter() - start
    latents = torch.cat(latents)
    fidelity = latent_fidelity(run, latents)
    consistency = F.cosine_similarity(run.encode_latents(texts).flatten(1), latents.flatten(1), dim=-1)
    repetition = tm.repetition_per_text(texts, 2)
    per_text = {
        "consistency": consistency.numpy(),
        "repetition": np.array([r or 0.0 for r in repetition]),
        "has_bigram": np.array([r is not None for r in repetition], dtype=np.float64),
        "texts": texts,
    }
    if run.dataset_dir is not None:
        per_text["copied"] = np.array(tm.copied(texts, dataset_texts(str(run.dataset_dir), "train")), dtype=np.float64)
    if fluency is not None:
        per_text["ngram_bits"], per_text["ngram_words"] = fluency.bits_per_text(texts)
    out = summarise(JOINT, per_text, num_samples=num_samples, samples_per_s=num_samples / seconds)
    out["latent_fidelity"] = fidelity
    selected = selection(options)
    if selected:
        out["selected_on"] = {"consistency": selected}
    out["examples"] = [{"generated": t, "consistency": round(c, 4)} for t, c in zip(texts, consistency.tolist())][
        :num_examples
    ]
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
    out = summarise(
        T2L,
        {"cosine": cosine.numpy(), "hit": hits.double().numpy()},
        num_samples=len(ids),
        retrieval_latents="posterior mean",
        pool_size=pool.shape[0],
        samples_per_s=len(ids) / seconds,
    )
    out["latent_fidelity"] = latent_fidelity(run, sampled, paired=True)
    return out


def t2l_latents(
    run: TrainedRun, options: SamplingOptions, ids: list[list[int]], batch_size: int, seed: int
) -> tuple[torch.Tensor, float]:
    """(latents (N, K, D) t2l samples for the texts `ids`, on the CPU; the seconds it took)."""
    sampler = run.sampler(options)
    generated = []
    start = time.perf_counter()
    with progress.stage(stage_name("t2l", options), len(ids)):
        for b in range(0, len(ids), batch_size):
            tokens, pad_mask = run.batch_of(ids[b : b + batch_size])
            generated.append(sampler.t2l(tokens, pad_mask, _generator(seed, 2, b)).cpu())
    return torch.cat(generated), time.perf_counter() - start


def latent_fidelity(run: TrainedRun, generated: torch.Tensor, paired: bool = False) -> dict | None:
    """The fidelity figures (latent_fidelity.py) of generated latents (N, K, D) in encoder space against
    the first validation latents, in the standardised space, beside two disjoint sets of real latents
    at the same N (N is cut to half the validation split when it has fewer than 2N); None below N = 2.
    `paired`: row i was made from validation text i (t2l), whose latent is real row i."""
    n = min(len(generated), len(run.val) // 2)
    if n < 2:
        return None
    _, real = _first_val(run, 2 * n)
    standard = lambda x: run.latent.standardize(x.float()).flatten(1).double().numpy()  # noqa: E731
    return lf.fidelity(standard(generated[:n].cpu()), standard(real[:n]), standard(real[n : 2 * n]), paired=paired)


# --------------------------------------------------------------------------------------------------
# 4.-5. length and references


@torch.no_grad()
def length_prediction(run: TrainedRun, num_samples: int) -> dict | None:
    """The length head's argmax from the first N validation latents vs the lengths of their stored
    texts; None for a model without a length head. A text longer than the model reads has a length
    the head cannot name: such texts are counted apart ("num_over_max_length"), not scored, so that
    cutting them to the longest length never scores as exact."""
    if getattr(run.model, "length_head", None) is None:
        return None
    _, latents = _first_val(run, num_samples)
    predicted = torch.tensor(run.predict_lengths(latents))
    true = torch.tensor([max(len(run.val[i][1]), 1) for i in range(len(latents))])
    within = true <= run.max_length
    per_text = {
        "correct": (predicted == true)[within].double().numpy(),
        "abs_error": (predicted - true)[within].abs().double().numpy(),
    }
    fixed = {
        "num_samples": len(latents),
        "num_scored": int(within.sum()),
        "num_over_max_length": int((~within).sum()),
        "max_length": run.max_length,
    }
    if not within.any():
        return {**fixed, "accuracy": float("nan"), "mean_abs_error": float("nan")}
    return summarise(LENGTH, per_text, **fixed)


def references(run: TrainedRun, num_samples: int, pool_size: int, fluency: tm.NgramReference | None = None) -> dict:
    """What trivial predictors and real text score on the same samples (module docstring, 5)."""
    ids, targets = _first_val(run, num_samples)
    targets = targets.flatten(1)  # (N, K*D), encoder space
    mean = run.latent.mean
    per_text = {}
    if mean is not None:
        constant = mean.float().repeat(run.model.cfg.num_latents)[None, :]  # (1, K*D)
        per_text["mean_latent_cosine"] = F.cosine_similarity(constant, targets, dim=-1).numpy()
    texts = run.decode(*run.batch_of(ids))
    repetition = tm.repetition_per_text(texts, 2)
    per_text["real_repetition"] = np.array([r or 0.0 for r in repetition])
    per_text["real_has_bigram"] = np.array([r is not None for r in repetition], dtype=np.float64)
    per_text["real_texts"] = texts
    if len(targets) > 1:
        others = texts[1:] + texts[:1]
        per_text["other_sentence_cosine"] = F.cosine_similarity(targets.roll(-1, dims=0), targets, dim=-1).numpy()
        per_text["other_sentence_word_f1"] = np.array([word_f1(words(a), words(b)) for a, b in zip(others, texts)])
        per_text["other_sentence_bleu_statistics"] = tm.bleu_statistics(others, texts)
    if fluency is not None:
        per_text["real_ngram_bits"], per_text["real_ngram_words"] = fluency.bits_per_text(texts)
        shuffled = fluency.bits_per_text(tm.shuffled_words(texts))
        per_text["shuffled_ngram_bits"], per_text["shuffled_ngram_words"] = shuffled
    return summarise(
        REFERENCES, per_text, num_samples=len(ids), chance_retrieval_at_1=1.0 / min(pool_size, len(run.val))
    )


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
    per_text = {
        "word_f1": np.array([word_f1(words(a), words(b)) for a, b in zip(nearest, sources)]),
        "bleu_statistics": tm.bleu_statistics(nearest, sources),
        "exact": np.array([a == b for a, b in zip(nearest, sources)], dtype=np.float64),
        "cosine": best.values.numpy(),
    }
    return summarise(NEAREST, per_text, num_samples=len(ids))


# --------------------------------------------------------------------------------------------------
# The whole report.


def evaluate(
    run: TrainedRun,
    cfg: EvalConfig,
    options: SamplingOptions | None = None,
    num_t_draws: int = 1,
    seed: int = 0,
    guidance_scales: list[float] | None = None,
    num_elbo: int | None = None,
) -> dict:
    """ELBO per mode, l2t reconstruction, t2l retrieval, length prediction and the references of `run`
    with the budget of `cfg`; the samplers once per guidance scale (default: options.guidance_scale);
    with cfg.writing also the writing figures (`writing`). A decoder that selects its texts by the
    encoder is also run without selecting (`without_selection`). The ELBO scores `num_elbo` texts per
    mode (default cfg.num_elbo_batches batches of cfg.batch_size)."""
    if options is None:  # evaluation during training: what the model writes alone, without the encoder's help
        options = SamplingOptions.defaults(run.cfg.text_diffusion, run.cfg.latent_diffusion, cfg.num_steps)
        options = dataclasses.replace(options, best_of=1, correction_rounds=0)
    scales = list(guidance_scales) if guidance_scales else [options.guidance_scale]
    first = dataclasses.replace(options, guidance_scale=scales[0])
    was_training = run.model.training
    run.model.eval()
    try:
        if cfg.writing:
            progress.note("n-gram reference: fitting on the training texts")
        fluency = fluency_reference(run) if cfg.writing else None
        num_elbo = num_elbo or cfg.num_elbo_batches * cfg.batch_size
        report = {
            "checkpoint": str(run.checkpoint) if run.checkpoint else None,
            "step": run.step,
            "weights": run.weights,
            "sampling": first.to_dict(),
            "num_t_draws": num_t_draws,
            "seed": seed,
            "texts_sha256": texts_digest(run, num_elbo, cfg.num_samples, cfg.retrieval_pool),
            "elbo": elbo_with_progress(run, num_elbo, cfg.batch_size, num_t_draws, seed),
            **guidance_sweep(run, cfg, options, scales, seed, fluency),
        }
        length = length_prediction(run, cfg.num_samples)
        if length is not None:
            report["length"] = length
        if cfg.writing:
            report.update(writing(run, cfg, first, seed, fluency))
        report.update(without_selection(run, cfg, first, seed, fluency))
        progress.note("references: what trivial predictors and real text score")
        report["references"] = references(run, cfg.num_samples, cfg.retrieval_pool, fluency)
        if cfg.writing and fluency is None:
            report["references"]["ngram_perplexity"] = "not measured: no training texts at hand"
        if fluency is not None:  # what the n-gram perplexities were scored by (compare checks it)
            report["fluency_reference"] = {"num_texts": fluency.num_texts, "sha256": fluency.sha256}
    finally:
        run.model.train(was_training)
    return report


def without_selection(run: TrainedRun, cfg: EvalConfig, options: SamplingOptions, seed: int, fluency) -> dict:
    """Where the decoder selects by the encoder (best_of > 1, correction rounds), l2t (and, with
    cfg.writing, joint) once more with the sampler's one text: the cosine and consistency a selection
    did not choose (a selected figure is a maximum over candidates by construction)."""
    if not (cfg.encoder and selection(options)):
        return {}
    plain = dataclasses.replace(options, best_of=1, correction_rounds=0)
    out = {
        "l2t_without_selection": l2t_reconstruction(
            run, plain, cfg.num_samples, cfg.batch_size, seed, True, 0, fluency=fluency
        )
    }
    if cfg.writing:
        out["joint_without_selection"] = joint_generation(run, plain, cfg.num_samples, cfg.batch_size, seed, fluency, 0)
    return out


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
        kept = ("cosine_mean", "exact_match", "word_f1", "bleu", "repetition", "real_word_rate", "retrieval_at_1")
        shown = lambda entry: {k: v for k, v in entry.items() if k.removesuffix("_interval") in kept}  # noqa: E731
        out["guidance"] = [
            {"guidance_scale": entry["guidance_scale"], "l2t": shown(entry["l2t"]), "t2l": shown(entry["t2l"])}
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
    per_text = {
        "real_pairs": F.cosine_similarity(encoded, latents, dim=-1).numpy(),
        "shuffled_pairs": F.cosine_similarity(encoded, latents.roll(-1, dims=0), dim=-1).numpy(),
    }
    return summarise(PAIRS, per_text, num_samples=len(ids))


def flat(report: dict) -> dict:
    """The report's numbers as eval_* keys (for metrics.jsonl): eval_elbo_l2t_text_nats_per_token, and
    each interval as _low and _high: eval_elbo_l2t_text_nats_per_token_low, ... (no per-text values)."""
    out = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if key in ("per_text", "examples"):
                continue
            if isinstance(value, dict):
                walk(f"{prefix}_{key}", value)
            elif key.endswith("_interval") and isinstance(value, list):
                name = f"{prefix}_{key.removesuffix('_interval')}"
                out[f"{name}_low"], out[f"{name}_high"] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{prefix}_{key}"] = value

    parts = (
        "elbo",
        "l2t",
        "t2l",
        "length",
        "references",
        "l2t_predicted_length",
        "l2t_without_selection",
        "joint",
        "joint_without_selection",
        "nearest_training_text",
    )
    walk("eval", {k: report[k] for k in parts if k in report})
    return out


def figure_text(section: dict, key: str, spec: str = ".3f") -> str:
    """`section[key]` with its 95% interval, '0.589 [0.561, 0.617]' ('.1%': '41.0% [35.2%, 46.9%]')."""
    value, interval = section[key], section.get(f"{key}_interval")
    if interval is None or not all(math.isfinite(x) for x in interval):
        return format(value, spec)
    return f"{value:{spec}} [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def table_cell(text: str) -> str:
    """`text` as one markdown table cell: no line breaks, no bare column separator."""
    return " ".join(text.split()).replace("|", "\\|")


def selected_label(section: dict, key: str) -> str:
    """' (selected on: max over 4 candidates)' where the decoder chose its texts by figure `key`, else ''."""
    how = section.get("selected_on", {}).get(key)
    return f" (selected on: {how})" if how else ""


def _figures(r: dict) -> str:
    """BLEU, repetition and n-gram perplexity of one l2t entry, as a clause."""
    text = f"BLEU {figure_text(r, 'bleu', '.1f')}, repetition {figure_text(r, 'repetition')}" if "bleu" in r else ""
    if "ngram_perplexity" in r:
        text += f", n-gram perplexity {figure_text(r, 'ngram_perplexity', '.1f')}"
    return text


def _cosine_clause(report: dict, key: str) -> str:
    """The re-encoded cosine of l2t entry `key`, labelled when the decoder selected on it, beside the
    same decoder's cosine without selection."""
    r = report[key]
    if "cosine_mean" not in r:
        return "re-encoded cosine not measured"
    text = f"re-encoded cosine {figure_text(r, 'cosine_mean', '.4f')}{selected_label(r, 'cosine_mean')}"
    plain = report.get("l2t_without_selection", {}) if key == "l2t" else {}  # measured at the source lengths
    if "selected_on" in r and "cosine_mean" in plain:
        text += f"; without selection (best of 1) {figure_text(plain, 'cosine_mean', '.4f')}"
    return text


def _joint_lines(report: dict) -> list[str]:
    j, pairs = report["joint"], report["joint"]["reference"]
    consistency = f"consistency {figure_text(j, 'consistency', '.4f')}{selected_label(j, 'consistency')}"
    if "selected_on" in j and "joint_without_selection" in report:
        consistency += f"; without selection {figure_text(report['joint_without_selection'], 'consistency', '.4f')}"
    return [
        "",
        f"joint ({j['num_samples']} samples): repetition {figure_text(j, 'repetition')}, distinct-1/2 "
        f"{figure_text(j, 'distinct_1')}/{figure_text(j, 'distinct_2')}{_real_distinct(report)}"
        + (f", copy rate {figure_text(j, 'copy_rate', '.1%')}" if "copy_rate" in j else "")
        + (f", n-gram perplexity {figure_text(j, 'ngram_perplexity', '.1f')}" if "ngram_perplexity" in j else "")
        + f"; {consistency} (real pairs {figure_text(pairs, 'real_pairs', '.4f')}, shuffled pairs "
        f"{figure_text(pairs, 'shuffled_pairs', '.4f')})",
        "",
        "| joint sample | consistency |",
        "|---|---|",
        *[f"| {table_cell(e['generated'])} | {e['consistency']:.3f} |" for e in j["examples"]],
    ]


def _real_distinct(report: dict) -> str:
    """Real validation text's distinct-1/2 at the joint samples' n, where the report has it."""
    ref = report.get("references", {})
    if "real_distinct_1" not in ref or ref.get("num_samples") != report["joint"]["num_samples"]:
        return ""
    return f" (real text {ref['real_distinct_1']:.3f}/{ref['real_distinct_2']:.3f})"


def writing_lines(report: dict) -> list[str]:
    """The writing figures beside their references, in a few lines of markdown."""
    ref, l2t = report.get("references", {}), report["l2t"]
    lines = ["", f"l2t writing at the source lengths: {_figures(l2t)}"]
    if "real_repetition" in ref:
        real = f"real {texts_label(report)} texts: repetition {figure_text(ref, 'real_repetition')}"
        if "real_ngram_perplexity" in ref:
            real += (
                f", n-gram perplexity {figure_text(ref, 'real_ngram_perplexity', '.1f')} "
                f"(their words shuffled: {figure_text(ref, 'shuffled_ngram_perplexity', '.1f')})"
            )
        if "other_sentence_bleu" in ref:
            real += f"; an unrelated sentence: BLEU {figure_text(ref, 'other_sentence_bleu', '.1f')}"
        lines += ["", real]
    if "l2t_predicted_length" in report:
        r = report["l2t_predicted_length"]
        lines += [
            "",
            "l2t at the length head's lengths (what `decode` gives): exact match "
            + f"{figure_text(r, 'exact_match', '.1%')}, word F1 {figure_text(r, 'word_f1')}, {_figures(r)}, "
            + _cosine_clause(report, "l2t_predicted_length"),
        ]
    if "nearest_training_text" in report:
        r = report["nearest_training_text"]
        lines += [
            "",
            f"reference, the training text with the nearest latent: word F1 {figure_text(r, 'word_f1')}, BLEU "
            f"{figure_text(r, 'bleu', '.1f')}, exact match {figure_text(r, 'exact_match', '.1%')}, cosine "
            f"{figure_text(r, 'cosine_mean', '.4f')}",
        ]
    if "joint" in report:
        lines += _joint_lines(report)
    return lines


ELBO_LABELS = {
    "l2t": "-log p(text | its latent), the length paid by the length head: comparable only with a decoder "
    "given the same sentence embedding",
    "t2l": "the latent loss of encoding each text (the text is given clean)",
    "joint": "the text term of the joint loss: the text given a noised copy of its own latent, averaged over the "
    "latent's time, the length paid by the validation lengths; it bounds no marginal -log p(text)",
}


def _elbo_table(report: dict) -> list[str]:
    sampling = report.get("sampling", {})
    decoder = ", ".join(
        f"{key} {sampling[key]}"
        for key in ("num_steps", "temperature", "repetition_penalty", "best_of")
        if key in sampling
    )
    lines = [
        "Likelihood bounds: upper bounds of the continuous-time model at temperature 1, not of the decoder whose "
        f"texts fill the rest of this report ({decoder}). Per mode, what each bounds: "
        + "; ".join(f"{mode}: {label}" for mode, label in ELBO_LABELS.items() if mode in report["elbo"])
        + '. Per token divides by the T tokens of a text; "per T + 1" divides by T + 1, as an autoregressive model '
        "that pays for its end-of-text token does (the length term plays that token's role). Largest share: of the "
        "total, held by one text and draw of t (a bound weighted 1/t can rest on one draw at a small t).",
        "",
        f"| mode (n texts, {report.get('num_t_draws', 1)} draws of t each) | text nats/token given length "
        "| nats/token with length | nats per T + 1 with length | nats/text with length | length nats/text "
        "| perplexity bound with length (per T + 1) | largest share | latent loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["elbo"].items():
        cell = lambda k, f, r=r: figure_text(r, k, f) if k in r else "-"  # noqa: E731
        share = f"{r['largest_draw_share']:.1%}" if "largest_draw_share" in r else "-"
        lines.append(
            f"| {mode} ({r.get('num_samples', '?')}) | {cell('text_nats_per_token_given_length', '.4f')} | "
            f"{cell('nats_per_token_with_length', '.4f')} | {cell('nats_per_token_with_end', '.4f')} | "
            f"{cell('nats_per_text', '.2f')} | {cell('length_nats_per_text', '.2f')} | "
            f"{cell('ppl_bound_with_length', '.2f')} ({cell('ppl_bound_with_end', '.2f')}) | {share} | "
            f"{cell('latent_loss', '.4f')} |"
        )
    return lines


def _guidance_table(report: dict) -> list[str]:
    lines = [
        "",
        "| guidance scale | l2t word F1 | l2t real words | l2t exact match | l2t cosine | t2l cosine "
        "| t2l retrieval@1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in report["guidance"]:
        g2, g1 = entry["l2t"], entry["t2l"]
        cosine = figure_text(g2, "cosine_mean", ".4f") if "cosine_mean" in g2 else "-"
        lines.append(
            f"| {entry['guidance_scale']:g} | {figure_text(g2, 'word_f1')} | "
            + f"{figure_text(g2, 'real_word_rate', '.1%')} | {figure_text(g2, 'exact_match', '.1%')} | {cosine} | "
            + f"{figure_text(g1, 'cosine_mean', '.4f')} | {figure_text(g1, 'retrieval_at_1', '.1%')} |"
        )
    return lines


def length_line(length: dict, split: str = "validation") -> str:
    """The length head's figures on `split` latents, and how many texts were too long to score."""
    line = (
        f"length head ({length['num_samples']} {split} latents): exact "
        f"{figure_text(length, 'accuracy', '.1%')}, mean absolute error "
        f"{figure_text(length, 'mean_abs_error', '.2f')} tokens"
    )
    over = length.get("num_over_max_length", 0)
    if over:
        line += (
            f" over the {length['num_scored']} texts within max_length {length['max_length']}; {over} longer "
            f"texts not scored (the head names lengths up to {length['max_length']} only)"
        )
    return line


def fidelity_lines(report: dict) -> list[str]:
    """The "latent fidelity" section: t2l's and joint generation's latents against real ones."""
    rows = [(mode, report[mode]["latent_fidelity"]) for mode in ("t2l", "joint") if mode in report]
    rows = [(mode, f) for mode, f in rows if f is not None]
    if not rows:
        return []
    lines = [
        "",
        f"Latent fidelity (standardised space, {rows[0][1]['dims']} dims; each generated set against as many "
        f"real {texts_label(report)} latents, in brackets another disjoint real set of the same size against the "
        "same ones; "
        f"k-NN precision and recall at k = {rows[0][1]['k']}). t2l's latents are paired with their texts, "
        "compared with those texts' own latents: a perfect encoder scores Fréchet distance 0, precision and "
        "recall 1, std ratio 1 on every dimension; the other real set is an encoder that ignores its text but "
        "samples the right distribution, and the constant training-mean latent one that ignores both. Joint "
        "generation is unconditional: the other real set is what it should match.",
        "",
        "| latents | n | Fréchet distance (another real set; constant mean latent) | precision (...) | recall (...) "
        "| std ratio median [min, max] (another real set's) | spread (real) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in rows:
        constant = lambda key, spec, f=f: f"; {f[key]:{spec}}" if key in f else ""  # noqa: E731
        real_ratio = (
            f" ({f['std_ratio_real_vs_real_median']:.2f} [{f['std_ratio_real_vs_real_min']:.2f}, "
            f"{f['std_ratio_real_vs_real_max']:.2f}])"
            if "std_ratio_real_vs_real_min" in f
            else ""
        )
        lines.append(
            f"| {name}{' (paired)' if f.get('paired') else ''} | {f['num_samples']} | {f['frechet_distance']:.1f} "
            f"({f['frechet_distance_real_vs_real']:.1f}{constant('frechet_distance_mean_latent', '.1f')}) "
            f"| {f['precision']:.2f} ({f['precision_real_vs_real']:.2f}{constant('precision_mean_latent', '.2f')}) "
            f"| {f['recall']:.2f} ({f['recall_real_vs_real']:.2f}{constant('recall_mean_latent', '.2f')}) "
            f"| {f['std_ratio_median']:.2f} [{f['std_ratio_min']:.2f}, {f['std_ratio_max']:.2f}]{real_ratio} "
            f"| {f['spread']:.1f} ({f['spread_real']:.1f}) |"
        )
    if any(f["num_samples"] <= f["dims"] for _, f in rows):
        lines += [
            "",
            "With n at most the dimension the covariances are mostly estimation noise, and a narrower sample has "
            "less of it: read the std ratio and the spread before the Fréchet distance (docs/quality.md).",
        ]
    return lines


def texts_label(report: dict) -> str:
    """The split the figures come from, in words: "validation" (the run's own validation texts),
    "training", "training + validation", or with another dataset (--data) its folder's name first."""
    data = report.get("data", {})
    split = {"val": "validation", "train": "training", "all": "training + validation"}[data.get("split", "val")]
    return split if data.get("own_dataset", True) else f"{data['path'].rstrip('/').split('/')[-1]} {split}"


def small_n_notes(report: dict) -> list[str]:
    """A line for each figure too few texts make meaningless: a retrieval pool of one, n below MIN_TEXTS."""
    notes = []
    pool = report["t2l"].get("pool_size", 2)
    if pool < 2:
        notes.append(f"t2l retrieval@1 among {pool} is 100% by construction: it measures nothing here")
    counts = {"ELBO": min((r.get("num_samples", MIN_TEXTS) for r in report.get("elbo", {}).values()), default=None)}
    counts.update({key: report[key].get("num_samples") for key in ("l2t", "t2l", "joint") if key in report})
    small = {key: n for key, n in counts.items() if n is not None and n < MIN_TEXTS}
    if small:
        listed = ", ".join(f"{key} {n}" for key, n in small.items())
        notes.append(
            f"Too few texts to mean much ({listed}; below {MIN_TEXTS}): a 95% bootstrap interval of 10 texts holds "
            "the true figure about 89% of the time and of 5 texts 82%; raise --num-samples, or prepare a larger "
            "validation split"
        )
    return [f"**Note:** {note}." for note in notes]


def headline_lines(report: dict) -> list[str]:
    """The few figures a reader looks for first, each beside its reference: t2l retrieval and cosine, l2t
    word F1 and BLEU (BLEU where the writing figures were measured)."""
    l2t, t2l, ref = report["l2t"], report["t2l"], report.get("references", {})

    def beside(key: str, text: str, spec: str = ".3f") -> str:
        return f" ({text} {figure_text(ref, key, spec)})" if key in ref else ""

    lines = [
        f"- t2l retrieval@1 among {t2l['pool_size']}: {figure_text(t2l, 'retrieval_at_1', '.1%')}"
        + beside("chance_retrieval_at_1", "chance", ".1%"),
        f"- t2l cosine to the true latent: {figure_text(t2l, 'cosine_mean')}"
        + beside("mean_latent_cosine", "the constant training-mean latent"),
        f"- l2t word F1 against the source: {figure_text(l2t, 'word_f1')}"
        + beside("other_sentence_word_f1", "an unrelated sentence"),
    ]
    if "bleu" in l2t:
        lines.append(
            f"- l2t BLEU: {figure_text(l2t, 'bleu', '.1f')}"
            + beside("other_sentence_bleu", "an unrelated sentence", ".1f")
        )
    texts = f"{l2t['num_samples']} {texts_label(report)} text{'' if l2t['num_samples'] == 1 else 's'}"
    return [
        f"{texts}, each figure with its 95% interval (its reference in parentheses):",
        "",
        *lines,
    ]


def markdown(report: dict) -> str:
    """A short human summary of the report: the headline figures, then every figure with its 95% interval
    in brackets."""
    l2t, t2l, ref = report["l2t"], report["t2l"], report.get("references", {})
    reference = lambda key, text: f" ({text} {figure_text(ref, key, '.4f')})" if key in ref else ""  # noqa: E731
    chance = f" (chance {ref['chance_retrieval_at_1']:.1%})" if "chance_retrieval_at_1" in ref else ""
    split = texts_label(report)
    notes = small_n_notes(report)
    lines = [
        f"# Evaluation of {report['checkpoint']} (step {report['step']}, {report['weights']} weights)",
        "",
        *headline_lines(report),
        "",
        "## Every figure",
        "",
        "Sampling options: " + ", ".join(f"{key}={value}" for key, value in report["sampling"].items()),
        "",
        f"Texts: {split} (every figure below is of these texts). Each figure: its value [95% interval] "
        "(percentile bootstrap over the n texts, each with its draws of t for the ELBO; a rate no text reaches "
        "gets the exact Clopper-Pearson interval).",
        *(["", *notes] if notes else []),
        "",
        *_elbo_table(report),
        "",
        f"l2t reconstruction ({l2t['num_samples']} {split} latents): exact match "
        f"{figure_text(l2t, 'exact_match', '.1%')}, word F1 {figure_text(l2t, 'word_f1')}"
        f"{reference('other_sentence_word_f1', 'an unrelated real sentence:')}, "
        f"real words {figure_text(l2t, 'real_word_rate', '.1%')}, {_cosine_clause(report, 'l2t')}"
        f"{reference('other_sentence_cosine', 'an unrelated real sentence:')}, {l2t['samples_per_s']:.1f} samples/s",
        "",
        f"t2l ({t2l['num_samples']} {split} texts, the posterior mean): mean cosine to the true latent "
        f"{figure_text(t2l, 'cosine_mean', '.4f')}{reference('mean_latent_cosine', 'the training-set mean latent:')}, "
        f"retrieval@1 among {t2l['pool_size']} {figure_text(t2l, 'retrieval_at_1', '.1%')}{chance}, "
        f"{t2l['samples_per_s']:.1f} samples/s",
    ]
    lines += writing_lines(report)
    lines += fidelity_lines(report)
    if "length" in report:
        length = report["length"]
        lines += ["", length_line(length, split)]
    if "guidance" in report:
        lines += _guidance_table(report)
    lines += ["", "| source | generated from its latent |", "|---|---|"]
    lines += [f"| {table_cell(e['source'])} | {table_cell(e['generated'])} |" for e in l2t["examples"]]
    return "\n".join(lines) + "\n"
