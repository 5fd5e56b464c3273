"""An older launcher, read the way bash reads it: run under bash for the cluster (shell.py), its torchrun
call taken as torchrun's own parser and Hydra's read it, and what bash did besides that the launcher's
author would not have meant, named from what was recorded. This module owns the reading: it turns the
cluster into the sandbox's facts once (`facts_for`), and each further run of the launcher is those facts
with one thing changed:

- the branch taken: the torchrun call recorded for this cluster. The scheduler's variables a launcher
  reads (WORLD_SIZE, SLURM_NNODES, ...) are not known here: the launcher runs under each convention in
  SCHEDULER_CONVENTIONS, in order, until its torchrun call asks for the cluster's nodes and GPUs;
- overrides lost to a comment after a line continuation (`x=1 \\  # note`): bash ends the call there and
  runs each later `key=value \\` line as a command of its own, which is not found;
- bc refusing a number (`5e-5`): bc prints a syntax error, exits 0 and the variable stays empty; what the
  launcher meant is read from a second run with bc reading 5e-5 as 0.00005;
- the GPU's memory as nvidia-smi reports it (MiB): a launcher that divides it by 1024 with integer
  division reads 79 on an 80 GB H100; a second run at the card's nominal size (80 x 1024 MiB) names the
  overrides that this changes;
- `read -p` and reads of the terminal, python calls the stand-in for torch could not answer, file tests
  and folders of the cluster, files sourced that are not here, redirections, commands refused (sed -i,
  awk system()), builtins skipped (kill, trap, enable).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from hydra._internal.utils import get_args_parser as hydra_args_parser
from torch.distributed.run import get_args_parser as torchrun_args_parser

from mmldlm.tools.migrate.cluster import Cluster, MigrateError
from mmldlm.tools.migrate.shell import Facts, Record, ShellRun, run_bash

# Commands that run the command in their arguments (srun torchrun ..., env X=1 torchrun ...).
WRAPPERS = {
    "env",
    "nohup",
    "timeout",
    "srun",
    "mpirun",
    "mpiexec",
    "stdbuf",
    "numactl",
    "taskset",
    "nice",
    "ionice",
    "chrt",
    "time",
    "sudo",
    "apptainer",
    "singularity",
    "exec",
    "setsid",
    "unbuffer",
}
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w\-/@]*(\.[\w\-@]+)*=")
# The scheduler variables tried in turn (besides the user's --env), for a launcher that reads them:
# none (the launcher computes its own), one launcher per node (Kubeflow's PyTorchJob and others:
# WORLD_SIZE = nodes, RANK = node rank), WORLD_SIZE = every process, and SLURM's.
SCHEDULER_CONVENTIONS = {
    "none": lambda c: {},
    "per node (WORLD_SIZE = nodes, RANK = node rank)": lambda c: {"WORLD_SIZE": str(c.nnodes), "RANK": "0"},
    "per process (WORLD_SIZE = nodes x GPUs)": lambda c: {"WORLD_SIZE": str(c.world_size), "RANK": "0"},
    "SLURM": lambda c: {
        "SLURM_JOB_ID": "1",
        "SLURM_NNODES": str(c.nnodes),
        "SLURM_JOB_NUM_NODES": str(c.nnodes),
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_GPUS_ON_NODE": str(c.gpus_per_node),
        "SLURM_NTASKS_PER_NODE": str(c.gpus_per_node),
    },
}


def cluster_environment(cluster: Cluster) -> dict[str, str]:
    """What a user sets to run a launcher on this cluster (its ${NNODES:-1} style knobs); no MASTER_ADDR,
    so the launcher's own default stays visible."""
    return {
        "NNODES": str(cluster.nnodes),
        "NUM_NODES": str(cluster.nnodes),
        "NPROC_PER_NODE": str(cluster.gpus_per_node),
        "GPUS_PER_NODE": str(cluster.gpus_per_node),
        "NUM_GPUS": str(cluster.gpus_per_node),
        "NODE_RANK": "0",
        "USER": "user",
        "LANG": "C.UTF-8",
    }


def facts_for(cluster: Cluster, convention: str = "none") -> Facts:
    """The cluster as the sandbox answers for it, under one convention of the scheduler's variables (the
    user's --env over both)."""
    environ = {**cluster_environment(cluster), **SCHEDULER_CONVENTIONS[convention](cluster), **cluster.environ}
    return Facts(environ, cluster.gpus_per_node, cluster.gpu_memory_mib, cluster.gpu_name, cluster.cpus_per_node)


@dataclass
class TrainingCall:
    """A torchrun call as torchrun and Hydra read it."""

    record: Record
    nnodes: str
    nproc_per_node: str
    script: Path  # as resolved against the folder it ran in
    config_name: str | None
    config_path: str | None  # Hydra's --config-path, if given
    overrides: list[str]  # the Hydra override words, in order (a stray " " among them)
    environ: dict[str, str]
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def where(self) -> str:
        return self.record.where

    def override_values(self) -> dict[str, str]:
        return {w.split("=", 1)[0].lstrip("+~"): w.split("=", 1)[1] for w in self.overrides if "=" in w}

    def asks_for(self, cluster: Cluster) -> bool:
        """Whether this call runs on the cluster's nodes and GPUs (torchrun's gpu/auto: all of them)."""
        low, _, high = self.nnodes.partition(":")
        nodes_ok = low.isdigit() and int(low) <= cluster.nnodes <= int(high or low)
        procs_ok = self.nproc_per_node in ("gpu", "auto") or self.nproc_per_node == str(cluster.gpus_per_node)
        return nodes_ok and procs_ok


@dataclass
class LauncherReading:
    path: Path
    args: list[str]  # the launcher's own arguments
    facts: Facts  # what it ran with
    run: ShellRun
    convention: str
    calls: list[TrainingCall]
    call: TrainingCall | None
    lost: list[Record] = field(default_factory=list)  # the call's continuation lines bash ran as commands
    comment_line: str | None = None  # FILE:LINE of the comment after a continuation that ended the call
    meant: dict[str, str] = field(default_factory=dict)  # override -> value the launcher meant, where different
    bc_failures: list[Record] = field(default_factory=list)
    memory_branch: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (reported, nominal)
    nominal_mib: int | None = None

    @property
    def stray(self) -> list[str]:
        """Words of the call that are neither options nor overrides (the " " of `\\  # comment`)."""
        return [w for w in self.call.overrides if not OVERRIDE.match(w)] if self.call else []

    @property
    def exports(self) -> dict[str, str]:
        """The variables the launcher set in the call's environment (bash's own and the sandbox's aside)."""
        own = {"PWD", "OLDPWD", "SHLVL", "_", "PATH", "HOME"}
        given = self.facts.environ
        return {
            k: v
            for k, v in self.call.environ.items()
            if k not in own and not k.startswith("__MIG") and given.get(k) != v
        }

    @property
    def lost_overrides(self) -> list[str]:
        return [w for r in self.lost for w in r.words if OVERRIDE.match(w)]


def _torchrun_arguments(words: list[str]) -> list[str] | None:
    """The words after `torchrun` (or `python -m torch.distributed.run`) in a command, or None."""
    start = next((i for i, w in enumerate(words) if Path(w).name == "torchrun"), None)
    if start is not None and (start == 0 or Path(words[0]).name in WRAPPERS):
        return words[start + 1 :]
    module = next((i for i in range(len(words) - 1) if words[i] == "-m" and words[i + 1] in TORCHRUN_MODULES), None)
    runner = Path(words[0]).name
    if module is None or not (re.match(r"python[\d.]*$", runner) or runner in WRAPPERS):
        return None
    return [w for w in words[module + 2 :] if w not in ("--use-env", "--use_env")]


def _rendezvous(args: list[str], parsed) -> tuple[str | None, int | None]:
    """The master address and port the call gives (torchrun's defaults, 127.0.0.1:29500, are none)."""
    given = " ".join(w for w in args if w.startswith("--"))
    host, _, port = parsed.rdzv_endpoint.rpartition(":") if parsed.rdzv_endpoint else ("", "", "")
    addr = parsed.master_addr if re.search(r"--master[_-]addr", given) else host or None
    if re.search(r"--master[_-]port", given):
        return addr, parsed.master_port
    return addr, int(port) if port.isdigit() else None


def training_call(record: Record) -> TrainingCall | None:
    """The record as a torchrun call, read by torchrun's and Hydra's own parsers; None if it is not one."""
    words = record.words
    args = _torchrun_arguments(words)
    if args is None:
        return None
    env_words = dict(w.split("=", 1) for w in words[: len(words) - len(args)] if re.match(r"^[A-Za-z_]\w*=", w))
    try:
        parsed = torchrun_args_parser().parse_args(args)
        hydra = hydra_args_parser().parse_args(parsed.training_script_args)
    except SystemExit:
        raise MigrateError(
            f"{record.where}: torchrun's own argument parser refuses the call `{' '.join(words)[:200]}`"
        ) from None
    master_addr, master_port = _rendezvous(args, parsed)
    return TrainingCall(
        record=record,
        nnodes="1" if parsed.standalone else str(parsed.nnodes),
        nproc_per_node=str(parsed.nproc_per_node),
        script=Path(record.cwd) / parsed.training_script,
        config_name=hydra.config_name,
        config_path=hydra.config_path,
        overrides=list(hydra.overrides),
        environ={**record.environ, **env_words},
        master_addr=master_addr,
        master_port=master_port,
    )


def read_launcher(path: Path, args: list[str], cluster: Cluster) -> LauncherReading:
    """The launcher's torchrun call for `cluster` and what bash did that its author did not mean."""
    if not path.is_file():
        raise MigrateError(f"launcher {path}: no such file; expected the bash script that called torchrun")
    reading = None
    for convention in SCHEDULER_CONVENTIONS:
        facts = facts_for(cluster, convention)
        run = run_bash(path, args, facts)
        calls = _calls(run)
        candidate = LauncherReading(path, args, facts, run, convention, calls, calls[0] if calls else None)
        reading = reading or candidate
        if candidate.call is not None and candidate.call.asks_for(cluster):
            reading = candidate
            break
        if cluster.environ:  # the user named the scheduler's variables: no other convention is tried
            break
    if reading.call is None:
        raise MigrateError(_no_call_message(path, reading.run))
    _read_lost_lines(reading)
    _read_bc(reading)
    _read_memory_branch(reading)
    return reading


def _calls(run: ShellRun) -> list[TrainingCall]:
    return [c for c in map(training_call, run.of("cmd")) if c is not None]


def _no_call_message(path: Path, run: ShellRun) -> str:
    """One line: where bash stopped before any torchrun call, and what it said last."""
    said = next((line.strip() for line in reversed(run.output) if line.strip()), "")
    where = f" at {run.ended_at}" if run.ended_at else ""
    if run.stopped:
        how = f"bash was stopped{where} after {run.stopped}"
    else:
        how = f"bash ended{where} with status {run.status}"
    said = f": {said[:200]}" if said else ""
    missing = (
        "; bc is not installed here: install it (apt-get install bc; dnf install bc)"
        if any(r.words[3] == "missing" for r in run.of("bc"))
        else ""
    )
    return f"launcher {path}: {how} before it called torchrun (or python -m torch.distributed.run){said}{missing}"


def _read_lost_lines(reading: LauncherReading) -> None:
    """The commands bash ran right after the call that are override words: lines of the call that a
    comment after a line continuation cut off; and the comment's line."""
    records = reading.run.records
    index = records.index(reading.call.record)
    for record in records[index + 1 :]:
        if record.kind != "cmd":
            continue
        if record.words and OVERRIDE.match(record.words[0]):
            reading.lost.append(record)
        else:
            break
    if reading.stray or reading.lost:
        reading.comment_line = _comment_after_continuation(reading.call.where)


def _comment_after_continuation(where: str) -> str:
    """FILE:LINE of the first line from `where` on that holds `\\ ` followed by a comment (else `where`)."""
    file, _, line = where.rpartition(":")
    try:
        lines = Path(file).read_text(errors="replace").splitlines()
    except OSError:
        return where
    start = int(line) if line.isdigit() else 1
    found = next((n for n in range(start, len(lines) + 1) if re.search(r"\\\s+#", lines[n - 1])), None)
    return f"{file}:{found}" if found else where


def _read_bc(reading: LauncherReading) -> None:
    """bc calls that printed an error; with any, what the launcher meant, from a run where bc reads 5e-5."""
    reading.bc_failures = [r for r in reading.run.of("bc") if r.words[3] == "bc" and r.words[2].strip()]
    if not reading.bc_failures:
        return
    lenient = run_bash(reading.path, reading.args, dataclasses.replace(reading.facts, bc="lenient"))
    meant = _same_call(lenient, reading.call)
    if meant is not None:
        ours = reading.call.override_values()
        reading.meant.update({k: v for k, v in meant.override_values().items() if ours.get(k) != v})


def _read_memory_branch(reading: LauncherReading) -> None:
    """Whether the launcher's call changes between the GPU memory nvidia-smi reports and the card's
    nominal size (80 GB: 80 x 1024 MiB), where it read the memory."""
    asked = any(r.words[:1] == ["nvidia-smi"] and any("memory" in w for w in r.words) for r in reading.run.of("fact"))
    reported = reading.facts.gpu_memory_mib
    nominal = round(reported / 1024) * 1024
    if not asked or nominal == reported:
        return
    run = run_bash(reading.path, reading.args, dataclasses.replace(reading.facts, gpu_memory_mib=nominal))
    other = _same_call(run, reading.call)
    if other is None:
        return
    ours, theirs = reading.call.override_values(), other.override_values()
    reading.nominal_mib = nominal
    reading.memory_branch = {
        k: (ours.get(k, ""), theirs.get(k, "")) for k in {*ours, *theirs} if ours.get(k) != theirs.get(k)
    }


def _same_call(run: ShellRun, call: TrainingCall) -> TrainingCall | None:
    """The call of another run of the launcher that stands where `call` stood (its file and line)."""
    calls = _calls(run)
    return next((c for c in calls if c.where == call.where), calls[0] if calls else None)


# --------------------------------------------------------------------------------------------------
# The config the call names.


def config_of(call: TrainingCall, config_dir: Path | None = None) -> Path:
    """The config file of `call`: --config-name in `config_dir` where given, else in Hydra's --config-path,
    else in the config_path of the trainer's @hydra.main, else in configs/ beside the trainer script."""
    script = call.script
    if call.config_name is None:
        raise MigrateError(f"{call.where}: the torchrun call names no --config-name; give the older config as CONFIG")
    name = call.config_name if call.config_name.endswith(".yaml") else f"{call.config_name}.yaml"
    if config_dir is not None:
        if not (config_dir / name).is_file():
            raise MigrateError(f"{call.where}: --config-name {call.config_name}: no {config_dir / name}")
        return config_dir / name
    if not script.is_file():
        raise MigrateError(
            f"{call.where}: the trainer script {script} is not here; run migrate from the older repository's root "
            f"(where the launcher runs it), or give the older config as CONFIG"
        )
    folder = call.config_path or _hydra_main_config_path(script) or "configs"
    folder_path = Path(folder) if Path(folder).is_absolute() else script.parent / folder
    config = folder_path / name
    if not config.is_file():
        raise MigrateError(
            f"{call.where}: --config-name {call.config_name}: no {config}; give the older config as CONFIG"
        )
    return config


def _hydra_main_config_path(script: Path) -> str | None:
    """config_path= of the script's @hydra.main(...), read by Python's own parser."""
    try:
        tree = ast.parse(script.read_text(), str(script))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "main":
            for keyword in node.keywords:
                if keyword.arg == "config_path" and isinstance(keyword.value, ast.Constant):
                    return keyword.value.value
    return None
