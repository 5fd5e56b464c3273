"""The older run config, composed as the older trainer composes it: by hydra-core, from its `defaults:`
list and the group folders beside it, with the torchrun call's override words exactly as the trainer
received them, and `${a.b}` interpolations resolved by OmegaConf. An override Hydra refuses (a stray " ",
a key the config does not have without `+`) is one the older trainer refused at start: it is named with
Hydra's own words and the rest are composed, to say what the config held."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmldlm.tools.migrate.cluster import MigrateError

# The keys a run config of the older trainer has (any of them), as opposed to an eval or generation config.
RUN_KEYS = ("training.num_train_steps", "training.train_batch_size", "training.num_epochs")


@dataclass(frozen=True)
class OlderConfig:
    folder: Path  # Hydra's config folder: the groups of the defaults list are its subfolders
    name: str  # the config's name within it (no .yaml), as --config-name gives it

    @classmethod
    def at(cls, path: Path) -> OlderConfig:
        if not path.is_file():
            raise MigrateError(f"older config {path}: no such file; expected the run's Hydra run config (YAML)")
        return cls(path.parent, path.stem)

    @property
    def path(self) -> Path:
        return self.folder / f"{self.name}.yaml"


@dataclass
class Composed:
    values: dict[str, Any]  # flat: "section.key" -> value
    refused: list[tuple[str, str]]  # (override, Hydra's reason): the older trainer refused these at start


def compose_older(config: OlderConfig, overrides: list[str]) -> Composed:
    """`config` with `overrides` (Hydra override words) applied as Hydra applies them."""
    refused, accepted = [], []
    parser = OverridesParser.create()
    for word in overrides:
        try:
            parser.parse_overrides([word])
            accepted.append(word)
        except HydraException as err:
            refused.append((word, _one_line(err).split(" See https")[0]))
    for _ in range(len(accepted) + 1):
        try:
            tree = _compose(config, accepted)
            break
        except (HydraException, OmegaConfBaseException) as err:
            culprit = _culprit(err, accepted)
            if culprit is None:
                raise MigrateError(f"older config {config.path}: {_hydra_message(err)}") from None
            accepted.remove(culprit)
            refused.append((culprit, _hydra_message(err)))
    values = flatten(tree)
    if not any(key in values for key in RUN_KEYS):
        sections = ", ".join(sorted({k.split(".")[0] for k in values})) or "nothing"
        raise MigrateError(
            f"older config {config.path}: not a run config of the older trainer: none of {', '.join(RUN_KEYS)} "
            f"(it holds {sections}; an eval or generation config?); give the config the trainer was started with"
        )
    return Composed(values, refused)


def _compose(config: OlderConfig, overrides: list[str]) -> dict:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config.folder.resolve()), version_base=None):
            cfg = compose(config_name=config.name, overrides=overrides)
            return OmegaConf.to_container(cfg, resolve=True)
    except yaml.YAMLError as err:
        raise MigrateError(f"older config {config.path}: not valid YAML ({_one_line(err)})") from None


def _culprit(err: Exception, overrides: list[str]) -> str | None:
    """The override Hydra's error is about, if it is about one."""
    text = str(err)
    if "override" not in text.lower() and "append" not in text.lower():
        return None
    for word in overrides:
        key = word.split("=", 1)[0].lstrip("+~")
        if re.search(rf"'{re.escape(key)}'|\b{re.escape(word)}\b|'{re.escape(key.split('.')[-1])}'", text):
            return word
    return None


def _hydra_message(err: Exception) -> str:
    return _one_line(err).split(" Config search path:")[0]  # Hydra appends its search path


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"section.key": value}; an empty mapping stays a value, so it is named too."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
