"""`python` as an older launcher calls it under `mmldlm migrate` (shell.py puts this file on its PATH as
python, python3, ...). A program given inline or on stdin (`python -c CODE`, `python - <<'PY'`), the
launchers' arithmetic (`LR=$(python -c "print(5e-5 * 2)")`), GPU count and start-up diagnostics
(`torch.__version__`, `torch.cuda.nccl.version()`), runs here with what it may do cut to computing and
printing: an audit hook refuses writing or removing files, starting processes, sockets, signals and
native code, and `torch` is a stand-in answering the cluster's facts. Every other call (a script, `-m
torch.distributed.run`) is recorded as a command, as sandbox.sh's recorder records one.

The stand-in answers what launchers ask before they start training: the CUDA device count, names,
memory and capability (the cluster's, from sandbox.sh's environment), and the versions of torch 2.4.0's
CUDA 12.1 build (CUDA, NCCL 2.20.5, cuDNN 9.1), which launchers print and none branches on. Anything else
of torch fails that one call as it would on a machine without it: the error on stderr, status 1, and a
record naming the launcher's line and the attribute. stdlib only.
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
TORCH_VERSION, CUDA_VERSION, NCCL_VERSION, CUDNN_VERSION = "2.4.0+cu121", "12.1", (2, 20, 5), 90100


def audit(event: str, args: tuple) -> None:
    if event.startswith(REFUSED_EVENTS):
        raise PermissionError(f"{event}: refused while mmldlm migrate reads the launcher")
    if event == "open" and len(args) >= 3:
        mode, flags = args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS
        )
        if writing and args[0] not in ("/dev/null", 1, 2):
            raise PermissionError(f"open {args[0]} for writing: refused while mmldlm migrate reads the launcher")


class StandIn(types.ModuleType):
    """A module of the stand-in: what it was given, and for any other name the AttributeError a torch
    without it raises."""

    def __getattr__(self, name: str):
        raise AttributeError(f"module '{self.__name__}' has no attribute '{name}'")


def module(name: str, **attributes) -> StandIn:
    stand_in = StandIn(name)
    stand_in.__dict__.update(attributes)
    sys.modules[name] = stand_in
    return stand_in


def cluster_torch() -> StandIn:
    """`torch` as the cluster would answer (sandbox.sh's __MIG_* facts)."""
    gpus = int(os.environ["__MIG_NGPUS"])
    total = int(os.environ["__MIG_GPU_MIB"]) * 2**20
    name = os.environ["__MIG_GPU_NAME"]
    properties = types.SimpleNamespace(name=name, total_memory=total, multi_processor_count=132, major=9, minor=0)
    cuda = module(
        "torch.cuda",
        is_available=lambda: gpus > 0,
        device_count=lambda: gpus,
        current_device=lambda: 0,
        get_device_name=lambda device=0: name,
        get_device_properties=lambda device=0: properties,
        get_device_capability=lambda device=0: (9, 0),
        mem_get_info=lambda device=0: (total, total),
        is_bf16_supported=lambda *args, **kwargs: True,
        nccl=module("torch.cuda.nccl", version=lambda: NCCL_VERSION),
    )
    cudnn = module("torch.backends.cudnn", version=lambda: CUDNN_VERSION, is_available=lambda: True, enabled=True)
    return module(
        "torch",
        __version__=TORCH_VERSION,
        version=module("torch.version", __version__=TORCH_VERSION, cuda=CUDA_VERSION),
        cuda=cuda,
        backends=module("torch.backends", cudnn=cudnn),
    )


def _record(kind: str, words: list[str], environ: dict[str, str] | None = None, file=None) -> None:
    """One record as sandbox.sh's __mig_record writes it: kind, where, folder, words, environment; into
    `file` where it was opened before the audit hook (migrate's own bookkeeping is not the snippet's)."""
    fields = [kind, os.environ.get("__MIG_WHERE", "?"), os.environ.get("PWD", os.getcwd()), str(len(words)), *words]
    fields += [f"{k}={v}" for k, v in (environ or {}).items()]
    if file is None:
        file = open(_record_path(), "x")
    with file:
        file.write("\0".join(fields) + "\0")


def _record_path() -> str:
    return os.path.join(os.environ["__MIG_DIR"], "rec", f"{time.time_ns() // 1000:019d}-{os.getpid()}-python")


def main(argv: list[str]) -> int:
    name = os.path.basename(argv[0])
    args = argv[1:]
    flags = []
    while args and args[0].startswith("-") and args[0] not in ("-c", "-") and not args[0].startswith("-c"):
        flags.append(args.pop(0))
    if args and args[0] == "-c" and len(args) > 1:
        code, sys.argv = args[1], ["-c", *args[2:]]
    elif args and args[0].startswith("-c") and args[0] != "-c":
        code, sys.argv = args[0][2:], ["-c", *args[1:]]
    elif args[:1] == ["-"] or not (args or flags):  # the program on stdin (a here-document)
        code, sys.argv = sys.stdin.read(), ["-", *args[1:]]
    else:
        _record("cmd", [name, *flags, *args], dict(os.environ))
        return 0
    failure = open(_record_path(), "x")  # left empty, and so no record, unless the program fails
    cluster_torch()
    sys.addaudithook(audit)
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException as err:  # the program's own failure, as python prints it; then named
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        sys.stdout.flush()
        _record("python-failed", [code, f"{type(err).__name__}: {err}"], file=failure)
        return 1
    failure.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))  # argv[1]: the name it was called by (python, python3, ...)
