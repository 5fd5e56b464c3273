"""`mmldlm eval --run RUN_DIR [--num-samples N] [--out PATH]`: validation ELBO and latent loss per
mode, l2t reconstruction and t2l retrieval of a trained run (mmldlm/evaluation/evaluate.py). Writes
a JSON report (default RUN/eval/step-NNNNNNN.json) and its markdown summary beside it (.md, every
figure), and prints the headline figures, the first texts written and the paths. `--data DIR` evaluates
on another prepared dataset (made with `mmldlm prepare --like RUN_DIR`), by default its validation split
(all of it where it has none); its report goes to RUN/eval/step-NNNNNNN-<DIR name>.json. An exported
model folder (`mmldlm export`) carries no dataset, so with one `--data` is required."""

from __future__ import annotations

import argparse

from mmldlm.commands.sample import add_device_arguments, add_model_arguments, add_sampler_arguments, ema_choice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "a training run directory or an exported model folder (mmldlm export; needs --data)")
    add_evaluation_arguments(parser)
    parser.add_argument(
        "--out",
        metavar="PATH.json",
        help="the JSON report (default RUN/eval/step-NNNNNNN.json; for an exported folder "
        "./eval-<folder name>/step-NNNNNNN-<DIR name>.json, the folder is never written to)",
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="replace the default report even where it holds more samples than this evaluation (without it, "
        "such a report, the one the model card reads, is kept and the evaluation refused before it runs)",
    )
    parser.add_argument(
        "--if-missing",
        action="store_true",
        help="evaluate only where the checkpoint has no report of at least --num-samples samples yet; where "
        "it has one, say so and exit 0 (what `make train` runs again after a finished run)",
    )


def add_evaluation_arguments(parser: argparse.ArgumentParser) -> None:
    """What is evaluated and how (eval and compare): data, budget, samplers, seed, device."""
    parser.add_argument(
        "--data",
        metavar="DIR",
        help="evaluate on this prepared dataset (made with `mmldlm prepare --like RUN_DIR`) instead "
        "of the run's validation split; the latent statistics stay the run's own",
    )
    parser.add_argument(
        "--split",
        choices=["val", "train", "all"],
        help="the split evaluated (all: train then val); default val, or all with a --data set that has no "
        "validation split",
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        default=256,
        help="validation samples decoded (l2t) and encoded (t2l), and scored for the ELBO",
    )
    parser.add_argument("--num-t-draws", type=int, default=2, help="draws of t and noise per ELBO batch")
    add_sampler_arguments(parser)
    parser.add_argument(
        "--guidance-scale",
        type=float,
        nargs="+",
        default=[0.0],
        metavar="W",
        help="classifier-free guidance scales of the samplers; several: each is evaluated and "
        "reported side by side, the first also as the main figures",
    )
    parser.add_argument("--retrieval-pool", type=int, default=1000, help="validation sentences for t2l retrieval@1")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-encoder", action="store_true", help="skip re-encoding the l2t text (no cosine)")
    parser.add_argument(
        "--no-writing",
        action="store_true",
        help="skip the slower writing figures: l2t at the length head's lengths, joint generation, n-gram "
        "fluency and the nearest-training-text reference",
    )
    parser.add_argument("--seed", type=int, default=0, help="the seed of every sampler and draw of t")
    add_device_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from mmldlm.progress import note, reporting  # light (tqdm): the first line comes before torch loads

    with reporting(False if args.quiet else "auto"):
        note(f"mmldlm eval: loading {args.run}")
        return _evaluate(args)


def _evaluate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from mmldlm.evaluation.report import console_summary, markdown
    from mmldlm.outputs import write_atomically

    run, data, split = load_for_evaluation(args, args.run)
    out = Path(args.out) if args.out else default_report_path(args, run, data, split)
    kept = report_samples(out)
    if args.if_missing and kept is not None and kept >= args.num_samples:
        print(f"mmldlm eval: {out} already holds an evaluation of {kept} samples of this checkpoint; kept")
        return 0
    if not (args.out or args.replace):
        keep_larger_report(out, kept, args.num_samples)
    report = evaluate_loaded(args, run, data, split, args.run)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out.with_suffix(".md"), markdown(report))
    write_atomically(out, json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(console_summary(report))
    print(f"mmldlm eval: wrote {out} and {out.with_suffix('.md')} (every figure: the whole report)")
    return 0


def default_report_path(args: argparse.Namespace, run, data, split: str):
    """RUN/eval/step-NNNNNNN.json; another dataset's (or split's) report gets its own name so that it never
    replaces the run's own evaluation; an exported folder's go to ./eval-<folder name>/."""
    from pathlib import Path

    from mmldlm.export.pretrained import is_exported
    from mmldlm.runs.checkpoints import step_dir_name

    suffix = f"-{Path(data).name}" if args.data else ("" if split == "val" else f"-{split}")
    reports = Path(f"eval-{Path(args.run).resolve().name}") if is_exported(Path(args.run)) else Path(args.run) / "eval"
    return reports / f"{step_dir_name(run.step or 0)}{suffix}.json"


def report_samples(path) -> int | None:
    """The samples of the report at `path`; None where there is none this command can read."""
    import json

    try:
        kept = json.loads(path.read_text(encoding="utf-8"))["l2t"]["num_samples"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kept if isinstance(kept, int) else None


def keep_larger_report(path, kept: int | None, num_samples: int) -> None:
    """UserError where the report at `path` holds more samples (`kept`) than an evaluation of
    `num_samples` would: the model card reads it, and a smaller one would silently take its place."""
    from mmldlm.errors import UserError

    if kept is not None and kept > num_samples:
        raise UserError(
            f"{path} holds an evaluation of {kept} samples; this one of --num-samples {num_samples} would replace "
            "it (the model card reads it): pass --out PATH to write elsewhere, or --replace to replace it"
        )


def check_options(args: argparse.Namespace) -> None:
    """OptionError for the first option of add_evaluation_arguments that cannot be used."""
    from mmldlm.errors import require_positive
    from mmldlm.threads import parse_threads

    require_positive(
        {
            "--num-samples": args.num_samples,
            "--num-t-draws": args.num_t_draws,
            "--retrieval-pool": args.retrieval_pool,
            "--batch-size": args.batch_size,
        }
    )
    args.threads = parse_threads(args.threads)


def evaluation(args: argparse.Namespace, model_path: str):
    """(the trained run, its report) of the model at `model_path` with the options of `args`
    (add_evaluation_arguments, and --checkpoint / --no-ema where the command has them)."""
    run, data, split = load_for_evaluation(args, model_path)
    return run, evaluate_loaded(args, run, data, split, model_path)


def load_for_evaluation(args: argparse.Namespace, model_path: str):
    """(the trained run, the prepared dataset, the split) that `args` evaluate the model at `model_path` on."""
    from pathlib import Path

    from mmldlm.device import keep_freed_memory, pick_device
    from mmldlm.export.pretrained import load_trained
    from mmldlm.threads import set_threads

    check_options(args)
    set_threads(args.threads)
    keep_freed_memory()  # the samplers' vocabulary-wide tensors, reused instead of faulted in at every step
    device = str(pick_device(args.device, key="--device"))
    run = load_trained(model_path, getattr(args, "checkpoint", None), device, use_ema=ema_choice(args))
    if run.dataset_dir is None and not args.data:
        raise run.no_dataset()
    data = Path(args.data) if args.data else run.dataset_dir
    split = args.split or default_split(data)
    if args.data or split != "val":
        run.use_eval_data(data, split)
    return run, data, split


def evaluate_loaded(args: argparse.Namespace, run, data, split: str, model_path: str) -> dict:
    """The report of `run` (load_for_evaluation) with the options of `args`."""
    import math

    from mmldlm.commands.sample import sampling_options
    from mmldlm.config import EvalConfig
    from mmldlm.evaluation.evaluate import evaluate

    options = sampling_options(args, run, guidance_scale=args.guidance_scale[0])
    cfg = EvalConfig(
        num_samples=args.num_samples,
        num_steps=args.num_steps,
        batch_size=args.batch_size,
        num_elbo_batches=math.ceil(args.num_samples / args.batch_size),
        retrieval_pool=args.retrieval_pool,
        encoder=not args.no_encoder,
        writing=not args.no_writing,
    )
    cfg.check()
    report = evaluate(
        run,
        cfg,
        options,
        num_t_draws=args.num_t_draws,
        seed=args.seed,
        guidance_scales=args.guidance_scale,
        num_elbo=args.num_samples,
    )
    report["data"] = {"path": str(data.resolve()), "split": split, "own_dataset": not args.data}
    if args.data and run.dataset_dir is not None:
        seen, checked = texts_in_training(run, model_path, data, split, max(args.num_samples, args.retrieval_pool))
        report["data"].update(in_training=seen, in_training_of=checked)
    return report


def default_split(data) -> str:
    """ "val" where the prepared dataset at `data` has validation samples, else "all" (train then val)."""
    from mmldlm.data.format import read_meta

    shards = read_meta(data)["shards"].get("val", [])
    return "val" if sum(shard["num_samples"] for shard in shards) else "all"


def texts_in_training(run, model_path: str, data, split: str, num: int) -> tuple[int, int]:
    """(how many of the first `num` texts evaluated from `data` (`split`) the run trained on, as decoded; how
    many were compared): a warning names them, since their figures measure recall of training texts, not
    generalisation, and the report says so beside its figures (report.py `training_texts_note`)."""
    import logging

    from mmldlm.runs.trained import dataset_texts

    evaluated = dataset_texts(str(data), split)[:num]
    trained = set(dataset_texts(str(run.dataset_dir), "train"))
    seen = sum(text in trained for text in evaluated)
    if seen:
        logging.getLogger(__name__).warning(
            "%s: %d of the %d texts evaluated from %s (%s) are texts this run trained on: their figures measure "
            "recall, not generalisation; `python scripts/held_out_texts.py` writes texts no given run trained on",
            model_path,
            seen,
            len(evaluated),
            data,
            split,
        )
    return seen, len(evaluated)
