"""A trained model as a self-contained folder, and the MMLDLM Python API around a trained model.

pretrained.py  the exported folder (write, read, check) and `MMLDLM` (from_pretrained, encode, decode,
               generate, save_pretrained); `load_trained` reads a run directory or an exported folder
card.py        the exported folder's model card (README.md), from the run directory

Public names: MMLDLM, load_trained (also `from mmldlm import MMLDLM`).
"""

from mmldlm.export.pretrained import MMLDLM, load_trained

__all__ = ["MMLDLM", "load_trained"]
