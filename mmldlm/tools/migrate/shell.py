"""An older launcher run under real bash with nothing outside it touched (sandbox.sh says what runs and
what is recorded). `run_bash` makes a scratch folder with the only folder on PATH (the pure tools:
symlinks to this machine's own, sed, awk and date behind guards, bc, python), runs the launcher there
with stdin closed, a time limit and, where the kernel offers Landlock, no write outside the scratch
folder, and returns what was recorded, in the order it happened. It knows nothing of clusters: the
facts it answers with are given whole (`Facts`, made by launcher.py).

bc is this machine's GNU bc; where it is not installed, each bc call is recorded as one bc cannot make
(`bc="missing"`) and the launcher goes on with bc's output empty, as on a machine without it.
`bc="lenient"` runs bc on its input with 5e-5 written 0.00005, to learn what a launcher meant where bc
refused a number.
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mmldlm.tools.migrate.cluster import MigrateError

HERE = Path(__file__).resolve().parent
# Tools that compute from their arguments and input and write only to stdout: run as they are.
PURE_TOOLS = (
    "expr cut tr seq basename dirname wc head tail grep sort uniq cat readlink realpath printf echo true false "
    "whoami id numfmt rev paste column fold od"
).split()
PYTHON_NAMES = ("python", "python3", *(f"python3.{minor}" for minor in range(6, 15)))
TIME_LIMIT_S = 20.0
OUTPUT_LINES = 15  # of the launcher's own output, kept for the messages that quote it
# bc's input with each number in scientific notation written out (5e-5 -> 0.00005): what the author meant.
LENIENT = (
    "import re, sys, decimal; sys.stdout.write(re.sub(r'(?<![\\w.])(\\d+(?:\\.\\d*)?|\\.\\d+)[eE]([-+]?\\d+)', "
    "lambda m: format(decimal.Decimal(m.group(0)), 'f'), sys.stdin.read()))"
)


@dataclass(frozen=True)
class Facts:
    """What the launcher runs with: its whole environment (besides PATH, HOME and the sandbox's own), the
    cluster's facts as its tools report them, and how bc runs ("bc", "lenient"; "missing" where this
    machine has no bc)."""

    environ: dict[str, str]
    gpus_per_node: int
    gpu_memory_mib: int
    gpu_name: str
    cpus_per_node: int
    bc: str = "bc"


@dataclass
class Record:
    kind: str  # cmd, bc, fact, redirect, missing-cd, missing-source, assumed-test, read-prompt, tty, end, ...
    where: str  # FILE:LINE where the launcher's command starts
    cwd: str
    words: list[str]
    environ: dict[str, str] = field(default_factory=dict)  # a command's exported variables

    @property
    def line(self) -> str:
        return self.where.rsplit(":", 1)[-1]


@dataclass
class ShellRun:
    records: list[Record]
    status: int  # bash's exit status
    output: list[str]  # the launcher's last lines of output (stdout and stderr), its set -x trace aside
    stopped: str | None  # why bash was stopped before the launcher ended, if it was
    bc: str  # how bc ran: "bc", "lenient" or "missing"
    write_guard: str  # what kept writes inside the scratch folder

    def of(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.kind == kind]

    @property
    def ended_at(self) -> str | None:
        """The launcher's line bash ran last (where it ended, or last recorded where it was stopped)."""
        ends = [r for r in self.of("end") or self.records[-1:] if r.where != "?"]
        return ends[-1].where if ends else None


def run_bash(launcher: Path, args: list[str], facts: Facts, time_limit_s: float = TIME_LIMIT_S) -> ShellRun:
    """`launcher` run by bash from the current folder with `facts`."""
    bash = shutil.which("bash")
    if bash is None:
        raise MigrateError("bash is not installed here: migrate runs the older launcher under bash to read it")
    with tempfile.TemporaryDirectory(prefix="mmldlm-migrate-") as scratch:
        root = Path(scratch)
        for sub in ("rec", "out", "bin"):
            (root / sub).mkdir()
        bc = _install_tools(root / "bin", bash, facts.bc)
        env = {
            **facts.environ,
            "PATH": str(root / "bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "__MIG_DIR": scratch,
            "__MIG_BIN": str(root / "bin"),
            "__MIG_PRELUDE": str(HERE / "sandbox.sh"),
            "__MIG_NGPUS": str(facts.gpus_per_node),
            "__MIG_GPU_MIB": str(facts.gpu_memory_mib),
            "__MIG_GPU_NAME": facts.gpu_name,
            "__MIG_CPUS": str(facts.cpus_per_node),
        }
        guard = _landlock_available()
        command = [bash, "--noprofile", "--norc", "-c", _START, str(launcher), str(launcher), *args]
        status, output, stopped = _run(command, env, root, guard, time_limit_s)
        records = read_records(root / "rec")
    stops = [r for r in records if r.kind == "stop"]
    if stops and stopped is None:
        stopped = stops[0].words[0] if stops[0].words else "stopped"
    write_guard = "Landlock (the kernel refuses any write outside it)" if guard else "bash's redirections only"
    return ShellRun(records, status, output, stopped, bc, write_guard)


# At the top level of `bash -c`, so that the launcher is sourced outside any function (sandbox.sh); the
# EXIT trap records the launcher's line bash ran last.
_START = (
    'shopt -s extdebug; builtin source "$__MIG_PRELUDE"; '
    '[[ $1 == -c ]] && { __mig_file "$2"; set -- "$__MIG_FILE" "${@:3}"; }; '
    'builtin trap "__mig_record end \\$?" EXIT; trap "$__MIG_TRAP" DEBUG; builtin source "$@"'
)


def _run(command: list[str], env: dict, root: Path, guard: bool, time_limit_s: float):
    preexec = (lambda: _restrict_writes(root)) if guard else None
    proc = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group (the time limit ends all of it), no terminal
        preexec_fn=preexec,
    )
    stopped = None
    try:
        out, _ = proc.communicate(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        stopped = f"the time limit of {time_limit_s:g} s"
    lines = out.decode(errors="replace").splitlines()
    return proc.returncode, lines[-OUTPUT_LINES:], stopped


def read_records(folder: Path) -> list[Record]:
    """The records in the order they were made (each file is named by its microsecond); an empty file (a
    python call's record that was not needed) is none."""
    records, starts = [], {}
    for path in sorted(folder.iterdir(), key=lambda p: int(p.name.split("-")[0])):
        fields = path.read_bytes().decode(errors="replace").split("\0")
        if len(fields) < 4:
            continue
        kind, where, cwd, count = fields[:4]
        end = 4 + int(count)
        environ = dict(f.split("=", 1) for f in fields[end:] if "=" in f)
        records.append(Record(kind, _command_start(where, starts), cwd, fields[4:end], environ))
    return records


def _command_start(where: str, lines_of: dict[str, list[str]]) -> str:
    """FILE:LINE of the line a command starts on: bash names the second line of `torchrun \\` + options
    (the line of the command's second word); the lines before it that end in a continuation are its own."""
    file, _, line = where.rpartition(":")
    if not line.isdigit() or not file:
        return where
    if file not in lines_of:
        try:
            lines_of[file] = Path(file).read_text(errors="replace").splitlines()
        except OSError:
            lines_of[file] = []
    lines, number = lines_of[file], int(line)
    while 1 < number <= len(lines) + 1 and re.search(r"(^|[^\\])(\\\\)*\\$", lines[number - 2]):
        number -= 1
    return f"{file}:{number}"


# --------------------------------------------------------------------------------------------------
# The tools on the launcher's PATH.


def _install_tools(bin_dir: Path, bash: str, bc: str) -> str:
    """The tools of the launcher's PATH; returns how bc runs ("missing" where this machine has none)."""
    for name in PURE_TOOLS:
        real = shutil.which(name)
        if real is not None:
            (bin_dir / name).symlink_to(real)
    _write_tool(bin_dir / "bash", bash, _child_bash(bash))
    (bin_dir / "sh").symlink_to(bin_dir / "bash")
    _write_tool(bin_dir / "sed", bash, _guard_sed())
    _write_tool(bin_dir / "awk", bash, _guard_awk())
    _write_tool(bin_dir / "date", bash, _guard_date())
    python = f'exec {sys.executable} -I -S {HERE / "python_c.py"} "${{0##*/}}" "$@"'
    for name in PYTHON_NAMES:
        _write_tool(bin_dir / name, bash, python)
    real_bc = shutil.which("bc")
    if real_bc is None:
        bc, run = "missing", "{ cat >/dev/null; printf 'bc: command not found\\n' >&2; exit 127; }"
    elif bc == "lenient":
        run = f'{{ {sys.executable} -I -S -c {shlex.quote(LENIENT)} | {real_bc} "$@"; }}'
    else:
        bc, run = "bc", f'{real_bc} "$@"'
    _write_tool(bin_dir / "bc", bash, _recording_bc(run, bc))
    return bc


def _write_tool(path: Path, bash: str, body: str) -> None:
    path.write_text(f"#!{bash}\n{body}\n")
    path.chmod(0o755)


def _child_bash(bash: str) -> str:
    """bash (or sh) started by the launcher: the same shell, reading a script file, -c STRING or stdin."""
    start = f"exec {bash} --noprofile --norc -c '{_START}'"
    return f"""while [[ ${{1:-}} == [-+]* && $1 != -c && $1 != -- ]]; do [[ $1 == [-+]o ]] && shift; shift; done
[[ ${{1:-}} == -- ]] && shift
[[ ${{1:-}} == -c ]] && {start} "${{3:-bash}}" -c "$2" "${{@:4}}"
{start} "${{1:-bash}}" "${{1:-/dev/stdin}}" "${{@:2}}\""""


def _recording_bc(run: str, bc: str) -> str:
    """bc with its input, output, errors and how it ran recorded (a launcher's `$(... | bc)` hides its errors)."""
    return f"""input=$(</dev/stdin)
err="$__MIG_DIR/out/bc.$$.$RANDOM"
out=$(printf '%s\\n' "$input" | {run} 2>"$err")
status=$?
errors=$(<"$err")
printf '%s\\0' bc "${{__MIG_WHERE:-?}}" "$PWD" 4 "$input" "$out" "$errors" "{bc}" \\
    >"$__MIG_DIR/rec/${{EPOCHREALTIME/[.,]/}}-$$-bc"
[[ -n $out ]] && printf '%s\\n' "$out"
[[ -n $errors ]] && printf '%s\\n' "$errors" >&2
exit $status"""


def _refusal(what: str) -> str:
    return f"""printf '%s\\0' refused "${{__MIG_WHERE:-?}}" "$PWD" $(($# + 2)) {what} "$0" "$@" \\
    >"$__MIG_DIR/rec/${{EPOCHREALTIME/[.,]/}}-$$-refused"
exit 0"""


def _guard_sed() -> str:
    real = shutil.which("sed")
    gnu = real is not None and b"GNU" in subprocess.run([real, "--version"], capture_output=True).stdout
    sandbox = "--sandbox " if gnu else ""  # GNU sed refuses its e, r and w commands under --sandbox
    return f"""for a in "$@"; do
    case $a in -i* | --in-place* | -[!-]*i*) {_refusal("'edits a file in place'")} ;; esac
done
exec {real} {sandbox}"$@\""""


def _guard_awk() -> str:
    """awk that may not run commands or write files: gawk's --sandbox, or a refusal of any program that
    could (system, getline, pipes, print or printf redirected)."""
    real = shutil.which("gawk") or shutil.which("awk") or "awk"
    if shutil.which("gawk"):
        return f'exec {real} --sandbox "$@"'
    return f"""prog="" skip=0
for a in "$@"; do
    ((skip)) && {{ skip=0; continue; }}
    case $a in -[Fv]) skip=1 ;; -[Fv]*) ;; -f) {_refusal("'reads its program from a file'")} ;;
    -*) ;; *) [[ -z $prog ]] && prog=$a ;; esac
done
could='system|getline|[|]|(print|printf)[^;}}]*[>]'
if [[ $prog =~ $could ]]; then
    {_refusal("'could run a command or write a file'")}
fi
exec {real} "$@\""""


def _guard_date() -> str:
    return f"""for a in "$@"; do
    case $a in -s* | --set*) {_refusal("'would set the clock'")} ;; esac
done
exec {shutil.which("date") or "date"} "$@\""""


# --------------------------------------------------------------------------------------------------
# Landlock: the kernel refuses writes outside the scratch folder (Linux 5.13 and later).

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_PR_SET_NO_NEW_PRIVS = 38
_WRITE_FILE, _TRUNCATE = 1 << 1, 1 << 14
_WRITES_V1 = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make
_REFER = 1 << 13


def _landlock_abi() -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, libc.syscall(_SYS_CREATE_RULESET, None, 0, 1))
    except (OSError, AttributeError):
        return 0


def _landlock_available() -> bool:
    return sys.platform == "linux" and _landlock_abi() >= 1


def _restrict_writes(root: Path) -> None:
    """In the child before exec: writes allowed beneath `root` and to /dev/null only."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = _landlock_abi()
    handled = _WRITES_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(ctypes.c_uint64(handled)), 8, 0)
    for path, access in ((root, handled), (Path("/dev/null"), _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH)
        rule = (ctypes.c_uint8 * 12).from_buffer_copy(
            access.to_bytes(8, "little") + fd.to_bytes(4, "little", signed=True)
        )
        libc.syscall(_SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0)
        os.close(fd)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0)
    os.close(ruleset)
