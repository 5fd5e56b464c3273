"""The loop end to end on CPU with gloo: DDP/FSDP2 vs one process, HSDP on a 2 x 2 mesh vs one
process, exact resume after kill -9, the non-finite guard, a stalled rank, accumulation (the launcher on
two simulated nodes: tests/test_launcher.py)."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from data_support import distributed_corpus_texts, prepared

from mmldlm import cli
from mmldlm.config import ConfigValueError, DistributedConfig
from mmldlm.export.pretrained import MMLDLM
from mmldlm.runs.checkpoints import read_weights, verify
from mmldlm.training import distributed

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "train_worker.py"
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]

# A smaller tiny model, small batches, every step logged, deterministic kernels, no loader workers.
BASE = [
    "model=tiny",
    "model.hidden_size=64",
    "model.num_blocks=2",
    "model.timestep_embed_dim=32",
    "train.micro_batch_size=2",
    "train.log_every=1",
    "train.deterministic=true",
    # One torch thread in-process as in the workers (OMP_NUM_THREADS=1), whatever an earlier test left
    # this process with: another count sums in another order (a straight run on 2 threads and its resume
    # from a 1-thread worker's checkpoint differed at step 22).
    "train.threads=1",
    "logging.progress_bar=false",
    "schedule.warmup_steps=2",
    "optim.lr=1e-3",
    "checkpoint.every=1000",
    "data.num_workers=0",
    "train.precision=fp32",  # auto is bf16 on CPUs with native bf16: equalities across batch splits need fp32
    "data.bucket_batches=1",
]  # bucketed batches are cut per rank: 1 x 2 accumulation steps != 2 ranks


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small prepared dataset (real tokenizer, encoder and on-disk format) for every run here, the
    same for the launcher's scenarios (prepared once per session)."""
    data = prepared(
        tmp_path_factory, "distributed", distributed_corpus_texts(), vocab_size=300, shard_size=64, val_fraction=0.05
    )
    BASE.append(f"data.path={data}")
    yield data
    BASE.remove(f"data.path={data}")


def training_scenario(test):
    """A scenario that trains in subprocesses (torchrun, or `mmldlm train` with a fault) on the
    prepared dataset: the slow tier."""
    return pytest.mark.slow(pytest.mark.usefixtures("dataset")(test))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(
    fault: str | None = None,
    dump_shards: Path | None = None,
    record: Path | None = None,
    compile_trace: Path | None = None,
) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in (
        "MMLDLM_TEST_FAULT",
        "MMLDLM_TEST_FIRED",
        "MMLDLM_TEST_DUMP_SHARDS",
        "MMLDLM_TEST_RECORD",
        "MMLDLM_TEST_COMPILE",
    ):
        env.pop(name, None)
    if fault:
        env["MMLDLM_TEST_FAULT"] = fault
    if dump_shards:
        env["MMLDLM_TEST_DUMP_SHARDS"] = str(dump_shards)
    if record:
        record.mkdir(parents=True, exist_ok=True)
        env["MMLDLM_TEST_RECORD"] = str(record)
    if compile_trace:
        env["MMLDLM_TEST_COMPILE"] = str(compile_trace)
    return env


def train(
    run_dir: Path,
    args: list[str],
    nproc: int = 1,
    fault: str | None = None,
    resume: str | None = None,
    timeout: float = 180,
    dump_shards: Path | None = None,
    record: Path | None = None,
    compile_trace: Path | None = None,
) -> subprocess.CompletedProcess:
    cmd = [*BASE, f"train.run_dir={run_dir}", *args] + (["--resume", resume] if resume else [])
    if nproc == 1 and not (fault or dump_shards or record or compile_trace):
        return train_in_process(cmd)
    if nproc == 1:
        full = [PYTHON, str(WORKER), *cmd]
    else:
        full = [
            *TORCHRUN,
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(WORKER),
            *cmd,
        ]
    env = _env(fault, dump_shards, record, compile_trace)
    return subprocess.run(full, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def train_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """`mmldlm train` in this process (one torch thread, as the workers' OMP_NUM_THREADS=1): a run with
    nothing injected gains nothing from a subprocess but its start-up."""
    return subprocess.CompletedProcess(["mmldlm", "train", *args], cli.main(["train", *args]), "", "")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path, weights: str = "model") -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return read_weights(run_dir / "checkpoints" / latest, weights)


def assert_ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def assert_params_equal(a: dict, b: dict):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_params_close(a: dict, b: dict, tol: float = 1e-5):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < tol, worst


@training_scenario
@pytest.mark.parametrize(
    "mode,strategy,grouped",
    [("joint", "ddp", False), ("random", "ddp", False), ("joint", "fsdp2", False), ("random", "fsdp2", True)],
)
def test_two_processes_match_one_process(tmp_path, mode, strategy, grouped):
    # The loader strides samples over ranks (rank r takes r, r + W, ...): with one sample per
    # micro-batch, 1 process x 2 accumulation steps sees exactly the two ranks' micro-batches.
    # The last case stacks FSDP2's gathered weights for the streams' grouped products.
    args = [
        "train.steps=10",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        f"objective.mode={mode}",
        f"distributed.strategy={strategy}",
        "train.ema_decay=0.9",
        f"perf.grouped_linears={str(grouped).lower()}",
    ]
    assert_ok(train(tmp_path / "one", args))
    assert_ok(train(tmp_path / "two", args, nproc=2))
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["mode"] for r in one] == [r["mode"] for r in two]
    assert mode != "random" or {"l2t", "t2l"} <= {r["mode"] for r in one}  # each head idle at some step
    assert one[-1]["accumulation_steps"] == 2 and two[-1]["accumulation_steps"] == 1
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    assert_params_close(final_params(tmp_path / "one"), final_params(tmp_path / "two"))
    # The EMA of the weights too (under FSDP2 each rank averages its shards; the checkpoint gathers them).
    assert_params_close(final_params(tmp_path / "one", "ema"), final_params(tmp_path / "two", "ema"))


@training_scenario
@pytest.mark.parametrize("compiled", ["perf.compile_model=true", "perf.compile_outside_blocks=true"])
def test_ddp_with_compiled_graphs_trains_as_one_eager_process_does(tmp_path, compiled):
    # DDP's hooks stay outside the graphs (the whole model's forward, or each block and the parts
    # outside them); the anchor of the idle head's parameters is added outside them too. Traced with
    # aot_eager (tests/fault_injection.py): forward and backward as the compiler sees them, run eagerly.
    args = [
        "train.steps=6",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "objective.mode=random",
        "distributed.strategy=ddp",
    ]
    assert_ok(train(tmp_path / "one", args))
    trace = tmp_path / "trace"
    assert_ok(train(tmp_path / "two", [*args, "perf.compile=true", compiled], nproc=2, compile_trace=trace))
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert {"l2t", "t2l"} <= {r["mode"] for r in one}  # the anchored idle head at some steps
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    assert_params_close(final_params(tmp_path / "one"), final_params(tmp_path / "two"))
    for rank in (0, 1):
        found = json.loads((trace / f"rank-{rank}.json").read_text())
        assert found["graphs"] > 0 and found["graph_breaks"] == 0, (rank, found)


@training_scenario
def test_fsdp2_ranks_start_a_fine_tuning_run_from_the_sources_whole_weights(tmp_path):
    # Every rank reads the source's weights and keeps its shards; a negligible learning rate leaves
    # them where they started, so the new run's checkpoint gathers the source's EMA again.
    args = ["train.micro_batch_size=1", "train.global_batch_size=2", "train.ema_decay=0.9"]
    assert_ok(train(tmp_path / "source", [*args, "train.steps=2"]))
    tuned = [
        *args,
        "train.steps=1",
        "optim.lr=1e-12",
        f"train.init_from={tmp_path / 'source'}",
        "distributed.strategy=fsdp2",
    ]
    proc = train(tmp_path / "tuned", tuned, nproc=2)
    assert_ok(proc)
    assert proc.stderr.count("initialized from") == 1
    assert [r["step"] for r in records(tmp_path / "tuned")] == [1]
    source = final_params(tmp_path / "source", "ema")
    assert_params_close(final_params(tmp_path / "tuned"), source, tol=1e-6)
    assert_params_close(final_params(tmp_path / "tuned", "ema"), source, tol=1e-6)


@training_scenario
def test_ddp_accumulating_micro_batches_trains_as_one_process_does(tmp_path):
    # 2 processes x 2 accumulation steps against 1 process x 4: the same micro-batches, the same update.
    # DDP's static graph cannot run under no_sync(), so "auto" leaves it off when a step accumulates.
    args = ["train.steps=6", "train.micro_batch_size=1", "train.global_batch_size=4", "objective.mode=random"]
    assert_ok(train(tmp_path / "one", args))
    assert_ok(train(tmp_path / "two", args, nproc=2))
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert one[-1]["accumulation_steps"] == 4 and two[-1]["accumulation_steps"] == 2
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    assert_params_close(final_params(tmp_path / "one"), final_params(tmp_path / "two"))


@training_scenario
def test_a_config_for_one_process_runs_on_two_with_each_process_taking_its_share(tmp_path):
    """Micro-batch 2 = global batch 2, written for one process (as configs/default.yaml), under torchrun
    with 2: each process runs micro-batches of 1, said once."""
    proc = train(tmp_path / "run", ["train.steps=2", "train.global_batch_size=2"], nproc=2)
    assert_ok(proc)
    said = (
        "train.micro_batch_size=2 x 2 processes is more than the global batch of 2; "
        "each process runs micro-batches of 1"
    )
    assert proc.stderr.count(said) == 1
    assert [(r["micro_batch_size"], r["accumulation_steps"]) for r in records(tmp_path / "run")] == [(1, 1), (1, 1)]


@training_scenario
def test_kill_and_resume_repeats_the_straight_run_exactly(tmp_path):
    args = [
        "train.steps=40",
        "train.global_batch_size=2",
        "checkpoint.every=10",
        "objective.mode=random",
        "train.ema_decay=0.95",
    ]
    assert_ok(train(tmp_path / "straight", args))
    killed = train(tmp_path / "resumed", args, fault="kill:23")  # SIGKILL before step 24's forward
    assert killed.returncode == -signal.SIGKILL
    assert len(records(tmp_path / "resumed")) == 23  # steps 21-23 were logged after the last checkpoint
    assert_ok(train(tmp_path / "resumed", args, resume="auto"))
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 41))  # each step once, in order
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    for weights in ("model", "ema"):
        a, b = final_params(tmp_path / "straight", weights), final_params(tmp_path / "resumed", weights)
        assert all(torch.equal(a[k], b[k]) for k in a), weights


def samples_by_step(record: Path) -> dict[int, list[int]]:
    """{step: the samples all ranks trained on in it} from the worker's MMLDLM_TEST_RECORD files."""
    read = {}
    for file in record.glob("rank-*.txt"):
        for line in file.read_text().splitlines():
            step, *indices = map(int, line.split())
            read.setdefault(step, []).extend(indices)
    return read


@training_scenario
@pytest.mark.parametrize(
    "before,after,batch",
    [((2, "ddp"), (1, "ddp"), 2), ((1, "ddp"), (2, "fsdp2"), 2), ((4, "fsdp2"), (2, "ddp"), 4)],
)
def test_a_run_resumes_on_another_number_of_processes_and_strategy_reading_each_sample_once(
    tmp_path, before, after, batch
):
    """Killed after the checkpoint of step 3, resumed on another world size (and strategy): DCP
    reshards model, optimizer and EMA, the LR schedule goes on by step, and the data by samples seen.
    Each step trains on the samples it trains on in the run that was never stopped, none twice; with
    one sample per micro-batch the steps are the same computations, so the losses and weights agree."""
    args = ["train.steps=6", "checkpoint.every=3", "train.micro_batch_size=1", f"train.global_batch_size={batch}"]
    args += ["objective.mode=random", "train.ema_decay=0.9"]

    def run(name, topology, **kw):
        nproc, strategy = topology
        return train(tmp_path / name, [*args, f"distributed.strategy={strategy}"], nproc=nproc, **kw)

    assert_ok(run("straight", before, record=tmp_path / "read-straight"))
    killed = run("resumed", before, fault="kill:4", record=tmp_path / "read-before")
    assert killed.returncode != 0
    proc = run("resumed", after, resume="auto", record=tmp_path / "read-after")
    assert_ok(proc)
    processes = "1 process" if after[0] == 1 else f"{after[0]} processes"
    assert f"resumed on {processes} from a checkpoint of {before[0]}:" in proc.stderr
    assert "seeded from (train.seed, step 3, rank)" in proc.stderr
    straight = samples_by_step(tmp_path / "read-straight")
    read = {s: v for s, v in samples_by_step(tmp_path / "read-before").items() if s < 3}
    read.update(samples_by_step(tmp_path / "read-after"))
    assert {s: sorted(v) for s, v in read.items()} == {s: sorted(v) for s, v in straight.items()}
    all_read = [i for v in read.values() for i in v]
    assert len(all_read) == len(set(all_read)) == 6 * batch
    a, b = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["lr"] for r in b] == [r["lr"] for r in a]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5, abs=1e-6)
    for weights in ("model", "ema"):
        assert_params_close(final_params(tmp_path / "straight", weights), final_params(tmp_path / "resumed", weights))


@training_scenario
def test_asynchronous_sharded_checkpoints_list_every_ranks_files_and_resume(tmp_path):
    """FSDP2 on 2 processes, saved in the background: each checkpoint's manifest lists both ranks'
    shards and states with their checksums, the run resumes from it, and one process reads it."""
    args = ["train.steps=4", "checkpoint.every=2", "checkpoint.async_save=true", "distributed.strategy=fsdp2"]
    args.append("train.ema_decay=0.9")
    assert_ok(train(tmp_path / "run", args, nproc=2))
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-0000002", "step-0000004"]
    meta = json.loads((ckpt / "step-0000004" / "meta.json").read_text())
    assert (meta["world_size"], meta["strategy"]) == (2, "fsdp2")
    listed = set(meta["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt", "trainer.pt"} <= listed
    assert listed == {p.name for p in (ckpt / "step-0000004").iterdir()} - {"meta.json"}
    assert verify(ckpt / "step-0000004", checksums=True) is None
    assert_ok(train(tmp_path / "run", [*args, "train.steps=6"], nproc=2, resume=str(ckpt / "step-0000002")))
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, 7))
    # Read in this one process: the API, and an export of it, hold the EMA the 2 ranks wrote in shards.
    ema = read_weights(ckpt / "step-0000006", "ema")
    loaded = MMLDLM.from_pretrained(tmp_path / "run", device="cpu")
    assert (loaded.run.step, loaded.run.weights) == (6, "ema")
    assert_params_equal(loaded.run.model.state_dict(), ema)
    loaded.save_pretrained(tmp_path / "exported")
    exported = MMLDLM.from_pretrained(tmp_path / "exported", device="cpu").run.model.state_dict()
    assert_params_equal(exported, ema)


@training_scenario
def test_a_failed_background_save_on_one_rank_stops_every_rank_with_the_cause(tmp_path):
    """Rank 1's disk fills while it writes the checkpoint of step 4 in the background: every rank hears
    it, and the job stops at the first step after the write ended (at the latest before the next
    save), saying which file failed; the partial checkpoint is gone and step 2 is whole."""
    args = ["train.steps=40", "checkpoint.every=2", "checkpoint.async_save=true", "distributed.strategy=fsdp2"]
    proc = train(tmp_path, args, nproc=2, fault="fullsave:1:4", timeout=120)
    assert proc.returncode != 0
    said = re.search(
        r"no space left on device .*rank-00001\.pt; the partial checkpoint was removed, the last good "
        r"checkpoint is .*step-0000002",
        proc.stderr,
    )
    assert said, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exitcode  : 2 " in proc.stderr  # a rank stopped with the error, not by a signal or a timeout
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-0000002"]
    assert verify(ckpt / "step-0000002", checksums=True) is None
    assert 4 <= max(r["step"] for r in records(tmp_path)) <= 6


@training_scenario
def test_nonfinite_loss_on_one_rank_is_skipped_on_every_rank(tmp_path):
    args = [
        "train.steps=6",
        "train.global_batch_size=4",
        "checkpoint.every=1",
        "objective.mode=joint",
        "checkpoint.keep_last=10",
    ]
    assert_ok(train(tmp_path, args, nproc=2, fault="nan:1:3"))  # rank 1 only, step index 3
    recs = records(tmp_path)
    assert [r["skipped"] for r in recs] == [False, False, False, True, False, False]
    assert recs[-1]["num_skipped"] == 1 and all(r["loss"] == r["loss"] for r in recs[4:])  # finite again
    ckpt = tmp_path / "checkpoints"
    before, after = (read_weights(ckpt / f"step-000000{s}") for s in (3, 4))
    assert all(torch.equal(before[k], after[k]) for k in before)  # rank 0 skipped too (its loss was finite)
    assert not torch.equal(after["text_embed.weight"], read_weights(ckpt / "step-0000005")["text_embed.weight"])


@training_scenario
def test_consecutive_nonfinite_updates_stop_the_run_with_checkpoints_untouched(tmp_path):
    args = ["train.steps=10", "train.global_batch_size=2", "checkpoint.every=4", "train.max_consecutive_skips=3"]
    proc = train(tmp_path, args, fault="nan:0:4,5,6")
    assert proc.returncode == 1
    assert "3 consecutive updates were skipped" in proc.stderr and "untouched" in proc.stderr
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step-0000004"  # nothing written when stopping at 7
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-0000004"]


@training_scenario
def test_stalled_rank_fails_the_job_with_a_message(tmp_path):
    # Rank 1 sleeps 12 s before the forward of step 3; rank 0 gives up on the step's all-reduce after
    # 6 s. A machine too slow for that margin makes the message name another collective: a failure.
    args = ["train.steps=6", "train.global_batch_size=4", "checkpoint.every=1", "distributed.timeout_minutes=0.1"]
    proc = train(tmp_path, args, nproc=2, fault="stall:1:2:12")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "gradient all-reduce of step 3 did not complete within distributed.timeout_minutes=0.1" in out
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step-0000002"
    assert json.loads((ckpt / "step-0000002" / "meta.json").read_text())["step"] == 2


# HSDP on 4 processes: 2 shard groups (replicas) of 2 ranks each; every mode of the mix, the EMA.
HSDP_ARGS = [
    "train.steps=8",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "objective.mode=random",
    "train.ema_decay=0.9",
    "checkpoint.every=4",
]


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory, dataset):
    """An HSDP run (2 x 2) whose ranks wrote their local shards after training."""
    root = tmp_path_factory.mktemp("hsdp")
    (root / "shards").mkdir()
    args = [*HSDP_ARGS, "distributed.strategy=hsdp", "distributed.shard_group_size=2"]
    assert_ok(train(root / "run", args, nproc=4, dump_shards=root / "shards"))
    return root


@training_scenario
def test_hsdp_trains_as_one_process_does(hsdp_run, tmp_path):
    """The same losses step by step and the same weights as one process accumulating the four ranks'
    micro-batches (which DDP and FSDP2 match, above): sharding changes only the order of float sums
    (reduce-scatter within a group, all-reduce across groups), hence 1e-5, not equality."""
    assert_ok(train(tmp_path, HSDP_ARGS))
    hsdp, other = records(hsdp_run / "run"), records(tmp_path)
    assert [r["mode"] for r in hsdp] == [r["mode"] for r in other] and len(hsdp) == 8
    assert {"l2t", "t2l"} <= {r["mode"] for r in hsdp}  # each head idle at some step (None gradients)
    assert other[-1]["accumulation_steps"] == 4 and hsdp[-1]["accumulation_steps"] == 1
    for a, b in zip(hsdp, other):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6)
    for weights in ("model", "ema"):
        assert_params_close(final_params(hsdp_run / "run", weights), final_params(tmp_path, weights))


@training_scenario
def test_hsdp_shards_within_a_group_and_replicates_across_groups(hsdp_run):
    """Rank r sits at mesh coordinate (r // 2, r % 2); the two ranks of a group hold different halves
    of each parameter (dim 0), which together are the checkpoint's weight, and the two replicas hold
    equal shards after 8 updates (the gradients were all-reduced across the groups)."""
    dumps = [torch.load(hsdp_run / "shards" / f"rank-{r}.pt") for r in range(4)]
    assert [tuple(d["coordinate"]) for d in dumps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    full = final_params(hsdp_run / "run")
    assert dumps[0]["params"].keys() <= full.keys()  # the checkpoint also holds the buffers
    for name in dumps[0]["params"]:
        weight = full[name]
        for group in ((0, 1), (2, 3)):
            shards = [dumps[r]["params"][name] for r in group]
            if weight.shape[0] > 1:
                assert shards[0].shape[0] < weight.shape[0], name  # a part, not the whole
            assert torch.equal(torch.cat(shards), weight), name
        for replicas in ((0, 2), (1, 3)):
            assert torch.equal(dumps[replicas[0]]["params"][name], dumps[replicas[1]]["params"][name]), name


@pytest.mark.parametrize(
    "shard_group_size,local_world_size,expected",
    [
        (3, 2, "config key 'distributed.shard_group_size': got 3; expected a divisor of the world size 4,"),
        (None, 3, "got 3; expected a divisor of the world size 4 (null: LOCAL_WORLD_SIZE, the processes per node)"),
        (0, 2, "got 0; expected null (the processes of one node) or an integer >= 1"),
    ],
)
def test_a_shard_group_size_that_does_not_divide_the_world_is_refused(shard_group_size, local_world_size, expected):
    cfg = DistributedConfig(strategy="hsdp", shard_group_size=shard_group_size)
    with pytest.raises(ConfigValueError, match=re.escape(expected)):
        cfg.check()
        cfg.num_shards(4, local_world_size)


def test_each_strategy_shards_over_its_own_number_of_ranks():
    assert DistributedConfig(strategy="ddp").num_shards(8, 4) == 1
    assert DistributedConfig(strategy="fsdp2").num_shards(8, 4) == 8
    assert DistributedConfig(strategy="hsdp").num_shards(8, 4) == 4  # null: one node's processes
    assert DistributedConfig(strategy="hsdp", shard_group_size=2).num_shards(8, 4) == 2
    assert DistributedConfig(strategy="hsdp").num_shards(1, 1) == 1


@training_scenario
def test_a_run_started_under_torchrun_and_stopped_says_to_continue_with_torchruns_line(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [*TORCHRUN, "--nproc-per-node", "1", "--master-port", str(free_port()), "-m", "mmldlm", "train"]
    cmd += [*BASE, "train.steps=100000", f"train.run_dir={run_dir}", "--resume", "auto"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").stat().st_size:
            assert proc.poll() is None and time.monotonic() < deadline, "no step trained"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole process group
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    line = next(line for line in err.splitlines() if line.startswith("mmldlm train: stopped by SIGINT"))
    resumed = [arg for arg in cmd if arg not in ("--resume", "auto")]  # the option given once, at the end
    assert line.endswith(f"Continue with: {shlex.join(resumed)} --resume auto")


@pytest.mark.parametrize(
    "environ,parent,expected",
    [
        ({}, None, "mmldlm train --config c x=1 --resume auto"),
        (
            {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            ["torchrun", "--nproc-per-node", "2", "-m", "mmldlm", "train", "--resume", "runs/x/step-1", "x=1"],
            "torchrun --nproc-per-node 2 -m mmldlm train x=1 --resume auto",
        ),
        (  # no /proc to read torchrun's line from: its environment
            {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
            None,
            "torchrun --nnodes=2 --nproc-per-node=2 -m mmldlm train --config c x=1 --resume auto (on every node)",
        ),
        (
            {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MMLDLM_LAUNCH_COMMAND": "L"},
            ["python", "-m", "torch.distributed.run"],
            "L (on every node, each with its own NODE_RANK)",
        ),
    ],
    ids=["one process", "torchrun", "torchrun without /proc", "scripts/launch.sh"],
)
def test_the_line_that_continues_a_run_is_the_one_it_was_launched_with(monkeypatch, environ, parent, expected):
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MMLDLM_LAUNCH_COMMAND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "torchrun_argv", lambda: parent)
    assert distributed.continue_command("mmldlm train --config c x=1") == expected
