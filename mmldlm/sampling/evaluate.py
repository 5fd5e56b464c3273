"""Evaluation of a trained run on its validation split: likelihood bounds, reconstructions, retrieval.

1. ELBO per mode: the training objective itself (`Objective`, forced to one mode, no condition
   dropping) on validation batches, averaged over `num_t_draws` draws of t and noise per batch.
   The text term is MDLM's NELBO (whatever text_diffusion.loss trained with) in nats per real
   token, token-weighted over batches; bits = nats / ln 2; exp(nats) bounds the perplexity from
   above. In l2t it bounds -log p(text | latent); in joint it is the text term of the joint loss
   (the latent noised at its own t). The latent term is the configured latent loss.
2. l2t reconstruction: text sampled from the first N validation latents (each text's true length is
   given, see sampler.py), re-encoded with the dataset's sentence encoder; mean cosine to the source
   latent, and the exact-match rate of the decoded text against the source text.
3. t2l: latents sampled from the first N validation texts; mean cosine to the true latent, and
   retrieval@1: the share whose nearest (cosine) latent among the first `retrieval_pool` validation
   latents is their own.
4. Speed: samples per second of each sampler at the given step count (one measurement, noisy on a
   shared machine).
The report is a JSON-able dict; `markdown` renders it, `flat` turns it into eval_* metric keys.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from mmldlm.config import EvalConfig
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
    from mmldlm.data.dataset import PadCollate

    collate = PadCollate(run.text.pad_token_id, run.data_cfg.pad_to_multiple, run.data_cfg.max_length)
    n = min(num_samples, len(run.val))
    for start in range(0, n, batch_size):
        yield collate([run.val[i] for i in range(start, min(start + batch_size, n))])


# --------------------------------------------------------------------------------------------------
# 1. ELBO


def eval_objective(run: TrainedRun, mode: str) -> Objective:
    """The training objective in one mode, with the MDLM ELBO as its text loss and no condition dropping."""
    text = MaskedDiffusion(dataclasses.replace(run.text.cfg, loss="elbo"), run.text.mask_token_id,
                           run.text.pad_token_id)
    cfg = dataclasses.replace(run.cfg.objective, mode=mode, cond_drop_prob=0.0)
    return Objective(cfg, text, run.latent)


@torch.no_grad()
def elbo(run: TrainedRun, num_samples: int, batch_size: int, num_t_draws: int = 1, seed: int = 0,
         modes: tuple[str, ...] = MODES) -> dict:
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
            result.update(text_nats_per_token=per_token, text_bits_per_token=per_token / math.log(2),
                          text_ppl_bound=math.exp(min(per_token, 700.0)), num_tokens=int(tokens / num_t_draws))
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
    ids = [s[1][:run.data_cfg.max_length].tolist() for s in samples]
    return ids, torch.stack([torch.from_numpy(s[2].astype("float32")) for s in samples])


def l2t_reconstruction(run: TrainedRun, options: SamplingOptions, num_samples: int, batch_size: int,
                       seed: int = 0, use_encoder: bool = True, num_examples: int = 5) -> dict:
    """Text from the first N validation latents vs. the source texts (module docstring, 2)."""
    ids, latents = _first_val(run, num_samples)
    sampler = run.sampler(options)
    sources, generated = [], []
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        tokens, pad_mask = run.batch_of(ids[b:b + batch_size])
        out = sampler.l2t(latents[b:b + batch_size], pad_mask, _generator(seed, 1, b))
        sources += run.decode(tokens, pad_mask)
        generated += run.decode(out, pad_mask)
    seconds = time.perf_counter() - start
    result = {"num_samples": len(ids), "exact_match": sum(g == s for g, s in zip(generated, sources)) / len(ids),
              "samples_per_s": len(ids) / seconds,
              "model_calls_per_batch": sampler.num_forward / math.ceil(len(ids) / batch_size)}
    cosines = None
    if use_encoder:
        cosines = F.cosine_similarity(run.encode_latents(generated).flatten(1), latents.flatten(1), dim=-1)
        result["cosine_mean"] = cosines.mean().item()
    result["examples"] = [{"source": s, "generated": g, **({"cosine": round(cosines[i].item(), 4)} if cosines is not None else {})}
                          for i, (s, g) in enumerate(zip(sources[:num_examples], generated[:num_examples]))]
    return result


def t2l_retrieval(run: TrainedRun, options: SamplingOptions, num_samples: int, batch_size: int,
                  pool_size: int = 1000, seed: int = 0) -> dict:
    """Latents from the first N validation texts vs. the true latents (module docstring, 3)."""
    _, pool = _first_val(run, max(pool_size, num_samples))
    ids = _first_val(run, num_samples)[0]
    sampler = run.sampler(options)
    generated = []
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        tokens, pad_mask = run.batch_of(ids[b:b + batch_size])
        generated.append(sampler.t2l(tokens, pad_mask, _generator(seed, 2, b)).cpu())
    seconds = time.perf_counter() - start
    generated = torch.cat(generated).flatten(1)  # (N, K*D)
    pool = pool.flatten(1)  # (P, K*D), P >= N: sample i is pool row i
    cosine = F.cosine_similarity(generated, pool[:len(ids)], dim=-1)
    similarity = F.normalize(generated, dim=-1) @ F.normalize(pool, dim=-1).T  # (N, P)
    hits = similarity.argmax(dim=1) == torch.arange(len(ids))
    return {"num_samples": len(ids), "cosine_mean": cosine.mean().item(), "retrieval_at_1": hits.float().mean().item(),
            "pool_size": pool.shape[0], "samples_per_s": len(ids) / seconds}


# --------------------------------------------------------------------------------------------------
# The whole report.


def evaluate(run: TrainedRun, cfg: EvalConfig, options: SamplingOptions | None = None, num_t_draws: int = 1,
             seed: int = 0) -> dict:
    """ELBO per mode, l2t reconstruction and t2l retrieval of `run` with the budget of `cfg`."""
    options = options or SamplingOptions(num_steps=cfg.num_steps)
    was_training = run.model.training
    run.model.eval()
    try:
        report = {"checkpoint": str(run.checkpoint) if run.checkpoint else None, "step": run.step,
                  "sampling": options.to_dict(), "num_t_draws": num_t_draws,
                  "elbo": elbo(run, cfg.num_elbo_batches * cfg.batch_size, cfg.batch_size, num_t_draws, seed),
                  "l2t": l2t_reconstruction(run, options, cfg.num_samples, cfg.batch_size, seed, cfg.encoder),
                  "t2l": t2l_retrieval(run, options, cfg.num_samples, cfg.batch_size, cfg.retrieval_pool, seed)}
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

    walk("eval", {k: report[k] for k in ("elbo", "l2t", "t2l")})
    return out


def markdown(report: dict) -> str:
    """A short human summary of the report."""
    lines = [f"# Evaluation of {report['checkpoint']} (step {report['step']})", "",
             f"Sampling: {report['sampling']}", "",
             "| mode | text nats/token | text bits/token | perplexity bound | latent loss |", "|---|---|---|---|---|"]
    for mode, r in report["elbo"].items():
        cell = lambda k, f: format(r[k], f) if k in r else "-"  # noqa: E731
        lines.append(f"| {mode} | {cell('text_nats_per_token', '.4f')} | {cell('text_bits_per_token', '.4f')} | "
                     f"{cell('text_ppl_bound', '.2f')} | {cell('latent_loss', '.4f')} |")
    l2t, t2l = report["l2t"], report["t2l"]
    cosine = f"{l2t['cosine_mean']:.4f}" if "cosine_mean" in l2t else "not measured"
    lines += ["", f"l2t reconstruction ({l2t['num_samples']} validation latents): exact match "
              f"{l2t['exact_match']:.1%}, mean cosine of the re-encoded text to the source latent {cosine}, "
              f"{l2t['samples_per_s']:.1f} samples/s", "",
              f"t2l ({t2l['num_samples']} validation texts): mean cosine to the true latent {t2l['cosine_mean']:.4f}, "
              f"retrieval@1 among {t2l['pool_size']} {t2l['retrieval_at_1']:.1%}, {t2l['samples_per_s']:.1f} samples/s",
              "", "| source | generated from its latent |", "|---|---|"]
    row_text = lambda text: " ".join(text.split()).replace("|", "\\|")  # one table row: no line breaks  # noqa: E731
    lines += [f"| {row_text(e['source'])} | {row_text(e['generated'])} |" for e in l2t["examples"]]
    return "\n".join(lines) + "\n"
