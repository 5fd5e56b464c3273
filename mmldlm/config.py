"""Typed configuration: one small dataclass per component, YAML presets, `section.key=value` overrides.

A run config is a `RunConfig` of sections. Each component takes only its own section
(`MultimodalMMDiT(cfg.model)`, `MaskedDiffusion(cfg.text_diffusion)`, ...). Every value is checked
for type and range before any work starts; a bad one raises `ConfigError` naming the key, the value
given and what is allowed.

Presets are YAML files:
- `configs/NAME.yaml` holds a whole run config; `inherit: OTHER.yaml` starts from another file.
- `configs/model/NAME.yaml` holds a model size preset; `model: NAME` in a run config (or the
  override `model=NAME`) loads it, and later `model.key=value` overrides apply on top. The override
  `model=NAME` sets the preset's keys and keeps other model keys set before it (e.g. the baseline
  preset's `model.attention`), so it picks a size without undoing a run config's choices.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mmldlm.errors import OptionError, UserError
from mmldlm.outputs import write_atomically

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
MODES = ("l2t", "t2l", "joint")
DEVICE_KINDS = re.compile(r"auto|cpu|cuda(:\d+)?")  # what train.device and every --device accept


class ConfigError(UserError):
    """A config file, override or value that cannot be used; the message names the file or key, the
    value and what is allowed."""


class ConfigValueError(OptionError, ConfigError):
    """One config key with a value that cannot be used."""


def _fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigValueError(f"config key '{key}'", value, allowed)


# --------------------------------------------------------------------------------------------------
# Component configs. Each `check(prefix)` validates values that the type alone cannot.


# ModelConfig keys that a null value leaves to the prepared dataset (mmldlm/data/dataset.py, model_for_dataset).
FROM_DATASET = ("vocab_size", "latent_dim", "num_latents")


@dataclass
class ModelConfig:
    """The MultimodalMMDiT network (see mmldlm/model/mmdit.py)."""

    hidden_size: int = 256
    num_blocks: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    vocab_size: int | None = None  # None: taken from the prepared dataset's tokenizer
    max_seq_len: int = 128  # longest text (in tokens) the model accepts
    latent_dim: int | None = None  # D; None: the prepared dataset's (its sentence encoder's width)
    num_latents: int | None = None  # K latent vectors per sample; None: the prepared dataset's (1 per text)
    pos_embedding: Literal["rope", "learned"] = "rope"
    qk_norm: bool = True  # RMSNorm on queries and keys, per head
    # sdpa: SDPA, with a padding mask where a batch has padding (none, so flash, where it has none);
    # varlen: on a CUDA device a padded or packed batch attends over its real positions alone with
    # flash attention's variable-length kernel, in shapes that follow the batch's shape alone, so it
    # takes static compiled graphs and CUDA graphs (less device time, more host time per call: slower
    # at the older codebase's shape in eager mode, docs/benchmarks-gpu.md); explicit: the baseline
    # recipe (mmldlm/baseline.py). All three are exact; model/attention.py says which runs when.
    attention: Literal["sdpa", "varlen", "explicit"] = "sdpa"
    timestep_embed_dim: int = 256  # sinusoidal features fed to the timestep MLPs
    # The blocks' adaLN modulation (shift, scale, gate of each sublayer and stream): per_block, each
    # block's own projection of the conditioning vector (DiT); single, one projection shared by every
    # block plus a learned offset per block (PixArt-alpha's adaLN-single): num_blocks - 1 fewer
    # (H, 12H) matrices, a third of the base preset's parameters, each read once a step for one row per text;
    # on the main job it cost t2l quality (docs/log/quality.md, "One adaLN projection for every block").
    adaln: Literal["per_block", "single"] = "per_block"
    null_latent: bool = True  # learned "no condition" latent for classifier-free guidance
    # Latent self-conditioning (Chen et al. 2022): the latent stream also reads an earlier x0 estimate.
    self_condition: bool = False
    # A small head that predicts the text length from the clean latent (the model has no end-of-text
    # token): what a sampler uses where no source text gives the length.
    length_head: bool = True
    # Vocabulary prior: every text logit gets a bonus for the tokens whose own sentence-encoder latent
    # is near the latent input (cosine), scaled by a learned function of t_latent. Needs the dataset's
    # token latents (made by `mmldlm prepare`, or added at the first training start).
    vocab_prior: bool = False
    # Prefix tokens: the latent input also enters the text stream as this many tokens placed before the
    # text (a linear map of the latent, as vec2text feeds an embedding to its decoder), so every block of
    # the text stream reads it through its own weights and several keys; 0 = off.
    num_prefix_tokens: int = 0
    dropout: float = 0.0
    init_std: float = 0.02
    norm_eps: float = 1e-6

    def check(self, prefix: str = "model") -> None:
        for key in (
            "hidden_size",
            "num_blocks",
            "num_heads",
            "max_seq_len",
            "latent_dim",
            "num_latents",
            "timestep_embed_dim",
        ):
            value = getattr(self, key)
            if value is None and key in FROM_DATASET:
                continue
            if value < 1:
                allowed = "null (from the dataset) or an integer >= 1" if key in FROM_DATASET else "an integer >= 1"
                _fail(f"{prefix}.{key}", value, allowed)
        if self.hidden_size % self.num_heads:
            _fail(f"{prefix}.hidden_size", self.hidden_size, f"a multiple of {prefix}.num_heads={self.num_heads}")
        head_dim = self.hidden_size // self.num_heads
        if self.pos_embedding == "rope" and head_dim % 2:
            _fail(
                f"{prefix}.num_heads",
                self.num_heads,
                f"a head count giving an even head dim for RoPE (hidden_size/num_heads = {head_dim})",
            )
        if self.timestep_embed_dim % 2:
            _fail(f"{prefix}.timestep_embed_dim", self.timestep_embed_dim, "an even integer")
        if self.vocab_size is not None and self.vocab_size < 3:
            _fail(f"{prefix}.vocab_size", self.vocab_size, "null (from the dataset) or an integer >= 3")
        if self.num_prefix_tokens < 0:
            _fail(f"{prefix}.num_prefix_tokens", self.num_prefix_tokens, "an integer >= 0 (0 = off)")
        if self.mlp_ratio <= 0:
            _fail(f"{prefix}.mlp_ratio", self.mlp_ratio, "a number > 0")
        if not 0.0 <= self.dropout < 1.0:
            _fail(f"{prefix}.dropout", self.dropout, "a number in [0, 1)")
        if self.init_std <= 0 or self.norm_eps <= 0:
            key = "init_std" if self.init_std <= 0 else "norm_eps"
            _fail(f"{prefix}.{key}", getattr(self, key), "a number > 0")


# --------------------------------------------------------------------------------------------------
# The sampler's options (mmldlm/sampling/sampler.py). Each field states once its default, its
# command-line help (`mmldlm sample`, `eval` and `compare` make their options from it:
# mmldlm/commands/sample.py) and the values it takes; the run config's sampler defaults below
# (text_diffusion.sampling_*, latent_diffusion.sampler, ...) name the field they set.


def _option(default: Any, help: str, rule: tuple | None = None, none: str = "", flag: str | None = None) -> Any:
    """A SamplingOptions field: its default; its command-line help (argparse's: %(default)s is the
    default); `rule`, (valid(value), what it expects), the values it takes (a Literal's are its
    choices); `none`, what None means, said after what it expects (a field that takes None); and its
    flag where that is not --NAME."""
    return field(default=default, metadata={"help": help, "rule": rule, "none": none, "flag": flag})


_COUNT = (lambda value: value >= 1, "an integer >= 1")
_COUNT_OR_OFF = (lambda value: value >= 0, "an integer >= 0 (0 = off)")
_SHARE = (lambda value: 0 < value <= 1, "a number in (0, 1]")


@dataclass
class SamplingOptions:
    """How the samplers sample (mmldlm/sampling/sampler.py)."""

    # Reverse steps from t = 1 to t = 0 of l2t and joint.
    num_steps: int = _option(
        32,
        "reverse steps of every sampler (default: the run's text_diffusion.num_sampling_steps for l2t and joint, "
        "latent_diffusion.num_sampling_steps for t2l)",
        _COUNT,
        flag="--steps",
    )
    # Reverse steps of t2l; None: num_steps. The text nearly fixes its latent, and a few steps (whose
    # first x0 estimate is the conditional mean) can beat many (docs/log/quality.md).
    latent_steps: int | None = _option(
        None,
        "reverse steps of t2l (default: --steps, else the run's latent_diffusion.num_sampling_steps)",
        _COUNT,
        " (or None: num_steps)",
    )
    # Text logits are divided by it; 1 keeps the model's distribution where the strategy does.
    temperature: float = _option(
        1.0,
        "text logits are divided by it (default: the run's text_diffusion.sampling_temperature)",
        (lambda value: value > 0, "a number > 0"),
    )
    # How masked text positions are revealed (MaskedDiffusion.step). "confidence" (the most confident
    # draws first) is mode-seeking: it keeps a draw for being likely, so it does not sample the model's
    # distribution, and it decodes far better words than MDLM's ancestral sampler from small models
    # (docs/quality.md). "ancestral", "margin" and "left_to_right" choose positions without looking at
    # the drawn values and sample the model's distribution when steps reveal one token each.
    strategy: Literal["confidence", "margin", "left_to_right", "ancestral"] = _option(
        "confidence",
        "text: the most confident positions first (mode-seeking), the widest gap between the two best words "
        "first, the leftmost first, or MDLM ancestral unmasking (these three sample the model's distribution)",
    )
    # Classifier-free guidance w (sampler.py's docstring); 0 = off.
    guidance_scale: float = _option(
        0.0,
        "classifier-free guidance w: cond + w (cond - uncond); 0 = off",
        (math.isfinite, "a finite number (0 = off)"),
    )
    # "ddim" or "ddpm" (GaussianDiffusion.step) sample the latent; "mean" (t2l only) is the posterior mean
    # E[x0 | text] for an encoder: one model call at t = 1, whose x0 estimate given noise that carries no
    # signal (alpha_1 = latent_diffusion.min_alpha) is the regression answer. Samples of few DDIM steps at a
    # shifted schedule are close to it too: too narrow to stand for the latent distribution (docs/quality.md).
    latent_sampler: Literal["ddim", "ddpm", "mean"] = _option(
        "ddim",
        "default: the run's latent_diffusion.sampler; mean (t2l): the posterior mean E[latent | text], one "
        "model call, for using t2l as an encoder",
    )
    # The latent sampler's time grid (GaussianDiffusion.time_grid): None, equal steps of t; s', the SNRs of
    # equal steps under shift s'. t2l, joint and the latent prior; the text keeps equal steps of t.
    latent_shift: float | None = _option(
        None,
        "the latent sampler's time grid (t2l, joint): the SNRs of equal steps under this shift, e.g. 1 for the "
        "plain cosine schedule's (default: the run's latent_diffusion.sampling_shift; none: equal steps of the "
        "trained schedule's t)",
        (lambda value: math.isfinite(value) and value > 0, "a number > 0"),
        ", or None (equal steps of t)",
    )
    # l2t: skip the model call when the last step unmasked nothing.
    reuse_output: bool = _option(True, "l2t: call the model even when a step changed nothing", flag="--no-reuse")
    # Each revealed text position's logit of every token already revealed in its text is lowered by this
    # much (0 = off): a small model otherwise writes the latent's keyword at several positions.
    repetition_penalty: float = _option(
        0.0,
        "text: lower the logit of every token already in the text by this much (default: the run's "
        "text_diffusion.sampling_repetition_penalty; 0 = off)",
        (lambda value: math.isfinite(value) and value >= 0, "a number >= 0 (0 = off)"),
    )
    # Remasking: "confidence" rounds after the text is complete, each masking its least confident
    # `remask_fraction` of tokens again and re-sampling them given the rest, `remask_rounds` times (0 =
    # off); mode-seeking, as the tokens remasked are chosen by their values. "posterior": ReMDM's
    # remasking posterior (Wang et al. 2025) at every step of the ancestral sampler, each revealed token
    # masked again with probability min(remask_cap, (1 - alpha_s) / alpha_t) whatever its value; it
    # samples the model's distribution (MaskedDiffusion.remasking_step).
    remask: Literal["confidence", "posterior"] = _option(
        "confidence",
        "text: how revealed tokens are masked again: the least confident share in rounds after the text "
        "(--remask-rounds; mode-seeking; the default), or ReMDM's remasking posterior at every step of "
        "--strategy ancestral (samples the model's distribution)",
    )
    remask_rounds: int = _option(
        0,
        "text: re-sample the least confident share of a finished text given the rest, this many times "
        "(--remask confidence; default %(default)s)",
        _COUNT_OR_OFF,
    )
    remask_fraction: float = _option(
        0.25,
        "the share of a text's tokens re-sampled per remasking or correction round (default %(default)s)",
        _SHARE,
    )
    remask_cap: float = _option(
        0.02,
        "--remask posterior: the most a step masks again of the revealed tokens, "
        "sigma_t = min(cap, (1 - alpha_s) / alpha_t) (default %(default)s)",
        _SHARE,
    )
    # The sentence encoder in the loop (decoding.py): `best_of` candidates per text, the one whose
    # re-encoding is closest to the target latent kept; then `correction_rounds` rounds, each re-sampling
    # `correction_proposals` variants of the kept text with its least confident `remask_fraction` masked
    # (one variant) or a confidence-weighted random share (the others), a variant kept only where its
    # re-encoding is closer. l2t: the target is the given latent; joint: the text's own sampled latent.
    best_of: int = _option(
        1,
        "text: sample N texts per latent and keep the one whose re-encoding by the sentence encoder is closest "
        "(l2t: to the latent; joint: to its own latent); default: the run's text_diffusion.sampling_best_of",
        (lambda value: value >= 1, "an integer >= 1 (1 = one text, no re-ranking)"),
    )
    correction_rounds: int = _option(
        0,
        "text: rounds of re-sampling variants of the kept text, each kept only where its re-encoding is closer "
        "(uses the sentence encoder); default: the run's text_diffusion.sampling_correction_rounds",
        _COUNT_OR_OFF,
    )
    correction_proposals: int = _option(4, "variants per correction round (default %(default)s)", _COUNT)
    # joint: "together" moves text and latent down one time grid side by side; "latent_first" samples the
    # latent given only the text's length (the text fully masked, as training drops the text) and then
    # decodes it at that length as l2t does, with every l2t option (the latent model and l2t see far
    # more training than text and latent noised together).
    joint_order: Literal["together", "latent_first"] = _option(
        "together",
        "joint: text and latent side by side, or the latent first and then its text as l2t decodes it "
        "(default: %(default)s)",
    )
    # l2t where the length comes from the length head: its `length_candidates` most likely lengths are
    # each decoded (best_of texts each) and the encoder keeps the closest text (1 = the head's argmax).
    length_candidates: int = _option(
        1,
        "l2t without a given length: decode at the length head's N most likely lengths and keep the text the "
        "sentence encoder puts closest (default %(default)s: the most likely length only)",
        _COUNT,
    )

    def check(self, keys: dict[str, str] | None = None) -> None:
        """OptionError for a value that cannot be used, named by `keys` (field -> the command-line
        option it came from), else as "sampling option 'FIELD'"."""

        def fail(name: str, expected: str):
            key = (keys or {}).get(name, f"sampling option '{name}'")
            raise OptionError(key, getattr(self, name), expected)

        for f in dataclasses.fields(self):
            expected = _sampling_option_expects(f.name, getattr(self, f.name), takes_none=bool(f.metadata["none"]))
            if expected is not None:
                fail(f.name, expected)
        if self.remask == "posterior" and self.strategy != "ancestral":
            fail(
                "strategy",
                "'ancestral' with remask 'posterior' (the posterior reveals each masked token by its own probability)",
            )
        if self.remask == "posterior" and self.remask_rounds:
            fail(
                "remask_rounds",
                "0 with remask 'posterior' (it remasks during the trajectory; the rounds are confidence remasking)",
            )

    @property
    def uses_encoder(self) -> bool:
        """Whether decoding re-encodes its candidates with the sentence encoder."""
        return self.best_of > 1 or self.correction_rounds > 0 or self.length_candidates > 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def defaults(
        cls, text: TextDiffusionConfig, latent: LatentDiffusionConfig, steps: int | None = None, **options
    ) -> SamplingOptions:
        """A run's sampler defaults: the keys of its text_diffusion and latent_diffusion that hold one
        (`_sampler_default`; both num_sampling_steps `steps` when given); `options` that are not None set
        the rest."""
        run = {
            f.metadata["option"]: getattr(section, f.name)
            for section in (text, latent)
            for f in dataclasses.fields(section)
            if "option" in f.metadata
        }
        if steps is not None:
            run.update(num_steps=steps, latent_steps=steps)
        return cls(**{**run, **{key: value for key, value in options.items() if value is not None}})


def _sampling_option_expects(name: str, value: Any, takes_none: bool) -> str | None:
    """What SamplingOptions field `name` expects where `value` is not one of its values, else None;
    `takes_none`: whether None is one (what None means is then said too)."""
    tp = typing.get_type_hints(SamplingOptions)[name]
    if typing.get_origin(tp) is Literal:
        return None if value in typing.get_args(tp) else " or ".join(map(repr, typing.get_args(tp)))
    metadata = SamplingOptions.__dataclass_fields__[name].metadata
    valid, expected = metadata["rule"] or (lambda value: True, "")
    if takes_none if value is None else valid(value):
        return None
    return expected + (metadata["none"] if takes_none else "")


def _sampler_default(option: str, default: Any = dataclasses.MISSING) -> Any:
    """A run config key that holds the run's default of SamplingOptions field `option`
    (SamplingOptions.defaults reads it, `_check_sampler_defaults` checks it by that field's rule): the
    field's default unless `default` is given."""
    if default is dataclasses.MISSING:
        default = SamplingOptions.__dataclass_fields__[option].default
    return field(default=default, metadata={"option": option})


def _check_sampler_defaults(section: Any, prefix: str) -> None:
    """The run's sampler defaults in `section` (`_sampler_default`), each by its SamplingOptions field's
    rule; a config file spells None null."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if "option" in f.metadata:
            value = getattr(section, f.name)
            takes_none = type(None) in typing.get_args(hints[f.name])
            expected = _sampling_option_expects(f.metadata["option"], value, takes_none)
            if expected is not None:
                _fail(f"{prefix}.{f.name}", value, expected.replace("None", "null"))


@dataclass
class TextDiffusionConfig:
    """Masked (absorbing-state) diffusion over tokens, MDLM (see mmldlm/diffusion/masked.py)."""

    schedule: Literal["loglinear", "linear"] = "loglinear"
    loss: Literal["elbo", "masked_ce"] = "elbo"  # elbo: continuous-time MDLM weight; masked_ce: unweighted
    # alpha_1 = eps (a sliver of signal at t = 1, as in MDLM); the ELBO weight is evaluated at t >= eps
    # so it stays finite near t = 0 (at most 1/eps for loglinear)
    eps: float = 1e-3
    # The text sampler's defaults (SamplingOptions): reverse steps of l2t and joint, temperature
    # (logits / T), repetition penalty; decoding with the sentence encoder in the loop
    # (mmldlm/sampling/decoding.py): candidates per text, and correction rounds. Evaluation during
    # training always decodes without them.
    num_sampling_steps: int = _sampler_default("num_steps", 50)
    sampling_temperature: float = _sampler_default("temperature")
    sampling_repetition_penalty: float = _sampler_default("repetition_penalty")
    sampling_best_of: int = _sampler_default("best_of")
    sampling_correction_rounds: int = _sampler_default("correction_rounds")

    def check(self, prefix: str = "text_diffusion") -> None:
        if not 0.0 < self.eps < 0.5:
            _fail(f"{prefix}.eps", self.eps, "a number in (0, 0.5)")
        _check_sampler_defaults(self, prefix)


@dataclass
class LatentDiffusionConfig:
    """Continuous-time Gaussian diffusion over standardised latents (see mmldlm/diffusion/gaussian.py)."""

    schedule: Literal["cosine"] = "cosine"
    prediction: Literal["eps", "x0", "v"] = "v"
    loss: Literal["mse", "cosine", "normalized_mse"] = "mse"  # normalized_mse: baseline recipe
    min_alpha: float = 1e-4  # alpha(t=1) floor: keeps eps <-> x0 conversions finite at t = 1
    # Shifted schedule: the signal-to-noise ratio at every t divided by shift^2 (> 1: noisier, more of
    # training and sampling where the condition must supply what the noised latent no longer holds).
    shift: float = 1.0
    # Weight of the loss over t, as a weight on the x0 error: none (the plain MSE of the
    # parameterisation), min_snr (min(SNR, min_snr_gamma), Hang et al. 2023).
    loss_weighting: Literal["none", "min_snr"] = "none"
    min_snr_gamma: float = 5.0
    # The latent sampler's defaults (SamplingOptions): reverse steps of t2l, DDIM or DDPM, and the time
    # grid: null, equal steps of t; a number s', the SNRs of equal steps under shift s' (below `shift`:
    # more of the steps at high SNR, where few steps shrink the samples).
    num_sampling_steps: int = _sampler_default("latent_steps", 50)
    sampler: Literal["ddim", "ddpm"] = _sampler_default("latent_sampler")
    sampling_shift: float | None = _sampler_default("latent_shift")

    def check(self, prefix: str = "latent_diffusion") -> None:
        if not 0.0 < self.min_alpha < 0.1:
            _fail(f"{prefix}.min_alpha", self.min_alpha, "a number in (0, 0.1)")
        if self.shift <= 0:
            _fail(f"{prefix}.shift", self.shift, "a number > 0 (1 = the plain cosine schedule)")
        if self.min_snr_gamma <= 0:
            _fail(f"{prefix}.min_snr_gamma", self.min_snr_gamma, "a number > 0")
        if self.loss_weighting != "none" and self.loss != "mse":
            _fail(
                f"{prefix}.loss_weighting",
                self.loss_weighting,
                f"'none' with {prefix}.loss={self.loss!r} (weighting over t applies to the mse loss)",
            )
        _check_sampler_defaults(self, prefix)


@dataclass
class ObjectiveConfig:
    """Which direction is trained at each step and how the two losses combine (see mmldlm/objective.py)."""

    mode: Literal["l2t", "t2l", "joint", "random", "sequential"] = "random"
    # random: relative weights of the modes, drawn per step from (seed, step) so all ranks agree.
    mode_weights: dict[str, float] = field(default_factory=lambda: {"l2t": 1.0, "t2l": 1.0, "joint": 1.0})
    # sequential: [[first_step, mode], ...] sorted by step, the first at step 0.
    mode_schedule: list[list[Any]] = field(default_factory=lambda: [[0, "l2t"]])
    text_loss_weight: float = 1.0
    latent_loss_weight: float = 1.0
    length_loss_weight: float = 0.1  # cross-entropy of the length head (model.length_head), every step
    t_sampling: Literal["uniform", "antithetic", "stratified"] = "stratified"
    cond_drop_prob: float = 0.1  # l2t/t2l: replace the condition by the null condition (for CFG)
    # With model.self_condition: the share of steps (t2l, joint) whose latent input carries the x0
    # estimate of a first, gradient-free pass; the other steps train the first pass itself.
    self_condition_prob: float = 0.5
    seed: int = 0

    def check(self, prefix: str = "objective") -> None:
        for name, weight in self.mode_weights.items():
            if name not in MODES:
                _fail(f"{prefix}.mode_weights.{name}", weight, f"weights for the modes {', '.join(MODES)}")
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
                _fail(f"{prefix}.mode_weights.{name}", weight, "a number >= 0")
        if self.mode == "random" and sum(self.mode_weights.values()) <= 0:
            _fail(f"{prefix}.mode_weights", self.mode_weights, "at least one weight > 0")
        if self.mode == "sequential":
            last = -1
            for i, entry in enumerate(self.mode_schedule):
                ok = (
                    isinstance(entry, (list, tuple))
                    and len(entry) == 2
                    and isinstance(entry[0], int)
                    and not isinstance(entry[0], bool)
                    and entry[1] in MODES
                )
                if not ok:
                    _fail(f"{prefix}.mode_schedule[{i}]", entry, f"[step, mode] with mode in {MODES}")
                if entry[0] <= last:
                    _fail(f"{prefix}.mode_schedule[{i}]", entry, "steps strictly increasing")
                last = entry[0]
            if not self.mode_schedule or self.mode_schedule[0][0] != 0:
                _fail(f"{prefix}.mode_schedule", self.mode_schedule, "a list whose first entry starts at step 0")
        for key in ("text_loss_weight", "latent_loss_weight", "length_loss_weight"):
            if getattr(self, key) < 0:
                _fail(f"{prefix}.{key}", getattr(self, key), "a number >= 0")
        if not 0.0 <= self.cond_drop_prob < 1.0:
            _fail(f"{prefix}.cond_drop_prob", self.cond_drop_prob, "a number in [0, 1)")
        if not 0.0 <= self.self_condition_prob <= 1.0:
            _fail(f"{prefix}.self_condition_prob", self.self_condition_prob, "a number in [0, 1]")
        if self.seed < 0:
            _fail(f"{prefix}.seed", self.seed, "an integer >= 0")


# --- data sections ---


@dataclass
class DataConfig:
    """The prepared dataset and its loader (see mmldlm/data/dataset.py and `mmldlm prepare`)."""

    path: str | None = (
        None  # a prepared dataset directory; null: the bundled default corpus, prepared once into cache_dir
    )
    cache_dir: str | None = None  # null: $MMLDLM_CACHE, else ~/.cache/mmldlm
    max_length: int | None = (
        None  # tokens per sample, longer ones cut; null: model.max_seq_len (rounded down to pad_to_multiple)
    )
    pad_to_multiple: int = 8  # batch length rounded up to this; 64 bounds the shapes torch.compile sees
    # Fixed batch lengths, ascending: a batch is padded to the shortest that holds its longest text
    # (data.max_length past the last), so torch.compile and CUDA graphs see only these shapes.
    # Null: every multiple of pad_to_multiple is a length of its own. With data.packing, the packed
    # rows' widths: a micro-batch's rows are as wide as the shortest that holds its fullest row
    # (data.pack_length past the last), so that one wide row of a whole micro-batch
    # (data.pack_length its texts' most, data.pack_rows=[1]) computes little more than its tokens.
    length_buckets: list[int] | None = None
    num_workers: int | None = None  # null: min(8, cpus // local ranks)
    prefetch_factor: int | None = 4  # batches each worker keeps ready; null: torch's default (2)
    persistent_workers: bool = True  # keep workers alive between epochs
    pin_memory: bool | None = None  # null: on when CUDA is available
    shuffle: bool = True
    drop_last: bool = True  # every rank gets the same number of full batches
    # Length bucketing: each run of this many batches is regrouped into batches of similar lengths
    # (less padding computed; see BatchOrder); 1 = off. A resume on another batch size regroups what is left.
    bucket_batches: int = 1
    # Sequence packing: the texts of a micro-batch are laid end to end in rows of pack_length text
    # positions, each attending only to itself (and its own latent slots), so the blocks compute
    # almost no padding (see PadCollate, mmldlm/model/mmdit.py `Packing`). The micro-batch still counts texts.
    packing: bool = False
    pack_length: int | None = None  # null: data.max_length; at least the longest text kept
    # Packed row counts: a micro-batch's rows are padded with empty ones to the fewest of these that
    # holds them, one row per text past the last, so the blocks see a few fixed shapes (perf.cuda_graphs,
    # perf.compile_dynamic=false; the latent groups of a row stay at most data.pad_to_multiple). null: as
    # many rows as the texts fill.
    pack_rows: list[int] | None = None
    seed: int = 0  # shuffle order (epoch e uses seed + e); build_loader's seed argument overrides it
    # Preparing the default corpus (path null); `mmldlm prepare` has these and more as options.
    vocab_size: int = 8192
    val_fraction: float = 0.01
    encoder: str = "all-MiniLM-L6-v2"
    max_samples: int | None = None  # null: the whole bundled corpus (154k texts); N: a seeded subset of N

    def check(self, prefix: str = "data") -> None:
        if self.pad_to_multiple < 1:
            _fail(f"{prefix}.pad_to_multiple", self.pad_to_multiple, "an integer >= 1")
        if self.max_length is not None and (self.max_length < 1 or self.max_length % self.pad_to_multiple):
            _fail(
                f"{prefix}.max_length",
                self.max_length,
                f"null or a positive multiple of {prefix}.pad_to_multiple={self.pad_to_multiple}",
            )
        if self.length_buckets is not None:
            buckets = self.length_buckets
            if (
                not buckets
                or any(not isinstance(n, int) or n < 1 or n % self.pad_to_multiple for n in buckets)
                or any(a >= b for a, b in zip(buckets, buckets[1:]))
            ):
                _fail(
                    f"{prefix}.length_buckets",
                    buckets,
                    f"null or a non-empty ascending list of positive multiples of {prefix}.pad_to_multiple="
                    f"{self.pad_to_multiple}",
                )
        if self.pack_rows is not None:
            rows = self.pack_rows
            if (
                not rows
                or any(not isinstance(n, int) or n < 1 for n in rows)
                or any(a >= b for a, b in zip(rows, rows[1:]))
            ):
                _fail(f"{prefix}.pack_rows", rows, "null or a non-empty ascending list of positive integers")
            if not self.packing:
                _fail(f"{prefix}.pack_rows", rows, f"null with {prefix}.packing=false (it pads packed rows)")
        if self.num_workers is not None and self.num_workers < 0:
            _fail(f"{prefix}.num_workers", self.num_workers, "null (automatic) or an integer >= 0")
        if self.bucket_batches < 1:
            _fail(f"{prefix}.bucket_batches", self.bucket_batches, "an integer >= 1 (1 = no length bucketing)")
        if self.pack_length is not None and (self.pack_length < 1 or self.pack_length % self.pad_to_multiple):
            _fail(
                f"{prefix}.pack_length",
                self.pack_length,
                f"null (data.max_length) or a positive multiple of {prefix}.pad_to_multiple={self.pad_to_multiple}",
            )
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            _fail(f"{prefix}.prefetch_factor", self.prefetch_factor, "null or an integer >= 1")
        if self.vocab_size < 258:
            _fail(f"{prefix}.vocab_size", self.vocab_size, "an integer >= 258 (256 bytes + [PAD] + [MASK])")
        if not 0.0 <= self.val_fraction < 1.0:
            _fail(f"{prefix}.val_fraction", self.val_fraction, "a number in [0, 1)")
        if self.max_samples is not None and self.max_samples < 2:
            _fail(f"{prefix}.max_samples", self.max_samples, "null (the whole corpus) or an integer >= 2")
        if not self.encoder:
            _fail(
                f"{prefix}.encoder", self.encoder, "a registered encoder name or a local sentence-transformers folder"
            )


# --- training sections ---


@dataclass
class OptimConfig:
    """AdamW and gradient clipping (see mmldlm/training/optim.py)."""

    lr: float = 3e-4  # peak learning rate; the schedule scales it
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1  # never applied to norms, biases, embeddings or the null latent
    fused: bool | Literal["auto"] = "auto"  # auto: fused kernel where the device has one, else foreach
    # Used when the fused kernel is off or unavailable. false: one update loop per parameter tensor,
    # the baseline preset's optimizer.
    foreach: bool = True
    grad_clip: float = 1.0  # max global grad norm; 0 = measure the norm but do not clip
    # Update each parameter as soon as its gradient is ready in backward and free that gradient, so
    # the full set of gradients never exists at once (4 bytes per parameter less at the peak).
    # Needs one process, no gradient accumulation, grad_clip 0 (the global norm is known only after
    # every update) and not fp16 (its scaler unscales all gradients at once); see `infeasible` and trainer.py.
    step_in_backward: bool = False
    # AdamW's two moments: fp32 (8 bytes per parameter), or block-quantized int8 (about 2) or int4
    # (about 1) by torchao's low-bit AdamW (weights stay fp32; tensors under 4096 elements keep fp32
    # moments). torchao compiles its update once per parameter shape: tens of seconds at start-up.
    # optim.fused and optim.foreach apply to fp32 state only.
    state_dtype: Literal["fp32", "int8", "int4"] = "fp32"

    def check(self, prefix: str = "optim") -> None:
        if self.step_in_backward and self.grad_clip > 0:
            _fail(
                f"{prefix}.grad_clip",
                self.grad_clip,
                f"0 with {prefix}.step_in_backward=true (each parameter is updated before the global gradient "
                f"norm that clipping needs is known; or set {prefix}.step_in_backward=false)",
            )
        if self.lr <= 0:
            _fail(f"{prefix}.lr", self.lr, "a number > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _fail(f"{prefix}.betas", self.betas, "two numbers in [0, 1)")
        if self.eps <= 0:
            _fail(f"{prefix}.eps", self.eps, "a number > 0")
        for key in ("weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                _fail(f"{prefix}.{key}", getattr(self, key), "a number >= 0")


@dataclass
class PlateauConfig:
    """Reduce-on-plateau on top of the schedule: every `every` steps the mean training loss of that
    window is compared with the best so far; after `patience` windows without a relative improvement
    of `threshold` the LR multiplier is scaled by `factor` (never below `min_lr`)."""

    enabled: bool = False
    every: int = 100
    patience: int = 5
    factor: float = 0.5
    min_lr: float = 1e-6
    threshold: float = 1e-3

    def check(self, prefix: str = "schedule.plateau") -> None:
        for key in ("every", "patience"):
            if getattr(self, key) < 1:
                _fail(f"{prefix}.{key}", getattr(self, key), "an integer >= 1")
        if not 0.0 < self.factor < 1.0:
            _fail(f"{prefix}.factor", self.factor, "a number in (0, 1)")
        if self.min_lr < 0 or self.threshold < 0:
            key = "min_lr" if self.min_lr < 0 else "threshold"
            _fail(f"{prefix}.{key}", getattr(self, key), "a number >= 0")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule by optimizer step (see mmldlm/training/schedules.py)."""

    kind: Literal["constant", "warmup_cosine", "cosine_restarts", "wsd"] = "warmup_cosine"
    warmup_steps: int = 100  # linear warmup from 0, every kind
    min_lr_ratio: float = 0.1  # floor of the decay, as a fraction of optim.lr
    # The schedule's length in optimizer steps: the decay reaches its floor at the last of them. null:
    # train.steps. Longer than train.steps, the run ends partway down (a run taken over as it trained).
    num_steps: int | None = None
    restart_period: int = 1000  # cosine_restarts: steps per cosine cycle after warmup
    decay_fraction: float = 0.2  # wsd: share of the steps after warmup spent decaying at the end
    plateau: PlateauConfig = field(default_factory=PlateauConfig)

    def check(self, prefix: str = "schedule") -> None:
        if self.warmup_steps < 0:
            _fail(f"{prefix}.warmup_steps", self.warmup_steps, "an integer >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail(f"{prefix}.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        if self.restart_period < 1:
            _fail(f"{prefix}.restart_period", self.restart_period, "an integer >= 1")
        if self.num_steps is not None and self.num_steps < 1:
            _fail(f"{prefix}.num_steps", self.num_steps, "null (train.steps) or an integer >= 1")
        if not 0.0 < self.decay_fraction <= 1.0:
            _fail(f"{prefix}.decay_fraction", self.decay_fraction, "a number in (0, 1]")
        self.plateau.check(f"{prefix}.plateau")


@dataclass
class TrainConfig:
    """The training loop (see mmldlm/training/trainer.py)."""

    steps: int = 1000  # optimizer steps
    # Samples per process per forward/backward. auto: the largest divisor of the per-process batch
    # that fits (backing off on CUDA out-of-memory; on CPU under memory_cap_gib), see batch_size.py.
    micro_batch_size: int | Literal["auto"] = 8
    # Memory a micro-batch may use for auto: peak CUDA allocation, or on CPU the process's peak RSS.
    # null: no cap on CUDA (the device's memory decides), 80% of the machine's memory on CPU.
    memory_cap_gib: float | None = None
    # Effective batch per optimizer step over all processes; accumulation steps =
    # global_batch_size / (micro_batch_size * world size), which must divide exactly. A micro-batch x
    # world size above the global batch runs as each process's share (training/batch_size.py).
    global_batch_size: int = 32
    # Progressive batch size: [[first_step, global_batch_size], ...], sorted, the first at step 0.
    batch_schedule: list[list[int]] = field(default_factory=list)
    # auto: bf16 autocast where bf16 matmuls are native (CUDA; CPUs with AVX512-BF16 or AMX), else fp32
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # auto, cpu, cuda (cuda:LOCAL_RANK) or cuda:N (one process; CUDA_VISIBLE_DEVICES chooses the GPUs seen)
    device: str = "auto"
    # torch's intra-op CPU threads per process; null: torch's default (one per core). With another
    # busy process on the same cores the threads wait for each other: 1 is then far faster. auto: the
    # CPUs other processes leave free, read again every few seconds of training (mmldlm/threads.py);
    # with deterministic: true, torch's count as it is, fixed (sums over other thread counts differ).
    threads: int | Literal["auto"] | None = None
    log_every: int = 10
    seed: int = 0
    deterministic: bool = False  # deterministic kernels: resumed runs repeat losses bit for bit
    # EMA of the weights (training/ema.py), used by sample and eval; 0 = off. The decay warms up as
    # min(ema_decay, (1 + n) / (10 + n)) over the first updates.
    ema_decay: float = 0.0
    max_consecutive_skips: int = 5  # non-finite updates in a row before the run stops
    run_dir: str = "runs/default"
    # Start a new run from another run's weights (fine-tuning; training/init_from.py): a run directory
    # (its newest checkpoint that verifies), a checkpoint directory or an exported model folder. The
    # optimizer, LR schedule, data position and step start afresh; null: random initial weights.
    init_from: str | None = None
    # Which of the source's weights: "ema", its EMA where it kept one (else its trained weights); "raw",
    # its trained weights (an exported folder holds only the one set it was exported with).
    init_weights: Literal["ema", "raw"] = "ema"

    def check(self, prefix: str = "train") -> None:
        for key in ("steps", "global_batch_size", "log_every", "max_consecutive_skips"):
            if getattr(self, key) < 1:
                _fail(f"{prefix}.{key}", getattr(self, key), "an integer >= 1")
        if not self.run_dir:
            _fail(f"{prefix}.run_dir", self.run_dir, "a directory path")
        if not DEVICE_KINDS.fullmatch(self.device):
            _fail(f"{prefix}.device", self.device, "auto, cpu, cuda or cuda:N")
        if self.init_from is not None and not self.init_from:
            _fail(f"{prefix}.init_from", self.init_from, "null or a run, checkpoint or exported model directory")
        if not 0.0 <= self.ema_decay < 1.0:
            _fail(f"{prefix}.ema_decay", self.ema_decay, "a number in [0, 1) (0 = no EMA)")
        if self.threads not in (None, "auto") and (isinstance(self.threads, str) or self.threads < 1):
            _fail(f"{prefix}.threads", self.threads, "null (torch's default), auto or an integer >= 1")
        if self.memory_cap_gib is not None and self.memory_cap_gib <= 0:
            _fail(f"{prefix}.memory_cap_gib", self.memory_cap_gib, "null or a number of GiB > 0")
        if self.micro_batch_size == "auto":  # divisibility is checked once the size is found
            return
        if self.micro_batch_size < 1:
            _fail(f"{prefix}.micro_batch_size", self.micro_batch_size, "an integer >= 1 or auto")
        if self.global_batch_size % self.micro_batch_size:
            _fail(
                f"{prefix}.global_batch_size",
                self.global_batch_size,
                f"a multiple of {prefix}.micro_batch_size={self.micro_batch_size}; for a smaller global batch set "
                f"both, e.g. {prefix}.global_batch_size={self.global_batch_size} "
                f"{prefix}.micro_batch_size={math.gcd(self.global_batch_size, self.micro_batch_size)}",
            )
        last = -1
        for i, entry in enumerate(self.batch_schedule):
            if len(entry) != 2 or entry[0] <= last or entry[1] < 1 or entry[1] % self.micro_batch_size:
                _fail(
                    f"{prefix}.batch_schedule[{i}]",
                    entry,
                    f"[step, global_batch_size] with steps increasing and sizes multiples of "
                    f"{prefix}.micro_batch_size={self.micro_batch_size}",
                )
            last = entry[0]
        if self.batch_schedule and self.batch_schedule[0][0] != 0:
            _fail(f"{prefix}.batch_schedule", self.batch_schedule, "a list whose first entry starts at step 0")


@dataclass
class DistributedConfig:
    """Process group and model wrapping (see mmldlm/training/distributed.py, parallelize.py)."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    # ddp: every rank holds the whole model; fsdp2: weights, gradients and optimizer state sharded over
    # all ranks; hsdp: sharded within groups of shard_group_size ranks, replicated across the groups.
    strategy: Literal["ddp", "fsdp2", "hsdp"] = "ddp"
    # hsdp: ranks per shard group (a divisor of the world size); null: the processes of one node
    # (torchrun's LOCAL_WORLD_SIZE), so the weight all-gathers stay on the node's fast links.
    shard_group_size: int | None = None
    # A collective that waits longer than this fails the job with a message instead of hanging.
    timeout_minutes: float = 30.0
    # DDP static graph; auto: on unless find_unused_parameters or a step accumulates micro-batches (the
    # idle-head anchor keeps the set of parameters with gradients the same at every step:
    # training/parallelize.py, which also says why static graph and no_sync() do not mix).
    static_graph: bool | Literal["auto"] = "auto"
    # true: DDP searches the autograd graph for unused parameters every step instead of the anchor
    # (the baseline recipe's setting).
    find_unused_parameters: bool = False

    def check(self, prefix: str = "distributed") -> None:
        if self.timeout_minutes <= 0:
            _fail(f"{prefix}.timeout_minutes", self.timeout_minutes, "a number of minutes > 0")
        if self.shard_group_size is not None and self.shard_group_size < 1:
            allowed = "null (the processes of one node) or an integer >= 1"
            _fail(f"{prefix}.shard_group_size", self.shard_group_size, allowed)

    @property
    def shards_model(self) -> bool:
        """Whether the strategy shards weights, gradients and optimizer state (fsdp2 and hsdp)."""
        return self.strategy in ("fsdp2", "hsdp")

    def num_shards(self, world_size: int, local_world_size: int, prefix: str = "distributed") -> int:
        """Over how many ranks each parameter is sharded in a job of `world_size` processes,
        `local_world_size` per node: 1 under ddp, all of them under fsdp2, one shard group under hsdp."""
        if not self.shards_model or world_size == 1:
            return 1
        if self.strategy == "fsdp2":
            return world_size
        size = self.shard_group_size if self.shard_group_size is not None else local_world_size
        where = "" if self.shard_group_size is not None else " (null: LOCAL_WORLD_SIZE, the processes per node)"
        if world_size % size:
            _fail(
                f"{prefix}.shard_group_size",
                size,
                f"a divisor of the world size {world_size}{where}, so that the ranks form whole shard groups",
            )
        return size


@dataclass
class CheckpointConfig:
    """Checkpoints under RUN/checkpoints/ (see mmldlm/runs/checkpoints.py)."""

    every: int = 500  # steps between checkpoints; the last step is always saved
    # Also save once this many minutes of wall clock have passed since the last save (or the start),
    # so a failure loses at most about this much work whatever a step costs; 0 = steps only. Rank 0's
    # clock decides, read every few steps (see CheckpointManager.due).
    every_minutes: float = 0.0
    keep_last: int = 3
    milestone_every: int = 0  # also keep every step that is a multiple of this; 0 = none
    async_save: bool = False  # copy to CPU memory and write in background threads, overlapping training

    def check(self, prefix: str = "checkpoint") -> None:
        if self.every < 1 or self.keep_last < 1:
            key = "every" if self.every < 1 else "keep_last"
            _fail(f"{prefix}.{key}", getattr(self, key), "an integer >= 1")
        if not self.every_minutes >= 0:
            _fail(f"{prefix}.every_minutes", self.every_minutes, "a number of minutes >= 0 (0 = steps only)")
        if self.milestone_every < 0:
            _fail(f"{prefix}.milestone_every", self.milestone_every, "an integer >= 0 (0 = no milestones)")


@dataclass
class EvalConfig:
    """Evaluation on rank 0 during training, written to metrics.jsonl (see mmldlm/evaluation/evaluate.py);
    `mmldlm eval` takes the same figures with a larger budget from the command line."""

    every: int = 0  # steps between evaluations; 0 = never during training
    num_samples: int = 32  # validation samples decoded (l2t) and encoded (t2l)
    num_steps: int | None = None  # sampling steps of every sampler; null: the diffusions' num_sampling_steps
    num_elbo_batches: int = 4  # validation batches of the ELBO / latent loss, per mode
    batch_size: int = 32
    retrieval_pool: int = 1000  # validation sentences the t2l latent must find its own among
    encoder: bool = True  # re-encode generated text with the dataset's sentence encoder (l2t cosine)
    # The slower writing figures: l2t at the length head's lengths, joint generation, n-gram fluency and
    # the nearest-training-text reference (`mmldlm eval` turns them on; off during training by default).
    writing: bool = False

    def check(self, prefix: str = "eval") -> None:
        if self.every < 0:
            _fail(f"{prefix}.every", self.every, "an integer >= 0 (0 = no evaluation during training)")
        if self.num_steps is not None and self.num_steps < 1:
            _fail(f"{prefix}.num_steps", self.num_steps, "null (the diffusions' num_sampling_steps) or an integer >= 1")
        for key in ("num_samples", "num_elbo_batches", "batch_size", "retrieval_pool"):
            if getattr(self, key) < 1:
                _fail(f"{prefix}.{key}", getattr(self, key), "an integer >= 1")


@dataclass
class LoggingConfig:
    """Where metrics go besides RUN/metrics.jsonl (see mmldlm/training/metrics.py)."""

    progress_bar: bool = True
    tensorboard: bool = False  # RUN/tensorboard/
    wandb: bool = False  # offline mode into RUN/wandb/; needs `pip install wandb`
    wandb_project: str = "mmldlm"


# --- performance sections ---


@dataclass
class ProfilerConfig:
    """A torch.profiler window: skip `skip` steps, warm up `warmup`, record `active`; the trace goes
    to RUN/profiler/ (open it in Perfetto or chrome://tracing)."""

    enabled: bool = False
    skip: int = 10
    warmup: int = 2
    active: int = 3

    def check(self, prefix: str = "perf.profiler") -> None:
        for key in ("skip", "warmup"):
            if getattr(self, key) < 0:
                _fail(f"{prefix}.{key}", getattr(self, key), "an integer >= 0")
        if self.active < 1:
            _fail(f"{prefix}.active", self.active, "an integer >= 1")


@dataclass
class PerfConfig:
    """Speed and memory switches applied when the trainer sets the model up (see parallelize.py)."""

    # none; full: every block; every_k: blocks 0, k, 2k, ...; selective: every block, keeping the
    # matmul and attention outputs and recomputing the cheap elementwise rest in backward; auto: the
    # least of none, selective, full under which the micro-batch fits (probed once at start-up;
    # none with train.micro_batch_size=auto, which then sizes the micro-batch to fit without it).
    activation_checkpointing: Literal["none", "full", "every_k", "selective", "auto"] = "none"
    checkpoint_every_k: int = 2
    compile: bool = False  # torch.compile each block (pair with data.pad_to_multiple=64: few shapes)
    # torch.compile's `dynamic`: null, torch's choice (the first length static, a recompile makes the
    # length symbolic); false: one static graph per shape (pair with data.length_buckets); true:
    # symbolic from the start.
    compile_dynamic: bool | None = None
    # With perf.compile, also compile the model's parts outside the blocks whose shapes are the batch
    # size's alone, one graph each whatever the text lengths: the two timestep MLPs, the blocks' adaLN
    # modulation, the latent stream's input, the text head's modulation, the latent head and the length
    # head (OUTSIDE_BLOCKS in training/parallelize.py). A few hundred eager operations a step become a
    # few compiled calls: the host work left beside CUDA graphs of the blocks, where short texts make
    # the step host-bound.
    compile_outside_blocks: bool = False
    # With perf.compile, compile the model's whole forward as one graph (every block, the parts
    # outside them, the heads and, with perf.fused_text_loss, the text loss) instead of each block
    # alone: one graph per mode and shape (and per text_row_buckets count), each compiled once, so a
    # step is one compiled forward and one backward, and under perf.cuda_graphs one CUDA graph each.
    # The blocks' code compiles once inside each graph and serves every block (a nested compile
    # region), so a graph's compile grows little with depth; still each mode, shape and row count is a
    # graph of its own (about a minute each on a CPU). One process or DDP; FSDP2 gathers parameters per
    # block and keeps per-block compile.
    compile_model: bool = False
    # CUDA graphs (torch.compile's "reduce-overhead"): each compiled block's forward and backward replay
    # as one launch per shape. Needs perf.compile, static shapes (compile_dynamic null or false) and
    # batches of few shapes: data.length_buckets (or packed rows with data.pack_rows), SDPA or varlen
    # attention. CUDA only (elsewhere: compile alone).
    cuda_graphs: bool = False
    # inductor's combo kernels (experimental in torch): kernels of one graph that read and write
    # nothing of each other's launched as one, such as the text and the latent stream's norms,
    # modulations and gates (the same code on tensors of other sizes). A CPU's generated C++ already
    # runs such loops in one function, so the switch changes nothing there; on a GPU each is a Triton
    # kernel of its own without it. Needs perf.compile; not yet measured on a GPU.
    combo_kernels: bool = False
    # cuDNN's fused attention for SDPA on a CUDA device, which the trainer otherwise turns off: on a
    # padded batch's key mask about half the memory-efficient kernel's time, but in training on batches
    # of every length it rebuilt its execution plan per padding mask, about 2.7 ms of host time a call
    # (base preset, H100). Meant beside few shapes (data.length_buckets) and CUDA graphs, whose replays
    # run no host code; not yet measured there (docs/benchmarks-gpu.md).
    cudnn_attention: bool = False
    # The text head fused with its cross-entropy in training, chunk by chunk of the masked positions
    # (mmldlm.diffusion.masked.subs_linear_cross_entropy): the (N, V) logits never exist whole, where the
    # head then the loss keep about three (N, V) tensors alive (docs/benchmarks.md). Same loss and
    # gradients; sampling and evaluation read logits as before.
    fused_text_loss: bool = False
    # The text head's rows in training (the masked real positions, about half the batch's) filled up to
    # the next multiple of the batch's text positions / text_row_buckets, the filling rows weighted 0:
    # the head and its loss then take a few row counts (each one graph when the whole model compiles,
    # perf.compile_model, and so one CUDA graph), where otherwise every step has its own. The same loss
    # and gradients; the head computes up to a bucket more rows. null: exactly the masked rows.
    text_row_buckets: int | None = None
    # bf16 compute weights: in training the blocks and the adaLN modulation read bf16 copies of their
    # weights, refreshed once a step, and their bf16 gradients are added into the float32 ones in one
    # operation after each backward, where autocast casts each weight and its gradient at every use
    # (mmldlm/training/compute_weights.py). The same weights to the bit; keeps 6 bytes per covered
    # parameter between steps. bf16 precision, one process (elsewhere it stays off and says why).
    compute_weights: bool = False
    # Each pair of the two streams' linear layers in a block (qkv, attention output, the MLP's two) as
    # one grouped matrix product over both streams' rows (torch's grouped_mm, two weights stacked),
    # and one GELU: the same products with about 26 fewer operations (15 kernels) a block forward and backward
    # (docs/benchmarks.md), at one stack of the two weights per product and use. On a CUDA device and
    # under perf.compile it needs bf16 precision and layer sizes of multiples of 8 (grouped_mm's kernels
    # there; elsewhere it stays off and says why). Not yet measured on a GPU.
    grouped_linears: bool = False
    # Toggle requires_grad over every parameter at every step: baseline recipe (mmldlm/baseline.py;
    # the idle head is otherwise handled once per mode, see parallelize.py).
    refreeze_every_step: bool = False
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    def check(self, prefix: str = "perf") -> None:
        if self.checkpoint_every_k < 1:
            _fail(f"{prefix}.checkpoint_every_k", self.checkpoint_every_k, "an integer >= 1")
        needs_compile = {
            "compile_outside_blocks": "it compiles beside the blocks",
            "compile_model": "it chooses what compiles",
            "cuda_graphs": "CUDA graphs are compile's",
            "combo_kernels": "they are inductor's",
        }
        for name, why in needs_compile.items():
            if getattr(self, name) and not self.compile:
                _fail(f"{prefix}.{name}", True, f"false with {prefix}.compile=false ({why})")
        if self.compile_model and self.compile_outside_blocks:
            _fail(
                f"{prefix}.compile_outside_blocks",
                True,
                f"false with {prefix}.compile_model=true (the whole model's graph holds those parts)",
            )
        static = self.cuda_graphs or self.compile_dynamic is False
        if self.compile_model and static and self.text_row_buckets is None:
            why = f"{prefix}.cuda_graphs" if self.cuda_graphs else f"{prefix}.compile_dynamic=false"
            _fail(
                f"{prefix}.text_row_buckets",
                None,
                f"an integer such as 16 with {prefix}.compile_model and {why} (the model's graph holds the text "
                "head, and its static shapes would compile a graph for each count of masked rows: a new one "
                "nearly every step, until dynamo's limit of graphs, then the model runs eagerly)",
            )
        if self.cuda_graphs and self.compile_dynamic:
            _fail(
                f"{prefix}.compile_dynamic",
                True,
                f"null or false with {prefix}.cuda_graphs=true (a CUDA graph is recorded for each shape anyway)",
            )
        if self.text_row_buckets is not None and self.text_row_buckets < 1:
            _fail(f"{prefix}.text_row_buckets", self.text_row_buckets, "null or an integer >= 1")
        self.profiler.check(f"{prefix}.profiler")


@dataclass
class RunConfig:
    """A whole run: one section per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    text_diffusion: TextDiffusionConfig = field(default_factory=TextDiffusionConfig)
    latent_diffusion: LatentDiffusionConfig = field(default_factory=LatentDiffusionConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def _refuse_beside(self, switch: str, refused: dict[str, bool], why: str) -> None:
        """ConfigError for `switch` (on) beside the first key of `refused` whose value it cannot take."""
        for key in (key for key, no in refused.items() if no):
            section, name = key.split(".")
            _fail(switch, True, f"false with {key}={getattr(getattr(self, section), name)} ({why})")

    def check(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "check"):
                section.check(f.name)
        if self.data.packing:
            self._refuse_beside(
                "data.packing",
                {
                    "model.attention": self.model.attention == "explicit",  # baseline recipe
                    "model.num_prefix_tokens": self.model.num_prefix_tokens > 0,
                    "distributed.strategy": self.distributed.strategy == "fsdp2",
                },
                "packed rows take SDPA attention, no prefix tokens, and one process or DDP",
            )
        if self.perf.compile_model:
            self._refuse_beside(
                "perf.compile_model",
                {"distributed.strategy": self.distributed.shards_model},
                "FSDP2 gathers each block's parameters in hooks around it: compile per block",
            )
        if self.perf.cuda_graphs:
            self._refuse_beside(
                "perf.cuda_graphs",
                {"data.packing": self.data.packing and self.data.pack_rows is None},  # the number of rows
                "its shapes change with every batch, and a CUDA graph is recorded for each shape: pad "
                "batches to data.length_buckets, or packed rows to data.pack_rows",
            )
        if self.optim.step_in_backward and self.train.precision == "fp16":
            _fail(
                "optim.step_in_backward",
                True,
                "false with train.precision=fp16 (the loss scaler unscales and "
                "checks every gradient before any update); use bf16, fp32 or auto",
            )


# --------------------------------------------------------------------------------------------------
# Feasibility: what a valid config still needs of the number of processes it runs on.


@dataclass(frozen=True)
class Infeasible:
    """One reason a valid config cannot run on a given number of processes: its case (`mmldlm check`
    words its finding after it), the key, the key's value and what the key would need."""

    case: Literal["batch_split", "batch_share", "step_in_backward_ranks", "step_in_backward_accumulation"]
    key: str
    value: Any
    expected: str

    def error(self) -> ConfigValueError:
        return ConfigValueError(f"config key '{self.key}'", self.value, self.expected)


def infeasible(cfg: RunConfig, world_size: int, micro_batch: int | None) -> list[Infeasible]:
    """What keeps a valid `cfg` from running on `world_size` processes that each run micro-batches of
    `micro_batch` samples (train.micro_batch_size, or each process's share of the global batch: see
    training/batch_size.py; None: train.micro_batch_size=auto before the trainer has probed it). The
    trainer refuses the first; `mmldlm check` reports each as a finding."""
    train = cfg.train
    # The scheduled sizes first: from step 0 on they are the batches the run takes.
    sizes = {f"train.batch_schedule[{i}]": size for i, (_, size) in enumerate(train.batch_schedule)}
    sizes["train.global_batch_size"] = train.global_batch_size
    problems = [problem for key, size in sizes.items() if (problem := batch_split(key, size, micro_batch, world_size))]
    # optim.step_in_backward updates each parameter as soon as its gradient of one micro-batch on one
    # process is ready: no data-parallel reduction and no accumulation can come between.
    if cfg.optim.step_in_backward and world_size > 1:
        expected = (
            f"false with more than one process (world size {world_size}): a parameter would be updated with its "
            "local gradient before the data-parallel reduction"
        )
        problems.append(Infeasible("step_in_backward_ranks", "optim.step_in_backward", True, expected))
    elif cfg.optim.step_in_backward and micro_batch is not None:  # auto: known once the micro-batch is probed
        sizes = [train.global_batch_size] + [size for _, size in train.batch_schedule]
        size = next((size for size in sizes if size != micro_batch), None)
        if size is not None:
            expected = (
                f"false with gradient accumulation (global batch {size} = {size // micro_batch} micro-batches of "
                f"{micro_batch}): each parameter is updated as soon as one micro-batch's gradient arrives. Set "
                "train.micro_batch_size to the global batch size, or optim.step_in_backward=false"
            )
            problems.append(Infeasible("step_in_backward_accumulation", "optim.step_in_backward", True, expected))
    return problems


def batch_split(key: str, size: int, micro_batch: int | None, world_size: int) -> Infeasible | None:
    """A global batch of `size` (config key `key`) that does not split into whole micro-batches on every
    process; with micro_batch None (auto), into equal shares, among whose divisors auto chooses."""
    if micro_batch is None:
        expected = f"a multiple of the world size {world_size}"
        return Infeasible("batch_share", key, size, expected) if size % world_size else None
    per_step = micro_batch * world_size
    share = " (or, smaller than that, a multiple of the world size: each process then takes its share)"
    expected = f"a multiple of train.micro_batch_size x world size = {micro_batch} x {world_size} = {per_step}"
    return Infeasible("batch_split", key, size, expected + share * (size < per_step)) if size % per_step else None


# --------------------------------------------------------------------------------------------------
# Typed construction from plain data (YAML or parsed overrides).


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return {list: "a list", dict: "a mapping"}.get(origin, str(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, tp.__name__)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return `value` as type `tp`, or raise ConfigError. Only lossless conversions (int -> float)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        _fail(key, value, _type_name(tp))
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(key, value, option)
            except ConfigError:
                continue
        _fail(key, value, _type_name(tp))
    if tp is type(None):
        if value is None:
            return None
        _fail(key, value, "null")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _fail(key, value, "a list")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _fail(key, value, "a mapping")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {_coerce(key, k, key_tp): _coerce(f"{key}.{k}", v, val_tp) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(key, value, "true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(key, value, "an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        _fail(key, value, "a number")
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(key, value, "a string")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    raise TypeError(f"unsupported config type {tp} for {key}")


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        _fail(prefix or cls.__name__, data, f"a mapping of {cls.__name__} keys")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"config key '{full}': unknown key; allowed keys here are: {', '.join(names)}")
        kwargs[key] = _coerce(full, value, hints[key])
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def flat_keys(tree: dict, prefix: str = "") -> dict:
    """{"section.key": value} of a config dict (`to_dict`); mode_weights is one value, not a section."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "mode_weights":
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# --------------------------------------------------------------------------------------------------
# Files and overrides.


def resolve_preset(name: str | Path, subdir: str = "") -> Path:
    """A path as given if it exists, else `configs/[subdir/]NAME[.yaml]`."""
    path = Path(name)
    if path.is_file():
        return path
    base = CONFIG_DIR / subdir if subdir else CONFIG_DIR
    for candidate in (base / name, base / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in base.glob("*.yaml"))
    raise ConfigError(f"config file '{name}' not found (looked in {base}); known presets: {', '.join(known)}")


def yaml_problem(err: yaml.YAMLError) -> str:
    """pyyaml's error in one line: the line and column (from 1) where the reader stopped, what it found and
    expected there, and what it was reading; a tab or an indentation that matches no level above says so."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return " ".join(str(err).split())
    text = f"line {mark.line + 1}, column {mark.column + 1}: {err.problem}"
    start = err.context_mark
    if err.context:
        opened = (
            f" opened at line {start.line + 1}, column {start.column + 1}" if start and start.line != mark.line else ""
        )
        text += f" ({err.context}{opened})"
    if "'\\t'" in err.problem:
        text += "; YAML indents with spaces, not tabs"
    elif "expected <block end>" in err.problem:
        text += f"; line {mark.line + 1} is indented to no level of the lines above it"
    elif "mapping values are not allowed" in err.problem:
        text += f"; line {mark.line + 1} is indented deeper than the key above it, or a value holds ': ' (quote it)"
    return text


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file '{path}': not valid YAML, {yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}': expected a mapping of sections at the top level")
    return data


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "mode_weights":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path.resolve() in seen:
        raise ConfigError(f"config file '{path}': 'inherit' forms a cycle")
    data = _read_yaml(path)
    parent = data.pop("inherit", None)
    if parent is not None:
        parent_path = path.parent / parent if (path.parent / parent).is_file() else resolve_preset(parent)
        # The parent's `model: NAME` is expanded first, so a child's `model: {key: value}` refines it.
        data = _merge(_expand_model_preset(_load_raw(parent_path, seen + (path.resolve(),))), data)
    return data


def _expand_model_preset(raw: dict) -> dict:
    """`model: NAME` -> the preset's keys; `model: {preset: NAME, key: value}` -> the preset refined."""
    model = raw.get("model")
    if isinstance(model, str):
        raw = {**raw, "model": _read_yaml(resolve_preset(model, "model"))}
    elif isinstance(model, dict) and "preset" in model:
        rest = {k: v for k, v in model.items() if k != "preset"}
        if not isinstance(model["preset"], str):
            _fail("model.preset", model["preset"], "the name of a model preset such as 'tiny'")
        raw = {**raw, "model": {**_read_yaml(resolve_preset(model["preset"], "model")), **rest}}
    return raw


_YAML11_FLOAT = re.compile(r"^[-+]?\d+(\.\d*)?[eE][-+]?\d+$")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value). The value is read as YAML (`4`, `1e-3`, `[1, 2]`)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected section.key=value")
    key, raw_value = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': expected section.key=value")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value
    if isinstance(value, str) and _YAML11_FLOAT.match(value):
        value = float(value)  # YAML 1.1 reads `1e-3` (no dot) as a string
    return key.split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = _expand_model_preset(raw)
    for text in overrides:
        path, value = parse_override(text)
        if path == ["model"] and isinstance(value, str):
            preset = _expand_model_preset({"model": value})["model"]
            raw = {**raw, "model": {**raw.get("model", {}), **preset}}
            continue
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls: type = RunConfig) -> Any:
    """Read a run config file (or the defaults), apply overrides, build and check it."""
    raw = _load_raw(resolve_preset(path)) if path is not None else {}
    raw = apply_overrides(raw, list(overrides))
    cfg = from_dict(cls, raw)
    cfg.check()
    return cfg


def load_model_preset(name: str | Path) -> ModelConfig:
    cfg = from_dict(ModelConfig, _read_yaml(resolve_preset(name, "model")), "model")
    cfg.check()
    return cfg


def load_model_config(target: str | Path) -> ModelConfig:
    """The model config of a model preset (a name or a file), of a run config file (its model section),
    or of a training run directory (its resolved config.yaml)."""
    path = Path(target)
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ConfigError(
                f"{path}: a directory without config.yaml; expected a model preset, a run config file, a "
                f"training run directory or an exported model folder"
            )
        path = path / "config.yaml"
    file = resolve_preset(path if path.is_file() else target, "model")
    if any(section.name in _read_yaml(file) for section in dataclasses.fields(RunConfig)):
        return load_config(file).model
    return load_model_preset(file)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically: a reader never sees half a file)."""
    write_atomically(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
