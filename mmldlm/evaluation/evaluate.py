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
   `num_samples` texts, each with its `num_t_draws` draws for the ELBO (intervals.py). figures.py
   names the recipe of every figure; `mmldlm compare` applies the same recipes to two reports, paired.
8. Selection: a decoder that keeps the candidate whose re-encoding is closest to the target (best_of > 1,
   correction rounds) maximises the l2t cosine and the joint consistency over its candidates. Those
   figures are labelled (`selected_on`) and measured again without selection (`l2t_without_selection`,
   `joint_without_selection`); word F1, exact match, BLEU and fluency, which no decoder selects on, are
   the headline of such a decoder.
The report is a JSON-able dict; report.py renders it (`markdown`) and turns it into eval_* metric keys (`eval_metrics`).
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
from mmldlm.config import EvalConfig, to_dict
from mmldlm.data.dataset import PadCollate, PreparedDataset
from mmldlm.diffusion import MaskedDiffusion
from mmldlm.evaluation import text_metrics
from mmldlm.evaluation.figures import recipes
from mmldlm.evaluation.latent_fidelity import fidelity
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
    collate = PadCollate(
        run.text.pad_token_id, run.cfg.data.pad_to_multiple, run.max_length, buckets=run.cfg.data.length_buckets
    )
    n = min(num_samples, len(run.val))
    for start in range(0, n, batch_size):
        yield collate([run.val[i] for i in range(start, min(start + batch_size, n))])


# --------------------------------------------------------------------------------------------------
# Figures with intervals: each section keeps its per-text values, and a recipe per figure (figures.py,
# intervals.py) says how the figure is made from them.


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


def describe_selection(options: SamplingOptions, length_candidates: bool = False) -> str | None:
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
        result = summarise(recipes("elbo"), per_text, num_samples=n)
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
    fluency: text_metrics.NgramReference | None = None,
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
        recipes("l2t"),
        per_text,
        num_samples=len(ids),
        samples_per_s=len(ids) / seconds,
        model_calls_per_batch=sampler.num_forward / math.ceil(len(ids) / batch_size),
        encoded_per_sample=sampler.num_encoded / len(ids),
    )
    selected = describe_selection(options, length_candidates=predicted_length)
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
    of texts against their sources (text_metrics.py; the figures: figures.py, "l2t")."""
    known = known_words(run)
    decoded_words = [words(g) for g in generated]
    repetition = text_metrics.repetition_per_text(generated, 2)
    out = {
        "exact": np.array([g == s for g, s in zip(generated, sources)], dtype=np.float64),
        "word_f1": np.array([word_f1(w, words(s)) for w, s in zip(decoded_words, sources)]),
        "bleu_statistics": text_metrics.bleu_statistics(generated, sources),
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
    fluency: text_metrics.NgramReference | None = None,
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
    fidelity_figures = latent_fidelity(run, latents)
    consistency = F.cosine_similarity(run.encode_latents(texts).flatten(1), latents.flatten(1), dim=-1)
    repetition = text_metrics.repetition_per_text(texts, 2)
    per_text = {
        "consistency": consistency.numpy(),
        "repetition": np.array([r or 0.0 for r in repetition]),
        "has_bigram": np.array([r is not None for r in repetition], dtype=np.float64),
        "texts": texts,
    }
    if run.dataset_dir is not None:
        per_text["copied"] = np.array(
            text_metrics.copied(texts, dataset_texts(str(run.dataset_dir), "train")), dtype=np.float64
        )
    if fluency is not None:
        per_text["ngram_bits"], per_text["ngram_words"] = fluency.bits_per_text(texts)
    out = summarise(recipes("joint"), per_text, num_samples=num_samples, samples_per_s=num_samples / seconds)
    out["latent_fidelity"] = fidelity_figures
    selected = describe_selection(options)
    if selected:
        out["selected_on"] = {"consistency": selected}
    out["examples"] = [{"generated": t, "consistency": round(c, 4)} for t, c in zip(texts, consistency.tolist())][
        :num_examples
    ]
    return out


@functools.lru_cache(maxsize=2)
def _ngram_lm(dataset_dir: str, split: str) -> text_metrics.NgramReference:
    return text_metrics.NgramReference.fit(list(dataset_texts(dataset_dir, split)))


def fluency_reference(run: TrainedRun) -> text_metrics.NgramReference | None:
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
        recipes("t2l"),
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
    return fidelity(standard(generated[:n].cpu()), standard(real[:n]), standard(real[n : 2 * n]), paired=paired)


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
    return summarise(recipes("length"), per_text, **fixed)


def measure_references(
    run: TrainedRun, num_samples: int, pool_size: int, fluency: text_metrics.NgramReference | None = None
) -> dict:
    """What trivial predictors and real text score on the same samples (module docstring, 5)."""
    ids, targets = _first_val(run, num_samples)
    targets = targets.flatten(1)  # (N, K*D), encoder space
    mean = run.latent.mean
    per_text = {}
    if mean is not None:
        constant = mean.float().repeat(run.model.cfg.num_latents)[None, :]  # (1, K*D)
        per_text["mean_latent_cosine"] = F.cosine_similarity(constant, targets, dim=-1).numpy()
    texts = run.decode(*run.batch_of(ids))
    repetition = text_metrics.repetition_per_text(texts, 2)
    per_text["real_repetition"] = np.array([r or 0.0 for r in repetition])
    per_text["real_has_bigram"] = np.array([r is not None for r in repetition], dtype=np.float64)
    per_text["real_texts"] = texts
    if len(targets) > 1:
        others = texts[1:] + texts[:1]
        per_text["other_sentence_cosine"] = F.cosine_similarity(targets.roll(-1, dims=0), targets, dim=-1).numpy()
        per_text["other_sentence_word_f1"] = np.array([word_f1(words(a), words(b)) for a, b in zip(others, texts)])
        per_text["other_sentence_bleu_statistics"] = text_metrics.bleu_statistics(others, texts)
    if fluency is not None:
        per_text["real_ngram_bits"], per_text["real_ngram_words"] = fluency.bits_per_text(texts)
        shuffled = fluency.bits_per_text(text_metrics.shuffled_words(texts))
        per_text["shuffled_ngram_bits"], per_text["shuffled_ngram_words"] = shuffled
    return summarise(
        recipes("references"), per_text, num_samples=len(ids), chance_retrieval_at_1=1.0 / min(pool_size, len(run.val))
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
        "bleu_statistics": text_metrics.bleu_statistics(nearest, sources),
        "exact": np.array([a == b for a, b in zip(nearest, sources)], dtype=np.float64),
        "cosine": best.values.numpy(),
    }
    return summarise(recipes("nearest_training_text"), per_text, num_samples=len(ids))


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
    with cfg.writing also the writing figures (`measure_writing`). A decoder that selects its texts by the
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
            "config": to_dict(run.cfg),  # what the run trained with: compare checks that --a/--b are one recipe
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
            report.update(measure_writing(run, cfg, first, seed, fluency))
        report.update(without_selection(run, cfg, first, seed, fluency))
        progress.note("references: what trivial predictors and real text score")
        report["references"] = measure_references(run, cfg.num_samples, cfg.retrieval_pool, fluency)
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
    if not (cfg.encoder and describe_selection(options)):
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


def measure_writing(run: TrainedRun, cfg: EvalConfig, options: SamplingOptions, seed: int, fluency) -> dict:
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
    return summarise(recipes("joint reference"), per_text, num_samples=len(ids))
