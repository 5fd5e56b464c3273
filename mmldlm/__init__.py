"""MM-LDLM: multimodal latent diffusion language models (masked text diffusion + Gaussian latent diffusion).

    from mmldlm import MMLDLM
    m = MMLDLM.from_pretrained("exported/")    # an exported folder or a run directory

`MMLDLM` loads its module (and torch) on first use (PEP 562), so `import mmldlm` and `mmldlm --help`
stay fast.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "MMLDLM":
        from mmldlm.export.pretrained import MMLDLM

        return MMLDLM
    raise AttributeError(f"module 'mmldlm' has no attribute '{name}'")
