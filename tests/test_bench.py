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
from mmldlm.data.prepare import default_prepare_options
from mmldlm.tools.bench import (
    BenchOptions,
    OutOfMemory,
    _measure,
    _summary,
    bench_configs,
    main_job_data,
    markdown,
)

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


@pytest.mark.slow  # prepares a 400-text corpus and runs two configs: 13 s
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
    # The data overrides given to every config shape it as they shape the configs: 40 texts, not the 50k.
    (override,) = main_job_data(BenchOptions(overrides=["model=tiny", "data.max_samples=40"]))
    subset = default_prepare_options(load_config("default", ["data.max_samples=40"]).data).out
    assert override == f"data.path={subset}" and subset != expected
    assert json.loads((Path(subset) / "meta.json").read_text())["lengths"]["num_texts"] == 40


def summary_of(step_times, peaks_gib, num_shards, **recorded):
    """bench's figures of a config of 1000 parameters, global batch 8, over steps of the given times
    (tokens/s 100, 200, 50, ...) with the given per-rank peaks above the runtime; `recorded`: more
    fields of every step's record."""
    setup = dict(parameters=1000, num_shards=num_shards, world_size=2, device="cpu", micro_batch_size=4)
    setup.update(global_batch_size=8, strategy="fsdp2" if num_shards > 1 else "ddp")
    records = [
        dict(step_time_s=t, accumulation_steps=1, tokens_per_s=tokens, data_wait_share=0.1, loss=3.0 - i, **recorded)
        for i, (t, tokens) in enumerate(zip(step_times, [100.0, 200.0, 50.0]))
    ]
    memory = [dict(peak_bytes=(1 + peak) * 2**30, runtime_bytes=2**30) for peak in peaks_gib]
    return _summary(setup, records, memory)


RATIO_KEYS = ("samples_per_s", "best_samples_per_s", "tokens_per_s", "peak_memory_gib", "peak_above_state_gib")


def report_of(configs: dict, steps: int, ratios: dict | None = None, **options) -> dict:
    """A bench report of `configs` (name: figures, in order; the first the baseline, the second the
    optimized row), measured over `steps` steps; every ratio 1 unless given."""
    baseline, optimized = list(configs)[:2]
    return dict(
        command="mmldlm bench",
        date="2026-11-25T15:00:00",
        machine=dict(cpus=2, torch_threads=1, torch="2"),
        model_parameters=1000,
        options=dict(steps=steps, warmup=1, round_steps=1, baseline=baseline, optimized=optimized, **options),
        wall_time_s=1.0,
        configs=configs,
        ratios=ratios or {key: 1.0 for key in RATIO_KEYS},
        order=list(configs),
    )


def test_a_configs_figures_come_from_its_steps_and_its_largest_rank_and_the_report_shows_them():
    ddp, fsdp2 = summary_of([0.5, 0.25, 1.0], [2.0, 1.5], 1), summary_of([0.5, 0.5, 0.5], [1.0, 1.0], 2)
    assert ddp["step_time_s"]["median"] == 0.5 and (ddp["step_time_s"]["min"], ddp["step_time_s"]["max"]) == (0.25, 1.0)
    assert ddp["samples_per_s"] == 8 / 0.5 and ddp["best_samples_per_s"] == 8 / 0.25  # median and fastest step
    assert ddp["tokens_per_s"] == 100.0 and ddp["total_tokens_per_s"] == pytest.approx(150 / 1.75)
    assert ddp["peak_memory_per_rank_gib"] == [2.0, 1.5] and ddp["peak_memory_gib"] == 2.0
    assert ddp["state_gib"] == pytest.approx(16 * 1000 / 2**30) and fsdp2["state_gib"] == ddp["state_gib"] / 2
    assert ddp["peak_above_state_gib"] == pytest.approx(2.0 - ddp["state_gib"])
    assert ddp["mfu"] is None and ddp["losses"] == [3.0, 2.0, 1.0]
    ratios = {key: fsdp2[key] / ddp[key] for key in RATIO_KEYS}
    md = markdown(report_of({"ddp": ddp, "fsdp2": fsdp2}, 3, ratios, processes=2))
    assert "peak RSS above runtime GiB per process" in md and "each config as 2 processes" in md
    assert "| ddp | 4 x 1 | 16.00 | 100 | 0.500 | 0.250, 0.300-0.900 | 2.00 |" in md
    assert "fsdp2 / ddp: samples/s **1.00x** (from the fastest steps 0.50x)" in md
    assert "peak memory at equal batch **0.50x**" in md
    assert "**Too few steps to decide**: 3 measured steps per config, time per sample p10..p90 " in md


def test_a_compiled_rows_graphs_and_those_run_without_cuda_graphs_are_in_its_figures_and_the_report():
    """The last record's graph counts (`compiled_graphs`, and `cuda_graph_skips` under perf.cuda_graphs)
    are the row's, and the report names them under the table; an eager row has none."""
    times = [0.5, 0.5]
    eager, compiled = summary_of(times, [1.0], 1), summary_of(times, [1.0], 1, compiled_graphs=6)
    graphs = summary_of(times, [1.0], 1, compiled_graphs=6, cuda_graph_skips=0)
    assert eager["compiled_graphs"] is None and compiled["compiled_graphs"] == 6 and graphs["cuda_graph_skips"] == 0
    md = markdown(report_of({"eager": eager, "graphs": graphs, "compiled": compiled}, 2))
    assert (
        "Compiled by the end of the measured steps: graphs 6 graphs (0 run without CUDA graphs); compiled 6 graphs."
        in md
    )


def test_the_report_says_when_its_steps_cannot_tell_the_configs_apart():
    def report(steps, times_a, times_b):
        return report_of(
            {name: summary_of(times, [1.0, 1.0], 1) for name, times in (("a", times_a), ("b", times_b))}, steps
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


def test_a_variant_row_comes_after_optimized_and_names_its_changes_against_the_baseline():
    rows = bench_configs(
        BenchOptions(overrides=["model=tiny"], variants=["optimized perf.activation_checkpointing=full"])
    )
    assert [r["name"] for r in rows] == ["baseline", "optimized", "optimized perf.activation_checkpointing=full"]
    assert [r["role"] for r in rows] == ["baseline", "optimized", "variant"]
    optimized, variant = rows[1], rows[2]
    assert set(variant["changes"]) == set(optimized["changes"])  # both leave the baseline's none
    assert variant["overrides"] == ["model=tiny", "perf.activation_checkpointing=full"]
    ladder = bench_configs(BenchOptions(ladder=True, overrides=["model=tiny"], variants=["optimized"]))
    assert [r["role"] for r in ladder[-2:]] == ["optimized", "variant"]
    assert ladder[-1]["name"] == "optimized"


@pytest.mark.slow  # each config trains in a spawned worker process
def test_bench_on_synthetic_tokens_needs_no_dataset_and_sets_each_row_against_the_baseline(tmp_path, capsys):
    """No data.path: the rows read random texts of 20-64 tokens; the report states that distribution,
    and the checkpointed row has its own figures and ratios beside auto's."""
    variant = "optimized perf.activation_checkpointing=full"
    synthetic = ["--synthetic-vocab", "300", "--synthetic-lengths", "20:64", "--synthetic-latent-dim", "8"]
    status = main(
        [
            "bench",
            *TINY,
            "model.max_seq_len=64",
            *synthetic,
            "--synthetic-samples",
            "64",
            "--variant",
            variant,
            "--steps",
            "2",
            "--warmup",
            "1",
            "--round-steps",
            "1",
            "--memory-cap-gib",
            "2",
            "--max-micro-batch",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["order"] == ["baseline", "optimized", variant]
    assert report["data"].startswith("synthetic tokens: 64 texts of uniformly random length 20-64 tokens")
    assert "300-entry vocabulary" in report["data"] and "one 8-d" in report["data"]
    for c in report["configs"].values():
        assert c["measured_steps"] == 2 and c["largest_micro_batch"] == 4
        # Real tokens per text, 20-64: all steps' tokens over their time against texts over the median
        # step time, which for two steps is their mean (one estimator: the median of each step's
        # tokens/s against it passed 64 when one step of two was slowed by another process).
        assert 20 <= c["total_tokens_per_s"] / c["samples_per_s"] <= 64
    assert report["configs"]["baseline"]["activation_checkpointing"] == "none"
    assert report["configs"][variant]["activation_checkpointing"] == "full"  # as forced; optimized's auto resolved
    assert report["configs"]["optimized"]["activation_checkpointing"] in ("none", "selective", "full")
    assert report["optimized"] == "optimized" and set(report["variant_ratios"]) == {variant}
    assert report["variant_ratios"][variant]["samples_per_s"] == pytest.approx(
        report["configs"][variant]["samples_per_s"] / report["configs"]["baseline"]["samples_per_s"]
    )
    md = (tmp_path / "bench.md").read_text()
    assert f"Data: {report['data']}." in md and f"{variant} / baseline: samples/s **" in md
    assert f"| {variant} | 4 x 2, AC full |" in md
    assert " ".join(synthetic) in report["command"] and f"--variant '{variant}'" in report["command"]


@pytest.mark.slow  # each config trains in a spawned worker process
def test_rows_one_at_a_time_each_train_alone_and_log_their_figures_as_they_finish(tmp_path, caplog):
    """--rows one-at-a-time (auto's choice on a GPU): a config's worker is built, measured and ended
    before the next one is built, so no waiting config holds memory beside it; each row's figures
    are logged the moment they are measured, and the report is that of rows taken in turns."""
    synthetic = ["--synthetic-vocab", "300", "--synthetic-lengths", "20:64", "--synthetic-latent-dim", "8"]
    steps = ["--steps", "2", "--warmup", "1", "--round-steps", "1", "--no-fit"]
    caplog.set_level("INFO", logger="mmldlm.tools.bench")
    args = [*TINY, "model.max_seq_len=64", *synthetic, "--synthetic-samples", "64", *steps]
    assert main(["bench", *args, "--rows", "one-at-a-time", "--out", str(tmp_path)]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bench: ")]
    ready = [i for i, line in enumerate(lines) if " ready (" in line]
    measured = [i for i, line in enumerate(lines) if "samples/s" in line]
    assert len(ready) == len(measured) == 2
    assert ready[0] < measured[0] < ready[1] < measured[1]  # the optimized row is built after the baseline ended
    report = json.loads((tmp_path / "bench.json").read_text())
    assert "--rows one-at-a-time" in report["command"] and report["options"]["rows"] == "one-at-a-time"
    for name, c in report["configs"].items():
        assert c["measured_steps"] == 2
        assert f"bench: {name}: {c['samples_per_s']:.2f} samples/s" in lines[measured[report["order"].index(name)]]


@pytest.mark.slow  # the config fails in its spawned worker
def test_a_bad_config_found_in_a_bench_worker_is_one_line_naming_the_row(tmp_path, capsys):
    """The data's latents are 8-d and model.latent_dim says 16: the worker that builds the row
    finds it, and bench says so as every command does, in one line with exit status 2."""
    synthetic = ["--synthetic-vocab", "300", "--synthetic-lengths", "20:64", "--synthetic-latent-dim", "8"]
    status = main(["bench", *TINY, "model.max_seq_len=64", "model.latent_dim=16", *synthetic, "--out", str(tmp_path)])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(
        "mmldlm bench: config 'baseline': config key 'model.latent_dim': got 16; expected null or 8"
    )


class Row:
    """A bench row's workers as _measure sees them: each "steps" call returns one record per step;
    with `out_of_memory_at`, that call (counting from 1) runs out of memory instead."""

    def __init__(self, name: str, out_of_memory_at: int | None = None):
        self.job, self.out_of_memory_at, self.steps_calls, self.closed = {"name": name}, out_of_memory_at, 0, False

    def call(self, *command):
        if command[0] == "steps":
            self.steps_calls += 1
            if self.steps_calls == self.out_of_memory_at:
                raise OutOfMemory("CUDA out of memory. Tried to allocate 2.00 GiB")
            return [{"records": [{"step": self.steps_calls}] * command[1]}]
        if command[0] == "memory":
            return [{"peak_bytes": 2**30, "runtime_bytes": 0}]
        return [{"ok": True}]

    def close(self):
        self.closed = True


def test_a_row_out_of_memory_is_dropped_and_said_so_while_the_others_are_measured():
    baseline, optimized = Row("baseline", out_of_memory_at=2), Row("optimized")
    live = [baseline, optimized]
    records, memory = _measure(live, BenchOptions(steps=2, warmup=1, round_steps=1))
    assert live == [optimized] and baseline.closed and not optimized.closed
    assert baseline.job["out_of_memory"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert set(records) == set(memory) == {"optimized"} and len(records["optimized"]) == 2
    assert optimized.steps_calls == 3  # one warm-up and two measured steps, after the baseline was gone
    measured = summary_of([0.5, 0.25, 1.0], [2.0], 1)
    report = dict(
        command="mmldlm bench",
        date="2026-11-26T10:00:00",
        machine=dict(gpu="H100", torch="2", cpus=16, torch_threads=16),
        model_parameters=1000,
        options=dict(steps=2, warmup=1, round_steps=1, baseline="baseline", optimized="optimized", memory_cap_gib=70),
        wall_time_s=10.0,
        baseline="baseline",
        configs={
            "baseline": {"out_of_memory": baseline.job["out_of_memory"], "largest_micro_batch": 2},
            "optimized": {**measured, "largest_micro_batch": 16},
        },
        ratios=None,
        order=["baseline", "optimized"],
    )
    md = markdown(report)
    assert "| baseline | out of memory |  |  |  |  |  |  |  |  |  | 2 |" in md and "| optimized | 4 x 1 | 16.00 |" in md
    assert "optimized / baseline: no ratios, one of them ran out of memory at this micro-batch." in md


def test_profile_step_lists_the_matrix_products_of_a_step_by_shape(tmp_path_factory, tmp_path, monkeypatch):
    """scripts/profile_step.py --shapes: the host-time tables and, below them, every matrix product of
    the profiled steps grouped by input shape, with its time and calls per step."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import profile_step

    data = prepared(tmp_path_factory)
    overrides = [*TINY, f"data.path={data}", "train.precision=fp32"]
    assert (
        profile_step.main(
            ["optimized", *overrides, "--warmup", "1", "--steps", "2", "--shapes", "--out", str(tmp_path)]
        )
        == 0
    )
    text = (tmp_path / "profile.txt").read_text()
    assert "## by host time" in text and "## matrix products by input shape (host time)" in text
    shapes = text.split("## matrix products by input shape (host time)")[1]
    rows = [line for line in shapes.splitlines() if line.startswith("| aten::")]
    assert rows and all(line.count("|") == 5 and "[[" in line for line in rows), shapes
    assert float(shapes.split("all: ")[1].split(" ms")[0]) > 0
