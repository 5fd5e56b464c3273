"""`mmldlm bench` end to end on the tiny preset: both configs measured, JSON and markdown well formed
(the slow tier: each config runs in a spawned worker); a config's figures and the markdown report
from given step records; the ladder goes from baseline to exactly the optimized config one group of
keys at a time."""

import json
from pathlib import Path

import pytest
from data_support import prepared

from mmldlm.cli import main
from mmldlm.config import flat_keys, load_config, to_dict
from mmldlm.data.dataset import default_prepare_options
from mmldlm.tools.bench import BenchOptions, _summary, bench_configs, main_job_data, markdown

# The tiny model made smaller still, no compile and no loader workers: this checks the report, not
# the speed, and must stay fast.
TINY = [
    "model=tiny",
    "model.hidden_size=64",
    "model.num_blocks=2",
    "model.timestep_embed_dim=32",
    "perf.compile=false",
    "data.num_workers=0",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
]


@pytest.mark.slow  # each config trains in a spawned worker process
def test_bench_three_steps_writes_a_well_formed_report(tmp_path_factory, tmp_path, capsys):
    data = prepared(tmp_path_factory)
    status = main(
        [
            "bench",
            *TINY,
            f"data.path={data}",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--round-steps",
            "1",
            "--memory-cap-gib",
            "4",
            "--max-micro-batch",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["order"] == ["baseline", "optimized"]
    for name in report["order"]:
        c = report["configs"][name]
        assert c["measured_steps"] == 3 and len(c["losses"]) == 3
        assert c["micro_batch_size"] * c["accumulation_steps"] == c["global_batch_size"] == 8
        assert c["samples_per_s"] > 0 and c["tokens_per_s"] > 0 and c["peak_memory_gib"] > 0
        assert c["step_time_s"]["p10"] <= c["step_time_s"]["median"] <= c["step_time_s"]["p90"]
        assert c["peak_memory_kind"] == "cpu_peak_rss_above_runtime"
        assert c["state_gib"] == pytest.approx(16 * report["model_parameters"] / 2**30)
        assert c["peak_above_state_gib"] == pytest.approx(c["peak_memory_gib"] - c["state_gib"])
        assert c["mfu"] is None  # no known peak FLOP/s on a CPU: no MFU claimed
        assert c["largest_micro_batch"] == 4  # the tiny model fits the largest tried under 4 GiB
    assert set(report["ratios"]) == {
        "samples_per_s",
        "best_samples_per_s",
        "tokens_per_s",
        "total_tokens_per_s",
        "peak_memory_gib",
        "peak_above_state_gib",
        "largest_micro_batch",
    }
    assert "model.attention" in report["configs"]["optimized"]["changes"]
    md = (tmp_path / "bench.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| config"))
    assert "samples/s" in header and "MFU" in header and "largest micro-batch" in header
    assert md.count("| baseline |") == 1 and md.count("| optimized |") == 1
    assert "optimized / baseline" in capsys.readouterr().out


def test_bench_measures_on_the_main_jobs_data_prepared_once_where_no_config_names_one(
    tmp_path_factory, tmp_path, monkeypatch
):
    # The small corpus stands in for the bundled one, whose 50k texts take minutes to encode on a CPU.
    corpus = prepared(tmp_path_factory).parent / "corpus.txt"
    monkeypatch.setattr("mmldlm.data.corpus.DEFAULT_CORPUS", corpus)
    monkeypatch.setenv("MMLDLM_CACHE", str(tmp_path))
    (override,) = main_job_data(BenchOptions(overrides=["model=tiny"]))
    expected = default_prepare_options(load_config("default", []).data).out  # what `make train` prepares
    assert override == f"data.path={expected}" and (Path(expected) / "meta.json").is_file()
    assert main_job_data(BenchOptions(overrides=["model=tiny", "data.path=/some/dir"])) == []


def summary_of(step_times, peaks_gib, num_shards):
    """bench's figures of a config of 1000 parameters, global batch 8, over steps of the given times
    (tokens/s 100, 200, 50, ...) with the given per-rank peaks above the runtime."""
    setup = dict(parameters=1000, num_shards=num_shards, world_size=2, device="cpu", micro_batch_size=4)
    setup.update(global_batch_size=8, strategy="fsdp2" if num_shards > 1 else "ddp")
    records = [
        dict(step_time_s=t, accumulation_steps=1, tokens_per_s=tokens, data_wait_share=0.1, loss=3.0 - i)
        for i, (t, tokens) in enumerate(zip(step_times, [100.0, 200.0, 50.0]))
    ]
    memory = [dict(peak_bytes=(1 + peak) * 2**30, runtime_bytes=2**30) for peak in peaks_gib]
    return _summary(setup, records, memory)


def test_a_configs_figures_come_from_its_steps_and_its_largest_rank_and_the_report_shows_them():
    ddp, fsdp2 = summary_of([0.5, 0.25, 1.0], [2.0, 1.5], 1), summary_of([0.5, 0.5, 0.5], [1.0, 1.0], 2)
    assert ddp["step_time_s"]["median"] == 0.5 and (ddp["step_time_s"]["min"], ddp["step_time_s"]["max"]) == (0.25, 1.0)
    assert ddp["samples_per_s"] == 8 / 0.5 and ddp["best_samples_per_s"] == 8 / 0.25  # median and fastest step
    assert ddp["tokens_per_s"] == 100.0 and ddp["total_tokens_per_s"] == pytest.approx(150 / 1.75)
    assert ddp["peak_memory_per_rank_gib"] == [2.0, 1.5] and ddp["peak_memory_gib"] == 2.0
    assert ddp["state_gib"] == pytest.approx(16 * 1000 / 2**30) and fsdp2["state_gib"] == ddp["state_gib"] / 2
    assert ddp["peak_above_state_gib"] == pytest.approx(2.0 - ddp["state_gib"])
    assert ddp["mfu"] is None and ddp["losses"] == [3.0, 2.0, 1.0]
    keys = ("samples_per_s", "best_samples_per_s", "tokens_per_s", "peak_memory_gib", "peak_above_state_gib")
    report = dict(
        command="mmldlm bench",
        date="2026-11-25T15:00:00",
        machine=dict(cpus=2, torch_threads=1, torch="2"),
        model_parameters=1000,
        options=dict(processes=2, steps=3, warmup=1, round_steps=1, baseline="ddp", optimized="fsdp2"),
        wall_time_s=10.0,
        configs={"ddp": ddp, "fsdp2": fsdp2},
        ratios={key: fsdp2[key] / ddp[key] for key in keys},
        order=["ddp", "fsdp2"],
    )
    md = markdown(report)
    assert "peak RSS above runtime GiB per process" in md and "each config as 2 processes" in md
    assert "| ddp | 4 x 1 | 16.00 | 100 | 0.500 | 0.250, 0.300-0.900 | 2.00 |" in md
    assert "fsdp2 / ddp: samples/s **1.00x** (from the fastest steps 0.50x)" in md
    assert "peak memory at equal batch **0.50x**" in md
    assert "**Too few steps to decide**: 3 measured steps per config, time per sample p10..p90 " in md


def test_the_report_says_when_its_steps_cannot_tell_the_configs_apart():
    def report(steps, times_a, times_b):
        configs = {name: summary_of(times, [1.0, 1.0], 1) for name, times in (("a", times_a), ("b", times_b))}
        return dict(
            command="",
            date="2026-11-26T10:00:00",
            machine=dict(cpus=2, torch_threads=1, torch="2"),
            model_parameters=1000,
            options=dict(steps=steps, warmup=1, round_steps=1, baseline="a", optimized="b"),
            wall_time_s=1.0,
            configs=configs,
            ratios={key: 1.0 for key in ("samples_per_s", "best_samples_per_s", "tokens_per_s", "peak_memory_gib")}
            | {"peak_above_state_gib": 1.0},
            order=["a", "b"],
        )

    undecided = "**Too few steps to decide**"
    assert undecided not in markdown(report(10, [1.0, 1.1, 1.05], [0.5, 0.55, 0.52]))  # apart: decided
    overlapping = markdown(report(10, [1.0, 0.5, 0.7], [0.6, 0.9, 0.8]))
    assert f"{undecided}: 10 measured steps per config" in overlapping and "(overlapping)" in overlapping
    assert "--steps 30" in overlapping
    assert undecided in markdown(report(2, [1.0, 1.1, 1.05], [0.5, 0.55, 0.52]))  # 2 steps: apart by chance


def test_ladder_adds_one_group_at_a_time_and_ends_at_optimized():
    rungs = bench_configs(BenchOptions(ladder=True, overrides=["model=tiny"]))
    assert rungs[0]["name"] == "baseline" and rungs[-1]["name"].endswith("(= optimized)")
    changed = [key for rung in rungs[1:] for key in rung["changes"]]
    assert len(changed) == len(set(changed))  # each key changes once
    assert rungs[1]["changes"][0].startswith("data.") and "model.attention" in rungs[2]["changes"]
    last = flat_keys(to_dict(load_config(rungs[-1]["config"], rungs[-1]["overrides"])))
    optimized = flat_keys(to_dict(load_config("optimized", ["model=tiny"])))
    assert {k for k in last if last[k] != optimized[k]} == {"train.run_dir"}


@pytest.mark.slow  # two spawned configs of two gloo ranks each
def test_two_process_bench_reports_memory_per_process_and_fsdp2_shards_the_state(tmp_path_factory, tmp_path):
    """Each config runs as two gloo ranks; the training-state split is per process: whole under DDP,
    halved under FSDP2, and both ranks' peaks are reported."""
    data = prepared(tmp_path_factory)
    status = main(
        [
            "bench",
            *TINY,
            f"data.path={data}",
            "--baseline",
            "optimized distributed.strategy=ddp",
            "--optimized",
            "optimized distributed.strategy=fsdp2",
            "--processes",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--round-steps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    ddp, fsdp = (report["configs"][name] for name in report["order"])
    assert report["order"] == ["optimized distributed.strategy=ddp", "optimized distributed.strategy=fsdp2"]
    assert ddp["strategy"] == "ddp" and fsdp["strategy"] == "fsdp2"
    assert ddp["processes"] == fsdp["processes"] == 2
    assert ddp["changes"] == [] and fsdp["changes"] == ["distributed.strategy"]
    for c in (ddp, fsdp):
        assert len(c["peak_memory_per_rank_gib"]) == 2 and c["peak_memory_gib"] == max(c["peak_memory_per_rank_gib"])
        assert c["measured_steps"] == 2 and c["global_batch_size"] == 8
        assert "largest_micro_batch" not in c  # the fit search runs in one process: skipped
    assert ddp["state_gib"] == pytest.approx(16 * report["model_parameters"] / 2**30)
    assert fsdp["state_gib"] == pytest.approx(ddp["state_gib"] / 2)
    # Same seed, data and modes: the two strategies train the same model.
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-4)
    md = (tmp_path / "bench.md").read_text()
    assert "per process" in md and "2 processes" in md
