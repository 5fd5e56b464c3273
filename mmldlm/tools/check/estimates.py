"""The machine a run would go to (`Environment`, `detect_environment`) and what the run would take of
it (`estimate`): memory per process and checkpoint size from the parameter count (the model is built
on the meta device: no memory). They are meant to catch a run that cannot fit by a wide margin, not to
replace a measurement (`mmldlm train` logs the real peak memory).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmldlm.config import ConfigError, ModelConfig, RunConfig
from mmldlm.data import DataError
from mmldlm.data.dataset import heaviest_batch, open_dataset
from mmldlm.data.encoders import ENCODER_WIDTHS
from mmldlm.data.prepare import default_prepare_options
from mmldlm.device import auto_precision
from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.training.batch_size import batch_shape, global_batch_sizes, per_process_micro_batch
from mmldlm.training.metrics import cpu_has_native_bf16
from mmldlm.training.optim import STATE_BYTES
from mmldlm.training.storage import free_bytes

GIB = 2**30
MEMORY_HEADROOM = 0.9  # share of the device the estimate may fill (fragmentation, temporaries)
# Of the 50 bytes per token and hidden unit an MMDiT block keeps for backward, what selective activation
# checkpointing keeps: the matmul and attention outputs (qkv 3, attention 1, projection 1, MLP 4 + 1
# values of the hidden width in 16-bit), the cheap elementwise rest being recomputed.
SELECTIVE_BYTES = 20


@dataclass
class Environment:
    """Where the run would go: detected by `detect_environment`, or built by hand (tests, what-ifs)."""

    device: str = "cpu"  # "cuda" | "cpu"
    device_memory_gib: float = 16.0  # per process: the GPU's memory, or RAM / processes per node on CPU
    cpus: int = 1  # CPUs this node's processes share
    load: float = 0.0  # about how many of `cpus` other work keeps busy (a 1-minute load average)
    torch_threads: int = 1  # intra-op threads per process with train.threads=null (torch's default there)
    nproc_per_node: int = 1
    nnodes: int = 1
    free_disk_gib: float = 100.0  # at train.run_dir (or its nearest existing parent)
    fused_adamw: bool = True  # torch's fused AdamW kernel works on `device`
    native_bf16: bool = False  # bf16 matmuls in hardware (a CUDA GPU, or a CPU with AVX512-BF16/AMX)
    environ: dict[str, str] = field(default_factory=dict)  # the NCCL / torch variables that matter
    environ_source: str = "the environment"  # where `environ` was read, as findings name it
    resume: str | None = None  # what `mmldlm train --resume` would be given: "auto", a checkpoint path, or none

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


NCCL_VARIABLES = (
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_BLOCKING_WAIT",
)


def _fused_adamw_works(device: str) -> bool:
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def _load_on(cpus: int) -> float:
    """The machine's 1-minute load average (os.getloadavg), scaled to the share of its CPUs that this
    process may use (a container or taskset may allow fewer than the machine has)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not a Unix, or no /proc/loadavg: nothing known
        return 0.0
    return load * cpus / max(cpus, os.cpu_count() or 1)


def detect_environment(
    cfg: RunConfig,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    device_memory_gib: float | None = None,
    load: float | None = None,
) -> Environment:
    """This machine as the run would see it; process counts default to the torchrun/launcher variables,
    the load to the machine's 1-minute load average on this process's CPUs."""
    nproc = nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NPROC_PER_NODE") or 1)
    nodes = nnodes or int(os.environ.get("NNODES") or 1)
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    if device_memory_gib is None:
        if cuda:
            device_memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        else:  # CPU: the node's RAM is shared by its processes
            device_memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB / nproc
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # torchrun sets OMP_NUM_THREADS=1 for several processes per node unless it is set already.
    threads = torch.get_num_threads() if nproc == 1 or "OMP_NUM_THREADS" in os.environ else 1
    return Environment(
        device="cuda" if cuda else "cpu",
        device_memory_gib=device_memory_gib,
        cpus=cpus,
        load=_load_on(cpus) if load is None else load,
        torch_threads=threads,
        nproc_per_node=nproc,
        nnodes=nodes,
        free_disk_gib=free_bytes(cfg.train.run_dir) / GIB,
        fused_adamw=_fused_adamw_works("cuda" if cuda else "cpu"),
        native_bf16=torch.cuda.is_bf16_supported() if cuda else cpu_has_native_bf16(),
        environ={k: os.environ[k] for k in NCCL_VARIABLES if k in os.environ},
    )


@dataclass
class Estimate:
    num_params: int
    vocab_size: int
    seq_len: float  # text positions per sample: of the heaviest batch of the prepared data, else the longest
    seq_len_source: str  # where seq_len comes from, for the summary line
    static_gib: float  # weights, gradients, optimizer state, autocast copies and runtime overhead per process
    activations_gib_per_sample: float  # under `checkpointing`
    checkpoint_gib: float
    checkpointing: str = "none"  # the activation checkpointing estimated: the config's, or the one auto picks

    def memory_gib(self, micro_batch_size: int) -> float:
        return self.static_gib + micro_batch_size * self.activations_gib_per_sample


def vocab_size_of(cfg: RunConfig) -> int:
    """model.vocab_size, else the prepared dataset's (data.path/meta.json), else the default corpus's."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    if cfg.data.path is not None:
        meta = Path(cfg.data.path) / "meta.json"
        if meta.is_file():
            return int(json.loads(meta.read_text())["vocab_size"])
    return cfg.data.vocab_size


def model_of(cfg: RunConfig) -> ModelConfig:
    """cfg.model with a null latent_dim and num_latents set as training would set them: the prepared
    dataset's where it exists, else the sentence encoder's width (one latent per text)."""
    m = cfg.model
    if m.latent_dim is not None and m.num_latents is not None:
        return m
    path = prepared_data_path(cfg)
    if path is not None:
        meta = json.loads((path / "meta.json").read_text())
        shape = meta["num_latents"], meta["latent_dim"]
    elif cfg.data.encoder in ENCODER_WIDTHS:
        shape = 1, ENCODER_WIDTHS[cfg.data.encoder]
    else:
        raise ConfigError(
            f"config key 'model.latent_dim': null, and neither a prepared dataset at data.path nor a known "
            f"width of the encoder {cfg.data.encoder!r} gives it; set model.latent_dim (and model.num_latents)"
        )
    return dataclasses.replace(
        m,
        num_latents=shape[0] if m.num_latents is None else m.num_latents,
        latent_dim=shape[1] if m.latent_dim is None else m.latent_dim,
    )


def count_parameters(model: ModelConfig, vocab_size: int) -> int:
    with torch.device("meta"):  # shapes only
        network = MultimodalMMDiT(model, vocab_size=vocab_size)
    return sum(p.numel() for p in network.parameters())


def prepared_data_path(cfg: RunConfig) -> Path | None:
    """The prepared dataset a run of `cfg` would read, where it exists already: data.path, or for a
    null path the default corpus's cache entry."""
    path = Path(cfg.data.path) if cfg.data.path is not None else Path(default_prepare_options(cfg.data).out)
    return path if (path / "meta.json").is_file() else None


def text_positions_per_sample(cfg: RunConfig, env: Environment) -> tuple[float, str]:
    """Text positions the model computes per sample in the heaviest micro-batch of the run's first
    epoch (mmldlm/data/dataset.py, `heaviest_batch_lengths`): from the prepared dataset's real lengths
    under data.bucket_batches, where the dataset is there to read (only its offsets are read), else
    every text at data.max_length (or model.max_seq_len); and where the figure comes from."""
    max_length = max_length_of(cfg)
    path = prepared_data_path(cfg)
    if path is None:
        return float(max_length), f"every text at the longest length, {max_length} (no prepared dataset to read)"
    dataset = open_dataset(path, "train")
    data = dataclasses.replace(cfg.data, max_length=max_length)
    micro = micro_per_process(cfg, env)
    try:
        batch = heaviest_batch(dataset, data, micro, world_size=env.world_size)
    except DataError as err:  # not one batch of that size in the data: the loader refuses it too
        return float(max_length), f"every text at the longest length, {max_length} ({err})"
    rows, length = batch.get("pack_doc", batch["tokens"]).shape  # packed: the rows the blocks run on
    return rows * length / micro, f"the heaviest batch of {path}: {batch_shape(batch)}"


def estimate(cfg: RunConfig, env: Environment) -> Estimate:
    """Memory per process and checkpoint size from the parameter count P.

    Static: fp32 weights 4P + gradients 4P (none all at once with optim.step_in_backward) + AdamW
    moments 8P (about 2P in int8, 1P in int4: optim.state_dtype), divided by the world size under
    FSDP2, which shards all three (by the shard group size under HSDP); plus a 2P low-precision weight
    copy under bf16/fp16 autocast, plus runtime overhead (CUDA context and allocator slack 0.75 GiB;
    0.3 GiB of process on CPU).
    Activations per sample: a GPT block stores about S * H * (34 + 5 * nh * S / H) bytes with 16-bit
    activations (Korthikanti et al. 2022, sec. 4.1), over S = L + K tokens here. An MMDiT block also
    keeps its adaLN-modulated inputs and the QK-norm and RoPE outputs: 50 instead of 34 matches the
    tiny preset's measured RSS growth per sample in fp32 on CPU (twice the bytes of 16-bit). The
    5 * nh * S / H term (the attention matrix) counts only for the explicit-softmax attention; SDPA's
    fused kernels do not store it. The text head adds L * V * 12 bytes (logits, log-probabilities
    and their gradient in fp32). L is the text positions per sample of the heaviest batch the data
    yield (`text_positions_per_sample`).
    Activation checkpointing keeps less: full keeps each block's fp32 input (4 bytes per token and hidden
    unit) and one block's activations while it is recomputed; every_k does so for blocks 0, k, 2k, ...;
    selective keeps SELECTIVE_BYTES of the 50. auto is the least of none, selective, full under which the
    micro-batch fits (the trainer probes the same order at start-up); with micro-batch auto, none.
    Checkpoint: model.safetensors 4P + optimizer.pt 8P (fp32 weights and the two AdamW moments; about
    2P or 1P for the moments in int8 or int4).
    """
    m = model_of(cfg)
    vocab = vocab_size_of(cfg)
    params = count_parameters(m, vocab)
    seq_len, seq_len_source = text_positions_per_sample(cfg, env)
    tokens = seq_len + m.num_latents
    precision = cfg.train.precision if cfg.train.precision != "auto" else auto_precision(env.device, env.native_bf16)
    low_precision = precision in ("bf16", "fp16")
    shards = cfg.distributed.num_shards(env.world_size, env.nproc_per_node)
    # fp32 weights 4, gradients 4 (none all at once with the step in backward), AdamW moments by state_dtype
    moments = STATE_BYTES[cfg.optim.state_dtype]
    state = 4 + (0 if cfg.optim.step_in_backward else 4) + moments
    static = state * params / shards + (2 * params if low_precision else 0)
    static += (0.75 if env.device == "cuda" else 0.3) * GIB
    attention = 5 * m.num_heads * tokens / m.hidden_size if m.attention == "explicit" else 0
    scale = 1 if low_precision else 2
    per_block = tokens * m.hidden_size * (50 + attention) * scale
    block_input = tokens * m.hidden_size * 4
    head = seq_len * vocab * 12

    def per_sample(mode: str) -> float:
        every = {"full": 1, "every_k": cfg.perf.checkpoint_every_k}.get(mode)
        if mode == "selective":
            return m.num_blocks * tokens * m.hidden_size * SELECTIVE_BYTES * scale + head
        if every is None:
            return m.num_blocks * per_block + head
        wrapped = -(-m.num_blocks // every)
        return wrapped * block_input + (m.num_blocks - wrapped + 1) * per_block + head

    checkpointing = cfg.perf.activation_checkpointing
    if checkpointing == "auto":
        micro = micro_per_process(cfg, env)
        limit = MEMORY_HEADROOM * env.device_memory_gib * GIB - static
        fits = [mode for mode in ("none", "selective", "full") if micro * per_sample(mode) <= limit]
        picked = "none" if cfg.train.micro_batch_size == "auto" else (fits or ["full"])[0]
        checkpointing = f"{picked} (what auto picks)"
    return Estimate(
        num_params=params,
        vocab_size=vocab,
        seq_len=seq_len,
        seq_len_source=seq_len_source,
        static_gib=static / GIB,
        activations_gib_per_sample=per_sample(checkpointing.split()[0]) / GIB,
        checkpoint_gib=(4 + moments) * params / GIB,
        checkpointing=checkpointing,
    )


def max_length_of(cfg: RunConfig) -> int:
    """data.max_length, else model.max_seq_len rounded down to data.pad_to_multiple (at least one multiple)."""
    pad = cfg.data.pad_to_multiple
    return cfg.data.max_length or max(pad, cfg.model.max_seq_len // pad * pad)


def micro_per_process(cfg: RunConfig, env: Environment) -> int:
    """The micro-batch the trainer runs on each process: train.micro_batch_size, or each process's share
    of the global batch (see per_process_micro_batch); 1 for `auto` (the least the trainer will try)."""
    if cfg.train.micro_batch_size == "auto":
        return 1
    sizes = global_batch_sizes(cfg.train.global_batch_size, cfg.train.batch_schedule)
    return per_process_micro_batch(cfg.train.micro_batch_size, sizes, env.world_size)
