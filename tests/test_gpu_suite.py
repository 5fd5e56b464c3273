"""The GPU scripts' CPU-side promises: without CUDA the suite says so in one line and exits 0; its
report replaces only its own part of docs/benchmarks-gpu.md. The session script keeps to its ten
minutes by its parts' limits, names the data it needs, reports a part cut off without losing the
ones before, and its CPU rehearsal runs every part the device run takes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_support import prepared

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


def session(tmp_path, *args, **env):
    """`bash scripts/gpu_session.sh ARGS` with outputs under tmp_path and the given variables."""
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_session.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "out"), **env},
        timeout=900,
    )


def test_gpu_session_refuses_limits_that_add_up_past_its_ten_minutes(tmp_path):
    result = session(tmp_path, "--cpu", T_RUNG="300")
    assert result.returncode == 2
    assert result.stdout.strip() == (
        "gpu_session: the parts' limits add up to 770 s; expected at most 540 (the device's 600 s less the report "
        "and copies)"
    )
    assert not (tmp_path / "out").exists()


def test_gpu_session_without_its_prepared_data_names_the_command_that_makes_it(tmp_path):
    result = session(tmp_path, "--cpu", DATA=str(tmp_path / "none"))
    assert result.returncode == 2
    assert result.stdout.strip().endswith(f"--max-samples 50000 --out {tmp_path / 'none'}")


def test_a_part_cut_off_is_said_so_and_the_parts_before_it_stay_in_the_report(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_session_report
    finally:
        sys.path.pop(0)
    data = tmp_path / "data"
    data.mkdir()
    meta = dict(splits={"train": 90, "val": 10}, vocab_size=400, num_latents=1, latent_dim=384, encoder="E")
    (data / "meta.json").write_text(json.dumps(meta))
    report, section = tmp_path / "benchmarks-gpu.md", tmp_path / "session.md"
    report.write_text("# GPU benchmarks\n\nintro\n")
    common = ["--report", str(report), "--section", str(section)]
    assert gpu_session_report.main([*common, "start", "--mode", "gpu", "--data", str(data)]) == 0
    (tmp_path / "tests.log").write_text("..\n7 passed in 40.0s\n")
    (tmp_path / "rung.log").write_text("training\n")
    part = ["part", "--budget", "60", "--command", "CMD"]
    assert (
        gpu_session_report.main(
            [*common, *part, "--title", "1. tests", "--status", "0", "--seconds", "41"]
            + ["--log", str(tmp_path / "tests.log"), "--tests"]
        )
        == 0
    )
    assert (
        gpu_session_report.main(
            [*common, *part, "--title", "4. rung", "--status", "124", "--seconds", "60"]
            + ["--log", str(tmp_path / "rung.log"), "--ladder", str(tmp_path / "rung")]
        )
        == 0
    )
    text = report.read_text()
    assert text.startswith("# GPU benchmarks\n\nintro\n") and text.count(gpu_session_report.START) == 1
    assert "90 train + 10 val texts, vocabulary 400, latents 1x384 from E" in text
    assert "### 1. tests" in text and "done in 41 s of its 60 s" in text and "7 passed in 40.0s" in text
    assert "### 4. rung" in text and "**cut off** at its limit of 60 s" in text and "the rung did not finish" in text
    # a bench cut off before its report: the rows it had measured, from its log
    (tmp_path / "shape.log").write_text(
        "bench: baseline ready (cuda:0, micro-batch 4)\n"
        "bench: baseline: 12.50 samples/s, 17,000 tokens/s, peak 51.20 GiB, MFU 6.0% (micro-batch 4)\n"
        "bench: optimized ready (cuda:0, micro-batch 4)\n"
    )
    part = [*part[:3], "--command", "BENCH", "--title", "1a. shape", "--status", "124", "--seconds", "60"]
    log = ["--log", str(tmp_path / "shape.log"), "--bench", str(tmp_path / "shape")]
    assert gpu_session_report.main([*common, *part, *log]) == 0
    text = report.read_text()
    assert "Rows it measured before it ended (its log):" in text
    assert "- bench: baseline: 12.50 samples/s, 17,000 tokens/s, peak 51.20 GiB, MFU 6.0% (micro-batch 4)" in text
    assert "- bench: optimized ready" not in text


@pytest.mark.slow  # every part of the session at tiny shapes: 1.5 to 7 minutes on 2 shared cores
def test_gpu_session_rehearsal_on_a_cpu_runs_every_part_and_reports_each(tmp_path_factory, tmp_path):
    copies = tmp_path / "copies"
    result = session(tmp_path, "--cpu", DATA=str(prepared(tmp_path_factory)), COPY_TO=str(copies))
    assert result.returncode == 0, result.stdout + result.stderr
    text = (tmp_path / "out" / "report.md").read_text()
    assert text.count("done in ") == 10 and "failed" not in text and "cut off" not in text
    for title in (
        "1a. The older",
        "1b. The older",
        "1c. The older",
        "1d. The older",
        "1e. The older",
        "1f. The older",
        "2. Short texts",
        "2b. Short texts",
        "3. A first",
        "4. CUDA-only",
    ):
        assert f"### {title}" in text
    assert "wall " in text and "## by host time" in text  # the profile's head, in the report
    assert "| optimized | 8 x 1, AC " in text
    assert "| optimized perf.cudnn_attention=true data.length_buckets=[64] | 8 x 1, AC " in text
    assert "| optimized perf.compute_weights=true | 8 x 1" in text
    assert "| packed: block-diagonal mask | default | " in text  # part 1d's attention kernels
    assert "| padded: a new key mask each call | default | " in text
    assert "| fused, chunk by chunk | " in text  # part 1e's text head and loss
    assert "| optimized perf.grouped_linears=true | 8 x 1" in text  # part 1f
    # part 1b: compiled without and with CUDA graphs and cuDNN's attention, padded and packed (their
    # length buckets and packed row counts alone on a CPU, where compile is off and cuDNN absent)
    assert "| compiled | 8 x 1, AC " in text
    assert "| compiled data.length_buckets=[64] perf.cudnn_attention=true | 8 x 1" in text
    wide = "model.attention=varlen data.packing=true data.pack_length=512 data.pack_rows=[1] data.length_buckets=[384]"
    assert f"| compiled {wide} | 8 x 1" in text
    # part 2: short texts at the batch whose loss after equal samples holds, the blocks' graphs, the
    # whole model's (its filled text rows alone on a CPU, where compile is off) and one packed row
    assert "| compiled data.length_buckets=[64] | 16 x 1" in text
    assert "| compiled data.length_buckets=[64] perf.text_row_buckets=4 | 16 x 1" in text
    packed = "data.packing=true data.pack_length=256 data.pack_rows=[1] data.length_buckets=[128]"
    assert f"| compiled data.length_buckets=[64] {packed} | 16 x 1" in text
    assert text.count("| reference: plain transformer | ") == 3  # parts 1a, 1b and 2, each beside its rows
    assert "tokens/s ÷ reference" in text
    # what comes back from the device: the report so far and every part's log, as each part ended
    assert (copies / "session.md").read_text() == (tmp_path / "out" / "session.md").read_text()
    logs = {
        "shape-4.log",
        "shape-8.log",
        "profile.log",
        "attention.log",
        "text-loss.log",
        "grouped.log",
        "base.log",
        "parts.log",
        "rung.log",
        "tests.log",
    }
    assert {p.name for p in copies.iterdir()} == {"session.md", "profile.txt", *logs}
    # part 2b: the host's time by part outside the model, the update's pieces among them
    assert "| part of the step, 5 steps after 20 | ms per step (mean) | calls per step |" in text
    assert "| of it: AdamW's parameter lists (Python, per group) | " in text
    assert "Data: synthetic tokens: 64 texts of uniformly random length 20-64 tokens" in text
    assert "| tiny:1 | " in text and "l2t word F1" in text
    assert "Session ended" in text
    # the lease's second call on the warm machine, whose runs/ keeps the first call's outputs: the
    # ladder runs in a folder of its own, the first's left as it was
    first = sorted(p.relative_to(tmp_path) for p in (tmp_path / "out" / "rung").rglob("*"))
    others = ("SHAPE4", "SHAPE8", "PROFILE", "ATTENTION", "LOSS", "GROUPED", "BASE", "PARTS", "TESTS")
    again = session(tmp_path, "--cpu", DATA=str(prepared(tmp_path_factory)), **{f"T_{n}": "0" for n in others})
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "out" / "rung").rglob("*")) == first
    assert (tmp_path / "out" / "rung-2" / "ladder.md").exists() and (tmp_path / "out" / "rung-2.log").exists()
