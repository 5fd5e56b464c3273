"""Operating tools: `monitor` (health of a run from its metrics.jsonl), `check` (a config and its
environment audited before a run starts) and `bench` (baseline vs optimized, the ablation ladder).
The commands in mmldlm/commands/ are thin wrappers."""
