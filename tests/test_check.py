"""`mmldlm check` on the tiny preset: each planted problem is flagged by its rule (and nothing else
is an error or a warning), `--fix` output passes, and the command's exit codes."""

import dataclasses
import os
import re

import pytest
import torch
import yaml

from mmldlm import cli
from mmldlm.config import CheckpointConfig, RunConfig, infeasible, load_config
from mmldlm.tools.check import RULES, Environment, audit, detect_environment, estimate, fix_config
from mmldlm.training.checkpoint import CheckpointManager
from mmldlm.training.distributed import DistInfo

# A machine described by hand, so findings do not depend on where the tests run: 2 processes on a
# node with 8 CPUs, 24 GiB per process, plenty of disk, fused AdamW available.
ENV = Environment(
    device="cuda",
    device_memory_gib=24.0,
    cpus=8,
    nproc_per_node=2,
    nnodes=1,
    free_disk_gib=500.0,
    fused_adamw=True,
    native_bf16=True,
)
CLEAN = ["model=tiny", "train.steps=600", "train.global_batch_size=32", "train.micro_batch_size=16"]


def findings_of(tmp_path, overrides, env=ENV):
    # A cache of its own: the bundled corpus prepared in the user's cache would add its data findings.
    isolated = [f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config(None, [*CLEAN, *isolated, *overrides])
    return cfg, audit(cfg, env)[0]


def serious(findings):
    return sorted((f.rule, f.severity) for f in findings if f.severity != "info")


def test_a_clean_config_has_no_error_or_warning(tmp_path):
    _, findings = findings_of(tmp_path, [])
    assert serious(findings) == []
    # The random mode mix leaves a head idle on l2t/t2l steps: explained, nothing to fix.
    assert [(f.rule, f.severity) for f in findings] == [("unused_parameters", "info")]
    assert "find_unused_parameters=False" in findings[0].why


def test_a_heartbeat_timeout_beside_the_monitor_turned_off_is_named_moot_not_an_error(tmp_path):
    environ = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "12000000", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    _, findings = findings_of(tmp_path, [], Environment(**{**ENV.__dict__, "environ": environ}))
    assert serious(findings) == [("nccl_env", "warning")]  # the monitor off: its own warning
    moot = next(f for f in findings if f.message.startswith("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"))
    assert (
        moot.severity == "info" and "has no effect: TORCH_NCCL_ENABLE_MONITORING=0 turns the heartbeat" in moot.message
    )


def test_memory_is_estimated_under_the_activation_checkpointing_auto_would_pick(tmp_path):
    # A micro-batch that fits only with checkpointing: auto is estimated as the least that fits.
    overrides = ["train.micro_batch_size=16", "train.global_batch_size=32", "model.max_seq_len=2048"]
    env = Environment(**{**ENV.__dict__, "device_memory_gib": 4.8})
    cfg, _ = findings_of(tmp_path, overrides, env)
    sizes = {}
    for mode in ("none", "selective", "full", "auto"):
        est = estimate(dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, activation_checkpointing=mode)), env)
        sizes[mode] = (est.checkpointing, est.memory_gib(16))
    assert sizes["none"][1] > sizes["selective"][1] > sizes["full"][1]
    picked = next(mode for mode in ("none", "selective", "full") if sizes[mode][1] <= 0.9 * 4.8)
    assert sizes["auto"] == (f"{picked} (what auto picks)", sizes[picked][1]) and picked != "none"


@pytest.mark.parametrize(
    "overrides,env_changes,expected",
    [
        (["distributed.timeout_minutes=198720"], {}, [("timeout", "error")]),  # 138 days
        (["distributed.timeout_minutes=1"], {}, [("timeout", "warning")]),
        ([], {"environ": {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "11923200"}}, [("nccl_env", "error")]),
        ([], {"environ": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}}, [("nccl_env", "error")]),
        ([], {"environ": {"NCCL_BLOCKING_WAIT": "1"}}, [("nccl_env", "warning")]),
        ([], {"environ": {"TORCH_NCCL_BLOCKING_WAIT": "1"}}, [("nccl_env", "warning")]),
        ([], {"environ": {"TORCH_NCCL_ENABLE_MONITORING": "0"}}, [("nccl_env", "warning")]),
        (["data.num_workers=16"], {}, [("loader_workers", "warning")]),
        (["data.prefetch_factor=null"], {}, [("loader_prefetch", "warning")]),
        (["data.persistent_workers=false"], {}, [("loader_persistence", "warning")]),
        (["data.pin_memory=false"], {}, [("loader_pin_memory", "warning")]),
        (["train.micro_batch_size=4096", "train.global_batch_size=8192"], {}, [("memory", "error")]),
        (["optim.fused=true"], {"fused_adamw": False}, [("fused_optimizer", "error")]),
        (["optim.fused=false"], {}, [("fused_optimizer", "warning")]),
        (
            ["checkpoint.every=10", "checkpoint.keep_last=60"],
            {"free_disk_gib": 3.0},
            [("checkpoint_retention", "error")],
        ),
        (
            ["checkpoint.every=10", "checkpoint.milestone_every=20"],
            {"free_disk_gib": 3.0},
            [("checkpoint_retention", "warning")],
        ),
        (["train.micro_batch_size=12", "train.global_batch_size=36"], {}, [("batch_divisible", "error")]),
        (["train.batch_schedule=[[0, 48], [300, 64]]"], {}, [("batch_divisible", "error")]),
        (["schedule.warmup_steps=600"], {}, [("lr_schedule", "error")]),
        (
            ["schedule.kind=cosine_restarts", "schedule.restart_period=400", "schedule.warmup_steps=0"],
            {},
            [("lr_schedule", "warning")],
        ),
        (["train.batch_schedule=[[0, 32], [600, 64]]"], {}, [("lr_schedule", "warning")]),
        (["distributed.find_unused_parameters=true"], {}, [("find_unused_parameters", "warning")]),
        (["optim.foreach=false", "optim.fused=false"], {"fused_adamw": False}, [("optimizer_loop", "warning")]),
        (["perf.refreeze_every_step=true"], {}, [("refreeze", "warning")]),
        (["model.attention=explicit"], {}, [("attention", "warning")]),
        (["perf.compile=true"], {}, [("compile_shapes", "warning")]),
        (["perf.compile=true", "perf.cuda_graphs=true"], {}, [("cuda_graphs_shapes", "warning")]),
        (["perf.cudnn_attention=true"], {}, [("cudnn_attention_shapes", "warning")]),
        (["perf.cudnn_attention=true", "data.packing=true"], {}, [("cudnn_attention_packing", "warning")]),
        (["data.packing=true", "data.bucket_batches=32"], {}, [("packing_gaps", "warning")]),
        (["data.packing=true", "data.pack_length=1024"], {}, [("packed_rows_mask", "warning")]),
        (["checkpoint.async_save=true"], {"device": "cpu", "native_bf16": True}, [("async_save", "warning")]),
        (["optim.step_in_backward=true", "optim.grad_clip=0"], {}, [("step_in_backward", "error")]),
        (["optim.step_in_backward=true", "optim.grad_clip=0"], {"nproc_per_node": 1}, [("step_in_backward", "error")]),
        (
            [],
            {"device": "cpu", "cpus": 2, "nproc_per_node": 1, "load": 1.0, "torch_threads": 2},
            [("busy_cpus", "warning")],
        ),
    ],
)
def test_planted_problem_is_flagged_and_fix_passes(tmp_path, overrides, env_changes, expected):
    env = Environment(**{**ENV.__dict__, **env_changes})
    cfg, findings = findings_of(tmp_path, overrides, env)
    assert serious(findings) == expected
    flagged = next(f for f in findings if f.severity != "info")
    assert flagged.why and flagged.fix
    if not flagged.changes:  # an environment variable: the fix is outside the config
        assert flagged.fix.startswith("unset ")
        return
    fixed, applied = fix_config(cfg, env)
    assert applied and serious(audit(fixed, env)[0]) == []
    assert fixed.train.global_batch_size == cfg.train.global_batch_size  # the training itself stays the same


def test_few_shapes_keep_cuda_graphs_and_cudnn_attention_quiet(tmp_path):
    """Length buckets, or packed rows padded to a few row counts: no shape warning for either switch."""
    for overrides in (
        ["data.length_buckets=[32, 64]"],
        ["data.packing=true", "data.pack_rows=[4, 6]", "data.bucket_batches=1"],
    ):
        switches = ["perf.compile=true", "perf.cuda_graphs=true", "perf.cudnn_attention=true"]
        _, findings = findings_of(tmp_path, [*switches, *overrides])
        assert serious(findings) == [], overrides


def test_the_whole_models_graphs_are_counted_where_its_shapes_are_static(tmp_path):
    """perf.compile_model under static shapes: a note with the number of graphs the batches can ask
    for (shapes x, per shape, one for t2l and one per text-row count for each text mode), a warning
    past 24 and on packed rows of any count; with symbolic shapes, or each block compiled, nothing."""
    whole = ["perf.compile=true", "perf.compile_model=true", "perf.compile_dynamic=false", "perf.text_row_buckets=4"]

    def graphs_finding(overrides):
        _, findings = findings_of(tmp_path, overrides)
        found = [f for f in findings if f.rule == "compile_model_graphs"]
        assert len(found) <= 1
        return found[0] if found else None

    one_length = graphs_finding([*whole, "data.pad_to_multiple=64"])  # tiny: texts of at most 64 tokens
    assert one_length.severity == "info"
    assert "up to 9 graphs" in one_length.message and "1 batch shape x 9" in one_length.message
    assert "l2t, t2l, joint" in one_length.message
    l2t_alone = graphs_finding([*whole, "data.pad_to_multiple=64", "objective.mode=l2t"])
    assert "up to 4 graphs" in l2t_alone.message
    every_eighth = graphs_finding(whole)  # lengths 8, 16, ..., 64
    assert every_eighth.severity == "warning" and "up to 72 graphs" in every_eighth.message
    packed_any_count = graphs_finding([*whole, "data.packing=true"])
    assert packed_any_count.severity == "warning" and "without data.pack_rows" in packed_any_count.message
    assert graphs_finding(["perf.compile=true", "perf.compile_model=true", "perf.text_row_buckets=4"]) is None
    assert graphs_finding(["perf.compile=true", "perf.compile_dynamic=false", "data.pad_to_multiple=64"]) is None


def test_a_micro_batch_larger_than_the_share_of_each_process_is_a_note_not_an_error(tmp_path):
    """configs/default.yaml (micro-batch 64 = global batch 64) on 2 processes: the trainer runs 32 on each."""
    cfg, findings = findings_of(tmp_path, ["train.micro_batch_size=32", "train.global_batch_size=32"])
    assert serious(findings) == []
    note = next(f for f in findings if f.rule == "batch_divisible")
    assert note.severity == "info" and not note.changes
    assert note.message == "train.micro_batch_size=32 x 2 processes is more than the global batch of 32"
    assert note.why.startswith("the trainer runs micro-batches of 16 on each process instead (accumulation 1")
    _, findings = findings_of(tmp_path, ["train.micro_batch_size=33", "train.global_batch_size=33"])
    assert serious(findings) == [("batch_divisible", "error")]  # 33 does not split over 2 processes


def test_an_auto_micro_batch_needs_global_batches_that_split_over_the_processes_as_the_trainer_does(tmp_path):
    """check and the trainer read one rule set (mmldlm.config.infeasible): under auto each process probes
    the divisors of its equal share, so a global batch of 33 on 2 processes is refused before the probe."""
    cfg, findings = findings_of(tmp_path, ["train.micro_batch_size=auto", "train.global_batch_size=33"])
    assert serious(findings) == [("batch_divisible", "error")]
    found = next(f for f in findings if f.rule == "batch_divisible")
    assert found.message == "train.global_batch_size=33 not a multiple of the world size 2"
    assert found.changes == {"train.global_batch_size": 34}
    refused = infeasible(cfg, 2, None)[0].error()
    assert str(refused) == "config key 'train.global_batch_size': got 33; expected a multiple of the world size 2"


def test_out_of_memory_fix_keeps_the_global_batch_and_respects_the_world_size(tmp_path):
    cfg, _ = findings_of(tmp_path, ["train.micro_batch_size=4096", "train.global_batch_size=8192"])
    fixed, _ = fix_config(cfg, ENV)
    micro = fixed.train.micro_batch_size
    assert 1 < micro < 4096 and 8192 % (micro * ENV.world_size) == 0
    assert not any(f.rule == "memory" for f in audit(fixed, ENV)[0])


def test_the_memory_estimate_divides_the_training_state_by_the_ranks_that_shard_it(tmp_path):
    """2 nodes x 2 processes: fp32 weights, gradients and AdamW moments (16 bytes per parameter) whole
    under DDP, over 4 ranks under FSDP2, over one node's 2 ranks under HSDP (its default group)."""
    two_nodes = Environment(**{**ENV.__dict__, "nnodes": 2})
    static = {}
    for strategy in ("ddp", "fsdp2", "hsdp"):
        cfg, findings = findings_of(tmp_path, [f"distributed.strategy={strategy}"], two_nodes)
        static[strategy] = estimate(cfg, two_nodes).static_gib
        assert serious(findings) == []
    num_params = estimate(cfg, two_nodes).num_params
    state_gib = 16 * num_params / 2**30
    assert static["ddp"] - static["hsdp"] == pytest.approx(state_gib / 2)
    assert static["ddp"] - static["fsdp2"] == pytest.approx(state_gib * 3 / 4)


def test_auto_micro_batch_needs_only_micro_batch_one_to_fit(tmp_path):
    _, findings = findings_of(tmp_path, ["train.micro_batch_size=auto"])
    assert serious(findings) == []
    small_gpu = Environment(**{**ENV.__dict__, "device_memory_gib": 0.001})
    _, findings = findings_of(tmp_path, ["train.micro_batch_size=auto"], small_gpu)
    assert ("memory", "error") in serious(findings)


def test_a_background_save_is_flagged_on_cpu_only(tmp_path):
    """On GPUs the background copy and write cost the steps little; on a CPU they compete with them."""
    _, findings = findings_of(tmp_path, ["checkpoint.async_save=true"])
    assert serious(findings) == []


def test_the_baseline_preset_is_flagged_for_its_slow_switches(tmp_path):
    cfg = load_config("baseline", [f"train.run_dir={tmp_path / 'run'}"])
    rules = {f.rule for f in audit(cfg, ENV)[0] if f.severity == "warning"}
    assert {"find_unused_parameters", "optimizer_loop", "refreeze", "attention", "precision"} <= rules
    assert not {"find_unused_parameters", "optimizer_loop", "refreeze", "attention", "precision"} & {
        f.rule for f in audit(load_config("optimized", [f"train.run_dir={tmp_path / 'run'}"]), ENV)[0]
    }


def test_bf16_without_native_bf16_matmuls_is_flagged(tmp_path):
    cpu = Environment(device="cpu", device_memory_gib=24.0, cpus=8, free_disk_gib=500.0, native_bf16=False)
    assert ("precision", "warning") in serious(findings_of(tmp_path, ["train.precision=bf16"], cpu)[1])
    assert ("precision", "warning") not in serious(findings_of(tmp_path, ["train.precision=auto"], cpu)[1])
    assert ("precision", "warning") not in serious(findings_of(tmp_path, ["train.precision=fp32"], cpu)[1])


def test_resuming_with_another_length_warns_that_the_lr_jumps(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 300}}))
    (run / "checkpoints" / "latest").write_text("step-0000300\n")
    _, findings = findings_of(tmp_path, [])
    (finding,) = [f for f in findings if f.rule == "lr_schedule"]
    assert "train.steps=300" in finding.message and "jump" in finding.why


def test_a_resume_at_or_past_the_new_train_steps_trains_nothing_and_has_no_lr_jump_to_warn_about(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 300}}))
    (run / "checkpoints" / "latest").write_text("step-0000300\n")
    resumes = lambda findings: [f.severity for f in findings if "holds a checkpoint at step" in f.message]  # noqa: E731
    for steps in (200, 300):
        assert resumes(findings_of(tmp_path, [f"train.steps={steps}"])[1]) == []
    assert resumes(findings_of(tmp_path, ["train.steps=400"])[1]) == ["warning"]  # it trains on: the LR jumps


def test_a_resume_on_another_number_of_processes_says_what_it_does_in_one_line(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(CheckpointConfig(), tmp_path / "run", DistInfo())
    manager.save(3, model, optimizer, {"step": 3}, {"rng": None}, RunConfig(), metrics_lines=3)
    for resume in ("auto", str(tmp_path / "run" / "checkpoints" / "step-0000003")):
        _, findings = findings_of(tmp_path, ["distributed.strategy=fsdp2"], dataclasses.replace(ENV, resume=resume))
        (finding,) = [f for f in findings if f.rule == "resume_topology"]
        assert finding.severity == "info"
        assert finding.message == (
            f"--resume {resume}: checkpoint {tmp_path}/run/checkpoints/step-0000003 was written by 1 process "
            f"(single), this run has 2 (fsdp2)"
        )
        assert "resharded" in finding.why and "samples seen" in finding.why
    one_process = dataclasses.replace(ENV, resume="auto", nproc_per_node=1)
    assert not [f for f in findings_of(tmp_path, [], one_process)[1] if f.rule == "resume_topology"]


def test_cli_prints_why_and_fix_writes_a_config_that_passes(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", raising=False)
    base = [
        "default",
        f"train.run_dir={tmp_path / 'run'}",
        "distributed.timeout_minutes=198720",
        "data.num_workers=64",
        "data.persistent_workers=false",
        "train.micro_batch_size=65536",
        "train.global_batch_size=65536",
        "--device-memory-gib",
        "16",
    ]
    out = tmp_path / "fixed.yaml"
    assert cli.main(["check", *base, "--fix", str(out)]) == 2
    printed = capsys.readouterr().out
    assert "ERROR   [timeout] distributed.timeout_minutes=198720" in printed and "why: " in printed
    # Counts read as words: "1 process x 1 node", "3 errors, 1 warning", never "process(es)".
    assert "1 process x 1 node, " in printed and "(s)" not in printed and "(es)" not in printed
    assert re.search(r"^\d+ errors?, \d+ warnings?, \d+ notes?$", printed, re.M)
    assert re.search(r"--fix: applied \d+ fixes; wrote ", printed)
    diff = (tmp_path / "fixed.yaml.diff").read_text()
    assert "-  timeout_minutes: 198720.0\n+  timeout_minutes: 30.0" in diff
    assert "+  persistent_workers: true" in diff
    assert cli.main(["check", str(out), "--device-memory-gib", "16", "--strict"]) == 0
    assert load_config(out).train.global_batch_size == 65536
    assert cli.main(["check", "default", "data.num_workers=64", "--strict"]) == 1
    assert cli.main(["check", "default", "data.num_workers=64"]) == 0


def test_each_rule_with_a_config_fix_names_the_keys_that_fix_writes():
    for name, rule in RULES.items():
        assert rule.severity in ("error", "warning", "info"), name
        for key in rule.changes:
            assert f"{key}=" in rule.fix, (name, key)


@pytest.mark.parametrize(
    "overrides,machine,threads_fix",
    [
        ([], {"load": 1.0}, 1),  # one other busy process on 2 CPUs, torch's default 2 threads
        ([], {"load": 1.4}, 1),
        (["train.threads=4"], {"load": 1.0}, 1),
        ([], {"load": 2.0}, 1),  # no CPU free at all: one thread still waits for no other
        ([], {"load": 8.0, "cpus": 16, "torch_threads": 16}, 8),
        ([], {"load": 5.0, "cpus": 8, "torch_threads": 4, "nproc_per_node": 2}, 1),
        ([], {"load": 0.4}, None),  # idle: a load under 0.5 takes no CPU
        (["train.threads=1"], {"load": 1.0}, None),
        (["train.threads=auto"], {"load": 1.0}, None),  # the run follows the free CPUs itself
        ([], {"load": 1.0, "torch_threads": 1}, None),  # OMP_NUM_THREADS=1, or torchrun's default for several processes
        ([], {"load": 1.0, "device": "cuda"}, None),  # the GPU does the work
        (["train.threads=4"], {"load": 0.0}, None),  # more threads than CPUs on an idle machine is the config's choice
    ],
)
def test_busy_cpus_warn_when_torch_threads_outnumber_the_free_cpus(tmp_path, overrides, machine, threads_fix):
    env = Environment(
        **{**ENV.__dict__, "device": "cpu", "cpus": 2, "nproc_per_node": 1, "torch_threads": 2, **machine}
    )
    cfg, findings = findings_of(tmp_path, overrides, env)
    busy = [f for f in findings if f.rule == "busy_cpus"]
    if threads_fix is None:
        assert busy == []
        return
    (finding,) = busy
    assert finding.severity == "warning" and f"load average {env.load:.1f} on {env.cpus} CPUs" in finding.message
    processes = "1 process" if env.nproc_per_node == 1 else f"{env.nproc_per_node} processes"
    assert f"torch threads ({processes} x " in finding.message
    assert "wait for each other" in finding.why
    assert finding.fix == f"set train.threads={threads_fix} or stop the other job"
    fixed, _ = fix_config(cfg, env)
    assert fixed.train.threads == threads_fix and not any(f.rule == "busy_cpus" for f in audit(fixed, env)[0])


def test_the_load_is_read_from_the_machine_unless_given(tmp_path, monkeypatch):
    cfg = load_config(None, [*CLEAN, f"train.run_dir={tmp_path / 'run'}"])
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 0.5))
    env = detect_environment(cfg)  # the machine's load, on the share of its CPUs that this process may use
    assert env.load == pytest.approx(1.5 * env.cpus / os.cpu_count())
    assert detect_environment(cfg, load=0.25).load == 0.25


def test_blocking_wait_and_monitoring_off_in_this_shell_are_read_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "0")
    cfg = load_config(None, [*CLEAN, f"train.run_dir={tmp_path / 'run'}"])
    env = detect_environment(cfg)
    messages = [f.message for f in audit(cfg, env)[0] if f.rule == "nccl_env"]
    assert messages == [
        "TORCH_NCCL_ENABLE_MONITORING=0 in the environment",
        "TORCH_NCCL_BLOCKING_WAIT=1 in the environment",
        "NCCL_BLOCKING_WAIT=1 in the environment",
    ]


def test_bf16_compute_weights_where_the_trainer_turns_them_off_are_flagged_with_the_reason(tmp_path):
    cpu = Environment(device="cpu", device_memory_gib=24.0, cpus=8, free_disk_gib=500.0, native_bf16=False)
    one_gpu = dataclasses.replace(ENV, nproc_per_node=1)
    switch = ["perf.compute_weights=true"]
    single = ["train.global_batch_size=16"]  # one process, no accumulation: step_in_backward may apply

    def off(overrides, env):
        return [f for f in findings_of(tmp_path, [*switch, *overrides], env)[1] if f.rule == "compute_weights"]

    assert off(single, one_gpu) == []  # bf16 by auto on a GPU, one process
    (fp32,) = off([], cpu)  # auto resolves to fp32 on a CPU without bf16 matmuls
    assert "train.precision resolves to fp32" in fp32.message and fp32.changes == {"perf.compute_weights": False}
    (fp16,) = off(single, dataclasses.replace(one_gpu, native_bf16=False))  # a GPU without bf16: fp16
    assert "train.precision resolves to fp16" in fp16.message
    (ddp,) = off([], ENV)  # two processes
    assert "more than one process" in ddp.message
    (in_backward,) = off([*single, "optim.step_in_backward=true", "optim.grad_clip=0"], one_gpu)
    assert "optim.step_in_backward" in in_backward.message
    assert off(["train.precision=fp32"], cpu)[0].severity == "warning"
