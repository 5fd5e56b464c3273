"""`mmldlm migrate` on runs of the older codebase (tests/data/older_repo: an older repository's root with
its trainer entry point, Hydra configs and launchers of every shape the older codebase's launchers have),
at 1 x 8 and 2 x 8 H100s: the written config holds what bash and the older trainer really produce (its
LR curve and its samples included), the launcher's bugs are ERRORs and WARNINGs by name and each is
true, the output is one screen of 100 columns in words, the exit status tells the truth, and bad input
is one line."""

import contextlib
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from mmldlm import cli

# hydra-core is a pinned dependency; a partial install (a GPU image running only `pytest -m cuda`)
# may lack it, and collecting this file must not fail there.
pytest.importorskip("hydra")
from mmldlm.config import load_config
from mmldlm.tools.check import apply_changes, estimate
from mmldlm.tools.migrate import OLDER_KEYS, Cluster, migrate
from mmldlm.tools.migrate.older_trainer import heads_for
from mmldlm.tools.migrate.report import summary, write_files
from mmldlm.training.schedules import LRSchedule

OLDER_REPO = Path(__file__).resolve().parent / "data" / "older_repo"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "migrating.md"


@contextlib.contextmanager
def in_older_repo():
    """Launchers run from the older repository's root, where they call the trainer by a relative path."""
    before = os.getcwd()
    os.chdir(OLDER_REPO)
    try:
        yield
    finally:
        os.chdir(before)


def run_migrate(out_dir: Path, launcher: str | None, nnodes: int, config: str | None = None, taken=None):
    """A migration as the command makes it: its config and details file written."""
    with in_older_repo():
        m = migrate(
            Path(config) if config else None,
            Path(f"scripts/{launcher}") if launcher else None,
            Cluster(nnodes, 8, cpus_per_node=32),
            out_dir / f"{launcher or 'config'}-{nnodes}.yaml",
            taken=taken,
        )
        write_files(m)
    return m


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    """The stable-launcher-like fixture migrated for 1 and 2 nodes of 8 H100s (81559 MiB each)."""
    out = tmp_path_factory.mktemp("stable")
    return {n: run_migrate(out, "launch_stable.sh", n) for n in (1, 2)}


# nodes -> (micro, global, steps, LR the launcher meant, schedule, warmup, save every, run name)
STABLE = {
    # 81559 MiB // 1024 = 79 < 80: batch 3, accumulation 2 (never applied); 250,000 samples per GPU / 3
    1: (3, 24, 83_334, 6.1235e-05, 1_000_000, 5000, 50_000, "stable_l2t"),
    # 2,000,000 / 16 GPUs = 125,000 per GPU / 3 = 41,667 steps; sqrt(96 / 32) = 1.7320 at bc's scale 4
    2: (3, 48, 41_667, 8.66e-05, 500_000, 5000, 25_000, "stable_l2t_2n"),
}


@pytest.mark.parametrize("nnodes", [1, 2])
def test_the_stable_launcher_is_migrated_to_what_bash_and_the_older_trainer_really_ran(stable, nnodes):
    m = stable[nnodes]
    micro, batch, steps, lr, schedule, warmup, every, name = STABLE[nnodes]
    cfg = load_config(m.out)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.steps) == (micro, batch, steps)
    assert cfg.optim.lr == pytest.approx(lr)  # the older run had none: bc left optimizer.lr empty
    assert m.run.lr is None and m.run.values["optimizer.lr"] == ""
    s = cfg.schedule  # the older cosine, to 0 over num_train_steps, apart from the run's length
    assert (s.kind, s.num_steps, s.min_lr_ratio, s.warmup_steps) == ("warmup_cosine", schedule, 0.0, warmup)
    assert cfg.optim.betas == [0.9, 0.99]  # optimizer.betas; beta1/beta2 (0.9/0.95) were never read
    assert (cfg.model.num_heads, cfg.model.hidden_size, cfg.model.num_blocks) == (8, 1024, 24)
    assert (cfg.model.max_seq_len, cfg.model.latent_dim, cfg.objective.mode) == (2048, 32, "l2t")
    assert (cfg.objective.text_loss_weight, cfg.objective.latent_loss_weight) == (1.0, 0.1)
    assert (cfg.checkpoint.every, cfg.checkpoint.every_minutes, cfg.checkpoint.keep_last) == (every, 30.0, 4)
    assert (cfg.train.precision, cfg.distributed.timeout_minutes, cfg.data.num_workers) == ("bf16", 30.0, None)
    assert cfg.train.run_dir == f"runs/{name}" and cfg.eval.batch_size == micro and cfg.eval.every == 0
    prepare = m.translation.prepare
    assert (prepare["--legacy-order"], prepare["--max-samples"], prepare["--val-fraction"]) == ("scan", 2_000_000, 0)


@pytest.mark.parametrize("nnodes", [1, 2])
def test_the_stable_launchers_bugs_are_named_and_the_exit_status_says_it_failed(stable, nnodes):
    m = stable[nnodes]
    rules = {f.rule: f for f in m.findings}
    bc = rules["launcher_bc"]
    assert bc.severity == "error" and bc.message.startswith("bc cannot read `scale=10; 5e-5 * ")
    assert bc.message.endswith(
        "the trainer is handed optimizer.lr= and fails at its first step, so the older launcher fails on this cluster"
    )
    memory = rules["launcher_gpu_memory"]
    assert "at 81559 MiB" in memory.message and "nominal 81920 MiB" in memory.message
    assert "training.train_batch_size=3" in memory.message and "training.train_batch_size=4" in memory.message
    nccl = [f.message for f in m.findings if f.rule == "nccl_env"]
    assert any(msg.startswith("NCCL_IB_TIMEOUT=90") and "dropped" in msg for msg in nccl)
    assert any(msg.startswith("NCCL_DEBUG=INFO") and "NCCL_DEBUG=WARN in the launch line" in msg for msg in nccl)
    assert "read by neither torch nor NCCL" in rules["timeout"].message
    assert "never applied" in rules["older_accumulation"].message
    assert "is never read: the older block runs 8 heads" in rules["older_heads"].message
    assert m.why_not_ready == bc.message
    assert load_config(m.out).optim.lr > 0  # written all the same, and marked
    assert m.out.read_text().startswith("# NOT READY: mmldlm migrate exited 1: bc cannot read")


def test_a_finding_of_the_older_run_that_the_written_config_fixes_is_no_error_and_a_moot_setting_says_why(stable):
    # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=12000000 beside TORCH_NCCL_ENABLE_MONITORING=0: the monitor that
    # reads it is off. Only the launcher's own bug is an ERROR, and it is what makes the exit status 1.
    m = stable[2]
    heartbeat = next(f for f in m.findings if f.message.startswith("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"))
    assert heartbeat.severity == "info" and "has no effect: TORCH_NCCL_ENABLE_MONITORING=0 turns" in heartbeat.message
    assert [f.rule for f in m.findings if f.severity == "error"] == ["launcher_bc"]


def test_the_output_is_one_screen_of_100_columns_in_words_with_no_line_twice(stable, shapes):
    for m in [*stable.values(), *shapes.values()]:
        text = summary(m)
        lines = text.splitlines()
        assert max(map(len, lines)) <= 100, max(lines, key=len)
        assert len(lines) <= 48, m.out
        said = [line for line in lines if line.strip()]
        assert len(said) == len(set(said)), m.out
        details = m.details_path.read_text()  # the launcher's own output quoted as it printed it aside
        details = re.sub(r"  the launcher's last output:\n(    .*\n)*", "", details)
        for written in (text, m.out.read_text(), details):
            for python in (r"\bNone\b", r"(?<![:\w])(True|False)\b", r"\(s\)", "='", r"\['"):
                assert not re.search(python, written), (m.out, re.search(python, written))


def test_the_table_leads_and_its_numbers_read_alike_in_both_columns(stable):
    lines = summary(stable[2]).splitlines()
    table = lines[lines.index("") + 1 :]
    assert table[0].split()[:4] == ["the", "older", "run", "trained"]
    rows = {line[:22].strip(): line[22:] for line in table[1:18] if line[:22].strip()}
    assert list(rows) == [
        "steps (epochs)",
        "micro / global batch",
        "accumulation",
        "LR",
        "warmup",
        "LR schedule",
        "betas",
        "heads",
        "sequence length",
        "latent width",
        "mode",
        "text / latent weight",
        "samples (pairs)",
        "validation",
        "precision",
        "checkpoints",
    ]
    assert rows["steps (epochs)"].split() == ["41,667", "(1", "epoch", "of", "41,667)", "41,667"]
    assert rows["LR"].split() == ["fails:", "empty", "(meant", "8.66e-05)", "8.66e-05"]
    assert rows["LR schedule"].split() == "cosine to 0 over 500,000: 0.99x at end cosine to 0 over 500,000".split()
    details = stable[2].details_path.read_text()
    for part in ("carried over (older key -> ours):", "not carried over:", "the launcher under bash", "why:"):
        assert part in details
    assert "scripts/launch_stable.sh:59: output redirected to the scratch folder instead of logs/launch.txt" in details
    assert "scripts/launch_stable.sh:44: bc reads `scale=10; 5e-5 * 1.7320`, prints nothing; on stderr:" in details


def test_the_launch_line_carries_the_reviewed_nccl_settings(stable):
    launch = " ".join(summary(stable[2]).split("\nnext:\n")[1].replace("\\\n", "").split())
    assert "mmldlm prepare --legacy-tokens /store/old-run/tokens" in launch
    assert "NCCL_SOCKET_IFNAME=ib0" in launch and "NCCL_DEBUG=WARN" in launch
    for dropped in ("NCCL_IB_TIMEOUT", "NCCL_TIMEOUT", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "NCCL_BLOCKING_WAIT"):
        assert dropped not in launch
    assert "MASTER_ADDR=10.1.2.3 MASTER_PORT=29600 scripts/launch.sh" in launch


# Every launcher shape, for 1 and 2 nodes of 8 GPUs. configs/small_joint.yaml: 10,000 pairs read
# (max_samples null), micro-batch 16, 3 epochs, mode unconditional; configs/mmdit_2048.yaml: the loader's
# default 10,000 pairs, micro-batch 16 at 2048 tokens, 20 epochs. (micro, global, steps, epochs, run name,
# checkpoint.every, data.num_workers given to the older run, mode, never started)
SHAPES = {
    ("launch_branches.sh", 1): (16, 128, 3 * 79, 3, "small_joint_single", 2000, 12, "joint", False),
    ("launch_branches.sh", 2): (16, 256, 6 * 40, 6, "small_joint_multi", 250, 4, "joint", False),
    ("launch_retry.sh", 1): (8, 64, 3 * 157, 3, "retry_1", 1000, 8, "joint", False),
    ("launch_retry.sh", 2): (8, 128, 3 * 79, 3, "retry_1", 1000, 8, "joint", False),
    # never started: the launcher meant micro-batch 32 (of the lines after the comment)
    ("launch_comment.sh", 1): (32, 256, 2 * 40, 2, "small_joint_long", 1000, 8, "joint", True),
    ("launch_comment.sh", 2): (32, 512, 2 * 20, 2, "small_joint_long", 1000, 8, "joint", True),
    ("launch_interactive.sh", 1): (16, 128, 2 * 79, 2, "small_joint_eval", 1000, 8, "joint", False),
    ("launch_interactive.sh", 2): (16, 256, 2 * 40, 2, "small_joint_eval", 1000, 8, "joint", False),
    ("launch_restart_forever.sh", 1): (16, 128, 4 * 79, 4, "small_joint", 1000, 8, "joint", False),
    ("train_t2l_multinode.sh", 1): (16, 128, 20 * 79, 20, "mmdit_2048", 50_000, 8, "l2t", False),
    ("train_t2l_multinode.sh", 2): (16, 256, 20 * 40, 20, "mmdit_2048", 50_000, 8, "l2t", False),
    ("train_unconditional_diag.sh", 1): (16, 128, 4 * 79, 4, "mmdit_2048", 50_000, 8, "joint", False),
    ("train_unconditional_diag.sh", 2): (16, 256, 4 * 40, 4, "mmdit_2048", 50_000, 8, "joint", False),
    ("train_l2t_gpucount.sh", 1): (16, 128, 20 * 79, 20, "l2t_1n", 50_000, 8, "l2t", False),
    ("train_l2t_gpucount.sh", 2): (16, 256, 30 * 40, 30, "l2t_2n", 50_000, 8, "l2t", True),
}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Each shape in a folder of its own: no run name is taken by another's."""
    return {key: run_migrate(tmp_path_factory.mktemp("shape"), *key) for key in SHAPES}


@pytest.mark.parametrize("key", SHAPES, ids=[f"{name}-{n}x8" for name, n in SHAPES])
def test_every_launcher_shape_gives_the_config_the_older_run_really_trained(shapes, key):
    m = shapes[key]
    micro, batch, steps, epochs, name, every, workers, mode, never_started = SHAPES[key]
    cfg = load_config(m.out)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.steps) == (micro, batch, steps)
    assert (m.run.epochs, m.run.values["data.num_workers"], cfg.checkpoint.every) == (epochs, workers, every)
    assert cfg.train.run_dir == f"runs/{name}" and cfg.data.path == f"data/prepared/{name}"
    assert (cfg.objective.mode, cfg.model.num_heads) == (mode, 8)
    assert (m.never_started is not None) == never_started
    assert m.translation.prepare["--max-samples"] == 10_000 and m.translation.prepare["--legacy-order"] == "scan"
    assert cfg.schedule.num_steps == m.run.schedule_steps and cfg.schedule.min_lr_ratio == 0.0
    samples = [f.message for f in m.findings if f.rule == "older_samples"]
    assert samples == ([] if never_started else [samples[0]]) and all(
        "only the first 10,000 pairs" in s for s in samples
    )


@pytest.mark.parametrize("key", [k for k in SHAPES if not SHAPES[k][-1]], ids=lambda k: f"{k[0]}-{k[1]}x8")
def test_the_written_lr_curve_is_the_older_one_at_every_step(shapes, key):
    # The older trainer: linear warmup, then a cosine to 0 over training.num_train_steps, however long
    # its epochs ran (a run of hundreds of steps never left the peak). Warmup: ours reaches the peak one
    # step sooner ((s + 1) / W against s / W).
    m = shapes[key]
    cfg = load_config(m.out)
    ours = LRSchedule(cfg.schedule, cfg.optim.lr, cfg.train.steps)
    warmup, length, peak = m.run.warmup, m.run.schedule_steps, m.run.lr
    for step in range(cfg.train.steps):
        older = (
            peak * step / warmup
            if step < warmup
            else peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (length - warmup)))
        )
        assert ours.lr(step) == pytest.approx(older, rel=1e-4, abs=1.01 * peak / warmup)
    if cfg.train.steps > 2 * warmup:  # its LR never left the peak, where a cosine over the run ends at 0.1 x
        assert ours.lr(cfg.train.steps - 1) > 0.99 * peak
    suggested = m.translation.suggestions
    assert suggested and suggested[0].startswith("schedule.num_steps: null, min_lr_ratio: 0.1")


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_comment_after_a_continuation_means_the_older_run_never_started(shapes, nnodes):
    m = shapes[("launch_comment.sh", nnodes)]
    lost = next(f for f in m.findings if f.rule == "launcher_continuation")
    assert lost.severity == "error"
    assert lost.message == (
        "scripts/launch_comment.sh:5: a comment after a line continuation ends the torchrun call: torchrun gets "
        "a lone ' ' argument, which Hydra refuses, so the older run never started; the lines after it ran as "
        "commands, not found: training.train_batch_size=32, optimizer.lr=1e-4, logging.run_name=small_joint_long"
    )
    assert m.never_started == "Hydra refuses the argument ' '"
    text = summary(m) + m.details_path.read_text()
    assert "never started: Hydra refuses the argument ' '" in text
    assert "trained with" not in text and not any(f.rule.startswith("older_") for f in m.findings)
    written = m.out.read_text()
    assert "micro_batch_size: 32  # training.train_batch_size=32" in written and "lr: 0.0001" in written
    assert m.why_not_ready == lost.message


def test_a_bug_of_one_branch_stops_only_that_branch(shapes):
    assert shapes[("train_l2t_gpucount.sh", 1)].never_started is None
    assert shapes[("train_l2t_gpucount.sh", 1)].why_not_ready is None
    two = shapes[("train_l2t_gpucount.sh", 2)]
    assert two.never_started == "Hydra refuses the argument ' '"
    assert two.reading.call.where == "scripts/train_l2t_gpucount.sh:29" and two.reading.comment_line.endswith(":33")


def test_the_three_launchers_that_stopped_migrate_are_read_at_one_and_two_nodes(shapes):
    # read -p from /dev/tty on node rank 0, a diagnostic python -c, a python here-document counting GPUs
    for name in ("train_t2l_multinode.sh", "train_unconditional_diag.sh", "train_l2t_gpucount.sh"):
        for nnodes in (1, 2):
            call = shapes[(name, nnodes)].reading.call
            assert (call.nnodes, call.nproc_per_node) == (str(nnodes), "8"), (name, nnodes)
    tty = next(f for f in shapes[("train_t2l_multinode.sh", 2)].findings if f.rule == "launcher_prompt")
    assert tty.severity == "warning" and "< /dev/tty" in tty.message and "under a batch scheduler" in tty.message
    assert shapes[("train_t2l_multinode.sh", 2)].reading.call.where == "scripts/train_t2l_multinode.sh:23"
    diag = shapes[("train_unconditional_diag.sh", 1)]
    assert "✓ NCCL version: (2, 20, 5)" in diag.reading.run.output and diag.why_not_ready is None


def test_memory_is_estimated_with_the_checkpointing_auto_picks(shapes):
    # Micro-batch 16 at 2048 tokens on a 1.5B-parameter model: no fit without activation checkpointing,
    # and the written config's auto picks selective, under which it fits.
    m = shapes[("train_t2l_multinode.sh", 1)]
    env = m.cluster.environment()
    assert not [f for f in m.remaining if f.rule == "memory"]
    assert estimate(m.sized, env).checkpointing == "selective (what auto picks)"
    assert "activation checkpointing selective (what auto picks)" in m.details_path.read_text()
    without = estimate(apply_changes(m.sized, {"perf.activation_checkpointing": "none"}), env)
    assert without.memory_gib(16) > 0.9 * env.device_memory_gib


def test_the_launchers_other_bugs_are_each_found_and_true(shapes):
    t2l = shapes[("train_t2l_multinode.sh", 2)]
    rules = {f.rule: f for f in t2l.findings}
    assert rules["launcher_mode"].message == (
        "scripts/train_t2l_multinode.sh is named for t2l but passes loss.loss_type=l2t: the older run trained l2t"
    )
    assert rules["older_eval"].message == (
        "logging.eval_freq=5000 is longer than the run's 800 steps: the older run never evaluates"
    )
    retention = rules["checkpoint_retention"].message
    assert retention.startswith(
        "logging.save_freq=50000 is longer than the run's 800 steps: the older run saves nothing"
    )
    assert "50000 steps" not in retention.split(":", 2)[2]  # the cost is the run's, not a whole interval's
    debug_file = next(r for r in t2l.reviews if r.name == "NCCL_DEBUG_FILE")
    assert (debug_file.action, debug_file.new) == ("changed", "/shared/logs/nccl_debug.%h.%p.log")
    assert "NCCL_DEBUG_FILE=/shared/logs/nccl_debug.%h.%p.log" in summary(t2l)
    assert not [f for f in shapes[("train_unconditional_diag.sh", 1)].findings if f.rule == "launcher_mode"]


def test_two_launchers_writing_one_run_name_do_not_share_a_run_or_its_data(tmp_path):
    first = run_migrate(tmp_path, "train_t2l_multinode.sh", 1, taken={})
    second = run_migrate(tmp_path, "train_unconditional_diag.sh", 1, taken={first.run_name: first.owner})
    assert first.written.train.run_dir == "runs/mmdit_2048"
    assert second.written.train.run_dir == "runs/mmdit_2048-train_unconditional_diag"
    assert second.written.data.path == "data/prepared/mmdit_2048-train_unconditional_diag"
    shared = next(f for f in second.findings if f.rule == "launcher_shared")
    assert shared.message == (
        "logging.run_name=mmdit_2048 is also the run of scripts/train_t2l_multinode.sh at 1 node: the older runs "
        "wrote the same folders (/store/checkpoints/mmdit_2048)"
    )
    with in_older_repo():  # the command reads what it wrote beside --out
        argv = ["migrate", "--launcher", "scripts/train_unconditional_diag.sh", "--cpus-per-node", "32"]
        cli.main([*argv, "--out", str(tmp_path / "again.yaml")])
    assert load_config(tmp_path / "again.yaml").train.run_dir == "runs/mmdit_2048-train_unconditional_diag-1n"


def test_read_p_and_a_restart_loop_are_named_and_the_interactive_launcher_runs_to_its_exec(shapes):
    interactive = shapes[("launch_interactive.sh", 1)]
    prompt = next(f for f in interactive.findings if f.rule == "launcher_prompt")
    assert prompt.severity == "warning"
    assert 'read -p "Press Enter to start training on 1 nodes..." waits for a person' in prompt.message
    assert interactive.reading.call.record.words[0] == "/opt/conda/envs/mmdit/bin/torchrun"  # by its full path
    assert interactive.why_not_ready is None  # a warning asks, it does not fail the migration
    loop = shapes[("launch_restart_forever.sh", 1)]
    stopped = next(f for f in loop.findings if f.rule == "launcher_stopped")
    assert "ran 25 times" in stopped.message and "25 identical torchrun calls" in stopped.message


def test_a_launcher_that_only_runs_on_one_node_is_an_error_on_two(tmp_path):
    m = run_migrate(tmp_path, "launch_restart_forever.sh", 2)
    mismatch = next(f for f in m.findings if f.rule == "launcher_cluster")
    assert "runs --nnodes 1 --nproc_per_node gpu, not this cluster's --nnodes 2" in mismatch.message
    assert m.why_not_ready is not None


def test_the_branch_is_taken_with_the_schedulers_world_size_as_the_node_count(shapes):
    for nnodes in (1, 2):
        reading = shapes[("launch_branches.sh", nnodes)].reading
        assert reading.convention.startswith("per node")
        assert reading.call.nnodes == str(nnodes)
    # The launch line's rendezvous: the call's own (--rdzv_endpoint), else a placeholder, never torchrun's default
    assert "MASTER_ADDR=node0 MASTER_PORT=29400" in summary(shapes[("launch_branches.sh", 2)])
    assert "MASTER_ADDR=NODE0_ADDRESS MASTER_PORT=29500" in summary(shapes[("launch_comment.sh", 2)])


def test_the_config_is_found_from_the_launcher_alone_and_a_config_given_is_read_as_it_is(shapes, tmp_path):
    assert shapes[("launch_retry.sh", 1)].config.path == OLDER_REPO / "configs" / "small_joint.yaml"
    m = run_migrate(tmp_path, None, 1, config=str(OLDER_REPO / "configs" / "stable_l2t.yaml"))
    cfg = load_config(m.out)
    # No launcher: the config's own values, on 8 GPUs: 2,000,000 / 8 / 4 = 62,500 steps of 32
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.steps) == (4, 32, 62_500)
    assert cfg.optim.lr == 5e-05 and m.why_not_ready is None


def test_the_command_exits_0_for_a_clean_migration_and_1_with_one_line_why_otherwise(tmp_path, capsys):
    with in_older_repo():
        argv = ["migrate", "--launcher", "scripts/launch_retry.sh", "--cpus-per-node", "32"]
        assert cli.main([*argv, "--out", str(tmp_path / "retry.yaml")]) == 0
        assert capsys.readouterr().err == ""
        argv = ["migrate", "--launcher", "scripts/launch_comment.sh", "--nnodes", "2", "--cpus-per-node", "32"]
        assert cli.main([*argv, "--out", str(tmp_path / "comment.yaml")]) == 1
    out, err = capsys.readouterr()
    # the run the launcher meant (micro-batch 32: 40 steps) ends inside its warmup of 100: check's error too
    assert (
        err
        == f"mmldlm migrate: {tmp_path / 'comment.yaml'}: NOT READY, 2 errors (launcher_continuation, lr_schedule)\n"
    )
    assert "ERROR   [launcher_continuation] scripts/launch_comment.sh:5: a comment after" in out
    assert (tmp_path / "comment.yaml").read_text().startswith("# NOT READY")


def test_a_folder_of_launchers_is_one_table_and_exit_0_only_when_every_one_is_ready(tmp_path, capsys):
    folder = tmp_path / "launchers"
    folder.mkdir()
    for name in ("launch_retry.sh", "launch_comment.sh", "train_t2l_multinode.sh"):
        shutil.copy(OLDER_REPO / "scripts" / name, folder)
    (folder / "setup_env.sh").write_text("#!/bin/bash\nexport HF_HOME=/store/hf\necho ready\n")
    with in_older_repo():
        argv = ["migrate", "--launchers", str(folder), "configs", "--nnodes", "1,2", "--cpus-per-node", "32"]
        assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["launcher", "nodes", "steps", "batch", "mode", "verdict", "worst", "finding"]
    rows = {(line.split()[0], line.split()[1]): line.split()[2:] for line in lines[1:9]}
    assert rows[("launch_retry.sh", "1")][:4] == ["471", "8/64", "joint", "ready"]
    assert rows[("launch_comment.sh", "2")][:5] == ["40", "32/512", "joint", "never", "started"]
    assert rows[("train_t2l_multinode.sh", "2")][:4] == ["800", "16/256", "l2t", "ready"]
    assert rows[("setup_env.sh", "1")] == ["-", "-", "-", "unreadable", "(below)"]
    assert max(len(line) for line in lines[:-1]) <= 100  # the last: the folder written
    reason = f"launcher {folder / 'setup_env.sh'}: bash ended at {folder / 'setup_env.sh'}:3 with status 0 before"
    assert " ".join(line.strip() for line in lines[9:]).startswith(f"setup_env.sh at 1 node: {reason}")
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(written) == 12 and "train_t2l_multinode-2n.yaml.migrate.txt" in written


BAD_INPUTS = {
    "an eval config": (["configs/eval_l2t.yaml"], "not a run config of the older trainer"),
    "not YAML": (["configs/broken.yaml"], "not valid YAML"),
    "a missing group file": (["configs/lion.yaml"], "'optimizer/lion'"),
    "a script without torchrun": (
        ["--launcher", "scripts/no_torchrun.sh"],
        "scripts/no_torchrun.sh: bash ended at scripts/no_torchrun.sh:3 with status 0 before it called torchrun",
    ),
    "a launcher that is not here": (["--launcher", "scripts/nowhere.sh"], "no such file"),
    "a list of node counts for one launcher": (
        ["--launcher", "scripts/launch_retry.sh", "--nnodes", "1,2"],
        "--nnodes",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch, case):
    argv, expected = BAD_INPUTS[case]
    repo = tmp_path / "repo"
    shutil.copytree(OLDER_REPO, repo)
    (repo / "configs" / "broken.yaml").write_text("model: [1024,\n")
    (repo / "configs" / "lion.yaml").write_text(
        "defaults:\n  - optimizer: lion\n  - _self_\ntraining:\n  num_epochs: 1\n"
    )
    (repo / "scripts" / "no_torchrun.sh").write_text("#!/bin/bash\necho training\npython train.py\n")
    out = tmp_path / "imported.yaml"
    monkeypatch.chdir(repo)
    assert cli.main(["migrate", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmldlm migrate: ") and err.count("\n") == 1 and expected in err
    assert "Traceback" not in err and "+ " not in err
    assert not out.exists()


def test_the_older_blocks_eight_heads_are_kept_where_they_divide_the_width():
    assert heads_for(1024) == 8 and heads_for(256) == 8
    assert heads_for(40) == 10  # 40 / 8 = 5 is odd: the nearest count with even head dims (4)


def test_every_older_key_has_a_row_in_the_docs_table():
    rows = set(re.findall(r"^\| `([\w.]+)` \|", DOCS.read_text(), re.M))
    assert set(OLDER_KEYS) <= rows, sorted(set(OLDER_KEYS) - rows)


def pages_blocks(tmp_path, monkeypatch) -> list[str]:
    """docs/migrating.md's quoted output, with the older repository copied in and made the current folder
    as the page's commands run."""
    shutil.copytree(OLDER_REPO, tmp_path / "old-repo")
    monkeypatch.chdir(tmp_path / "old-repo")
    return re.findall(r"^```text\n(.*?)^```$", DOCS.read_text(encoding="utf-8"), re.M | re.S)


def test_the_pages_output_is_what_migrate_prints_for_the_stable_launcher(tmp_path, capsys, monkeypatch):
    """The stable launcher's table on one node, the whole output on two and the line on stderr."""
    blocks = pages_blocks(tmp_path, monkeypatch)
    printed = {}
    for nnodes in (1, 2):
        argv = ["migrate", "--launcher", "scripts/launch_stable.sh", "--nnodes", str(nnodes), "--gpus-per-node", "8"]
        assert cli.main([*argv, "--cpus-per-node", "32", "--out", "imported.yaml"]) == 1
        printed[nnodes] = capsys.readouterr()
    one_node_table = printed[1].out.split("\n\n")[:2]
    assert blocks[1] == "\n\n".join(one_node_table) + "\n"
    assert blocks[2] == printed[2].out
    assert blocks[3] == printed[2].err


@pytest.mark.slow  # every launcher of the folder at two node counts: 18 migrations
def test_the_pages_output_is_what_migrate_prints_for_the_folder(tmp_path, capsys, monkeypatch):
    blocks = pages_blocks(tmp_path, monkeypatch)
    argv = ["migrate", "--launchers", "scripts", "configs", "--nnodes", "1,2", "--cpus-per-node", "32"]
    assert cli.main([*argv, "--out", "migrated/"]) == 1
    assert blocks[0] == capsys.readouterr().out
