"""Rebuild the bundled default corpus (mmldlm/data/corpus/default.txt.gz) from WordNet 3.0.

WordNet's database files end each synset line with a gloss: a definition followed by quoted usage
examples, e.g. `| an assemblage of parts ...; "how big is that part compared to the whole?"`.
Every definition and every example becomes one sample, in database order (noun, verb, adj, adv).

    apt-get download wordnet-base && dpkg -x wordnet-base_*.deb /tmp/wordnet
    python scripts/extract_default_corpus.py /tmp/wordnet/usr/share/wordnet

The output is byte-for-byte reproducible (gzip with a fixed mtime and no file name).
"""

from __future__ import annotations

import argparse
import gzip
import re
from pathlib import Path

POS_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
EXAMPLE = re.compile(r'"([^"]+)"')
MIN_WORDS, MAX_WORDS = 3, 40  # 1-2 word examples ("patent advantages") carry little for a sentence model
MAX_CHARS = 250
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "mmldlm" / "data" / "corpus" / "default.txt.gz"


def gloss_texts(gloss: str) -> list[str]:
    """The definition and the usage examples of one gloss, whitespace-normalised."""
    definition = gloss.split('; "', 1)[0].strip().strip(';"').strip()
    # Attributions after an example ("..."- Henry Miller) lie outside the quotes and are dropped.
    texts = [definition] + EXAMPLE.findall(gloss[len(definition) :])
    return [" ".join(t.split()) for t in texts]


def extract(wordnet_dir: Path) -> tuple[list[str], dict[str, int]]:
    counts = {"read": 0, "malformed": 0, "too_short": 0, "too_long": 0, "duplicate": 0}
    seen: dict[str, None] = {}
    for name in POS_FILES:
        with open(wordnet_dir / name, encoding="utf-8") as f:
            for line in f:
                if line.startswith("  "):  # the licence header
                    continue
                for text in gloss_texts(line.split(" | ", 1)[1]):
                    counts["read"] += 1
                    num_words = len(text.split())
                    if text.count('"') % 2:  # a gloss missing its '; "' separator: definition and example run together
                        counts["malformed"] += 1
                    elif num_words < MIN_WORDS:
                        counts["too_short"] += 1
                    elif num_words > MAX_WORDS or len(text) > MAX_CHARS:
                        counts["too_long"] += 1
                    elif text in seen:
                        counts["duplicate"] += 1
                    else:
                        seen[text] = None
    return list(seen), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wordnet_dir", type=Path, help="folder holding data.noun, data.verb, data.adj, data.adv")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    texts, counts = extract(args.wordnet_dir)
    payload = ("\n".join(texts) + "\n").encode("utf-8")
    with open(args.out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
        f.write(payload)
    print(
        f"{args.out}: {len(texts)} samples kept of {counts['read']} "
        f"({counts['malformed']} malformed, {counts['too_short']} too short, {counts['too_long']} too long, "
        f"{counts['duplicate']} duplicates); "
        f"{len(payload)} bytes, {args.out.stat().st_size} gzipped"
    )


if __name__ == "__main__":
    main()
