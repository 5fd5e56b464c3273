"""`mmldlm` for the shell blocks of the docs pages (tests/test_docs_pages.py), started in milliseconds:
this process imports mmldlm and torch once, then forks one child per command, which runs `mmldlm` with
the caller's arguments (tests/docs_support.py `tiny_argv` appends the tiny sizes), working directory,
environment and standard streams, and sends back its exit status. Importing torch afresh takes about 4 s
a command, and the pages hold about a hundred. tests/command_client.py is the `mmldlm` the blocks run.

    python tests/command_server.py SOCKET

Protocol, over a SOCK_SEQPACKET Unix socket: the client sends one JSON message {argv, cwd, env} with its
file descriptors 0, 1 and 2; a forked handler answers `pid N` of the command's process (the client
forwards SIGINT and SIGTERM to it) and `exit S` once that process has ended (128 + N for signal N)."""

import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_support  # noqa: E402
import torch  # noqa: E402, F401  (imported here once, not in every command)

import mmldlm.data.prepare  # noqa: E402, F401
import mmldlm.evaluation.evaluate  # noqa: E402, F401
import mmldlm.training.run  # noqa: E402, F401
from mmldlm import cli  # noqa: E402
from mmldlm.data.encoders import DEFAULT_ENCODER, sentence_transformer  # noqa: E402


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the finished handlers
    while True:
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            handle(conn)
        conn.close()


def handle(conn: socket.socket) -> None:
    """In a forked handler: fork the command, answer its pid, wait until its process has ended (a run
    directory's lock is released only then), and answer its exit status as bash reports one."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waited for below, and by the command for its own
    pid = os.fork()
    if pid == 0:
        run_command(json.loads(message), fds)
    for fd in fds:
        os.close(fd)
    conn.send(f"pid {pid}".encode())
    _, wait_status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    conn.send(f"exit {code if code >= 0 else 128 - code}".encode())
    os._exit(0)


def run_command(request: dict, fds: list[int]) -> None:
    """In the command's process: take the caller's streams, directory and environment, run `mmldlm`, and
    exit with its status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    try:
        status = cli.main(docs_support.tiny_argv(request["argv"]))
    except SystemExit as stop:  # argparse's refusals and --help
        status = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # a bug: its traceback, as `mmldlm` itself would end
        traceback.print_exc()
        status = 1
    sys.exit(status)


if __name__ == "__main__":
    # What `mmldlm check` reads of the machine: an idle one, as every test sees (tests/conftest.py), so that
    # a page's documented exit status does not depend on the other jobs of a shared machine.
    os.getloadavg = lambda: (0.0, 0.0, 0.0)
    # The pages' sentence encoder, loaded once as in a process that runs several commands (it is cached per
    # process): importing sentence-transformers and loading it took 5-15 s a command.
    sentence_transformer(DEFAULT_ENCODER, "cpu")
    serve(sys.argv[1])
