"""A stand-in for the data loader in trainer tests: micro-batches of consecutive samples of a fixed
random set, with the resumable position the trainer checkpoints."""

import torch


class SyntheticLoader:
    """64 fixed random samples, `micro` consecutive ones per batch (wrapping around). With pad_id,
    each sample has a random length in [3, length] and is padded after it (a `pad_mask` is given)."""

    def __init__(self, micro: int, vocab: int, length: int, dim: int, pad_id: int | None = None, first_token: int = 0):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(first_token, vocab, (64, length), generator=g)  # (64, L)
        self.lengths = torch.randint(3, length + 1, (64,), generator=g) if pad_id is not None else None
        self.latents = torch.randn(64, 1, dim, generator=g)  # (64, 1, D)
        self.micro, self.length, self.pad_id, self.pos = micro, length, pad_id, 0

    def __iter__(self):
        while True:
            idx = torch.arange(self.pos * self.micro, (self.pos + 1) * self.micro) % 64
            self.pos += 1
            batch = {"tokens": self.tokens[idx], "latents": self.latents[idx], "index": idx}
            if self.pad_id is not None:
                pad_mask = torch.arange(self.length)[None, :] < self.lengths[idx, None]  # (B, L)
                batch.update(tokens=batch["tokens"].masked_fill(~pad_mask, self.pad_id), pad_mask=pad_mask)
            yield batch

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]
