"""`python` as an older launcher calls it under `mmldlm migrate` (sandbox.sh puts this file on its PATH as
python, python3, ...). `python -c CODE`, the launchers' arithmetic (`LR=$(python -c "print(5e-5 * 2)")`)
and GPU count (`python -c "import torch; print(torch.cuda.device_count())"`), runs here with what it may
do cut to computing and printing: an audit hook refuses writing or removing files, starting processes,
sockets, signals and native code, and `torch` is a stand-in answering the cluster's facts (its CUDA
device count, names and memory; anything else of torch raises). Every other call (a script, `-m
torch.distributed.run`) is recorded as a command, as sandbox.sh's recorder records one.

Reads MMLDLM_MIGRATE_* facts from the environment sandbox.sh runs in; stdlib only.
"""

from __future__ import annotations

import os
import sys
import time
import types

REFUSED_EVENTS = (
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "subprocess.Popen",
    "os.remove",
    "os.rmdir",
    "os.rename",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.kill",
    "os.killpg",
    "os.link",
    "os.symlink",
    "os.utime",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
    "socket.",
    "ctypes.",
    "pty.spawn",
    "signal.",
)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def audit(event: str, args: tuple) -> None:
    if event.startswith(REFUSED_EVENTS) or event == "os.fork":
        raise PermissionError(f"{event}: refused while mmldlm migrate reads the launcher")
    if event == "open" and len(args) >= 3:
        mode, flags = args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS
        )
        if writing and args[0] not in ("/dev/null", 1, 2):
            raise PermissionError(
                f"open({args[0]!r}, {mode!r}): writing refused while mmldlm migrate reads the launcher"
            )


def cluster_torch() -> types.ModuleType:
    """`torch` as the cluster would answer: the CUDA facts; everything else raises AttributeError."""
    gpus = int(os.environ["__MIG_NGPUS"])
    total = int(os.environ["__MIG_GPU_MIB"]) * 2**20
    name = os.environ["__MIG_GPU_NAME"]
    properties = types.SimpleNamespace(name=name, total_memory=total, multi_processor_count=132, major=9, minor=0)
    cuda = types.ModuleType("torch.cuda")
    cuda.is_available = lambda: True
    cuda.device_count = lambda: gpus
    cuda.get_device_name = lambda device=0: name
    cuda.get_device_properties = lambda device=0: properties
    cuda.mem_get_info = lambda device=0: (total, total)
    cuda.is_bf16_supported = lambda *args, **kwargs: True
    torch = types.ModuleType("torch")
    torch.cuda = cuda
    return torch


def _record(kind: str, words: list[str], environ: dict[str, str] | None = None) -> None:
    """One record as sandbox.sh's __mig_record writes it: kind, where, folder, words, "", environment."""
    fields = [kind, os.environ.get("__MIG_WHERE", "?"), os.environ.get("PWD", os.getcwd()), str(len(words)), *words]
    fields += [f"{k}={v}" for k, v in (environ or {}).items()]
    stamp = f"{time.time_ns() // 1000:019d}-{os.getpid()}-python"
    with open(os.path.join(os.environ["__MIG_DIR"], "rec", stamp), "x") as f:
        f.write("\0".join(fields) + "\0")


def main(argv: list[str]) -> int:
    name = os.path.basename(argv[0])
    args = argv[1:]
    flags = []
    while args and args[0].startswith("-") and args[0] not in ("-c", "-m") and not args[0].startswith("-c"):
        flags.append(args.pop(0))
    if not args or args[0] not in ("-c",) and not args[0].startswith("-c"):
        _record("cmd", [name, *flags, *args], dict(os.environ))
        return 0
    code = args[1] if args[0] == "-c" else args[0][2:]
    sys.argv = ["-c", *args[2 if args[0] == "-c" else 1 :]]
    sys.modules["torch"] = cluster_torch()
    sys.modules["torch.cuda"] = sys.modules["torch"].cuda
    sys.addaudithook(audit)
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except BaseException as err:  # the snippet's own failure, as python would print it; then named
        if isinstance(err, SystemExit):
            raise
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        sys.stdout.flush()
        _record("python-failed", [code, f"{type(err).__name__}: {err}"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))  # argv[1]: the name it was called by (python, python3, ...)
