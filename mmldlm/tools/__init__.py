"""Operating tools: `monitor` (health of a run from its metrics.jsonl) and `check` (a config and its
environment audited before a run starts). The commands in mmldlm/commands/ are thin wrappers."""
