"""`mmldlm migrate` on a run of the older codebase written from its known settings (a Hydra-composed
config with a defaults list, group files and interpolations; a bash launcher that computes batch, LR,
warmup and steps from the cluster): the written config passes `check`, its values are the older run's
for each cluster, the audit names the critical issues, nothing unread goes unnamed, bad input is one
line with exit status 2."""

import math
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from mmldlm import cli

# hydra-core is a pinned dependency; a partial install (a GPU image running only `pytest -m cuda`)
# may lack it, and collecting this file must not fail there.
pytest.importorskip("hydra")
from mmldlm.config import load_config
from mmldlm.tools.check import Environment, audit
from mmldlm.tools.migrate import OLDER_KEYS, Cluster, heads_dividing, migrate

DOCS = Path(__file__).resolve().parent.parent / "docs" / "migrating.md"

MAIN_CONFIG = """\
defaults:
  - logging: default
  - optimizer: adam
  - _self_

data:
  token_dir: /store/old-run/tokens
  latent_dir: /store/old-run/latents
  max_samples: 2000000
  max_val_samples: 1000
  num_workers: 16
  val_ratio: 0.05
  tokenizer_path: /store/models/bert-base-uncased
model:
  hidden_size: 1024
  n_blocks: 24
  n_heads: 24
  cond_dim: ${model.hidden_size}
  max_seq_len: 2048
  dropout: 0.1
  num_residual_streams: 2
  qk_rmsnorm: true
  latent_dim: 32
  latent_timesteps: 1000
  latent_beta_schedule: cosine
  latent_parameterization: epsilon
  p_uniform: 0.0
  t_eps: 1e-4
  cluster_size: 0
training:
  seed: 42
  train_batch_size: 4
  eval_batch_size: ${training.train_batch_size}
  num_train_steps: 1000000
  dtype: bf16
  compile_model: false
  lr_schedule: cosine
  warmup_steps: 2000
  gradient_accumulation_steps: 2
loss:
  loss_type: l2t
  latent_loss_weight: 0.1
  text_loss_weight: 1.0
  use_cross_entropy: true
  reduction: tokenmean
"""
OPTIMIZER = """\
name: adamw
lr: 5e-5
weight_decay: 0.01
beta1: 0.9
beta2: 0.95
eps: 1e-8
grad_clip_norm: 0.5
use_fused: true
"""
LOGGING = """\
run_name: stable_l2t
save_dir: /store/checkpoints/${logging.run_name}
log_freq: 10000
eval_freq: 10000
save_freq: 50000
wandb_project: mmdit
"""
LAUNCHER = """\
#!/bin/bash
set -e
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-10.1.2.3}
MASTER_PORT=${MASTER_PORT:-29600}
BASE_WORLD_SIZE=8
WORLD_SIZE=$((NNODES * NPROC_PER_NODE))

export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=12000000
export TORCH_NCCL_ENABLE_MONITORING=0
export NCCL_TIMEOUT=7200
export NCCL_BLOCKING_WAIT=1
export TORCH_NCCL_BLOCKING_WAIT=1
export NCCL_ASYNC_ERROR_HANDLING=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

GPU_MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$GPU_MEM" -ge 80000 ]; then
    BATCH_SIZE=4
else
    BATCH_SIZE=1
fi
GRAD_ACCUM=1
while [ $((BATCH_SIZE * WORLD_SIZE * GRAD_ACCUM)) -lt 32 ]; do
    GRAD_ACCUM=$((GRAD_ACCUM + 1))
done
LR=$(python -c "import math; print(5e-5 * max(1, math.sqrt($BATCH_SIZE * $WORLD_SIZE * $GRAD_ACCUM / 32)))")
NUM_STEPS=$((1000000 * BASE_WORLD_SIZE / WORLD_SIZE))

torchrun --nnodes=$NNODES --node_rank=$NODE_RANK --nproc_per_node=$NPROC_PER_NODE \\
    --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \\
    train_mmdit_stable.py --config-name stable_l2t \\
    training.train_batch_size=$BATCH_SIZE \\
    training.num_train_steps=$NUM_STEPS \\
    optimizer.lr=$LR \\
    optimizer.grad_clip_norm=0.5 \\
    training.warmup_steps=$((NUM_STEPS / 50)) \\
    loss.latent_loss_weight=0.1 \\
    training.gradient_accumulation_steps=$GRAD_ACCUM \\
    data.num_workers=16 \\
    data.token_dir=/store/old-run/tokens \\
    data.latent_dir=/store/old-run/latents \\
    model.latent_dim=${LATENT_DIM:-32} \\
    training.dtype=bf16 \\
    logging.log_freq=$((10000 * BASE_WORLD_SIZE / WORLD_SIZE)) \\
    logging.eval_freq=$((10000 * BASE_WORLD_SIZE / WORLD_SIZE)) \\
    logging.save_freq=$((50000 * BASE_WORLD_SIZE / WORLD_SIZE))
"""


@pytest.fixture
def older(tmp_path):
    """The older run's files: conf/stable_l2t.yaml with its groups beside it, and launch.sh."""
    conf = tmp_path / "conf"
    (conf / "optimizer").mkdir(parents=True)
    (conf / "logging").mkdir()
    (conf / "stable_l2t.yaml").write_text(MAIN_CONFIG)
    (conf / "optimizer" / "adam.yaml").write_text(OPTIMIZER)
    (conf / "logging" / "default.yaml").write_text(LOGGING)
    (tmp_path / "launch.sh").write_text(LAUNCHER)
    return tmp_path


def cluster(nnodes, gpu_memory_gib=80.0):
    return Cluster(nnodes=nnodes, gpus_per_node=8, gpu_memory_gib=gpu_memory_gib, cpus_per_node=32)


def run(older, nnodes=1, gpu_memory_gib=80.0, launcher=True):
    out = older / "imported.yaml"
    shape = cluster(nnodes, gpu_memory_gib)
    return migrate(older / "conf" / "stable_l2t.yaml", older / "launch.sh" if launcher else None, shape, out), out


@pytest.mark.parametrize("nnodes", [1, 2])
def test_the_written_config_passes_check_with_no_error(older, nnodes):
    migration, out = run(older, nnodes)
    cfg = load_config(out)
    env = Environment(device="cuda", device_memory_gib=80.0, cpus=32, nproc_per_node=8, nnodes=nnodes, native_bf16=True)
    env.free_disk_gib = 10_000.0
    findings = audit(cfg, env)[0]
    assert [f.message for f in findings if f.severity == "error"] == []
    assert f"`mmldlm check` on {out} for this cluster: clean" in migration.report


# nodes, GPU GiB -> per-GPU batch, global batch, lr, steps, warmup, log/eval every, save every
CLUSTERS = {
    "1x8x80GB": (1, 80.0, 4, 32, 5e-5, 1_000_000, 5000, 10_000, 50_000),
    "2x8x80GB": (2, 80.0, 4, 64, 5e-5 * math.sqrt(2), 500_000, 5000, 5000, 25_000),
    # 8 x 8 GPUs: warmup 2% of 125,000 steps = 2500, inside [1000, 5000]
    "8x8x80GB": (8, 80.0, 4, 256, 5e-5 * math.sqrt(8), 125_000, 2500, 1250, 6250),
    # 40 GB: 3 per GPU, 24 < 32, so accumulation 2: an effective batch of 48
    "1x8x40GB": (1, 40.0, 3, 48, 5e-5 * math.sqrt(1.5), 1_000_000, 5000, 10_000, 50_000),
}


@pytest.mark.parametrize("shape", CLUSTERS)
def test_the_written_values_are_the_older_runs_as_its_launcher_computes_them(older, shape):
    nnodes, memory, micro, batch, lr, steps, warmup, log_every, save_every = CLUSTERS[shape]
    migration, _ = run(older, nnodes, memory)
    cfg = migration.config
    m = cfg.model
    assert (m.hidden_size, m.num_blocks, m.max_seq_len, m.latent_dim, m.dropout, m.qk_norm) == (
        1024,
        24,
        2048,
        32,
        0.1,
        True,
    )
    assert m.num_heads == 16 and m.vocab_size is None  # 24 does not divide 1024; vocabulary from the data
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (micro, batch)
    assert cfg.optim.lr == pytest.approx(lr)
    assert (cfg.optim.betas, cfg.optim.eps, cfg.optim.weight_decay, cfg.optim.grad_clip) == (
        [0.9, 0.95],
        1e-8,
        0.01,
        0.5,
    )
    assert (cfg.train.steps, cfg.schedule.warmup_steps, cfg.schedule.kind) == (steps, warmup, "warmup_cosine")
    assert (cfg.train.log_every, cfg.eval.every, cfg.checkpoint.every) == (log_every, log_every, save_every)
    assert cfg.eval.batch_size == micro  # ${training.train_batch_size}, resolved after the launcher's override
    assert (cfg.objective.mode, cfg.objective.latent_loss_weight, cfg.text_diffusion.loss) == ("l2t", 0.1, "masked_ce")
    assert (cfg.latent_diffusion.prediction, cfg.train.precision, cfg.train.seed) == ("eps", "bf16", 42)
    assert (cfg.checkpoint.keep_last, cfg.distributed.timeout_minutes, cfg.data.num_workers) == (3, 30.0, None)
    assert cfg.perf.activation_checkpointing == "auto"


def test_without_the_launcher_the_configs_own_batch_accumulation_and_warmup_are_kept(older):
    migration, _ = run(older, nnodes=1, launcher=False)
    cfg = migration.config
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (4, 4 * 2 * 8)
    assert (cfg.optim.lr, cfg.schedule.warmup_steps, cfg.train.steps) == (5e-5, 2000, 1_000_000)


def test_the_audit_names_the_critical_issues_of_the_older_files_and_what_the_written_config_does(older):
    migration, out = run(older, nnodes=2)
    report = migration.report
    audit_part = report.split("audit of the older run")[1].split("what the older training code got wrong")[0]
    expected = [
        "ERROR   [nccl_env] TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=12000000 in",
        "WARNING [nccl_env] TORCH_NCCL_ENABLE_MONITORING=0 in",
        "WARNING [nccl_env] NCCL_BLOCKING_WAIT=1 in",
        "WARNING [nccl_env] TORCH_NCCL_BLOCKING_WAIT=1 in",
        "WARNING [timeout] NCCL_TIMEOUT=7200 in",
        "WARNING [loader_workers] data.num_workers=16 with 32 CPUs for 8 processes per node",
        "WARNING [activation_checkpointing] model.max_seq_len=2048 with no activation checkpointing",
        "WARNING [checkpoint_retention] logging.save_freq=25000: the older trainer keeps every checkpoint, 20 of",
        "WARNING [num_heads] model.n_heads=24 does not divide model.hidden_size=1024",
        "INFO    [lr_schedule] the launcher computes optimizer.lr=7.07e-05 (from 5e-05)",
        "INFO    [fused_optimizer] optimizer.use_fused=true",
    ]
    for start in expected:
        assert re.search(rf"^{re.escape(start)}", audit_part, re.M), start
    blocks = re.split(r"\n(?=[A-Z]+ +\[)", audit_part.strip())[1:]
    assert len(blocks) == len(expected)
    for block in blocks:  # each: what, why, the fix, and what the written config does
        assert [line.split(":")[0].strip() for line in block.splitlines()[1:]] == ["why", "fix", "written"]
    assert f"written: {out} has data.num_workers=null" in audit_part
    assert f"written: {out} has distributed.timeout_minutes=30.0" in audit_part
    assert f"written: {out} has perf.activation_checkpointing=auto" in audit_part
    assert report.count("fp32 master copy") == 1  # the older code's mistakes, stated once


def test_settings_not_carried_over_unknown_keys_and_unevaluated_shell_lines_are_named(older):
    conf = older / "conf" / "stable_l2t.yaml"
    changed = MAIN_CONFIG.replace("  cluster_size: 0\n", "  cluster_size: 0\n  router_temperature: 0.7\n")
    conf.write_text(changed.replace("p_uniform: 0.0", "p_uniform: 0.1").replace("loss_type: l2t", "loss_type: mixed"))
    launcher = older / "launch.sh"
    launcher.write_text(
        LAUNCHER.replace("    training.dtype=bf16 \\\n", "    training.dtype=bf16 \\\n    data.shard=$(hostname) \\\n")
    )
    migration = run(older, nnodes=2)[0]
    report = migration.report
    assert "model.router_temperature=0.7: unknown key; not read" in report
    assert "model.p_uniform=0.1 (on in the older run): uniform-token noise" in report
    assert "loss.loss_type='mixed': no counterpart (known: l2t, t2l, joint); not carried, our default kept" in report
    assert "loss.loss_type" not in report.split("carried over (older key -> ours):")[1].split("not carried over:")[0]
    assert migration.config.objective.mode == "random"
    assert "override data.shard=$(hostname) not evaluated; not applied" in report
    assert re.search(r"launch\.sh:9: `WORLD_SIZE=\$\(\(NNODES \* NPROC_PER_NODE\)\)` not evaluated", report)
    assert re.search(r"launch\.sh:19-24: `GPU_MEM=\$\(nvidia-smi .*` not evaluated", report)
    assert re.search(r"launch\.sh:26-30: `while \[ .* \]; do` not evaluated", report)
    assert "training.train_batch_size, training.num_train_steps, optimizer.lr" in report  # the rules that stand in
    not_carried = report.split("not carried over:\n")[1].split("\n\n")[0]
    for key in ("num_residual_streams=2", "latent_timesteps=1000", "t_eps=0.0001", "cluster_size=0", "save_dir="):
        assert key in not_carried
    assert (
        "NCCL_ASYNC_ERROR_HANDLING=1: not carried (scripts/launch.sh sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in report
    )


def test_the_next_commands_import_the_data_and_launch_at_the_clusters_shape(older):
    report, out = run(older, nnodes=2)
    lines = report.report.split("\nnext:\n")[1].splitlines()
    assert lines[0].strip() == (
        "mmldlm prepare --legacy-tokens /store/old-run/tokens --legacy-latents /store/old-run/latents "
        "--tokenizer /store/models/bert-base-uncased --max-samples 2000000 --val-fraction 0.05 "
        "--out data/prepared/stable_l2t"
    )
    assert lines[1].strip() == f"mmldlm check {out} --nnodes 2 --nproc-per-node 8 --device-memory-gib 80"
    assert (
        lines[2]
        .strip()
        .startswith(
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NNODES=2 NPROC_PER_NODE=8 NODE_RANK=0 "
            f"MASTER_ADDR=10.1.2.3 MASTER_PORT=29600 scripts/launch.sh --config {out}"
        )
    )
    assert load_config(out).data.path == "data/prepared/stable_l2t"


BAD_INPUTS = {
    "not YAML": ("stable_l2t.yaml", "model: [1024,\n", None, "not valid YAML"),
    "a missing group file": (
        "stable_l2t.yaml",
        MAIN_CONFIG.replace("optimizer: adam", "optimizer: lion"),
        None,
        "'optimizer/lion'",
    ),
    "a missing interpolation": ("stable_l2t.yaml", MAIN_CONFIG + "extra: ${nowhere.lr}\n", None, "nowhere.lr"),
    "a script that is not a launcher": (None, None, "#!/bin/bash\necho training\npython train.py\n", "not a launcher"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_status_2(older, capsys, case):
    name, config_text, launcher_text, expected = BAD_INPUTS[case]
    if config_text is not None:
        (older / "conf" / name).write_text(config_text)
    if launcher_text is not None:
        (older / "launch.sh").write_text(launcher_text)
    out = older / "imported.yaml"
    argv = [
        "migrate",
        str(older / "conf" / "stable_l2t.yaml"),
        "--launcher",
        str(older / "launch.sh"),
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmldlm migrate: ") and err.count("\n") == 1 and expected in err
    assert not out.exists()


def test_the_head_count_is_rounded_to_the_nearest_divisor_with_an_even_head_dim():
    assert heads_dividing(1024, 24) == 16  # 16 and 32 are as near: fewer, wider heads
    assert heads_dividing(1024, 16) == 16
    assert heads_dividing(768, 12) == 12
    assert heads_dividing(1024, 30) == 32


def test_every_older_key_has_a_row_in_the_docs_table():
    rows = set(re.findall(r"^\| `([\w.]+)` \|", DOCS.read_text(), re.M))
    assert set(OLDER_KEYS) <= rows, sorted(set(OLDER_KEYS) - rows)


def test_the_memory_estimates_read_the_older_tokenizers_vocabulary_where_it_is_here(older):
    folder = older / "bert-base-uncased"
    folder.mkdir()
    Tokenizer(WordLevel({f"w{i}": i for i in range(30522)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    conf = older / "conf" / "stable_l2t.yaml"
    conf.write_text(MAIN_CONFIG.replace("/store/models/bert-base-uncased", str(folder)))
    migration = run(older)[0]
    assert "(vocab 30524)" in migration.report  # + [PAD] and [MASK], as prepare adds them
    assert "not readable here" not in migration.report
    assert migration.config.model.vocab_size is None  # the written config takes it from the prepared data


def test_launcher_values_are_evaluated_only_where_every_part_is_known(older):
    text = LAUNCHER.replace("    training.dtype=bf16 \\\n", "    training.dtype=${DTYPE:-$PRECISION} \\\n")
    (older / "launch.sh").write_text(text.replace("BASE_WORLD_SIZE=8\n", "BASE_WORLD_SIZE=${BASE:-8}\n"))
    migration = run(older, nnodes=2)[0]
    assert "override training.dtype=${DTYPE:-$PRECISION} not evaluated; not applied" in migration.report
    assert migration.config.train.steps == 500_000  # ${BASE:-8}: the default, 8 / 16 GPUs
    assert migration.launcher.variables["MASTER_PORT"] == "29600"


def test_the_command_writes_the_config_and_prints_the_report(older, capsys):
    out = older / "configs" / "imported.yaml"
    argv = ["migrate", str(older / "conf" / "stable_l2t.yaml"), "--launcher", str(older / "launch.sh")]
    assert cli.main([*argv, "--nnodes", "2", "--cpus-per-node", "32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"migrate: {older / 'conf' / 'stable_l2t.yaml'} + {older / 'launch.sh'} for 2 node(s)")
    assert "\nnext:\n  mmldlm prepare --legacy-tokens" in printed
    text = out.read_text()
    assert "  num_heads: 16  # model.n_heads=24; 24 does not divide 1024" in text
    assert "  global_batch_size: 64  # 4 per GPU x accumulation 1 x 16 GPUs" in text
