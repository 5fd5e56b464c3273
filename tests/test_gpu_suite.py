"""The GPU suite's two CPU-side promises: without CUDA it says so in one line and exits 0; its
report replaces only its own part of docs/benchmarks-gpu.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the suite runs for real")
def test_gpu_suite_without_cuda_says_so_in_one_line_and_exits_0(tmp_path):
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_suite.sh")],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "OUT_DIR": str(tmp_path / "out"),
            "REPORT": str(tmp_path / "report.md"),
        },
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [
        "gpu_suite: no CUDA device is visible to torch on this machine; nothing to run"
    ]
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "out").exists()


def test_gpu_report_replaces_only_the_text_between_its_markers(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_report
    finally:
        sys.path.pop(0)
    bench = tmp_path / "bench"
    bench.mkdir()
    config = {
        "micro_batch_size": 4,
        "accumulation_steps": 1,
        "samples_per_s": 10.0,
        "tokens_per_s": 100.0,
        "global_batch_size": 8,
        "step_time_s": {"median": 0.4, "min": 0.3, "p10": 0.3, "p90": 0.5},
        "peak_memory_gib": 2.0,
        "peak_above_state_gib": 1.0,
        "state_gib": 1.0,
        "mfu": 0.25,
        "peak_memory_kind": "cuda_max_allocated",
    }
    report = {
        "command": "mmldlm bench",
        "date": "2026-01-01T00:00:00",
        "model_parameters": 1000,
        "machine": {"gpu": "Some GPU", "torch": "x", "cpus": 1, "torch_threads": 1},
        "options": {"steps": 2, "warmup": 1, "round_steps": 1, "baseline": "baseline", "optimized": "optimized"},
        "wall_time_s": 1.0,
        "baseline": "baseline",
        "optimized": "optimized",
        "order": ["baseline", "optimized"],
        "configs": {"baseline": config, "optimized": {**config, "samples_per_s": 20.0}},
        "ratios": {
            "samples_per_s": 2.0,
            "best_samples_per_s": 2.0,
            "tokens_per_s": 1.0,
            "peak_memory_gib": 1.0,
            "peak_above_state_gib": 1.0,
        },
    }
    (bench / "bench.json").write_text(json.dumps(report))
    tests_log = tmp_path / "tests.log"
    tests_log.write_text("....\n7 passed in 1.0s\n")
    out = tmp_path / "benchmarks-gpu.md"
    out.write_text(
        f"# GPU benchmarks\n\nintro\n\n{gpu_report.START}\nold report\n{gpu_report.END}\n\n## analysis\nkept\n"
    )
    assert gpu_report.main(["--out", str(out), "--tests", str(tests_log), str(bench), str(tmp_path / "missing")]) == 0
    text = out.read_text()
    assert text.startswith("# GPU benchmarks\n\nintro\n\n") and text.endswith("## analysis\nkept\n")
    assert "old report" not in text and "7 passed in 1.0s" in text and "| optimized | 4 x 1 | 20.00 |" in text
    assert "(no bench.json: that bench failed" in text
