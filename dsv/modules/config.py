"""Configuration of DSV attention (the `attention` section of a run's config)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

ATTENTION_MODES = ("dense", "dsv", "window", "oracle")
# Modes whose attention is fixed from the first step: no predictor, no profiling-driven dispatch, no stage switch.
FIXED_MODES = ("dense", "window")
BACKENDS = ("auto", "reference", "triton")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _plain(value):
    """A numpy (or other) scalar as the Python int or float it stands for; Python values unchanged."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


# What each declared field type accepts (the annotations are strings under `from __future__ import annotations`).
_FIELD_CHECKS = {
    "int": (_is_int, "an int"),
    "float": (_is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "a bool (true/false)"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string or None"),
    "int | None": (lambda v: v is None or _is_int(v), "an int or None"),
}


def check_config_fields(config, section: str) -> None:
    """Raise ValueError naming the first field of a config dataclass whose value is not of its declared type
    (e.g. `kv_block=16.5`, or a cube of floats, which `int()` would truncate without a word), and the first
    float (or float in a tuple field) that is NaN or infinite: every range check after this compares False
    with NaN, so NaN would pass them all. Configs from Python or a stored JSON config reach here unparsed.
    Numeric scalars of other libraries (numpy) are accepted and stored as Python ints and floats."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.type in _FIELD_CHECKS:
            accepts, expected = _FIELD_CHECKS[f.type]
            if not accepts(value):
                raise ValueError(f"{section}.{f.name} must be {expected}, got {value!r}")
            # Stored as the declared type: an int in a float field (`lr=1`) made `--set` parse it with int().
            if f.type in ("int", "int | None") and value is not None:
                value = _plain(value)
            elif f.type == "float":
                value = float(value)
        elif f.type.startswith("tuple["):
            element, expected = (_is_int, "ints") if "int" in f.type else (_is_number, "numbers")
            if not isinstance(value, (tuple, list)) or not all(element(v) for v in value):
                raise ValueError(f"{section}.{f.name} must be a tuple of {expected}, got {value!r}")
            value = tuple(_plain(v) if element is _is_int else float(v) for v in value)
        setattr(config, f.name, value)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"{section}.{f.name} must be finite, got {value!r}")


@dataclass
class AttentionConfig:
    # dense: full attention; dsv: the two-stage learned sparse method; window: 3-D window baseline
    # (WA-L); oracle: exact top-k selection (for measurement; DSV with a perfect predictor).
    mode: str = "dsv"
    # Query cube (t, h, w): tokens of a cube are made contiguous and share one key selection.
    cube: tuple[int, int, int] = (2, 4, 4)
    # Keys per index entry in grouped order; 0 means one whole cube (block-sparse, the fast path).
    kv_block: int = 0
    # Sparse-op backend: auto = the fastest available for the device.
    backend: str = "auto"

    # Predictor.
    rank: int = 16
    predictor_lr: float = 1e-3
    stage2_lr_scale: float = 0.1
    learn_every_stage2: int = 1  # predictor steps every n-th step in stage 2 (its cost is per step)
    loss_cosine_weight: float = 0.9
    loss_mse_weight: float = 0.1
    sample_stride: int = 64  # every n-th query row (grouped order) feeds the loss and the profiler
    max_sample_rows: int = 256  # caps the R×S score rows at long sequences
    # Keys per predictor update: a random subset of this many (0 = all). The loss needs only means over the
    # keys (Gram matrices), which a few thousand estimate well, and the update's cost grows with the keys.
    predictor_keys: int = 0
    # Rank dims per head that carry the token's (t, h, w) position as rotary phases (0: none; a multiple of 6 up
    # to `rank`: 2 per frequency, as many frequencies along t, h and w). For models whose position enters only
    # q and k (rotary embeddings: Wan, CogVideoX with `use_rotary_positional_embeddings`), where the
    # predictor's input, the hidden states, has none. None: decided by the model (`with_rotary_default`): 6
    # where `install_dsv` finds rotary embeddings (on a Wan trained sparse it lowered held-out loss by 3.5–7.2%
    # while keeping fewer keys: benchmarks/results/2026-12-07-h100-predictor-rotary), 0 elsewhere (DSV's own
    # DiT adds its positions to the hidden states).
    predictor_rotary: int | None = None

    # Profiler.
    theta: float = 0.9
    profile_every_stage1: int = 25
    profile_every_stage2: int = 100
    ema_momentum: float = 0.9

    # Controller.
    switch_loss_threshold: float = 0.01
    min_stage1_steps: int = 0
    max_stage1_steps: int = 0  # 0: no limit, switch only on the loss threshold
    sparse_threshold: float = 0.8  # a block goes sparse when its mean head sparsity reaches this
    keep_floor_blocks: int = 2  # every group keeps at least this many key blocks
    keep_margin: float = 0.0  # extra kept fraction on top of (1 - sparsity)
    # > 0: each head's budget widens (or narrows back) at every stage-2 profiling step until its selection
    # keeps this fraction of theta of the attention mass (0.9: 90% of the critical mass); 0: the paper's budget.
    recall_target: float = 0.0
    # A sparse-enough block runs sparse only where the measured kernel speed beats dense at its shape
    # (`dsv.modules.dispatch`); False dispatches on sparsity alone (kernel checks on short sequences).
    speed_dispatch: bool = True
    # Hysteresis of that decision: a dense block goes sparse only where sparse is predicted to save at least this
    # fraction of its time; a sparse block goes back to dense only where sparse is predicted slower than dense.
    # Near the break-even the gain is a few percent of one block's attention, and without the band blocks
    # switched back and forth every few profiles (13 times in stage 2 of an 8192-token quality run).
    dispatch_margin: float = 0.1

    # Keep DSV's per-layer training state in pinned host memory between its uses (CUDA): each predictor's
    # weights and AdamW moments from its update to its next use, and the pooled low-rank rows that a
    # checkpointing recompute re-selects from, from the forward to the recompute. Lowers the training peak
    # (at the start of the backward) by that state, for a few asynchronous copies per layer and step.
    host_offload: bool = False

    window_frac: float = 2.0 / 3.0  # window extent per dimension for mode=window
    check_finite: bool = True  # raise on NaN/Inf activations entering attention

    def __post_init__(self) -> None:
        check_config_fields(self, "attention")
        if self.mode not in ATTENTION_MODES:
            raise ValueError(f"attention.mode must be one of {ATTENTION_MODES}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"attention.backend must be one of {BACKENDS}, got {self.backend!r}")
        if len(self.cube) != 3 or min(self.cube) < 1:
            raise ValueError(f"attention.cube must be three positive ints (t, h, w), got {self.cube}")
        if self.kv_block < 0:
            raise ValueError(f"attention.kv_block must be >= 0 (0 = cube volume), got {self.kv_block}")
        if not 0.0 <= self.dispatch_margin < 1.0:
            raise ValueError(f"attention.dispatch_margin must be a fraction of dense's time in [0, 1), got "
                             f"{self.dispatch_margin}")
        if not 0.0 < self.theta < 1.0:
            raise ValueError(f"attention.theta must be in (0, 1), got {self.theta}")
        if not 0.0 <= self.recall_target <= 1.0:
            raise ValueError(f"attention.recall_target must be in [0, 1] (a fraction of theta; 0 = off), "
                             f"got {self.recall_target}")
        if not 0.0 <= self.ema_momentum < 1.0:
            raise ValueError(f"attention.ema_momentum must be in [0, 1), got {self.ema_momentum}")
        if self.min_stage1_steps < 0 or self.max_stage1_steps < 0:
            raise ValueError(f"attention.min_stage1_steps and max_stage1_steps must be >= 0, got "
                             f"{self.min_stage1_steps} and {self.max_stage1_steps}")
        if self.max_stage1_steps and self.max_stage1_steps < self.min_stage1_steps:
            raise ValueError(f"attention.max_stage1_steps={self.max_stage1_steps} is below "
                             f"attention.min_stage1_steps={self.min_stage1_steps} (0 = no maximum)")
        if self.predictor_keys < 0 or self.predictor_keys == 1:
            # One key has no spread: its centred Grams are zero and the loss says nothing.
            raise ValueError(f"attention.predictor_keys must be an int, 0 (every key) or >= 2 (a random sample "
                             f"of that many keys), got {self.predictor_keys!r}")
        rotary = self.predictor_rotary
        if rotary is not None and (rotary < 0 or rotary % 6 or rotary > self.rank):
            raise ValueError(f"attention.predictor_rotary must be a multiple of 6 (a rotating pair per frequency "
                             f"and axis) from 0 to rank={self.rank}, got {self.predictor_rotary}")
        for name in ("sample_stride", "max_sample_rows", "profile_every_stage1", "profile_every_stage2",
                     "learn_every_stage2",
                     "keep_floor_blocks", "rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"attention.{name} must be >= 1, got {getattr(self, name)}")
        # Values that would train the predictor the wrong way or not at all, or make the switch and the dispatch
        # meaningless, without any error later.
        weights = (self.loss_cosine_weight, self.loss_mse_weight)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"attention.loss_cosine_weight and loss_mse_weight must be >= 0 with a positive sum, got "
                             f"{self.loss_cosine_weight} and {self.loss_mse_weight}")
        if self.predictor_lr < 0:
            raise ValueError(f"attention.predictor_lr must be >= 0 (0 freezes the predictor), got {self.predictor_lr}")
        if self.stage2_lr_scale < 0:
            raise ValueError(f"attention.stage2_lr_scale must be >= 0 (0 freezes the predictor in stage 2), "
                             f"got {self.stage2_lr_scale}")
        if self.switch_loss_threshold < 0:
            raise ValueError(f"attention.switch_loss_threshold must be >= 0 (0: switch at max_stage1_steps only), "
                             f"got {self.switch_loss_threshold}")
        if self.mode == "dsv" and self.switch_loss_threshold == 0 and self.max_stage1_steps == 0:
            raise ValueError("attention.switch_loss_threshold=0 with max_stage1_steps=0 never leaves stage 1 (dense); "
                             "set a loss threshold, a maximum number of stage-1 steps, or attention.mode=dense")
        if not 0.0 <= self.sparse_threshold <= 1.0:
            raise ValueError(f"attention.sparse_threshold must be a sparsity in [0, 1], got {self.sparse_threshold}")
        if self.keep_margin < 0:
            raise ValueError(f"attention.keep_margin must be >= 0, got {self.keep_margin}")
        if not 0.0 < self.window_frac <= 1.0:
            raise ValueError(f"attention.window_frac must be in (0, 1], got {self.window_frac}")
        if self.mode == "window" and self.kv_block not in (0, 1, self.group_size):
            # The window's key blocks are whole cubes or single tokens (`window_index`).
            raise ValueError(f"attention.kv_block must be 0 or 1 (or the cube volume {self.group_size}) for "
                             f"attention.mode=window, got {self.kv_block}")

    def with_rotary_default(self, rotary_embeddings: bool) -> AttentionConfig:
        """This config with `predictor_rotary` decided where it is None: 6 rotary dims for a model whose rotary
        embeddings give q and k positions its hidden states lack (where the rank has room), else 0."""
        if self.predictor_rotary is not None:
            return self
        return replace(self, predictor_rotary=6 if rotary_embeddings and self.rank >= 6 else 0)

    @property
    def group_size(self) -> int:
        t, h, w = self.cube
        return t * h * w

    @property
    def key_block(self) -> int:
        return self.kv_block or self.group_size
