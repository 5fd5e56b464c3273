"""`mmldlm migrate`: take a run of the older research codebase over, as it really trained. One module per
concern, in the order the command uses them; each imports only those above it:

- shell.py (with sandbox.sh, python_c.py): the launcher run under real bash (and this machine's bc) with
  every command that reaches outside it recorded instead of run;
- launcher.py: the one owner of reading a launcher: the cluster as the sandbox's facts, the runs it
  takes, the torchrun call bash reaches on the cluster, and the launcher's bugs;
- older_config.py: the run config composed as the older trainer composes it (Hydra);
- older_trainer.py: what the older trainer did with it (epochs, batch, betas, heads, samples read);
- mapping.py: our run config from that, every older key accounted for (OLDER_KEYS);
- audit.py: the findings, in `mmldlm check`'s shape;
- migration.py: the `Migration` from end to end, and its exit status;
- report.py: the `Migration` printed and written: the table, the findings, the files.
"""

from mmldlm.tools.migrate.cluster import Cluster, MigrateError
from mmldlm.tools.migrate.mapping import OLDER_KEYS
from mmldlm.tools.migrate.migration import Migration, migrate

__all__ = ["OLDER_KEYS", "Cluster", "MigrateError", "Migration", "migrate"]
