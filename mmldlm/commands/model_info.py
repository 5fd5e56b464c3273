"""`mmldlm model-info PRESET|CONFIG|RUN_DIR|EXPORTED`: parameter counts per part and training FLOPs per sample
of a model preset, of the model of a run config, of a training run or of an exported model folder."""

from __future__ import annotations

import argparse

DEFAULT_VOCAB_SIZE = 8192  # when neither the preset nor --vocab-size gives one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "preset",
        metavar="PRESET|CONFIG|RUN_DIR|EXPORTED",
        help="a model preset name (configs/model/NAME.yaml) or a path to one, a run config file (a run's "
        "config.yaml), a training run directory, or an exported model folder (mmldlm export)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"vocabulary size (default: the preset's, else {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument(
        "--latent-dim",
        type=int,
        default=None,
        help="latent width D (default: the preset's, else the default sentence encoder's)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="text length for the FLOPs (default: the preset's max_seq_len)"
    )


def run(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    import torch

    from mmldlm.config import ModelConfig, from_dict, load_model_config
    from mmldlm.data.encoders import DEFAULT_ENCODER, ENCODER_WIDTHS
    from mmldlm.errors import OptionError
    from mmldlm.export.pretrained import is_exported, read_config
    from mmldlm.model import MultimodalMMDiT, parameter_counts, training_flops_per_sample

    path = Path(args.preset)
    if is_exported(path):
        cfg = from_dict(ModelConfig, read_config(path)["model"], "model")
    else:
        cfg = load_model_config(args.preset)
    vocab_size = args.vocab_size or cfg.vocab_size or DEFAULT_VOCAB_SIZE
    vocab_note = "" if args.vocab_size or cfg.vocab_size else " (assumed: pass --vocab-size)"
    latent_dim = args.latent_dim or cfg.latent_dim or ENCODER_WIDTHS[DEFAULT_ENCODER]
    latent_note = "" if args.latent_dim or cfg.latent_dim else f" (assumed, {DEFAULT_ENCODER}'s: pass --latent-dim)"
    cfg = dataclasses.replace(cfg, latent_dim=latent_dim, num_latents=cfg.num_latents or 1)
    seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise OptionError(
            "--seq-len", seq_len, f"an integer in [1, {cfg.max_seq_len}] (model.max_seq_len of '{args.preset}')"
        )
    if vocab_size < 3:
        raise OptionError("--vocab-size", vocab_size, "an integer >= 3")
    if latent_dim < 1:
        raise OptionError("--latent-dim", latent_dim, "an integer >= 1")

    with torch.device("meta"):  # shapes only: even the largest preset costs no memory
        model = MultimodalMMDiT(cfg, vocab_size)
    counts = parameter_counts(model)

    head_dim = cfg.hidden_size // cfg.num_heads
    print(
        f"model '{args.preset}': hidden_size {cfg.hidden_size}, num_blocks {cfg.num_blocks}, "
        f"num_heads {cfg.num_heads} (head dim {head_dim}), mlp_ratio {cfg.mlp_ratio}, "
        f"latents {cfg.num_latents} x {cfg.latent_dim}{latent_note}, vocab_size {vocab_size}{vocab_note}"
    )
    print()
    rows = [
        ("text stream", counts["text"]),
        ("latent stream", counts["latent"]),
        ("shared (timestep MLPs, adaLN modulation, null latent)", counts["shared"]),
        ("total", counts["total"]),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"{'part':<{width}}  {'parameters':>14}  {'share':>6}")
    for label, n in rows:
        print(f"{label:<{width}}  {n:>14,}  {n / counts['total']:>6.1%}")
    print()
    print(f"training FLOPs per sample at text length {seq_len} (+{cfg.num_latents} latent), forward + backward:")
    for mode, heads in (("joint", (True, True)), ("l2t", (True, False)), ("t2l", (False, True))):
        flops = training_flops_per_sample(model, seq_len, text_head=heads[0], latent_head=heads[1])
        print(f"  {mode:<5}  {flops:.4e}")
    return 0
