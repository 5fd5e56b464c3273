"""Every page of docs/ runs as written and says what holds. The slow test runs each page's ```bash and
```python blocks top to bottom as one bash script, in a folder of its own laid out as the repository root,
with the tiny sizes of tests/docs_support.py appended to each `mmldlm` command; a command whose comment
says `exit N` must exit with N. A block that needs a GPU or several machines, or runs the test suite
itself, is marked `<!-- docs test: not run, REASON -->` on the line before its fence, and its page says
so. The fast tests keep the pages' option tables equal to the options, the reference pages short, and
the glossary and walkthrough where the README points. docs/log/ is history, its commands as they ran
then, and is not run."""

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from docs_support import (
    MAIN_JOB_STEP,
    REPO,
    TINY_ARGS,
    TINY_EVAL,
    TINY_STEP,
    fenced_blocks,
    makefile_train_commands,
    train_fresh_runs,
    write_user_inputs,
)
from test_training_distributed import free_port

from mmldlm.cli import build_parser
from mmldlm.config import DataConfig
from mmldlm.data.dataset import BatchOrder, Loader

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
NOT_RUN_REASONS = {
    "needs a GPU",
    "needs several machines",
    "runs the test suite itself",
    "prepares a GPU session (rehearsed by tests/test_gpu_suite.py)",
    "needs onnxruntime and onnx, which the project does not install",
}
# The pages whose examples start from the runs `make train` leaves (runs/default, and the runs compared
# beside it): they get a copy of tiny ones. The other pages make what they use.
PAGES_ON_RUNS = {"data.md", "sampling.md", "export.md", "quality.md", "benchmarks.md"}
PAGE_TIMEOUT = 600


def page_id(path: Path) -> str:
    return path.name


def text_of(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


# --- what a page holds -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_a_block_left_unrun_is_a_shell_block_and_says_why(path):
    for block in fenced_blocks(path.read_text(encoding="utf-8")):
        assert block.lang not in {"sh", "shell", "console", "zsh"}, f"{path.name}:{block.line}: write ```bash"
        if block.not_run:
            assert block.lang == "bash", f"{path.name}:{block.line}: only a shell block is marked not run"
            assert block.not_run in NOT_RUN_REASONS, f"{path.name}:{block.line}: {block.not_run!r}"


def first_cells(text: str) -> str:
    """The first cell of every table row of the page, one string: where a table names its options."""
    rows = (line for line in text.splitlines() if line.startswith("|"))
    return "\n".join(re.split(r"(?<!\\)\|", row)[1] for row in rows)


def options_of(command: str) -> list[str]:
    """The long options of `mmldlm COMMAND`."""
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    return [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")]


@pytest.mark.parametrize(("page", "command"), [("data.md", "prepare"), ("sampling.md", "sample")])
def test_the_option_tables_name_every_option_of_the_command(page, command):
    cells = first_cells(text_of(page))
    missing = [opt for opt in options_of(command) if opt != "--help" and not re.search(f"`{opt}[` ]", cells)]
    assert missing == [], f"docs/{page}: no table row for {missing}"


def test_the_data_section_table_names_every_key_of_data_config():
    cells = first_cells(text_of("data.md"))
    missing = [f.name for f in dataclasses.fields(DataConfig) if f"`{f.name}`" not in cells]
    assert missing == [], f"docs/data.md: no table row for data.{missing}"


REFERENCE_LENGTH = {"quality.md": 400, "troubleshooting.md": 400, "walkthrough.md": 200, "glossary.md": 200}


@pytest.mark.parametrize(("page", "limit"), REFERENCE_LENGTH.items())
def test_a_reference_page_stays_under_its_length(page, limit):
    assert len(text_of(page).splitlines()) < limit  # dated findings go to docs/log/ (docs/log/README.md)


GLOSSARY_TERMS = [
    "ELBO",
    "NELBO",
    "rep-2",
    "std ratio",
    "Fréchet distance",
    "selected on",
    "K and D",
    "EMA",
    "raw weights",
    "AC",
    "reference",
    "writing figures",
    "checkpoint that verifies",
]


def test_the_glossary_defines_the_terms_the_pages_use():
    defined = " | ".join(re.findall(r"^#{2,3} (.+)$", text_of("glossary.md"), re.M)).lower()
    # Whole words of a heading: "AC" is not defined by "packing".
    assert [term for term in GLOSSARY_TERMS if not re.search(rf"\b{re.escape(term.lower())}\b", defined)] == []


def test_the_data_page_lists_every_key_of_the_loaders_state_dict():
    order = BatchOrder(8, 2, rank=0, world_size=1, seed=0)
    loader = Loader(
        list(range(8)),
        order,
        collate=None,
        num_workers=0,
        prefetch_factor=None,
        persistent_workers=False,
        pin_memory=False,
    )
    listed = re.search(r"`state_dict\(\)` = `\{(.+?)\}`", text_of("data.md")).group(1)
    assert re.findall(r'"(\w+)"', listed) == list(loader.state_dict())


def test_the_readme_points_to_the_walkthrough_and_the_glossary_and_stays_short():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "(docs/walkthrough.md)" in readme and "(docs/glossary.md)" in readme
    assert len(readme.splitlines()) <= 150


def test_the_main_jobs_checkpoint_named_on_a_page_is_one_make_train_writes():
    """`make train` (configs/default.yaml: 4000 steps, a checkpoint every 1000) ends at step-0004000."""
    for path in [*PAGES, REPO / "README.md"]:
        for step in re.findall(r"runs/default/(?:eval|checkpoints)/step-(\d{7})", path.read_text(encoding="utf-8")):
            assert int(step) % 1000 == 0 and int(step) <= 4000, f"{path.name}: step-{step}"


# --- every page runs ---------------------------------------------------------------------------------

# Line 1 of each page is its title, never in a block: the script's line 1 holds this, so that every other
# line of the script is the page's line of the same number and a failure names the page's line.
PRELUDE = (
    "set -eo pipefail; __status=0; "
    '__expect() { local s=$__status; __status=0; [ "$s" = "$2" ] || '
    '{ echo "docs test: {page}:$1 exited $s, the page says exit $2" >&2; exit 1; }; }; '
    "trap 'echo \"docs test: {page}:$LINENO failed with exit status $?\" >&2' ERR"
)
# a command whose comment says `exit N`: `... # stall, exit 2`
EXPECTED_STATUS = re.compile(r"^(?P<code>.*?\S)\s+#[^#]*\bexit (?P<status>\d+)\b[^#]*$")


def page_script(path: Path) -> str:
    """The page as bash: its runnable blocks on their own lines, everything else blank, then `wait` for what
    a block started in the background."""
    lines = [""] * len(path.read_text(encoding="utf-8").splitlines())
    lines[0] = PRELUDE.replace("{page}", path.name)
    for block in fenced_blocks(path.read_text(encoding="utf-8")):
        if block.not_run or block.lang not in ("bash", "python"):
            continue
        for offset, line in enumerate(block.lines, start=1):
            expected = EXPECTED_STATUS.match(line) if block.lang == "bash" else None
            number = block.line + offset
            lines[number - 1] = (
                f"{expected['code']} || __status=$?; __expect {number} {expected['status']}" if expected else line
            )
        if block.lang == "python":
            lines[block.line - 1] = "python - <<'DOCS_PYTHON'"
            lines[block.line + len(block.lines)] = "DOCS_PYTHON"
    return "\n".join([*lines, "wait", ""])


def runnable(path: Path) -> bool:
    return any(not b.not_run and b.lang in ("bash", "python") for b in fenced_blocks(path.read_text(encoding="utf-8")))


def test_a_page_becomes_a_script_whose_lines_are_the_pages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```bash\nmmldlm check x   # exit 2\nmmldlm train \\\n    a=1\n```\n\n"
        "<!-- docs test: not run, needs a GPU -->\n```bash\nmmldlm bench\n```\n```python\nprint(1)\n```\n",
        encoding="utf-8",
    )
    lines = page_script(page).splitlines()
    assert lines[0].startswith("set -eo pipefail") and "page.md:$LINENO" in lines[0]
    assert lines[3] == "mmldlm check x || __status=$?; __expect 4 2"
    assert lines[4:6] == ["mmldlm train \\", "    a=1"]
    assert lines[10] == ""  # not run
    assert lines[12:15] == ["python - <<'DOCS_PYTHON'", "print(1)", "DOCS_PYTHON"]
    assert lines[-1] == "wait"


@pytest.fixture(scope="module")
def temp_dir():
    """TMPDIR of the command server and of every page, removed at the end: the server and the commands
    it still runs are SIGKILLed then, and multiprocessing's folders of those processes (`pymp-*`, which
    their exit would have removed) would be left in the system's temporary folder. A short path: Unix
    socket paths under it must stay under 108 bytes."""
    folder = tempfile.mkdtemp(prefix="mmldlm-pages-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def command_server(tmp_path_factory, temp_dir):
    """tests/command_server.py, listening: the `mmldlm` of every page."""
    root = tmp_path_factory.mktemp("server")
    path = root / "mmldlm.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": temp_dir}
    server = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "command_server.py"), str(path)], env=env, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while not path.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), "tests/command_server.py did not start listening"
    yield path
    os.killpg(server.pid, signal.SIGKILL)  # the server and any command still running
    server.wait()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """MMLDLM_CACHE of every page: the bundled corpus's tiny subset is prepared there once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def made_runs(tmp_path_factory, cache):
    """runs/default as `make train` leaves it, and the runs compared beside it, trained tiny here."""
    root = tmp_path_factory.mktemp("made-runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("MMLDLM_CACHE", str(cache))
        Path("configs").symlink_to(REPO / "configs")
        train_fresh_runs(TINY_ARGS["train"], TINY_EVAL)
    return root / "runs"


def bin_folder(root: Path) -> Path:
    """`mmldlm` (tests/command_client.py) and `make train` (the Makefile's commands, its install aside)."""
    folder = root / "bin"
    folder.mkdir()
    client = folder / "mmldlm"
    client.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{REPO / "tests" / "command_client.py"}" "$@"\n')
    make = folder / "make"
    recipe = "\n".join(f"mmldlm {shlex.join(argv)}" for argv in makefile_train_commands())
    make.write_text(
        "#!/bin/sh\n# `make train` as the Makefile runs it; its install step is this test's environment\nset -e\n"
        f'[ "$*" = train ] || {{ echo "make $*: the docs test runs make train alone" >&2; exit 2; }}\n{recipe}\n'
    )
    for tool in (client, make):
        tool.chmod(0o755)
    return folder


def page_folder(root: Path, page: str, made_runs: Path) -> Path:
    """A folder laid out as the repository root: its code, scripts and tests linked, its configs and docs
    copied (a page may write there), the user's files a page names, and the made runs where it uses them."""
    folder = root / "repo"
    folder.mkdir()
    for name in ("mmldlm", "scripts", "tests", "Makefile", "pyproject.toml", "requirements.txt"):
        (folder / name).symlink_to(REPO / name)
    for name in ("configs", "docs"):
        shutil.copytree(REPO / name, folder / name)
    (folder / "tmp").mkdir()
    write_user_inputs(folder)
    if page in PAGES_ON_RUNS:
        shutil.copytree(made_runs, folder / "runs", symlinks=True)
    return folder


# Where a page's text itself is sized for the real job, what runs here instead: (as written, as run), each
# checked to be on the page. The runs here stop at step 2 where `make train` stops at 4000.
PAGE_EDITS = {
    "data.md": [("range(605)", "range(40)")],  # the paragraphs of "Long texts": 40 instead of 605 to encode
    "benchmarks.md": [
        ("model=small", "model=tiny"),  # the scripts' runs (profile, checkpoint saves) at the tiny size too
        ("max_length: 2048,", "max_length: 64,"),  # the older shape's config, trained at the tiny model's length
        ("--num-sentences 2048", "--num-sentences 256"),  # sentences encoded
        ("--num-batches 3000", "--num-batches 300"),  # the loader's batches
        ("--num-batches 1000", "--num-batches 100"),
        ("verify-bench", "verify-bench --gib 0.01"),
        (
            "text_loss.py --rows 2650",
            "text_loss.py --hidden 32 --vocab 500 --iters 1 --rows 64",
        ),  # seconds, not a minute  # a checkpoint of 10 MiB, not the base preset's 14.9 GB
    ],
}


def tiny_script(path: Path) -> str:
    """The page's script with the edits of PAGE_EDITS, the tiny runs' last checkpoint, and /tmp/ the page
    folder's own tmp/ (pages run side by side with other jobs on one machine)."""
    script = page_script(path)
    for written, run in PAGE_EDITS.get(path.name, []):
        assert written in script, f"{path.name}: no {written!r} to run as {run!r} (PAGE_EDITS)"
        script = script.replace(written, run)
    return script.replace(MAIN_JOB_STEP, TINY_STEP).replace("/tmp/", "tmp/")


def run_page(path: Path, folder: Path, env: dict) -> subprocess.CompletedProcess:
    """The page's script in `folder`; whatever it leaves running is killed at the end."""
    script = folder.parent / f"{path.stem}.sh"
    script.write_text(tiny_script(path), encoding="utf-8")
    proc = subprocess.Popen(
        ["bash", str(script)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=PAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        err += f"\ndocs test: {path.name} did not end within {PAGE_TIMEOUT} s"
    _kill_group(proc.pid)  # what a block left in the background
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow  # every command of a page, tiny: torchrun, launchers and trainings, seconds to minutes a page
@pytest.mark.parametrize("path", [p for p in PAGES if runnable(p)], ids=page_id)
def test_every_block_of_the_page_runs_as_written(path, command_server, cache, made_runs, temp_dir, tmp_path):
    folder = page_folder(tmp_path, path.name, made_runs)
    env = {
        **os.environ,
        "TMPDIR": temp_dir,
        "PATH": os.pathsep.join([str(bin_folder(tmp_path)), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MMLDLM_CACHE": str(cache),
        "MMLDLM_COMMAND_SERVER": str(command_server),
        "MASTER_PORT": str(free_port()),  # scripts/launch.sh's rendezvous, where a page leaves it out
        "PET_MASTER_PORT": str(free_port()),  # torchrun's, likewise
    }
    result = run_page(path, folder, env)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    for check in PAGE_CHECKS.get(path.name, ()):
        check(folder)


# --- what a page's run leaves, beyond exit statuses --------------------------------------------------


def _sharded_prepare_is_the_single_process_one(folder: Path) -> None:
    one, two = folder / "data/prepared/body", folder / "data/prepared/body-2"
    names = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    assert [n for n in names if (one / n).read_bytes() != (two / n).read_bytes()] == []


def _other_text_is_evaluated_whole(folder: Path) -> None:
    report = json.loads((folder / f"runs/default/eval/{TINY_STEP}-my-texts-all.json").read_text())
    assert report["data"]["split"] == "all"


PAGE_CHECKS = {"data.md": (_sharded_prepare_is_the_single_process_one, _other_text_is_evaluated_whole)}
