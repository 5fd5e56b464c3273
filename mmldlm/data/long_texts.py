"""Texts longer than the model or the sentence encoder reads: their lengths, and what they become.

Two limits cut a text. The model reads at most `max_tokens` tokens (model.max_seq_len, or
data.max_length; `mmldlm prepare --max-tokens N`): the loader drops the rest of a longer sample. The
sentence encoder reads at most its own number of wordpieces (254 for all-MiniLM-L6-v2: 256 with
[CLS] and [SEP]) and ignores the rest, so without care a latent describes other words than its text.
A text over either limit is *long*; `prepare --long-texts` decides what it becomes:

    cut    its longest start, at a token boundary, that fits both limits
    split  passages that each fit both: whole sentences (joined by a space) where they fit, a sentence
           longer than a passage cut at token boundaries; each passage is a sample of its own
    drop   left out

The latent of a sample is computed from its stored text afterwards, so latent and text always
describe the same words. The lengths of the texts as read are summarised in meta.json ("lengths"),
which `mmldlm check` reads; `check` and `train` measure what the loader cuts from the stored lengths
(the shards' offsets), with no tokenising.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from mmldlm.data.tokenizer import encode_texts

MODES = ("cut", "split", "drop")
MODEL_LENGTHS = (64, 128, 256)  # the model lengths prepare reports the cut at, beside --max-tokens
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class Limits:
    """What a stored sample must fit: `max_tokens` of the dataset's tokenizer (None: no model limit)
    and the encoder's `max_wordpieces`."""

    tokenizer: object  # tokenizers.Tokenizer
    encoder: object  # mmldlm.data.encoders.SentenceEncoder
    max_tokens: int | None

    def within(self, num_tokens: int, num_wordpieces: int) -> bool:
        return (self.max_tokens is None or num_tokens <= self.max_tokens) and (
            num_wordpieces <= self.encoder.max_wordpieces
        )

    def fits(self, text: str) -> bool:
        return self.within(len(encode_texts(self.tokenizer, [text])[0]), self.encoder.count_wordpieces([text])[0])


def cut(text: str, limits: Limits) -> tuple[str, str]:
    """(the longest start of `text` that fits `limits`, the rest), both stripped: the start ends at a
    space where it holds one (no word is cut in two), else at a token boundary. It keeps at least one
    token, so splitting always moves on."""
    text = text.strip()
    ids = encode_texts(limits.tokenizer, [text])[0]
    start = lambda k: limits.tokenizer.decode(ids[:k])  # noqa: E731
    lo, hi = 1, len(ids) if limits.max_tokens is None else min(len(ids), limits.max_tokens)
    while lo < hi:  # the largest k whose start fits (fitting shrinks with k)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if limits.fits(start(mid).strip()) else (lo, mid - 1)
    head = start(lo)
    if not text.startswith(head):  # a token ends inside a character: the ids decode to other text
        return head.strip(), limits.tokenizer.decode(ids[lo:]).strip()
    if lo < len(ids) and not text[len(head)].isspace() and " " in head.strip():
        head = head[: head.rstrip().rfind(" ")]  # the next token goes on with the last word: end before it
    return head.strip(), text[len(head) :].strip()


def split(text: str, limits: Limits) -> list[str]:
    """Passages of `text` that each fit `limits` (module docstring), in order."""
    passages, current = [], ""
    for sentence in SENTENCE_END.split(text.strip()):
        candidate = f"{current} {sentence}" if current else sentence
        if limits.fits(candidate):
            current = candidate
            continue
        if current:
            passages.append(current)
        while sentence and not limits.fits(sentence):  # a sentence longer than a passage
            head, sentence = cut(sentence, limits)
            passages.append(head)
        current = sentence
    return [*passages, current] if current else passages


def resolve(
    texts: list[str], token_ids: list[list[int]], wordpieces: list[int], limits: Limits, mode: str
) -> tuple[list[str], list[list[int]], Counter]:
    """The texts to store and their token ids, each fitting `limits`: the texts that fit as they are,
    the long ones as `mode` makes them; and counts of what happened ("cut", "split", "passages",
    "dropped")."""
    out_texts, out_ids, counts = [], [], Counter()
    for text, ids, pieces in zip(texts, token_ids, wordpieces):
        if limits.within(len(ids), pieces):
            out_texts.append(text)
            out_ids.append(ids)
            continue
        if mode == "drop":
            counts["dropped"] += 1
            continue
        made = [p for p in ([cut(text, limits)[0]] if mode == "cut" else split(text, limits)) if p]
        counts[mode] += 1
        counts["passages"] += len(made)
        out_texts += made
        out_ids += encode_texts(limits.tokenizer, made)
    return out_texts, out_ids, counts


# --------------------------------------------------------------------------------------------------
# Lengths: what a limit would cut.


def distribution(lengths: np.ndarray) -> dict[str, int]:
    """min, median, p90, p99 and max of `lengths` (nearest rank, so every figure is a real length)."""
    if len(lengths) == 0:
        return {key: 0 for key in ("min", "median", "p90", "p99", "max")}
    q = np.percentile(lengths, [0, 50, 90, 99, 100], method="higher")
    return dict(zip(("min", "median", "p90", "p99", "max"), (int(v) for v in q)))


def over(lengths: np.ndarray, limit: int) -> dict:
    """How many of `lengths` exceed `limit`, and the share of all units (tokens, wordpieces) beyond it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    lost = int(np.maximum(lengths - limit, 0).sum())
    return {"texts": int((lengths > limit).sum()), "share": lost / total if total else 0.0}


def describe_distribution(summary: dict[str, int]) -> str:
    return " / ".join(f"{key} {value}" for key, value in summary.items())


# Below this share of the training tokens, what data.max_length cuts is a note in the log: nothing to act on.
NOTE_SHARE = 0.001


def cut_is_worth_a_warning(lengths: np.ndarray, max_length: int) -> bool:
    """Whether a model reading `max_length` tokens loses enough of `lengths` to ask the user to act: more
    than 1% of the texts longer (their 99th percentile beyond it) and at least NOTE_SHARE of the tokens.
    The bundled default corpus under the tiny preset loses 9 of 49000 texts, under 0.1% of its tokens."""
    return distribution(lengths)["p99"] > max_length and over(lengths, max_length)["share"] >= NOTE_SHARE


def percent(share: float) -> str:
    """A share as '4.1%', or 'under 0.1%' where '.1%' would print a misleading 0.0%."""
    return "under 0.1%" if 0 < share < 0.001 else f"{share:.1%}"


def cut_line(lengths: np.ndarray, max_length: int, where: str) -> str | None:
    """One line saying how much of the texts at `where` a model reading `max_length` tokens never sees,
    and what to do where it is worth a warning (cut_is_worth_a_warning); None when every text fits."""
    cut_off = over(lengths, max_length)
    if not cut_off["texts"]:
        return None
    p99 = distribution(lengths)["p99"]
    line = (
        f"{where}: {cut_off['texts']} of {len(lengths)} texts ({percent(cut_off['texts'] / len(lengths))}) are "
        f"longer than data.max_length={max_length} tokens; {percent(cut_off['share'])} of all training tokens are "
        f"never trained on (99% of the texts are at most {p99} tokens)"
    )
    if not cut_is_worth_a_warning(lengths, max_length):
        return line
    return (
        f"{line}. Raise model.max_seq_len (`mmldlm check --fix` proposes one), or prepare with "
        f"`mmldlm prepare --long-texts split --max-tokens {max_length}`"
    )


def measure(texts: list[str], limits: Limits, chunk: int = 8192) -> dict:
    """meta.json "lengths" without what became of the long texts (`outcome`): the lengths of the texts as
    read, in tokens and encoder wordpieces, and what the encoder and model lengths would cut of them."""
    tokens, pieces = [], []
    for start in range(0, len(texts), chunk):  # in chunks: the ids of a whole corpus at once would not fit
        part = texts[start : start + chunk]
        tokens += [len(ids) for ids in encode_texts(limits.tokenizer, part)]
        pieces += limits.encoder.count_wordpieces(part)
    tokens, pieces = np.array(tokens, dtype=np.int64), np.array(pieces, dtype=np.int64)
    model_lengths = sorted({*MODEL_LENGTHS, limits.max_tokens} - {None})
    return {
        "num_texts": len(tokens),
        "tokens": distribution(tokens),
        "wordpieces": distribution(pieces),
        "encoder_max_wordpieces": limits.encoder.max_wordpieces,
        "over_encoder": over(pieces, limits.encoder.max_wordpieces),
        "over_model_length": {str(n): over(tokens, n) for n in model_lengths},
        "max_tokens": limits.max_tokens,
    }


def outcome(mode: str, counts: list[Counter]) -> dict:
    """What `mode` did to the long texts, from the counts of `resolve` on each shard."""
    total = sum(counts, Counter())
    return {"long_texts": mode, **{key: total.get(key, 0) for key in ("cut", "split", "passages", "dropped")}}


def report(lengths: dict, encoder: str) -> list[str]:
    """The lines prepare prints about the lengths of the texts as read (`measure`)."""
    enc = lengths["over_encoder"]
    models = "; ".join(
        f"{limit}: {o['texts']} texts ({o['share']:.1%} of tokens)" for limit, o in lengths["over_model_length"].items()
    )
    return [
        f"lengths of the {lengths['num_texts']} texts read: tokens {describe_distribution(lengths['tokens'])}; "
        f"encoder wordpieces {describe_distribution(lengths['wordpieces'])}",
        f"over the encoder's {lengths['encoder_max_wordpieces']} wordpieces ({encoder} reads no further): "
        f"{enc['texts']} texts ({enc['share']:.1%} of wordpieces)",
        f"a model of max_seq_len N would cut, by N: {models}",
    ]


def report_outcome(lengths: dict) -> str:
    """The line prepare prints about what became of the long texts (`outcome`)."""
    limit = "the encoder's limit" + (f" or {lengths['max_tokens']} tokens" if lengths["max_tokens"] else "")
    done = {
        "cut": f"{lengths['cut']} texts cut to their start that fits",
        "split": f"{lengths['split']} texts split into {lengths['passages']} passages that fit",
        "drop": f"{lengths['dropped']} texts dropped",
    }[lengths["long_texts"]]
    return f"--long-texts {lengths['long_texts']}: over {limit}, {done}"
