"""`python -m mmldlm ...`: the `mmldlm` command without its installed entry point."""

import sys

from mmldlm.cli import main

sys.exit(main())
