"""`mmldlm CMD ...` for the interruption tests, run as a subprocess and held in the middle of its work:
with MMLDLM_TEST_HOLD=module:function (or module:Class.method) that function, once called, writes its
process id to the file MMLDLM_TEST_HELD and sleeps until a signal ends the command.
Usage: python tests/held_command.py CMD [arguments]."""

import importlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmldlm import cli  # noqa: E402


def hold(target: str) -> None:
    module_name, _, attribute = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)

    def held(*args, **kwargs):
        Path(os.environ["MMLDLM_TEST_HELD"]).write_text(str(os.getpid()))
        while True:
            time.sleep(1)

    setattr(owner, name, held)


if __name__ == "__main__":
    hold(os.environ["MMLDLM_TEST_HOLD"])
    sys.exit(cli.main(sys.argv[1:]))
