"""Imported by Python's `site` at the start of every process whose PYTHONPATH holds this folder. The
launcher tests put it there, so that the workers torchrun starts from scripts/launch.sh (the real
launcher running the real `mmldlm.cli train`) get the fault of MMLDLM_TEST_FAULT from
tests/fault_injection.py. Only workers are touched: torchrun gives them LOCAL_RANK, not itself."""

import os
import sys
from pathlib import Path

if os.environ.get("MMLDLM_TEST_FAULT") and "LOCAL_RANK" in os.environ:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import fault_injection

    fault_injection.install_from_environment()
