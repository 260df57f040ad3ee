"""The DSV controller: stage switch, per-block dispatch and per-head key budgets.

One controller serves every `DSVAttention` of a model. Global state (stage, switch step) lives in its
buffers and per-layer state (sparsity, recall, loss EMAs, dispatch, kept fraction) in each layer's
buffers, so all of it is part of the model's `state_dict` and of every checkpoint.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsv.modules.config import FIXED_MODES, AttentionConfig
from dsv.modules.predictor import release_parked

CONTROLLER_NAME = "dsv_controller"
"""Attribute (and state_dict prefix) of the controller on a transformer patched by
`dsv.integrations.diffusers.install_dsv`."""
LAYOUT_BUFFER = "layout"
"""A controller buffer that `dsv.integrations.diffusers.install_dsv` adds: what the model's DSV state is measured
with (`layout_record`), so that the state is not loaded into a model of another cube, key block or θ."""


# Training forwards under one step number without end_step after which begin_step warns: gradient accumulation
# with a begin_step per micro-batch stays below it.
REPEATED_BEGIN_WARNING = 64

# Per-layer buffers that the profiler and the predictor update inside the training forward (EMAs, and the
# recall boost's integral step). Rank-local inputs make them differ by rank; `average_over_ranks` averages them.
EMA_BUFFERS = ("sparsity_ema", "recall_ema", "loss_ema", "keep_boost")


@torch.no_grad()
def average_over_ranks(layers: list) -> None:
    """Average the DSV layers' EMA buffers (`sparsity_ema [H]`, `recall_ema [H]`, `loss_ema []`) and recall
    boosts (`keep_boost [H]`) over all ranks, in one all-reduce: every rank that trains the model must
    dispatch alike.

    The EMAs are linear in their measurements, so the average of the ranks' EMAs is the EMA of the
    rank-averaged measurements: `mean_r(m·old + (1-m)·x_r) = m·old + (1-m)·mean_r(x_r)` from identical old
    values, over any number of steps; a first measurement (NaN → x_r) becomes `mean_r(x_r)`; the boost's step
    `old + gap_r` becomes `old + mean_r(gap_r)` (unless its [0, 1] clamp acted on some rank). Never-measured
    entries are NaN on every rank (profiling runs on the same steps everywhere) and stay NaN."""
    buffers = [getattr(layer, name) for layer in layers for name in EMA_BUFFERS]
    # One flat fp32 message instead of four per layer; the buffers may have been cast with the model.
    flat = torch.cat([b.reshape(-1).float() for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        buffer.copy_(value.view_as(buffer))


def largest_batches_over_ranks(layers: list) -> list[int | None]:
    """Each layer's batch of its last training forward (`dispatch_basis`), the largest over all ranks (None
    where no rank has run it): the kernel-speed model decides sparse or dense by batch size, and ranks with
    uneven batches (a batch the world size does not divide) would otherwise dispatch differently, so that their
    replicas drift apart."""
    local = [basis[0] if (basis := layer.dispatch_basis()[0]) is not None else 0 for layer in layers]
    batches = torch.tensor(local, dtype=torch.int64, device=layers[0].sparsity_ema.device)
    dist.all_reduce(batches, op=dist.ReduceOp.MAX)
    return [int(batch) or None for batch in batches.tolist()]


def fill_from_meta(module: nn.Module, from_meta: list[str], initial: dict[str, torch.Tensor]) -> None:
    """Give the buffers `from_meta` (on the meta device before a conversion, `to_empty` off it) their
    initial values, where the conversion made them real: `to_empty` leaves memory unwritten, and DSV's state
    must start as a fresh module's (a run on pretrained weights that loads no DSV state keeps it so), not
    as whatever the memory held (a stage of 94232658510208)."""
    for name in from_meta:
        buffer = module._buffers[name]
        if not buffer.is_meta:
            with torch.no_grad():
                buffer.copy_(initial[name])


def layout_record(cfg: AttentionConfig) -> torch.Tensor:
    """`[cube t, cube h, cube w, key block, round(θ · 1e6)]` as int64: a model cast with `.to(dtype)` keeps it
    exact."""
    return torch.tensor([*cfg.cube, cfg.key_block, round(cfg.theta * 1e6)], dtype=torch.int64)


def layout_difference(saved: torch.Tensor, current: torch.Tensor) -> str | None:
    """What differs between two `layout_record`s, by the config's names ("cube=(2, 2, 2) (cfg: (2, 2, 1)), ..."),
    or None where they agree. Either may be on any device (a state saved on the CPU, loaded into a model on a GPU)."""
    saved, current = saved.to("cpu", torch.int64).flatten(), current.to("cpu", torch.int64).flatten()
    if saved.shape != current.shape:
        return f"a layout record of {saved.numel()} values (this version writes {current.numel()})"
    if torch.equal(saved, current):
        return None
    a, b = saved.tolist(), current.tolist()
    differences = []
    if a[:3] != b[:3]:
        differences.append(f"cube={tuple(a[:3])} (cfg: {tuple(b[:3])})")
    if a[3] != b[3]:
        differences.append(f"key block={a[3]} tokens (cfg: {b[3]}; kv_block=0 makes it the cube's volume)")
    if a[4] != b[4]:
        differences.append(f"theta={a[4] / 1e6:g} (cfg: {b[4] / 1e6:g})")
    return ", ".join(differences)


def check_layout(state_dict: dict, key: str, current: torch.Tensor, source: str, against: str) -> None:
    """Refuse a DSV state (`state_dict`, its record under `key`) measured with another layout than `current`:
    its sparsities, budgets and predictors belong to that layout. A state saved before the record warns and
    gets `current`. `source` and `against` name the two sides in the messages."""
    if key not in state_dict:
        warnings.warn(f"{source} does not record its cube, key block and theta ({key}; saved before they were "
                      f"recorded), so they are not checked against {against}", stacklevel=3)
        state_dict[key] = current.clone()
        return
    difference = layout_difference(state_dict[key], current)
    if difference is not None:
        raise ValueError(f"{source} was measured with another layout than {against}: saved {difference}. Load it "
                         "with the cube, kv_block and theta it was saved with")


def check_layout_on_load(controller: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """`load_state_dict` pre-hook of a controller with a `layout` buffer (`check_layout`). A state without any
    DSV controller state (e.g. a model's pretrained weights, loaded non-strictly) has nothing to check."""
    key = prefix + LAYOUT_BUFFER
    if key in state_dict or prefix + "stage" in state_dict:
        current = getattr(controller, LAYOUT_BUFFER)
        if current.is_meta:  # a model built on the meta device, loaded with assign=True: its config's record
            current = layout_record(controller.cfg)
        check_layout(state_dict, key, current, "load_state_dict: the DSV state", "this model's")


def mark_host_state_stale(module: nn.Module, *_args) -> None:
    """`state_dict` post-hook of a controller and its layers: the tensors handed out may be written in place
    (`DSVController.refresh_host_state`). A module-level function: torch marks the hook object, which a bound
    method cannot take, and the model still pickles."""
    controller = module if isinstance(module, DSVController) else getattr(module, "controller", None)
    if controller is not None:
        controller.host_state_stale = True


@dataclass
class StepEvents:
    """What changed at the end of a step, for the log."""

    switched: bool = False
    redispatched: bool = False
    switch_reason: str = ""


class DSVController(nn.Module):
    def __init__(self, cfg: AttentionConfig):
        super().__init__()
        if not isinstance(cfg, AttentionConfig):
            raise ValueError(f"DSVController: cfg must be a dsv.AttentionConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        for name, value in self._initial_buffers().items():
            self.register_buffer(name, value)
        self.step = 0
        # Increments in `begin_step`: a layer remembers how to re-select the keys of each training forward of
        # the step under it, so that an activation-checkpointing recompute uses its forward's keys.
        self.forward_id = 0
        # Increments in `begin_step` when the step number changes: a layer learns and profiles once per optimizer
        # step, also where a loop calls begin_step for each micro-batch of a gradient accumulation (each then has
        # a forward id of its own) or begins a step again after an abandoned attempt.
        self.learn_id = 0
        self._begun_step: int | None = None
        self._ended_step: int | None = None
        # Between begin_step and end_step: the predictors may step, so a forward with gradients outside training
        # mode must remember its keys for its recompute; outside a step nothing steps and a recompute re-selects.
        self.step_open = False
        # begin_steps of one step number in a row whose forwards trained, without end_step (micro-batches, or a
        # counter that never advances in a loop without end_step).
        self._repeated_unended = 0
        # `forward_id` at the last `end_step`: an `end_step` that finds it unchanged had no `begin_step` before it.
        self._ended_forward_id = 0
        # Training steps in a row (begin_step, a forward that trained) left without end_step: one is a step
        # abandoned by an exception (a skipped batch), two are a loop without end_step.
        self._unended_training_steps = 0
        self._layers: list = []
        self._stage_host = 1
        # Set when a state_dict of the controller or a layer is handed out: whoever holds it may write its
        # tensors in place (torch.distributed.checkpoint's load, an EMA copy), past `load_state_dict` and its
        # hooks, so the host mirrors are read again from the buffers at the next step or forward.
        self.host_state_stale = False
        self._warned_untrained_step = False
        self.warned_no_begin_step = False  # set by the first training forward that finds no begin_step before it
        self.register_load_state_dict_post_hook(self._after_load)  # a method, not a lambda: the model pickles
        self.register_state_dict_post_hook(mark_host_state_stale)

    # ----- wiring -----
    def attach(self, model: nn.Module) -> "DSVController":
        """Attach every DSV attention layer (`DSVAttentionCore`: `DSVAttention` or an integration's
        processor) in `model`, in module order, to this controller."""
        from dsv.modules.attention import DSVAttentionCore, ddp_ignore_predictors

        layers = [m for m in model.modules() if isinstance(m, DSVAttentionCore)]
        if not layers:
            raise ValueError("attach: the model has no DSV attention layers (DSVAttention or an integration)")
        scheduled = [index for index, layer in enumerate(layers) if layer.cfg.mode not in FIXED_MODES]
        if self.cfg.mode in FIXED_MODES and scheduled:
            # Its end_step would run no schedule: those layers' predictors would train for nothing and never
            # switch to sparse attention.
            raise ValueError(f"attach: the controller's cfg.mode is {self.cfg.mode!r}, but layers {scheduled} have "
                             f"mode {layers[scheduled[0]].cfg.mode!r}, whose stages it runs: build the "
                             "controller with the layers' AttentionConfig")
        # A layer reads the stage of the controller it is bound to: re-bound to this one, the other controller
        # (which the caller may still drive) would switch and dispatch layers that no longer follow it.
        taken = [index for index, layer in enumerate(layers) if layer.controller not in (None, self)]
        if taken:
            raise ValueError(f"attach: layers {taken} already follow another DSVController (a VideoDiT builds its "
                             "own, `model.controller`; install_dsv registers `dsv_controller`): a layer follows "
                             "one controller, so drive that one")
        self._layers = layers
        for index, layer in enumerate(self._layers):
            layer.bind(self, index)
        ddp_ignore_predictors(model)
        return self

    @property
    def layers(self) -> list:
        return self._layers

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # A copy (deepcopy, unpickling) of the model: its layers, copied without their controller
        # (`DSVAttentionCore.__getstate__`), are this copy's.
        for index, layer in enumerate(self._layers):
            layer.bind(self, index)

    @staticmethod
    def _initial_buffers() -> dict[str, torch.Tensor]:
        """Stage 1, not switched yet."""
        return {"stage": torch.tensor(1, dtype=torch.long), "switch_step": torch.tensor(-1, dtype=torch.long)}

    def _apply(self, fn, recurse=True):
        from_meta = [name for name, b in self._buffers.items() if b is not None and b.is_meta]
        super()._apply(fn, recurse)
        # With the layout record that `install_dsv` adds.
        fill_from_meta(self, from_meta, {**self._initial_buffers(), LAYOUT_BUFFER: layout_record(self.cfg)})
        return self

    def _refresh_host_state(self) -> None:
        self._stage_host = int(self.stage)

    def _after_load(self, _module: nn.Module, _incompatible_keys) -> None:
        self._refresh_host_state()
        self._follow_stage_in_predictor_lr()

    def _follow_stage_in_predictor_lr(self) -> None:
        # The predictors' learning rate follows the loaded stage (`enter_stage2` lowered it in the run that
        # saved it; a module's state_dict does not hold it). A trainer that restores the predictors'
        # optimizers afterwards sets the same rate.
        for layer in self._layers:
            if layer.predictor is not None:
                scale = layer.cfg.stage2_lr_scale if self._stage_host == 2 else 1.0
                layer.predictor.set_lr(layer.cfg.predictor_lr * scale)

    def refresh_host_state(self) -> None:
        """Read the stage, each layer's dispatch and budgets again from the DSV buffers, and set the predictors'
        learning rate to the stage's where the stage read differs from the one held (a rate set by hand stays
        while the stage does). `load_state_dict` does this itself; a write past it (in place into the tensors of a
        `state_dict()`, as `torch.distributed.checkpoint.load` does) is caught at the next `begin_step`, eager
        layer forward, or forward of a VideoDiT or an installed diffusers model (compiled blocks or not), since
        taking a state_dict marks the mirrors stale; call this after other in-place writes. One device
        synchronisation. A model still on the meta device has nothing to read."""
        buffers = [self.stage, *(b for layer in self._layers for b in (layer.use_sparse, layer.keep_fraction))]
        if any(b.is_meta for b in buffers):
            return
        # Gathered on one device, then one transfer (each read of a device value would wait for it on its own); the
        # layers' device, which the controller's buffers need not share (a controller left on the CPU).
        device = buffers[-1].device
        values = torch.cat([b.detach().reshape(-1).to(device, torch.float64) for b in buffers]).tolist()
        stage_changed = int(values[0]) != self._stage_host
        self._stage_host = int(values[0])
        at = 1
        for layer in self._layers:
            layer._use_sparse_host = bool(values[at])
            layer._keep_fraction_host = values[at + 1:at + 1 + layer.heads]
            at += 1 + layer.heads
        if stage_changed:
            # Only then: every state_dict() marks the mirrors stale, and a save must not reset the rate.
            self._follow_stage_in_predictor_lr()
        self.host_state_stale = False

    def refresh_host_state_if_stale(self) -> None:
        """`refresh_host_state` where a state_dict has been handed out since the mirrors were last read."""
        if self.host_state_stale:
            self.refresh_host_state()

    # ----- schedule -----
    @property
    def current_stage(self) -> int:
        return self._stage_host

    def begin_step(self, step: int) -> None:
        """Called before each training step's forwards (or before each of its micro-batches: the step learns
        and profiles once either way) with the number of optimizer steps done so far."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"begin_step: step must be a non-negative int (optimizer steps done so far), "
                             f"got {step!r}")
        if self.cfg.mode not in FIXED_MODES and step == self._ended_step:
            # end_step ran the switch and the dispatch for this step already: a counter that did not advance
            # (each micro-batch begun and ended, or a constant step) would repeat them within one step.
            raise ValueError(f"begin_step({step}): step {step} has ended (end_step); pass the number of optimizer "
                             "steps done so far, and call end_step once per optimizer step, after all its "
                             "micro-batches")
        new_step = step != self._begun_step
        unended = self.cfg.mode not in FIXED_MODES and self.forward_id != self._ended_forward_id
        trained = unended and any(layer._learned_id == self.forward_id for layer in self._layers)
        self._repeated_unended = self._repeated_unended + 1 if trained and not new_step else 0
        if self._repeated_unended == REPEATED_BEGIN_WARNING:
            warnings.warn(f"begin_step({step}): {self._repeated_unended} training forwards in a row under one step "
                          "number without end_step(): the step learns once, so a loop that never advances the step "
                          "or never calls end_step() leaves DSV dense; call end_step() after each optimizer step",
                          stacklevel=2)
        if trained and new_step:
            self._unended_training_steps += 1
            if self._unended_training_steps >= 2:
                # end_step runs the stage switch and the dispatch: without it DSV would stay dense for good.
                raise RuntimeError(f"begin_step({step}): the last {self._unended_training_steps} training steps had "
                                   "no end_step(); call controller.end_step() after each optimizer step (it runs "
                                   "the stage switch and the dispatch, without which DSV stays dense)")
        self.refresh_host_state_if_stale()
        self.step = int(step)
        self.forward_id += 1
        self.step_open = True
        if new_step:
            self.learn_id += 1
            self._begun_step = self.step
        if self.cfg.host_offload:
            release_parked()
            # Each layer's predictor work brings back the next predictor in use (`predictor_done`); the first
            # one starts here.
            first = next((layer for layer in self._layers if layer.will_use_predictor()), None)
            if first is not None:
                first.predictor.prefetch()

    def profile_due(self) -> bool:
        every = self.cfg.profile_every_stage1 if self._stage_host == 1 else self.cfg.profile_every_stage2
        return self.step % every == 0

    def end_step(self) -> StepEvents:
        """Called after each optimizer step; decides the stage switch and re-dispatches blocks after a
        profiling step (sparsity is dynamic, so the dispatch follows it)."""
        events = StepEvents()
        if self.cfg.mode in FIXED_MODES:  # no stages to run
            return events
        if self.forward_id == self._ended_forward_id:
            # The step's forwards would all have claimed the previous step's work as done (a layer learns and
            # profiles once per begin_step): the predictors would learn nothing and DSV stay dense for good.
            raise RuntimeError("end_step: no begin_step(step) since the last end_step; call "
                               "controller.begin_step(step) before each step's forwards")
        self._ended_forward_id = self.forward_id
        self._ended_step = self.step
        self.step_open = False
        self._unended_training_steps = 0
        self._warn_if_nothing_trained()
        self._refuse_sharded_predictors()
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            # Data parallelism (DDP, FSDP, accelerate): each rank measured its own data. The switch and the
            # dispatch below must decide alike on every rank, and a checkpoint (rank 0's) must hold what every
            # rank holds, so that a resume continues each rank exactly.
            average_over_ranks(self._layers)
        profiled = self.profile_due()
        if self._stage_host == 1:
            forced = self.cfg.max_stage1_steps and self.step + 1 >= self.cfg.max_stage1_steps
            # The loss check reads every layer's EMA (a device sync), so it runs on profiling steps only.
            reason = self._switch_reason() if (profiled or forced) else None
            if reason is not None:
                events.switch_reason = reason
                self.stage.fill_(2)
                self.switch_step.fill_(self.step + 1)
                self._stage_host = 2
                events.switched = True
                for layer in self._layers:
                    layer.enter_stage2()
        if self._stage_host == 2 and (profiled or events.switched):
            batches = largest_batches_over_ranks(self._layers) if distributed else [None] * len(self._layers)
            for layer, batch in zip(self._layers, batches):
                layer.dispatch(batch)
            events.redispatched = True
        return events

    def _refuse_sharded_predictors(self) -> None:
        """FSDP's `fully_shard` over a predictor (a user's own sharding, without ignored_params) makes its
        weights sharded DTensors, gathered into other tensors for each forward: the predictor's own optimizer
        would step the gathered copies, which the next forward gathers afresh from shards it never changed,
        so the predictor would silently stop learning. Between steps the sharded weights are what the module
        holds, so this is where they show."""
        if not dist.is_available():
            return
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for layer in self._layers if layer.predictor is not None
               for p in layer.predictor.parameters()):
            raise RuntimeError("a DSV predictor's parameters are sharded (fully_shard without ignored_params?): "
                               "they must stay replicated plain tensors, which the predictor's own optimizer "
                               "steps inside the forward; shard with dsv.parallel.shard_model, or pass "
                               "set(dsv.predictor_parameters(model)) as fully_shard's ignored_params")

    def _warn_if_nothing_trained(self) -> None:
        """Warns once when the step ran the model but no training forward (grad enabled, train mode): its
        predictors learned nothing and no sparsity was measured, so DSV would stay dense for good without a
        word, e.g. for a model that `from_pretrained` returned in eval mode. Likewise, once, when some layers
        trained and others ran without training (a block left in eval mode, or run under torch.no_grad, inside
        a training model): those layers would stay dense for good. Eager forwards only."""
        learners = [layer for layer in self._layers if layer.predictor is not None]
        if self._warned_untrained_step or not learners:
            return
        ran = [layer for layer in learners if layer._seen_id == self.forward_id]
        untrained = [layer.layer_index for layer in ran if layer._learned_id != self.forward_id]
        if not ran or not untrained:
            return
        self._warned_untrained_step = True
        if len(untrained) == len(ran) and not any(layer._learned_id == self.forward_id for layer in self._layers):
            warnings.warn(f"DSV step {self.step}: the model ran, but no forward of this step trained (the model is "
                          "in eval mode or ran under torch.no_grad), so the predictors learned nothing and no "
                          "sparsity was measured; call model.train() before training forwards", stacklevel=2)
        else:
            warnings.warn(f"DSV step {self.step}: DSV layers {untrained} ran in this step but no forward of theirs "
                          "trained (their modules are in eval mode, or they ran under torch.no_grad) while other "
                          "layers trained: their predictors learn nothing and they stay dense; call .train() on "
                          "the whole model", stacklevel=2)

    def _switch_reason(self) -> str | None:
        """Why stage 1 ends now, or None while it goes on."""
        cfg = self.cfg
        done = self.step + 1
        if done < cfg.min_stage1_steps:
            return None
        mean_loss = self.mean_predictor_loss()
        if mean_loss is not None and mean_loss < cfg.switch_loss_threshold:
            return f"mean predictor loss {mean_loss:.4f} < {cfg.switch_loss_threshold}"
        if cfg.mode == "oracle":  # exact selection needs no predictor training
            return "oracle selection needs no predictor"
        if cfg.max_stage1_steps and done >= cfg.max_stage1_steps:
            return f"max_stage1_steps={cfg.max_stage1_steps} reached"
        return None

    # ----- readouts -----
    def mean_predictor_loss(self) -> float | None:
        losses = [float(layer.loss_ema) for layer in self._layers if layer.predictor is not None]
        losses = [x for x in losses if not math.isnan(x)]
        return sum(losses) / len(losses) if losses else None

    def predictor_failed(self) -> torch.Tensor | None:
        """0-d bool on the device, no host sync: whether a predictor's loss (EMA) is not finite after its
        update. A predictor whose weights went NaN would select garbage keys for every sparse block until the
        next profiling step checks; a trainer folds this flag into its per-step check instead. None when no
        predictor has stepped yet."""
        emas = [layer.loss_ema for layer in self._layers if layer.predictor is not None and layer.has_learned]
        if not emas:
            return None
        return ~torch.isfinite(torch.stack([e.to(emas[0].device) for e in emas])).all()

    def sparse_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self._layers) if layer.runs_sparse()]

    def summary(self) -> dict:
        """Per-layer state for the metrics log (host values)."""
        return {
            "stage": self._stage_host,
            "switch_step": int(self.switch_step),
            "predictor_loss": self.mean_predictor_loss(),
            "layers": [layer.state_summary() for layer in self._layers],
        }
