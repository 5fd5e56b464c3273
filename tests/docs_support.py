"""What the tests that run the documentation share: the fenced blocks of a markdown page and the commands
of a shell block, the tiny sizes appended to each `mmldlm` command so that a page runs in seconds, the
files a user brings that the pages name, the Makefile's `make train`, and the runs `make train` and the
pages' other examples leave. tests/test_readme_commands.py runs the README's commands in this process;
tests/test_docs_pages.py runs the blocks of docs/ as bash, each `mmldlm` a fork of one warm process
(tests/command_server.py) that appends `tiny_argv`'s arguments."""

from __future__ import annotations

import gzip
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from data_support import corpus_texts

from mmldlm import cli

REPO = Path(__file__).resolve().parent.parent

# The tiny sizes: a model of 64 wide and 2 blocks, 2 steps of 8 samples, decoding and evaluation of a few texts.
TINY_STEPS = 2
TINY_MODEL = ["model=tiny", "model.hidden_size=64", "model.num_blocks=2", "model.timestep_embed_dim=32"]
TINY_RUN = [f"train.steps={TINY_STEPS}", "data.num_workers=0", "eval.every=0", "checkpoint.every=1000"]
TINY_BATCH = ["train.micro_batch_size=8", "train.global_batch_size=8"]
# Where a page prepares the bundled corpus or a run reads it (data.path null): 400 of its texts, and a vocabulary
# of 1000 (prepare embeds every token with the sentence encoder: seconds per thousand).
TINY_CORPUS, TINY_VOCAB = 400, 1000
TINY_SAMPLING = ["--steps", "2", "--best-of", "1"]
TINY_EVAL = [*TINY_SAMPLING, "--num-samples", "4", "--retrieval-pool", "8", "--num-t-draws", "1", "--no-writing"]

# `mmldlm COMMAND` on a docs page -> the arguments appended to run it tiny (a later option or override wins).
TINY_ARGS = {
    "train": [*TINY_MODEL, *TINY_RUN, *TINY_BATCH, f"data.max_samples={TINY_CORPUS}", f"data.vocab_size={TINY_VOCAB}"],
    "prepare": ["--max-samples", str(TINY_CORPUS), "--vocab-size", str(TINY_VOCAB)],  # with --input default
    # bench: the loader in each config's process (the baseline's 16 workers took most of a minute a bench)
    "bench": [*TINY_MODEL, *TINY_BATCH, "data.num_workers=0", f"data.max_samples={TINY_CORPUS}"]
    + [f"data.vocab_size={TINY_VOCAB}", "--steps", "2", "--warmup", "1", "--round-steps", "1", "--no-fit"],
    "sample": TINY_SAMPLING,
    "eval": TINY_EVAL,
    "compare": TINY_EVAL,
}
# The checkpoint `make train` ends with, and the one of a tiny run: a page's file names are read with it.
MAIN_JOB_STEP, TINY_STEP = "step-0004000", f"step-{TINY_STEPS:07d}"


def tiny_argv(argv: list[str]) -> list[str]:
    """The arguments of `mmldlm ARGV` as a docs page runs it here: `TINY_ARGS` of its command appended."""
    command = next((arg for arg in argv if not arg.startswith("-")), "")
    if command == "prepare" and "default" not in argv:
        return argv  # the pages' own files are small: only the bundled corpus is cut
    return [*argv, *TINY_ARGS.get(command, [])]


@dataclass
class Block:
    """A fenced block of a page: its language, the line of its opening fence (1-based), its lines and,
    where the line before the fence is `<!-- docs test: not run, REASON -->`, why it is not run."""

    lang: str
    line: int
    lines: list[str]
    not_run: str | None = None


NOT_RUN = re.compile(r"^<!-- docs test: not run, (.+?) -->$")
OPEN_FENCE = re.compile(r"^```(\w*)\s*$")


def fenced_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order."""
    blocks, lines, open_block = [], text.splitlines(), None
    for number, line in enumerate(lines, start=1):
        if open_block is not None:
            if line.startswith("```"):
                blocks.append(open_block)
                open_block = None
            else:
                open_block.lines.append(line)
            continue
        match = OPEN_FENCE.match(line)
        if match:
            marker = NOT_RUN.match(lines[number - 2]) if number > 1 else None
            open_block = Block(match.group(1), number, [], marker.group(1) if marker else None)
    return blocks


def shell_commands(lines: list[str]) -> list[str]:
    """The commands of a shell block: a continued line joined, comments left out."""
    commands = []
    for line in re.sub(r"\\\n\s*", "", "\n".join(lines)).splitlines():
        command = re.split(r"\s+#", line.strip(), maxsplit=1)[0].strip()
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def makefile_train_commands() -> list[list[str]]:
    """The recipe of `make train`: the argv after `$(PY) -m mmldlm.cli` of each line."""
    recipe = (REPO / "Makefile").read_text(encoding="utf-8").split("\ntrain:", 1)[1].split("\n\n", 1)[0]
    return [shlex.split(line.split("-m mmldlm.cli", 1)[1]) for line in recipe.splitlines() if "-m mmldlm.cli" in line]


def write_user_inputs(root: Path) -> None:
    """What a user brings that the pages name, in `root`: a 50-sentence text file, a gzipped JSONL corpus
    (its text in the fields `text` and `body`), source lines for `sample`, a book of blank-line separated
    paragraphs, two parquet files, a folder of the older codebase's per-sample files (OLD/), and an older
    repository's root with its launchers and Hydra run configs (old-repo/: tests/data/older_repo)."""
    texts = corpus_texts()
    (root / "my_texts.txt").write_text("\n".join(texts[:50]) + "\n", encoding="utf-8")
    with gzip.open(root / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text, "body": text}) + "\n" for text in texts[50:120])
    (root / "lines.txt").write_text("\n".join(texts[120:124]) + "\n", encoding="utf-8")
    paragraphs = ["\n".join(texts[i : i + 3]) for i in range(0, 60, 3)]
    (root / "book.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    _write_parquet_pair(root, texts[:80])
    _write_older_layout(root / "OLD")
    shutil.copytree(REPO / "tests" / "data" / "older_repo", root / "old-repo")


def _write_parquet_pair(root: Path, texts: list[str]) -> None:
    for name, part in (("a.parquet", texts[::2]), ("b.parquet", texts[1::2])):
        pq.write_table(pa.table({"text": part}), root / name)


def _write_older_layout(out: Path) -> None:
    """OLD/tokens, OLD/latents and OLD/tokenizer.json as scripts/legacy_layout.py writes them (60 files)."""
    script = REPO / "scripts" / "legacy_layout.py"
    args = ["write", "--out", str(out), "--num-files", "60", "--workers", "1"]
    subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True, cwd=REPO)


# The runs the pages compare beside runs/default: another seed, and two seeds of another learning rate.
OTHER_RUNS = {
    "default-seed1": ["train.seed=1"],
    "lr5e-4": ["optim.lr=5e-4"],
    "lr5e-4-seed1": ["optim.lr=5e-4", "train.seed=1"],
}


def train_fresh_runs(tiny: list[str], tiny_eval: list[str]) -> None:
    """`make train`'s two commands with `tiny` and `tiny_eval` appended, into runs/default of the current
    directory, and the other runs the pages compare beside it."""
    train, evaluate = makefile_train_commands()
    assert cli.main([*train, *tiny]) == 0
    assert cli.main([*evaluate, *tiny_eval]) == 0
    for name, changes in OTHER_RUNS.items():
        assert cli.main([*train, *tiny, f"train.run_dir=runs/{name}", *changes]) == 0
