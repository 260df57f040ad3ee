"""Typed run configuration: nested dataclasses, `--set section.field=value` overrides, round-trip to dict."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import torch

from dsv.modules.config import AttentionConfig, check_config_fields
from dsv.modules.dit import ModelConfig
from dsv.train.data import DataConfig

LR_SCHEDULES = ("constant", "cosine")  # OptimConfig.schedule


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    # After the warmup: "constant" keeps `lr`; "cosine" decays it along a half cosine towards `final_lr_ratio`·lr,
    # reached at the end of `train.steps` (which then may not change on resume: the remaining rates depend on it).
    schedule: str = "constant"
    final_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        check_config_fields(self, "optim")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optim.lr must be a finite number > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), e.g. optim.betas=0.9,0.999, got {self.betas}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:  # a negative warmup would make the learning rate negative
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.schedule!r}")
        if not 0.0 <= self.final_lr_ratio <= 1.0:
            raise ValueError(f"optim.final_lr_ratio must be a fraction of optim.lr in [0, 1], "
                             f"got {self.final_lr_ratio}")


def parse_device(name: str) -> torch.device | None:
    """None for "auto"; else the device ``name`` names, which must be "cpu", "cuda" or "cuda:N" (the trainer's
    autocast, data and kernels know these two types). A ValueError says the expected forms."""
    if name == "auto":
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {name!r}")
    return device


def device_absence(device: torch.device) -> str | None:
    """Why this machine lacks ``device``, or None where it has it."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device is available here"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
    return None


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 4
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    bf16: bool = True  # autocast to bf16 on CUDA; CPU runs stay fp32 (exact, reproducible)
    out_dir: str = "runs/debug"
    log_every: int = 10
    eval_every: int = 50
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    tensorboard: bool = True
    threads: int = 0  # torch CPU threads; 0 leaves the default
    # Wall-clock budget of this process in minutes (0: none). When it runs out the run saves a checkpoint after
    # the step in progress and stops; `--resume` continues it exactly (a job's time limit, a shared machine).
    max_minutes: float = 0.0
    # Decay per step of an exponential moving average of the model's weights, evaluated on the held-out clips
    # beside the weights themselves (0: none). It warms up, `trainer.ema_decay_at`: (1 + step) / (10 + step)
    # until that reaches ema_decay (0.99 at step 890; a decay the run's steps never reach acts as that bound).
    # At a constant learning rate the weights' held-out loss moves by several percent from one evaluation to
    # the next; the average's follows the trend.
    ema_decay: float = 0.0

    def __post_init__(self) -> None:
        check_config_fields(self, "train")
        try:
            parse_device(self.device)  # its form only: a config may be written on one machine and run on another
        except ValueError as err:
            raise ValueError(f"train.device {err}") from None
        for name in ("steps", "batch_size", "log_every", "eval_every", "ckpt_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"train.threads must be >= 0 (0 leaves torch's default), got {self.threads}")
        if not self.max_minutes >= 0 or self.max_minutes == float("inf"):  # NaN fails the first test
            raise ValueError(f"train.max_minutes must be a finite number >= 0 (0: no limit), got {self.max_minutes}")
        if not 0.0 <= self.ema_decay < 1.0:  # NaN fails too
            raise ValueError(f"train.ema_decay must be in [0, 1) (0: no average of the weights), got {self.ema_decay}")
        if not str(self.out_dir).strip():
            raise ValueError("train.out_dir must name a folder (empty would write into the current one)")


CP_MODES = ("hcp", "naive_hcp", "scp", "hybrid")  # dsv.parallel.context


@dataclass
class ParallelConfig:
    """Context parallelism under torchrun: `cp` ranks share each sample's sequence; the world is
    `world / cp` data-parallel groups of them (FSDP2 shards the model over all ranks)."""

    cp: int = 1  # ranks per context-parallel group; 1 = off
    cp_mode: str = "hybrid"  # hcp (heads placed by cost), naive_hcp (Ulysses), scp (critical K/V), hybrid (planner)
    cp_hcp: int = 0  # hybrid only: fix the HCP group size of every block (0 = the planner chooses per block)
    gpus_per_node: int = 8  # for the planner's link model
    intra_node_gbps: float = 300.0  # GB/s per GPU and direction inside a node (NVLink)
    inter_node_gbps: float = 25.0  # between nodes (a 200 Gb/s NIC per GPU)

    def __post_init__(self) -> None:
        check_config_fields(self, "parallel")
        if self.cp < 1:
            raise ValueError(f"parallel.cp must be >= 1, got {self.cp}")
        if self.gpus_per_node < 1 or self.intra_node_gbps <= 0 or self.inter_node_gbps <= 0:
            raise ValueError(f"parallel.gpus_per_node must be >= 1 and the link speeds > 0 (GB/s), got "
                             f"{self.gpus_per_node}, intra_node_gbps={self.intra_node_gbps}, "
                             f"inter_node_gbps={self.inter_node_gbps}")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"parallel.cp_mode must be one of {CP_MODES}, got {self.cp_mode!r}")
        if self.cp_hcp < 0 or (self.cp_hcp and (self.cp_mode != "hybrid" or self.cp % self.cp_hcp)):
            raise ValueError(f"parallel.cp_hcp={self.cp_hcp} must be 0, or divide parallel.cp={self.cp} "
                             f"with cp_mode 'hybrid'")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def _parse_value(text: str, current, declared: str = ""):
    """Parse `text` into the type of the field's current value, or of its `declared` type (the annotation's
    string) where the value is None. A field whose declared type allows None takes `none` or `null`."""
    if "None" in declared and text.lower() in ("none", "null"):
        return None
    if current is None and declared.startswith("int"):
        return int(text)
    kind = type(current)
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected a boolean (true/false), got {text!r}")
        return lowered in ("true", "1", "yes")
    if isinstance(current, tuple):
        items = [s for s in text.replace("x", ",").replace("(", "").replace(")", "").split(",") if s.strip()]
        elem = type(current[0]) if current else float
        return tuple(elem(s.strip()) for s in items)
    if current is None:
        if not text.strip():  # e.g. `data.path=$UNSET`: not silently the default
            raise ValueError("expected a value, or none for the default, got an empty string")
        return text
    if kind in (int, float, str):
        return kind(text)
    raise ValueError(f"cannot parse a value of type {kind.__name__} from the command line")


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `section.field=value` strings; unknown names and bad values raise with the valid choices."""
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    changed: dict[str, dict[str, object]] = {}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--set expects section.field=value, got {item!r}")
        key, text = item.split("=", 1)
        section_name, field_name = key.split(".", 1)
        if section_name not in sections:
            raise ValueError(f"--set {key}: unknown section {section_name!r}; sections: {sorted(sections)}")
        section = sections[section_name]
        names = {f.name: f for f in dataclasses.fields(section)}
        if field_name not in names:
            raise ValueError(f"--set {key}: unknown field; {section_name} has {sorted(names)}")
        try:
            value = _parse_value(text, getattr(section, field_name), str(names[field_name].type))
        except ValueError as err:
            raise ValueError(f"--set {key}={text}: {err}") from None
        changed.setdefault(section_name, {})[field_name] = value
    # Rebuild the touched sections so that their __post_init__ validation runs on the new values.
    updates = {name: dataclasses.replace(sections[name], **fields) for name, fields in changed.items()}
    return dataclasses.replace(cfg, **updates)


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# Fields whose default changes what a run does, by section: the value that reproduces a run saved before the
# field existed. A stored config without one of them takes this value, not today's default, so that a resume
# stays exact (or is refused where the run's own config differs) instead of changing behaviour mid-run.
VALUES_BEFORE_FIELDS = {"attention": {"dispatch_margin": 0.0}}


def config_from_dict(data: dict) -> Config:
    """Inverse of `config_to_dict`; unknown sections or fields raise (a config from another version). Fields
    it lacks (saved before they existed) take the value that reproduces the run that saved it where today's
    default would not (`VALUES_BEFORE_FIELDS`), today's defaults otherwise, with a warning naming them."""
    sections = {f.name: f for f in dataclasses.fields(Config)}
    unknown = set(data) - set(sections)
    if unknown:
        raise ValueError(f"config has unknown sections {sorted(unknown)}; expected {sorted(sections)}")
    built, missing = {}, []
    for name, section_field in sections.items():
        cls = section_field.default_factory().__class__
        values = data.get(name, {})
        names = {f.name for f in dataclasses.fields(cls)}
        extra = set(values) - names
        if extra:
            raise ValueError(f"config section {name!r} has unknown fields {sorted(extra)}")
        absent = sorted(names - set(values))
        missing += [f"{name}.{field}" for field in absent]
        before = {field: value for field, value in VALUES_BEFORE_FIELDS.get(name, {}).items() if field in absent}
        built[name] = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}, **before)
    if missing:
        reproduced = [f"{name}.{field}={value!r}" for name, fields in VALUES_BEFORE_FIELDS.items()
                      for field, value in fields.items() if f"{name}.{field}" in missing]
        warnings.warn(f"the stored config lacks {', '.join(missing)} (saved by an older version): "
                      + (f"{', '.join(reproduced)} as before the field existed, " if reproduced else "")
                      + "today's defaults for the others", stacklevel=2)
    return Config(**built)
