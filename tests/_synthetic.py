"""TEMPORARY stand-in for the data branch's loader (removed once mmldlm.data lands)."""
import torch


class Loader:
    def __init__(self, micro, rank, world, n=96, L=16, V=50, D=384):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(3, V, (n, L), generator=g)
        self.lat = torch.randn(n, 1, D, generator=g)
        self.pos, self.rank, self.world, self.micro, self.n = 0, rank, world, micro, n

    def __iter__(self):
        while True:
            j = self.pos * self.world + self.rank
            idx = torch.arange(j * self.micro, (j + 1) * self.micro) % self.n
            self.pos += 1
            yield {"tokens": self.tokens[idx], "pad_mask": torch.ones(self.micro, self.tokens.shape[1], dtype=torch.bool),
                   "latents": self.lat[idx], "index": idx}

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


def open_train_data(cfg, info):
    meta = {"vocab_size": 50, "mask_id": 1, "pad_id": 0, "latent_mean": [0.0] * 384, "latent_std": [1.0] * 384}
    return meta, Loader(cfg.train.micro_batch_size, info.rank, info.world_size)
