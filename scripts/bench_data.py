"""Data pipeline throughput: tokenisation (tokens/s), sentence encoding (sentences/s), and the
loader (samples/s, and the shortest step time it can feed). Prints one JSON object per measurement.

    PYTHONPATH=. python scripts/bench_data.py tokenize
    PYTHONPATH=. python scripts/bench_data.py encode --num-sentences 4096 --batch-size 128
    PYTHONPATH=.:SITE python scripts/bench_data.py encode-onnx --num-sentences 3000 --rounds 2
    PYTHONPATH=. python scripts/bench_data.py load --data DIR --batch-size 64 --num-workers 0 2 --num-batches 400

`tokenize` and `encode` read the bundled default corpus; `load` reads a prepared dataset directory.
`encode-onnx` sets the encoder run by onnxruntime (its transformer exported by torch.onnx, then mean
pooling and L2 normalisation, as sentence-transformers does them) beside `encode` on the same texts:
both rates and how far the latents differ. onnxruntime and onnx are not project dependencies: install
them apart, e.g. `pip install --no-deps --target SITE onnxruntime onnx flatbuffers ml_dtypes`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import numpy as np


def default_texts() -> list[str]:
    from mmldlm.data.corpus import DEFAULT_CORPUS

    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def bench_tokenize(args) -> None:
    from mmldlm.data.tokenizer import encode_texts, train_bpe

    texts = default_texts()
    start = time.perf_counter()
    tokenizer = train_bpe(texts, args.vocab_size)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    ids = encode_texts(tokenizer, texts)
    encode_s = time.perf_counter() - start
    num_tokens = sum(map(len, ids))
    print(
        json.dumps(
            {
                "measure": "tokenize",
                "samples": len(texts),
                "tokens": num_tokens,
                "vocab_size": args.vocab_size,
                "bpe_train_s": round(train_s, 2),
                "encode_s": round(encode_s, 2),
                "tokens_per_s": round(num_tokens / encode_s),
                "mean_tokens_per_sample": round(num_tokens / len(texts), 2),
            }
        )
    )


def bench_encode(args) -> None:
    import torch

    from mmldlm.data.encoders import load_encoder

    texts = default_texts()
    texts = [texts[i] for i in np.random.default_rng(0).choice(len(texts), args.num_sentences, replace=False)]
    encoder = load_encoder(device=args.device)
    encoder.encode(texts[: args.batch_size], args.batch_size)  # warm-up
    start = time.perf_counter()
    encoder.encode(texts, args.batch_size)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "measure": "encode",
                "encoder": encoder.name,
                "device": args.device,
                "threads": torch.get_num_threads(),
                "sentences": len(texts),
                "batch_size": args.batch_size,
                "seconds": round(seconds, 2),
                "sentences_per_s": round(len(texts) / seconds, 1),
            }
        )
    )


def bench_encode_onnx(args) -> None:
    import tempfile

    import torch

    from mmldlm.data.encoders import load_encoder

    try:
        import onnxruntime
    except ImportError as err:
        raise SystemExit("bench_data.py encode-onnx: needs onnxruntime and onnx (see this script's docstring)") from err

    texts = default_texts()
    texts = [texts[i] for i in np.random.default_rng(0).choice(len(texts), args.num_sentences, replace=False)]
    encoder = load_encoder()
    tokenizer, transformer = encoder.model.tokenizer, encoder.model[0].auto_model.eval()

    class Hidden(torch.nn.Module):  # keyword arguments: the exporter passes positional ones
        def __init__(self):
            super().__init__()
            self.transformer = transformer  # a submodule: its weights export as weights

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.transformer(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = tokenizer(["a small dog that barks", "hello"], padding=True, return_tensors="pt")
    with tempfile.TemporaryDirectory() as scratch:
        path = f"{scratch}/encoder.onnx"
        torch.onnx.export(
            Hidden(),
            tuple(example[n] for n in names),
            path,
            input_names=names,
            output_names=["hidden"],
            dynamic_axes={n: {0: "batch", 1: "length"} for n in [*names, "hidden"]},
            opset_version=17,
            dynamo=False,
        )
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def run_onnx() -> np.ndarray:
        out = np.empty((len(texts), encoder.latent_dim), dtype=np.float32)
        order = np.argsort([len(t) for t in texts], kind="stable")  # as SentenceEncoder.encode batches
        for start in range(0, len(texts), args.batch_size):
            idx = order[start : start + args.batch_size]
            batch = tokenizer([texts[i] for i in idx], padding=True, truncation=True, return_tensors="np")
            hidden = session.run(None, {n: batch[n].astype(np.int64) for n in names})[0]
            mask = batch["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.clip(mask.sum(1), 1e-9, None)
            out[idx] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return out

    for round_ in range(args.rounds):  # alternated: a shared machine disturbs both alike
        start = time.perf_counter()
        reference = encoder.encode(texts, args.batch_size)[:, 0]
        torch_s = time.perf_counter() - start
        start = time.perf_counter()
        latents = run_onnx()
        onnx_s = time.perf_counter() - start
        cosine = (latents * reference).sum(1)
        print(
            json.dumps(
                {
                    "measure": "encode-onnx",
                    "round": round_,
                    "threads": torch.get_num_threads(),
                    "onnxruntime": onnxruntime.__version__,
                    "sentences": len(texts),
                    "batch_size": args.batch_size,
                    "torch_sentences_per_s": round(len(texts) / torch_s, 1),
                    "onnx_sentences_per_s": round(len(texts) / onnx_s, 1),
                    "speedup": round(torch_s / onnx_s, 2),
                    "max_abs_difference": float(np.abs(latents - reference).max()),
                    "cosine_min": float(cosine.min()),
                }
            )
        )


def bench_load(args) -> None:
    from mmldlm.config import DataConfig
    from mmldlm.data.dataset import build_loader, open_dataset

    dataset = open_dataset(args.data, "train")
    for workers in args.num_workers:
        cfg = DataConfig(
            path=args.data,
            num_workers=workers,
            pad_to_multiple=args.pad_to_multiple,
            pin_memory=False,
            prefetch_factor=4 if workers else None,
        )
        loader = build_loader(dataset, cfg, args.batch_size, seed=0)
        batches, tokens = 0, 0
        it = iter(loader)
        next(it)  # worker start-up is not throughput
        start = time.perf_counter()
        while batches < args.num_batches:
            for batch in it:
                batches += 1
                tokens += int(batch["tokens"].numel())
                if batches == args.num_batches:
                    break
            else:
                it = iter(loader)
        seconds = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "measure": "load",
                    "data": args.data,
                    "num_workers": workers,
                    "batch_size": args.batch_size,
                    "batches": batches,
                    "seconds": round(seconds, 2),
                    "samples_per_s": round(batches * args.batch_size / seconds),
                    "padded_tokens_per_s": round(tokens / seconds),
                    "ms_per_batch": round(1000 * seconds / batches, 3),
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="measure", required=True)
    p = sub.add_parser("tokenize")
    p.add_argument("--vocab-size", type=int, default=8192)
    p = sub.add_parser("encode")
    p.add_argument("--num-sentences", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p = sub.add_parser("encode-onnx")
    p.add_argument("--num-sentences", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p = sub.add_parser("load")
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--num-batches", type=int, default=400)
    p.add_argument("--pad-to-multiple", type=int, default=8)
    args = parser.parse_args()
    measures = {
        "tokenize": bench_tokenize,
        "encode": bench_encode,
        "encode-onnx": bench_encode_onnx,
        "load": bench_load,
    }
    measures[args.measure](args)


if __name__ == "__main__":
    main()
