"""Tools around training: bench (baseline vs optimized, the ablation ladder)."""
