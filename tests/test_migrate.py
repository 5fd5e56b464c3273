"""`mmldlm migrate` on runs of the older codebase (tests/data/older_repo: an older repository's root with
its trainer entry point, Hydra configs and launchers of every shape the older codebase's launchers have),
at 1 x 8 and 2 x 8 H100s: the written config holds what bash and the older trainer really produce, the
launcher's bugs are ERRORs and WARNINGs by name, the output leads with one table and fits a screen, the
exit status tells the truth, and bad input is one line."""

import contextlib
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
from mmldlm.tools.migrate import OLDER_KEYS, Cluster, migrate
from mmldlm.tools.migrate.older_trainer import heads_for
from mmldlm.tools.migrate.report import summary

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


def run_migrate(out_dir: Path, launcher: str | None, nnodes: int, config: str | None = None, **cluster):
    with in_older_repo():
        m = migrate(
            Path(config) if config else None,
            Path(f"scripts/{launcher}") if launcher else None,
            Cluster(nnodes, 8, cpus_per_node=32, **cluster),
            out_dir / f"{launcher or 'config'}-{nnodes}.yaml",
        )
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
    assert (m.run.schedule_steps, cfg.schedule.warmup_steps, cfg.schedule.kind) == (schedule, warmup, "warmup_cosine")
    assert cfg.optim.betas == [0.9, 0.99]  # optimizer.betas; beta1/beta2 (0.9/0.95) were never read
    assert (cfg.model.num_heads, cfg.model.hidden_size, cfg.model.num_blocks) == (8, 1024, 24)
    assert (cfg.model.max_seq_len, cfg.model.latent_dim, cfg.objective.mode) == (2048, 32, "l2t")
    assert (cfg.objective.text_loss_weight, cfg.objective.latent_loss_weight) == (1.0, 0.1)
    assert (cfg.checkpoint.every, cfg.checkpoint.every_minutes, cfg.checkpoint.keep_last) == (every, 30.0, 4)
    assert (cfg.train.precision, cfg.distributed.timeout_minutes, cfg.data.num_workers) == ("bf16", 30.0, None)
    assert cfg.train.run_dir == f"runs/{name}" and cfg.eval.batch_size == micro
    assert m.translation.prepare["--max-samples"] == 2_000_000


@pytest.mark.parametrize("nnodes", [1, 2])
def test_the_stable_launchers_bugs_are_named_and_the_exit_status_says_it_failed(stable, nnodes):
    m = stable[nnodes]
    rules = {f.rule: f for f in m.findings}
    bc = rules["launcher_bc"]
    assert bc.severity == "error" and bc.message.startswith("the older launcher fails on this cluster: bc cannot read")
    assert "5e-5" in bc.message and bc.message.endswith(
        "so the trainer is handed optimizer.lr=: it fails at its first step"
    )
    memory = rules["launcher_gpu_memory"]
    assert "at 81559 MiB" in memory.message and "nominal 81920 MiB" in memory.message
    assert "training.train_batch_size=3" in memory.message and "training.train_batch_size=4" in memory.message
    nccl = [f.message for f in m.findings if f.rule == "nccl_env"]
    assert any(msg.startswith("NCCL_IB_TIMEOUT=90") and "dropped" in msg for msg in nccl)
    assert any(msg.startswith("NCCL_DEBUG=INFO") and "NCCL_DEBUG=WARN in the launch line" in msg for msg in nccl)
    assert "read by neither torch nor NCCL" in rules["timeout"].message
    assert "never applied" in rules["older_accumulation"].message
    assert "was never read: the older block ran 8 heads" in rules["older_heads"].message
    assert m.why_not_ready.startswith("the older launcher fails on this cluster")
    assert load_config(m.out).optim.lr > 0  # written all the same, and marked
    assert m.out.read_text().startswith("# NOT READY: mmldlm migrate exited 1: the older launcher fails")


def test_the_output_leads_with_the_table_then_errors_then_warnings_and_fits_a_screen(stable):
    text = summary(stable[2])
    lines = text.splitlines()
    assert len(lines) <= 60
    table = lines[lines.index("") + 1 :]
    assert table[0].split()[:4] == ["the", "older", "run", "trained"]
    rows = [line.split("  ")[0] for line in table[1:15]]
    assert rows == [
        "steps (epochs)",
        "micro / global batch",
        "accumulation",
        "LR, schedule length",
        "warmup",
        "betas",
        "heads",
        "sequence length",
        "latent width",
        "mode",
        "loss weights text / latent",
        "samples read",
        "precision",
        "checkpoints",
    ]
    severities = [line.split()[0] for line in lines if re.match(r"^(ERROR|WARNING) ", line)]
    assert severities == sorted(severities, key=["ERROR", "WARNING"].index) and "ERROR" in severities
    assert "fails: optimizer.lr='' (meant 8.66e-05)" in text
    details = stable[2].details_path.read_text()
    for part in ("carried over (older key -> ours):", "not carried over:", "the launcher under bash", "why:"):
        assert part in details
    assert "scripts/launch_stable.sh:59: output redirected to the scratch folder instead of: logs/launch.txt" in details


def test_the_launch_line_carries_the_reviewed_nccl_settings(stable):
    lines = summary(stable[2]).split("\nnext:\n")[1].splitlines()
    assert lines[0].strip().startswith("mmldlm prepare --legacy-tokens /store/old-run/tokens")
    launch = lines[2]
    assert "NCCL_SOCKET_IFNAME=ib0" in launch and "NCCL_DEBUG=WARN" in launch
    for dropped in ("NCCL_IB_TIMEOUT", "NCCL_TIMEOUT", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "NCCL_BLOCKING_WAIT"):
        assert dropped not in launch
    assert "MASTER_ADDR=10.1.2.3 MASTER_PORT=29600 scripts/launch.sh" in launch


# Every launcher shape, for 1 and 2 nodes of 8 GPUs, trains configs/small_joint.yaml: 10,000 files read
# (max_samples null), micro-batch 16, 3 epochs, mode unconditional. (micro, global, steps, epochs, run name,
# checkpoint.every, data.num_workers given to the older run)
SHAPES = {
    ("launch_branches.sh", 1): (16, 128, 3 * 79, 3, "small_joint_single", 2000, 12),
    ("launch_branches.sh", 2): (16, 256, 6 * 40, 6, "small_joint_multi", 250, 4),
    ("launch_retry.sh", 1): (8, 64, 3 * 157, 3, "retry_1", 1000, 8),
    ("launch_retry.sh", 2): (8, 128, 3 * 79, 3, "retry_1", 1000, 8),
    ("launch_comment.sh", 1): (16, 128, 2 * 79, 2, "small_joint", 1000, 8),
    ("launch_comment.sh", 2): (16, 256, 2 * 40, 2, "small_joint", 1000, 8),
    ("launch_interactive.sh", 1): (16, 128, 2 * 79, 2, "small_joint_eval", 1000, 8),
    ("launch_interactive.sh", 2): (16, 256, 2 * 40, 2, "small_joint_eval", 1000, 8),
    ("launch_restart_forever.sh", 1): (16, 128, 4 * 79, 4, "small_joint", 1000, 8),
}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    return {key: run_migrate(out, *key) for key in SHAPES}


@pytest.mark.parametrize("key", SHAPES, ids=[f"{name}-{n}x8" for name, n in SHAPES])
def test_every_launcher_shape_gives_the_config_the_older_run_really_trained(shapes, key):
    m = shapes[key]
    micro, batch, steps, epochs, name, every, workers = SHAPES[key]
    cfg = load_config(m.out)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.steps) == (micro, batch, steps)
    assert (m.run.epochs, m.run.values["data.num_workers"], cfg.checkpoint.every) == (epochs, workers, every)
    assert cfg.train.run_dir == f"runs/{name}"
    assert (cfg.objective.mode, cfg.model.num_heads, cfg.optim.lr) == ("joint", 8, 5e-05)  # unconditional; 8 heads
    assert m.translation.prepare["--max-samples"] == 10_000
    assert any(f.rule == "older_samples" and "only 10000 files" in f.message for f in m.findings)


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_comment_after_a_continuation_is_an_error_naming_the_lost_overrides(shapes, nnodes):
    m = shapes[("launch_comment.sh", nnodes)]
    lost = next(f for f in m.findings if f.rule == "launcher_continuation")
    assert lost.severity == "error"
    assert lost.message.endswith(
        "3 override(s) never reach the trainer: training.train_batch_size=32, optimizer.lr=1e-4, "
        "logging.run_name=small_joint_long"
    )
    meant = {key: m.meant[key] for key in ("training.train_batch_size", "optimizer.lr", "logging.run_name")}
    assert meant == {"training.train_batch_size": 32, "optimizer.lr": 1e-4, "logging.run_name": "small_joint_long"}
    text = m.out.read_text()
    assert "micro_batch_size: 16  # training.train_batch_size=16 (the launcher meant 32)" in text
    assert "lr: 5.0e-05  # optimizer.lr=5e-05 (the launcher meant 0.0001)" in text
    assert m.why_not_ready.startswith("scripts/launch_comment.sh:3: a comment after a line continuation")


def test_read_p_and_a_restart_loop_are_named_and_the_interactive_launcher_runs_to_its_exec(shapes):
    interactive = shapes[("launch_interactive.sh", 1)]
    prompt = next(f for f in interactive.findings if f.rule == "launcher_prompt")
    assert prompt.severity == "warning" and "read -p 'Press Enter to start training on 1 node(s)...'" in prompt.message
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
    assert "MASTER_ADDR=node0 MASTER_PORT=29400 scripts/launch.sh" in summary(shapes[("launch_branches.sh", 2)])
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
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmldlm migrate: scripts/launch_comment.sh:3: a comment after")
    assert (tmp_path / "comment.yaml").read_text().startswith("# NOT READY")


BAD_INPUTS = {
    "an eval config": (["configs/eval_l2t.yaml"], "not a run config of the older trainer"),
    "not YAML": (["configs/broken.yaml"], "not valid YAML"),
    "a missing group file": (["configs/lion.yaml"], "'optimizer/lion'"),
    "a script without torchrun": (["--launcher", "scripts/no_torchrun.sh"], "called no torchrun"),
    "a launcher that is not here": (["--launcher", "scripts/nowhere.sh"], "no such file"),
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
    assert not out.exists()


def test_the_older_blocks_eight_heads_are_kept_where_they_divide_the_width():
    assert heads_for(1024) == 8 and heads_for(256) == 8
    assert heads_for(40) == 10  # 40 / 8 = 5 is odd: the nearest count with even head dims (4)


def test_every_older_key_has_a_row_in_the_docs_table():
    rows = set(re.findall(r"^\| `([\w.]+)` \|", DOCS.read_text(), re.M))
    assert set(OLDER_KEYS) <= rows, sorted(set(OLDER_KEYS) - rows)


def test_the_pages_output_is_what_migrate_prints_for_the_stable_launcher(tmp_path, capsys, monkeypatch):
    """docs/migrating.md quotes the stable launcher's table on one node, the whole output on two and the
    line on stderr, run from the older repository's root with the page's command: they are printed so."""
    blocks = re.findall(r"^```text\n(.*?)^```$", DOCS.read_text(encoding="utf-8"), re.M | re.S)
    shutil.copytree(OLDER_REPO, tmp_path / "old-repo")
    monkeypatch.chdir(tmp_path / "old-repo")
    printed = {}
    for nnodes in (1, 2):
        argv = ["migrate", "--launcher", "scripts/launch_stable.sh", "--nnodes", str(nnodes), "--gpus-per-node", "8"]
        assert cli.main([*argv, "--cpus-per-node", "32", "--out", "imported.yaml"]) == 1
        printed[nnodes] = capsys.readouterr()
    one_node_table = printed[1].out.split("\n\n")[:2]
    assert blocks[0] == "\n\n".join(one_node_table) + "\n"
    assert blocks[1] == printed[2].out
    assert blocks[2] == printed[2].err
