"""`mmldlm train` for the tests, run as a subprocess (plain python or torchrun), with the faults of
MMLDLM_TEST_FAULT and the shard dump of MMLDLM_TEST_DUMP_SHARDS (tests/fault_injection.py lists them).
Usage: python tests/train_worker.py [mmldlm train arguments]."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fault_injection import install_from_environment  # noqa: E402

from mmldlm import cli  # noqa: E402

if __name__ == "__main__":
    install_from_environment()
    sys.exit(cli.main(["train", *sys.argv[1:]]))
