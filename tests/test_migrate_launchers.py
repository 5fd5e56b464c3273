"""An older launcher under `mmldlm migrate`'s bash (mmldlm/tools/migrate/shell.py, sandbox.sh): every
command that reaches outside the shell is recorded, not run, nothing is written outside the scratch
folder (with the kernel's Landlock and without it), the cluster's facts answer nvidia-smi, python and
the file tests, bc is this machine's, the terminal is never read, and a launcher that reaches no
torchrun is refused in one line."""

import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("hydra")  # launcher.py reads the call with Hydra's own argument parser
from mmldlm.tools.migrate import Cluster, MigrateError, shell
from mmldlm.tools.migrate.audit import launcher_findings
from mmldlm.tools.migrate.launcher import facts_for, read_launcher

OLDER_REPO = Path(__file__).resolve().parent / "data" / "older_repo"
CLUSTER = Cluster(2, 8, cpus_per_node=32)

HOSTILE = """\
#!/bin/bash
set -e
T={target}
rm -rf "$T"
/bin/rm -f "$T/canary.txt"
command rm -f "$T/canary.txt"
env rm -f "$T/canary.txt"
$(echo rm) -f "$T/canary.txt"
eval "rm -f \\"$T/canary.txt\\"; /usr/bin/truncate -s 0 \\"$T/canary.txt\\""
bash -c 'rm -f "$1/canary.txt"; echo gone > "$1/canary.txt"' child "$T"
echo overwritten > "$T/canary.txt"
echo appended >> "$T/canary.txt"
date > "$T/new-file.txt" 2>&1
printf 'x\\n' &> "$T/new-file2.txt"
cat <<EOF > "$T/heredoc.txt"
body
EOF
{{ echo grouped; }} > "$T/canary.txt" || true
exec 3> "$T/fd3.txt"
sed -i 's/original/changed/' "$T/canary.txt"
awk 'BEGIN {{ system("rm -f '"$T"'/canary.txt") }}'
awk 'BEGIN {{ print "x" > "'"$T"'/awk.txt" }}'
python3 -c "open('$T/py.txt', 'w').write('x')" || true
python3 -c "import os; os.remove('$T/canary.txt')" || true
tee "$T/tee.txt" < /dev/null
builtin cd "$T" && rm -f canary.txt
enable -f /nonexistent/loadable.so sleep || true
kill -0 $$
trap 'rm -f "$T/canary.txt"' EXIT
cp /etc/hostname "$T/copied.txt"
torchrun --nnodes=2 --nproc_per_node=8 train.py --config-name run a=1
"""


@pytest.fixture(params=["landlock", "bash only"])
def guard(request, monkeypatch):
    """Both ways writes are kept in: where the kernel has Landlock (here, if it has), and bash alone."""
    if request.param == "bash only":
        monkeypatch.setattr(shell, "_landlock_available", lambda: False)
    return request.param


def test_nothing_outside_the_launcher_runs_and_nothing_outside_the_scratch_folder_is_written(tmp_path, guard):
    target = tmp_path / "data"
    target.mkdir()
    (target / "canary.txt").write_text("original\n")
    launcher = tmp_path / "launch.sh"
    launcher.write_text(HOSTILE.format(target=target))
    run = shell.run_bash(launcher, [], facts_for(CLUSTER))
    assert sorted(p.name for p in target.iterdir()) == ["canary.txt"]
    assert (target / "canary.txt").read_text() == "original\n"
    recorded = [r.words[0] for r in run.of("cmd")]
    for command in ("rm", "/bin/rm", "/usr/bin/truncate", "cp", "tee", "torchrun"):
        assert command in recorded, command
    assert recorded.count("rm") >= 4  # direct, command, env, $(echo rm), eval, the child bash
    redirected = [r.words[0] for r in run.of("redirect")]
    assert f"{target}/canary.txt" in redirected and f"{target}/fd3.txt" in redirected
    refused = [r.words[0] for r in run.of("refused")]
    assert refused.count("could run a command or write a file") == 2 and "edits a file in place" in refused
    assert [r.words[0] for r in run.of("skipped")] == ["enable", "kill", "trap"]
    assert run.of("cmd")[-1].words[:3] == ["torchrun", "--nnodes=2", "--nproc_per_node=8"]
    if guard == "bash only":
        assert run.write_guard == "bash's redirections only"


FACTS = """\
#!/bin/bash
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0)
WITH_HEADER=$(nvidia-smi --query-gpu=index,memory.total --format=csv | head -2 | tr '\\n' ';')
GPUS=$(nvidia-smi -L | wc -l)
TORCH_GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
MATH=$(python3 -c "import math; print(5e-5 * math.sqrt(2))")
CPUS=$(nproc)
[ -d /cluster/only/data ] && ANSWER=exists || ANSWER=missing
[[ -d /cluster/only/data ]] && BRACKETS=exists || BRACKETS=missing
source /cluster/only/env.sh
source {env}
read -p "Continue? " REPLY
torchrun --standalone --nproc_per_node=gpu train.py "mib=$MIB" "name=$NAME" "header=$WITH_HEADER" \\
    "gpus=$GPUS" "torch=$TORCH_GPUS" "math=$MATH" "cpus=$CPUS" "test=$ANSWER" "brackets=$BRACKETS" \\
    "sourced=$FROM_ENV" "reply=$REPLY" "cwd=$(cd /cluster/only && pwd)"
"""


def test_the_clusters_facts_answer_the_launchers_questions(tmp_path):
    env = tmp_path / "env.sh"
    env.write_text("FROM_ENV=yes\n")
    launcher = tmp_path / "facts.sh"
    launcher.write_text(FACTS.format(env=env))
    run = shell.run_bash(launcher, [], facts_for(CLUSTER))
    call = run.of("cmd")[-1]
    values = dict(w.split("=", 1) for w in call.words[4:])
    assert values == {
        "mib": "81559",
        "name": "NVIDIA H100 80GB HBM3",
        "header": "index, memory.total [MiB];0, 81559 MiB;",
        "gpus": "8",
        "torch": "8",
        "math": str(5e-5 * 2**0.5),
        "cpus": "32",
        "test": "exists",  # [ -d ] of a path only the cluster has: answered as there
        "brackets": "missing",  # [[ -d ]] cannot be shadowed: answered by this machine, and named
        "sourced": "yes",
        "reply": "",
        "cwd": "/cluster/only",
    }
    assert [r.words[:2] for r in run.of("assumed-test")] == [["-d", "/cluster/only/data"]]
    assert [r.words[1] for r in run.of("missing-test")] == ["/cluster/only/data"]
    assert [r.words[0] for r in run.of("missing-source")] == ["/cluster/only/env.sh"]
    assert [r.words[0] for r in run.of("read-prompt")] == ["Continue? "]


def test_bc_refusing_5e_5_empties_the_lr_and_the_meant_lr_is_computed_by_bc(monkeypatch):
    monkeypatch.chdir(OLDER_REPO)
    reading = read_launcher(Path("scripts/launch_stable.sh"), [], CLUSTER)
    assert reading.run.bc == "bc"
    values = reading.call.override_values()
    assert values["optimizer.lr"] == "" and values["training.train_batch_size"] == "3"
    failure = reading.bc_failures[0]
    assert failure.words[:3] == ["scale=10; 5e-5 * 1.7320", "", "(standard_in) 1: syntax error"]
    # bc itself on 0.00005 * 1.7320, at scale min(5 + 4, max(10, 5, 4)) = 9
    assert reading.meant == {"optimizer.lr": ".000086600"}
    assert reading.memory_branch["training.train_batch_size"] == ("3", "4")


def test_where_bc_is_not_installed_one_error_says_so_with_the_install_line(monkeypatch, tmp_path):
    which = shutil.which
    monkeypatch.setattr(shell.shutil, "which", lambda name, *a, **k: None if name == "bc" else which(name, *a, **k))
    launcher = tmp_path / "launch.sh"
    launcher.write_text(
        '#!/bin/bash\nLR=$(echo "scale=6; 1/3" | bc)\ntorchrun --standalone --nproc_per_node=8 t.py "lr=$LR"\n'
    )
    reading = read_launcher(launcher, [], Cluster(1, 8))
    assert reading.run.bc == "missing" and reading.call.record.words[-1] == "lr="
    errors = [f for f in launcher_findings(reading, Cluster(1, 8), []) if f.rule == "launcher_bc"]
    assert len(errors) == 1 and errors[0].severity == "error"
    assert (
        errors[0].message
        == f"bc is not installed here: the launcher's 1 bc call ({launcher}:2 first) cannot be computed"
    )
    assert errors[0].fix.startswith("install it (apt-get install bc")
    # A launcher that stops there (set -e) is refused in one line that says it too.
    monkeypatch.chdir(OLDER_REPO)
    with pytest.raises(
        MigrateError,
        match=r"launch_stable.sh:43 .*: bc: command not found; bc is not installed here: install it \(apt-get",
    ):
        read_launcher(Path("scripts/launch_stable.sh"), [], CLUSTER)


def test_a_launcher_with_no_torchrun_is_refused_in_one_line_naming_where_bash_ended(tmp_path):
    launcher = tmp_path / "launch.sh"
    launcher.write_text('#!/bin/bash\nset -ux\necho "starting"\necho "$UNSET_VARIABLE"\ntorchrun train.py\n')
    with pytest.raises(MigrateError) as refused:
        read_launcher(launcher, [], Cluster(1, 8))
    message = str(refused.value)
    assert message == (
        f"launcher {launcher}: bash ended at {launcher}:4 with status 127 before it called torchrun (or python -m "
        f"torch.distributed.run): {launcher}: line 4: UNSET_VARIABLE: unbound variable"
    )  # its set -x trace, and the sandbox's, are not its output


TERMINAL = """\
#!/bin/bash
set -e
if [ "${NODE_RANK:-0}" -eq 0 ]; then
    read -p "Press Enter to start, or Ctrl+C to cancel..." </dev/tty
fi
read -n 1 -s KEY < /dev/tty
torchrun \\
    --nnodes=1 --nproc_per_node=8 train.py "key=$KEY"
"""


def test_a_read_from_the_terminal_is_answered_with_enter_and_never_reads_this_one(tmp_path):
    launcher = tmp_path / "launch.sh"
    launcher.write_text(TERMINAL)
    reading = read_launcher(launcher, [], Cluster(1, 8))
    assert reading.call.where == f"{launcher}:7"  # where the command starts: bash names its second line
    assert reading.call.record.words[-1] == "key="
    prompts = [r.words for r in reading.run.of("read-prompt")]
    assert prompts == [["Press Enter to start, or Ctrl+C to cancel...", "1"], ["", "1"]]
    warnings = [f for f in launcher_findings(reading, Cluster(1, 8), []) if f.rule == "launcher_prompt"]
    assert [f.severity for f in warnings] == ["warning", "warning"]
    assert warnings[0].message == (
        f'{launcher}:4: read -p "Press Enter to start, or Ctrl+C to cancel..." < /dev/tty waits for a person at '
        "a terminal: under a batch scheduler there is none, the redirect fails and the launcher stops here, "
        "before torchrun"
    )


# The older codebase's diagnostic line and GPU count, as the fixture launchers have them.
DIAG = next(
    line
    for line in (OLDER_REPO / "scripts" / "train_unconditional_diag.sh").read_text().splitlines()
    if line.startswith("python -c")
)
COUNT = re.search(
    r"NPROC_PER_NODE=\$\(python - <<'PY'\n.*?\nPY\n\)",
    (OLDER_REPO / "scripts" / "train_l2t_gpucount.sh").read_text(),
    re.S,
)[0]
PYTHON = f"""\
#!/bin/bash
set -e
{DIAG}
FACTS=$(python3 -c "import torch; print(torch.version.cuda, torch.backends.cudnn.version(), \\
torch.cuda.get_device_capability())")
python -c "import torch; print(torch.cuda.memory_summary())" || echo "no summary"
    {COUNT}
torchrun --nnodes=1 --nproc_per_node=$NPROC_PER_NODE train.py "facts=$FACTS"
"""


def test_python_answers_the_common_facts_and_fails_one_call_on_the_others(tmp_path):
    launcher = tmp_path / "launch.sh"
    launcher.write_text(PYTHON)
    reading = read_launcher(launcher, [], Cluster(1, 8))
    assert reading.call.nproc_per_node == "8"  # the here-document's count
    assert reading.call.record.words[-1] == "facts=12.1 90100 (9, 0)"
    assert reading.run.output[:4] == [
        "✓ PyTorch version: 2.4.0+cu121",
        "✓ CUDA available: True",
        "✓ NCCL version: (2, 20, 5)",
        "AttributeError: module 'torch.cuda' has no attribute 'memory_summary'",
    ]  # the call that asked more than the stand-in answers fails alone, as on a machine without it
    failed = [f for f in launcher_findings(reading, Cluster(1, 8), []) if f.rule == "launcher_python"]
    assert len(failed) == 1 and failed[0].severity == "warning"
    error = "AttributeError: module 'torch.cuda' has no attribute 'memory_summary'"
    assert failed[0].message == f"{launcher}:6: a python call failed here: {error}"
