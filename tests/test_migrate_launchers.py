"""An older launcher under `mmldlm migrate`'s bash (mmldlm/tools/migrate/shell.py, sandbox.sh): every
command that reaches outside the shell is recorded, not run, nothing is written outside the scratch
folder (with the kernel's Landlock and without it), the cluster's facts answer nvidia-smi, python -c and
the file tests, and the model of bc reads what launchers pipe into bc as GNU bc does."""

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")  # launcher.py reads the call with Hydra's own argument parser
from mmldlm.tools.migrate import Cluster, bc, shell
from mmldlm.tools.migrate.audit import launcher_findings
from mmldlm.tools.migrate.launcher import cluster_environment, read_launcher

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
    run = shell.run_launcher(launcher, [], CLUSTER, cluster_environment(CLUSTER))
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
    run = shell.run_launcher(launcher, [], CLUSTER, cluster_environment(CLUSTER))
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


@pytest.mark.parametrize(
    "engine", ["model", *(["bc"] if shutil.which("bc") else [])], ids=lambda e: f"bc={e}"
)  # this machine's bc where installed, and the model that stands in where it is not
def test_bc_refusing_5e_5_empties_the_lr_and_the_meant_lr_is_computed(engine, monkeypatch):
    monkeypatch.chdir(OLDER_REPO)
    reading = read_launcher(Path("scripts/launch_stable.sh"), [], CLUSTER, bc=engine)
    assert reading.run.bc_engine == engine
    values = reading.call.override_values()
    assert values["optimizer.lr"] == "" and values["training.train_batch_size"] == "3"
    failure = reading.bc_failures[0]
    assert failure.words[:3] == ["scale=10; 5e-5 * 1.7320", "", "(standard_in) 1: syntax error"]
    # 0.00005 * 1.7320 at scale min(5 + 4, max(10, 5, 4)) = 9, as bc prints it
    assert reading.meant == {"optimizer.lr": ".000086600"}
    assert reading.memory_branch["training.train_batch_size"] == ("3", "4")


def test_where_bc_is_not_installed_its_model_stands_in_and_a_warning_says_so(monkeypatch):
    which = shutil.which
    monkeypatch.setattr(shell.shutil, "which", lambda name, *a, **k: None if name == "bc" else which(name, *a, **k))
    monkeypatch.chdir(OLDER_REPO)
    reading = read_launcher(Path("scripts/launch_stable.sh"), [], CLUSTER)
    assert reading.run.bc_engine == "model" and reading.meant == {"optimizer.lr": ".000086600"}
    warning = next(f for f in launcher_findings(reading, CLUSTER, []) if f.message.startswith("bc is not installed"))
    assert warning.severity == "warning" and "2 bc calls ran on migrate's model of GNU bc" in warning.message
    assert warning.fix == "install bc (apt-get install bc) and run migrate again"


# What GNU bc 1.07 prints for each input (stdout, then stderr), as bc itself prints it (checked below
# wherever bc is installed; the runtime errors' "adr=" differs).
GNU_BC = {
    "scale=10; 1/4": (".2500000000", ""),
    "scale=3; -1/3": ("-.333", ""),
    "1.50*2": ("3.00", ""),
    "scale=1; 1.25*1.25": ("1.56", ""),
    "scale=4; sqrt(2)": ("1.4142", ""),
    "2.5^2": ("6.2", ""),
    "scale=3; 2^-2": (".250", ""),
    "scale=2; 7%3": (".01", ""),
    "-2^2": ("4", ""),
    "3 > 2 && 0": ("0", ""),
    "x=3; x*2": ("6", ""),
    "a=1.5; a+=1; a": ("2.5", ""),
    "81559/1024": ("79", ""),
    "scale=4; sqrt(96 / 32)": ("1.7320", ""),
    "scale=10; 5e-5 * 1.7320": ("", "(standard_in) 1: syntax error"),
    "5E-5": ("54", ""),  # E is a digit (9 in a longer number): 59 - 5
    "e": ("0", ""),
    "scale=100; 1/3": ("." + "3" * 67 + "\\\n" + "3" * 33, ""),  # 68 characters and a backslash a line
    "1/0": ("", "Runtime error (func=(main), adr=0): Divide by zero"),
    "scale=3; 5e-5\n1/3": ("0", "(standard_in) 1: syntax error"),
}


@pytest.mark.parametrize("text", GNU_BC)
def test_the_model_of_bc_prints_what_gnu_bc_prints(text, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(text + "\n"))
    assert bc.main([]) == 0
    out, err = capsys.readouterr()
    assert (out.rstrip("\n"), err.rstrip("\n")) == GNU_BC[text]


@pytest.mark.parametrize("text", GNU_BC if shutil.which("bc") else [])
def test_the_table_is_what_bc_itself_prints(text):
    done = subprocess.run([shutil.which("bc")], input=text + "\n", capture_output=True, text=True)
    out, err = GNU_BC[text]
    assert done.stdout.rstrip("\n") == out
    assert re.sub(r"adr=\d+", "adr=0", done.stderr.rstrip("\n")) == err


def test_the_model_of_bc_reads_5e_5_when_lenient_and_refuses_what_it_does_not_model(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("scale=10; 5e-5 * 1.7320\n"))
    assert bc.main(["--lenient"]) == 0
    assert capsys.readouterr().out == ".000086600\n"  # what bc prints for 0.00005 * 1.7320
    monkeypatch.setattr(sys, "stdin", io.StringIO("x = 4; if (x > 3) x\n"))
    assert bc.main([]) == 3
    assert "does not read if" in capsys.readouterr().err


def test_a_launcher_with_no_torchrun_is_refused_with_what_it_said(tmp_path):
    launcher = tmp_path / "launch.sh"
    launcher.write_text('#!/bin/bash\nset -u\necho "starting $UNSET_VARIABLE"\ntorchrun train.py\n')
    with pytest.raises(Exception, match="called no torchrun.*UNSET_VARIABLE: unbound variable"):
        read_launcher(launcher, [], Cluster(1, 8))
