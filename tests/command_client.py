"""The `mmldlm` of the docs pages' shell blocks: hands its arguments, directory, environment and standard
streams to tests/command_server.py (MMLDLM_COMMAND_SERVER names its socket), forwards SIGINT and SIGTERM
to the command, and exits with its status. Standard library only, run with `python -S`: it starts in
milliseconds."""

import json
import os
import signal
import socket
import sys


def main() -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(os.environ["MMLDLM_COMMAND_SERVER"])
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    pid = int(conn.recv(64).decode().split()[1])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    answer = conn.recv(64).decode()
    if not answer.startswith("exit "):
        print(f"mmldlm: no exit status of the command's process (pid {pid}): the server stopped", file=sys.stderr)
        return 1
    return int(answer.split()[1])


if __name__ == "__main__":
    sys.exit(main())
