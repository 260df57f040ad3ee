"""`DSVAttention`: the drop-in 3-D self-attention of a video DiT block."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv.modules.config import AttentionConfig
from dsv.modules.controller import fill_from_meta, mark_host_state_stale
from dsv.modules.dispatch import speed_model
from dsv.modules.predictor import LowRankPredictor, release_parked, rotary_frequencies
from dsv.ops import (
    SparseIndex,
    estimate_index_from_means,
    head_sparsity,
    index_recall,
    keep_blocks_from_sparsity,
    oracle_index,
    sample_key_positions,
    sample_query_rows,
    sparse_attention,
    window_index,
)
from dsv.ops.estimate import triton_estimation_unsupported
from dsv.ops.grouping import (
    check_sequence_matches_grid,
    cube_permutation_on,
    grouped_positions_on,
    outside_inference_mode,
)
from dsv.ops.sparse_attention import (
    hopper_backward_missing,
    hopper_backward_unsupported,
    hopper_forward_missing,
    hopper_forward_unsupported,
    resolve_backend,
)


def _ema(old: torch.Tensor, new: torch.Tensor, momentum: float) -> torch.Tensor:
    """EMA without a host sync: NaN marks 'never measured', and then the new value is taken."""
    new = new.to(old.dtype)
    return torch.where(torch.isnan(old), new, momentum * old + (1.0 - momentum) * new)


def key_seed(step: int, layer_index: int) -> int:
    """Seed of a layer's predictor key sample at a step: fresh keys every step and layer, the same on every
    rank (context parallelism equals one process) and in a resumed run."""
    return step * 65537 + layer_index


class DSVAttentionCore(nn.Module):
    """Everything DSV adds to one self-attention layer, without the projections: the predictor, the
    per-layer state (sparsity, recall and loss EMAs, dispatch, per-head budgets) and the controller
    interface. The caller brings `q, k, v` in grouped order; per forward:
    `check_input` → (permute to grouped order, project) → `prepare_index` → `attend`.

    `DSVAttention` adds DSV's own projections; integrations (e.g. diffusers processors) subclass this
    and reuse a model's projections. `last_path` says which implementation ran ("dense:sdpa",
    "sparse:reference", "sparse:triton"); of the last eager training forward, `forward_path`, which attention
    kernel it ran ("Hopper warp-specialized", "Triton: " and why not the Hopper kernel, "reference" or "dense"),
    and `backward_path`, which attention backward its gradients get ("fused Hopper", "split Triton: " and why
    not the fused kernel, "reference" or "dense").
    """

    def __init__(self, dim: int, heads: int, head_dim: int, cfg: AttentionConfig | None = None):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive int, got {value!r}")
        if cfg is not None and not isinstance(cfg, AttentionConfig):
            raise ValueError(f"{type(self).__name__}: cfg must be a dsv.AttentionConfig or None, got "
                             f"{type(cfg).__name__}")
        # An undecided `predictor_rotary` means no rotary embeddings here (DSV's own layers): install_dsv decides
        # it for the models it patches before it builds their processors.
        self.cfg = (cfg or AttentionConfig()).with_rotary_default(rotary_embeddings=False)
        self.dim = dim
        self.heads = heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.predictor = None
        if self.cfg.mode == "dsv":
            # Its own random stream: a DSV model then starts from the same weights as a dense or window
            # model of the same seed (the quality comparison trains all three from one initialisation).
            with torch.random.fork_rng(devices=[]):
                rotary = (rotary_frequencies(self.cfg.predictor_rotary // 6, self.cfg.cube)
                          if self.cfg.predictor_rotary else None)
                self.predictor = LowRankPredictor(dim, heads, self.cfg.rank, self.cfg.predictor_lr,
                                                  self.cfg.loss_cosine_weight, self.cfg.loss_mse_weight, rotary)
        for name, value in self._initial_buffers().items():
            self.register_buffer(name, value)
        self.register_load_state_dict_post_hook(self._refresh_after_load)  # a method: the model pickles
        self.register_state_dict_post_hook(mark_host_state_stale)
        # Host mirrors from the initial values, not read back from the buffers: the model can then be
        # built on the meta device (large-model init under FSDP).
        self._use_sparse_host = self.cfg.mode == "window"
        self._keep_fraction_host = [1.0] * heads
        # (kept fraction per head, sparse) of the current denoising step in place of the dispatched state: set by
        # sampling with noise-level budgets (`set_step_budget`); None: the dispatched state.
        self._step_budget: tuple[list[float], bool] | None = None
        self.controller = None
        self.layer_index = 0
        self.last_path = "none"
        # Forward key -> [[input fingerprint, a call that gives that forward's selection again, recalled yet]]
        # for the checkpointing recompute; this step's training forwards only.
        self._selection_cache: dict[tuple, list[list]] = {}
        self._warned_backend = False
        self._window_cache: tuple[tuple, SparseIndex] | None = None
        self._last_shape: tuple[int, int] | None = None
        # (batch, sequence length) and sparse backend of the last training forward: what the dispatch times.
        self._trained_shape: tuple[int, int] | None = None
        self._trained_backend: str | None = None
        self._warned_estimation = False
        self._warned_forward_kernel = False
        self._warned_backward_kernel = False
        self.forward_path: str | None = None
        self.backward_path: str | None = None
        self._last_backend = "reference"
        self.backend_reason: str | None = None
        # Window and dense layers never dispatch: their attention is fixed by the mode from the first step.
        self.dispatch_reason = {"window": "attention.mode=window: the fixed 3-D window in every step",
                                "dense": "attention.mode=dense"}.get(self.cfg.mode, "not dispatched yet")
        self._learned_id = -1
        # The controller's `learn_id` of this layer's last predictor step and profile: once per optimizer step.
        self._learned_step_id = -1
        # The controller's forward id of this layer's last eager forward, training or not (`end_step` warns
        # when a step ran forwards but none that trains).
        self._seen_id = -1
        # Optional measurement hook `observer(layer, hidden, q, k, grid)` (profiling, analysis); it sees
        # the grouped-order tensors and must not modify them.
        self.observer = None
        self._runtime_id = _register_layer(self)

    def _initial_buffers(self) -> dict[str, torch.Tensor]:
        """The per-layer state of a layer that has measured nothing yet (NaN: never measured)."""
        nan_heads = torch.full((self.heads,), float("nan"))
        return {"sparsity_ema": nan_heads.clone(), "recall_ema": nan_heads.clone(),
                "loss_ema": torch.tensor(float("nan")), "use_sparse": torch.tensor(self.cfg.mode == "window"),
                "keep_fraction": torch.ones(self.heads),
                # Per-head widening of the budget that holds the selection's recall at `cfg.recall_target`.
                "keep_boost": torch.zeros(self.heads)}

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # What this step's recompute re-selects from belongs to this layer's pending backward, not to a copy
        # (and host-offloaded rows may still be on their way to host memory).
        state["_selection_cache"] = {}
        # The context-parallel layout cache holds process groups; a copy plans its own.
        state.pop("_cp_layout", None)
        # Not the controller: a copy of the whole model gets it back from the copied controller
        # (`DSVController.__setstate__`), whereas a copy of this layer alone (a block copied to grow a model)
        # would otherwise bring a stand-in controller that nothing drives, and stay dense for good without a
        # word. Alone, the copy raises at its first forward until a controller attaches it.
        state["controller"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # A copy (deepcopy, unpickling) is a layer of its own: the runtime ops must find it, not the original.
        self._runtime_id = _register_layer(self)

    # ----- controller interface -----
    def bind(self, controller, layer_index: int) -> None:
        # A plain attribute, not a submodule: the controller is registered once at the model's top.
        object.__setattr__(self, "controller", controller)
        self.layer_index = layer_index

    def _refresh_after_load(self, _module: nn.Module, _incompatible_keys) -> None:
        self._refresh_host_state()

    def _refresh_host_state(self) -> None:
        # Host mirrors: the forward pass decides on them without a device synchronisation.
        self._use_sparse_host = bool(self.use_sparse)
        self._keep_fraction_host = [float(x) for x in self.keep_fraction]

    def runs_sparse(self) -> bool:
        if self.cfg.mode == "window":
            return True
        if self.cfg.mode == "dense" or self.controller is None:
            return False
        if self._step_budget is not None:
            return self._step_budget[1]
        # The dispatch first: torch.compile then guards on the stage only for a sparse block, so a block that
        # stays dense keeps its graph across the stage switch.
        return self._use_sparse_host and self.controller.current_stage == 2

    def enter_stage2(self) -> None:
        if self.predictor is not None:
            self.predictor.set_lr(self.cfg.predictor_lr * self.cfg.stage2_lr_scale)
        if not torch.isnan(self.recall_ema).any():
            # The first sparse steps start from the recall measured at the end of stage 1 (the smoothed
            # value: one step from the recent predictor, not the integral of its early, poor recall).
            self.update_keep_boost(self.keep_boost, self.recall_ema)

    def dispatch(self, batch: int | None = None) -> None:
        """Decide dense or sparse for this block from its profiled sparsity, and each head's budget; the speed
        model at `batch` (None: `dispatch_basis`'s)."""
        if self.cfg.mode not in ("dsv", "oracle"):
            return  # a window or dense layer under a controller of DSV layers: its attention is fixed by its mode
        sparsity = self.sparsity_ema
        if torch.isnan(sparsity).any():
            return  # never profiled: stay as is
        keep = (1.0 - sparsity + self.budget_margin(self.keep_boost)).clamp(0.0, 1.0)
        self.keep_fraction.copy_(keep)
        sparse = bool(sparsity.mean() >= self.cfg.sparse_threshold)
        # The comparison's outcome is spelled out: at 3 decimals a mean just either side of the threshold reads
        # as a tie.
        self.dispatch_reason = (f"mean sparsity {float(sparsity.mean()):.3f} {'≥' if sparse else '<'} threshold "
                                f"{self.cfg.sparse_threshold}")
        if sparse:
            # `dispatch_margin`: a dense block must gain to go sparse, a sparse one stays until it would lose.
            margin = 0.0 if self._use_sparse_host else self.cfg.dispatch_margin
            pays, reason = self.sparse_pays(keep, margin, batch)
            sparse = sparse if pays is None else pays
            self.dispatch_reason += reason
        self.use_sparse.fill_(sparse)
        self._refresh_host_state()

    def dispatch_basis(self) -> tuple[tuple[int, int] | None, str]:
        """`((batch, sequence length), sparse backend)` that the dispatch times: the last training forward's, so
        that an evaluation forward run between a step's training forwards and its `end_step` (another batch,
        dtype or device) does not decide it; the last forward's where none has trained."""
        if self._trained_shape is not None:
            return self._trained_shape, self._trained_backend
        return self._last_shape, self._last_backend

    def sparse_pays(self, keep: torch.Tensor, margin: float = 0.0, batch: int | None = None) -> tuple[bool | None, str]:
        """Whether the measured kernel speed (`dsv.modules.dispatch`) predicts sparse attention at the per-head
        kept fractions `keep` (float ``[H]``) faster than dense, by `margin` of dense's time, at the shape of
        `dispatch_basis` (with `batch`, at that batch size instead); and the numbers as text. None (and "") where
        no speed model applies: `speed_dispatch` off, a backend without one, or no forward seen yet."""
        basis, backend = self.dispatch_basis()
        model, blocks = (speed_model(backend, self.cfg.group_size, self.cfg.key_block)
                         if self.cfg.speed_dispatch else (None, ""))
        if model is None or basis is None:
            return None, ""
        last_batch, seq_len = basis
        # The kernels run whole key blocks, at least the floor: at short sequences a head's budget rounds up by
        # a sizeable fraction, which the model must be given rather than the fraction asked for.
        num_kv_blocks = -(-seq_len // self.cfg.key_block)
        kept_blocks = keep_blocks_from_sparsity(1.0 - keep.detach().double().cpu(), num_kv_blocks,
                                                self.cfg.keep_floor_blocks)
        run_keep = float(kept_blocks.double().mean()) / num_kv_blocks
        shape = (last_batch if batch is None else batch, self.heads, seq_len, self.head_dim)
        dense_ms = model.dense_ms(*shape)
        return model.pays(run_keep, *shape, margin=margin), (
            f"; {backend} speed model ({blocks}): sparse {model.sparse_ms(run_keep, *shape):.2f} ms at "
            f"{run_keep:.3f} kept in whole key blocks vs dense {dense_ms:.2f} ms"
            + (f" (to go sparse: < {(1.0 - margin) * dense_ms:.2f} ms)" if margin else ""))

    def set_step_budget(self, keep_fraction: list[float] | None, sparse: bool = True) -> None:
        """Run the following forwards with these per-head kept fractions, sparse or dense, in place of the
        dispatched state (a sampler with noise-level budgets sets one per denoising step); None returns to the
        dispatched state. The trained state (EMAs, dispatch, budgets) is left as it is."""
        if keep_fraction is None:
            self._step_budget = None
            return
        if self.cfg.mode not in ("dsv", "oracle"):
            raise ValueError(f"set_step_budget: layer {self.layer_index} runs attention.mode={self.cfg.mode!r}, "
                             "which has no per-head budget (dsv or oracle has)")
        if getattr(self, "context_parallel", None) is not None:
            raise ValueError(f"set_step_budget: layer {self.layer_index} runs context parallel, whose layouts take "
                             "the dispatched budget; sample on one device")
        keep = [float(x) for x in keep_fraction]
        if len(keep) != self.heads or not all(0.0 < x <= 1.0 for x in keep):
            raise ValueError(f"set_step_budget: keep_fraction must hold {self.heads} kept fractions in (0, 1] (one "
                             f"per head of layer {self.layer_index}), got {keep_fraction!r}")
        self._step_budget = (keep, bool(sparse))

    def budget_margin(self, keep_boost: torch.Tensor) -> torch.Tensor:
        """Kept fraction per head on top of `1 - sparsity`: the configured margin plus the recall boost."""
        return self.cfg.keep_margin + keep_boost

    def update_keep_boost(self, keep_boost: torch.Tensor, recall: torch.Tensor) -> None:
        """Move each head's boost by its recall gap (a step of `recall_target`'s integral control), in place.
        Called on stage-2 profiling steps, and once at the switch from stage 1's smoothed recall: in stage 1
        the predictor is still learning, and integrating its low early recall would wind the boost up to a
        full budget before the switch.

        Gain 1: a gap of x kept mass asks for x more kept fraction. Near the target the recall rises slower
        than the budget (the kept blocks already hold most of the mass), so the budget approaches the target
        from one side; where it rises faster the step overshoots and the next profiling narrows it back."""
        if self.cfg.recall_target <= 0.0:
            return
        gap = self.cfg.recall_target * self.cfg.theta - recall.to(keep_boost.dtype)
        keep_boost.copy_((keep_boost + gap).clamp(0.0, 1.0))

    def state_summary(self) -> dict:
        def values(t: torch.Tensor) -> list[float | None]:
            return [None if math.isnan(x) else round(x, 4) for x in t.tolist()]

        return {
            "path": self.last_path,
            # Why the sparse path is not the Triton kernels (None where it is): the warning of an eager forward,
            # kept for compiled models, which cannot warn.
            "backend_reason": self.backend_reason,
            # Recorded by eager training forwards, as a pair (None before one, under torch.compile and under
            # context parallelism, whose layouts run their own attention).
            "forward": self.forward_path,
            "backward": self.backward_path,
            "sparse": self.runs_sparse(),
            "sparsity": values(self.sparsity_ema),
            "recall": values(self.recall_ema),
            "keep": [round(x, 4) for x in self._keep_fraction_host],
            "keep_boost": [round(x, 4) for x in self.keep_boost.tolist()],
            "predictor_loss": None if math.isnan(float(self.loss_ema)) else round(float(self.loss_ema), 5),
            "dispatch": self.dispatch_reason,
        }

    def _apply(self, fn, recurse=True):
        # DSV's own state keeps its precision when the model is cast to half precision (a diffusers pipeline's
        # `.to(torch.bfloat16)`, say): in bf16 an EMA's step of a tenth of a change rounds away near 0.9, and
        # the predictor's AdamW would step bf16 weights against moments of another dtype. The model's own
        # weights follow the cast; a cast to a wide dtype (float64) applies to DSV's state too.
        half = (torch.float16, torch.bfloat16)
        # The tensors themselves, not just their dtypes: a value cast to half and back has lost its low bits.
        buffers = {name: b for name, b in self._buffers.items() if b is not None}
        from_meta = [name for name, b in buffers.items() if b.is_meta]
        predictor = list(self.predictor.parameters()) if self.predictor is not None else []
        predictor_data = [p.data for p in predictor]
        # Their AdamW moments too, which the predictor's own `_apply` casts with them.
        moments = [{key: value.data for key, value in self.predictor.optimizer.state.get(p, {}).items()
                    if isinstance(value, torch.Tensor) and value.dim() > 0} for p in predictor]
        super()._apply(fn, recurse)
        fill_from_meta(self, from_meta, self._initial_buffers())
        for name, old in buffers.items():
            new = self._buffers[name]
            if new is not None and new.dtype in half and old.dtype not in half:
                self._buffers[name] = old.to(new.device)
        # The live Parameters, by position: a conversion may have replaced them (under
        # `torch.__future__.set_overwrite_module_params_on_conversion(True)`).
        live = list(self.predictor.parameters()) if self.predictor is not None else []
        for param, old, old_moments in zip(live, predictor_data, moments):
            if param.dtype in half and old.dtype not in half:
                param.data = old.to(param.device)
                state = self.predictor.optimizer.state.get(param, {})
                state.update({key: value.to(param.device) for key, value in old_moments.items()})
        return self

    # ----- per-forward steps -----
    def check_input(self, x: torch.Tensor, grid: tuple[int, int, int]) -> None:
        """Reject `x` unless it is `[B, T*H*W, C]` for `grid`, finite (when `cfg.check_finite`), and the
        layer has the controller its mode needs."""
        if x.dim() != 3 or x.shape[0] == 0 or x.shape[2] != self.dim or not x.dtype.is_floating_point:
            raise ValueError(f"{type(self).__name__} layer {self.layer_index}: expects x of shape [B, S, C] with "
                             f"B >= 1 and C = {self.dim}, floating, got {tuple(x.shape)} {x.dtype}")
        check_sequence_matches_grid(x.shape[1], grid)
        self.check_input_values(x)

    def check_input_values(self, x: torch.Tensor) -> None:
        """The checks of `check_input` that do not depend on the shape: finite values, a controller."""
        if self.cfg.check_finite and not torch.compiler.is_compiling():
            # A compiled graph cannot branch on values: there `prepare_index` checks inside a runtime op.
            self._check_finite(x, collective=self.training and torch.is_grad_enabled())
        if self.cfg.mode in ("dsv", "oracle") and self.controller is None:
            raise RuntimeError(
                f"{type(self).__name__} layer {self.layer_index}: mode={self.cfg.mode!r} needs a DSVController: "
                "call DSVController(cfg).attach(model) once after building the model"
            )

    def _check_finite(self, x: torch.Tensor, collective: bool) -> None:
        # `collective` (a training forward, which every rank of a distributed run makes): decided over all
        # ranks. An evaluation forward may run on one rank alone (sampling on rank 0, say): checked locally.
        bad = ~torch.isfinite(x).all()
        if any_rank(bad) if collective else bool(bad):
            raise FloatingPointError(
                f"{type(self).__name__} layer {self.layer_index}: NaN or Inf in the attention input x (on this rank "
                "or another of the run); the run is diverging or its input data is corrupt"
            )

    def prepare_index(
        self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, grid: tuple[int, int, int]
    ) -> SparseIndex | None:
        """Observer, key selection and (in training) the predictor step and profiling.

        Args:
            hidden: `[B, S, C]` the attention input in grouped order (the predictor's input).
            q, k: `[B, H, S, D]` after norms (and rotary embeddings), grouped order.
            grid: `(T, H, W)` with `T*H*W == S`.

        Returns:
            The `SparseIndex` when this layer runs sparse now, else None (dense).
        """
        self.resolve_backends(q, q.shape[2])
        if self.controller is not None and not torch.compiler.is_compiling():  # an int Dynamo would guard on
            self._seen_id = self.controller.forward_id
            self.controller.refresh_host_state_if_stale()  # a forward without begin_step, e.g. sampling
        # Not in an eager checkpointing recompute (inside the backward): it would see the same forward twice. A
        # compiled block cannot ask (the graph task id is no tensor), so there the hook runs as traced.
        if self.observer is not None and (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1):
            self.observer(self, hidden, q, k, grid)
        training = self.training and torch.is_grad_enabled()
        learning = training and self.controller is not None
        compiling = torch.compiler.is_compiling()
        check = self.cfg.check_finite and compiling  # see `check_input_values`
        autocast_dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else None
        # Both steps are runtime ops (end of this file), so that torch.compile captures the layer whole (with
        # fullgraph=True: the selection's index width is data-dependent, which a graph with breaks allowed
        # splits at). Eager mode calls their kernels directly: through the dispatcher a call costs ~60 us more.
        select, update = (_layer_select, _layer_update) if compiling else (_select_kernel, _update_kernel)
        index = None
        # Select before the predictor steps, so a checkpointing recompute selects the same keys.
        if self.runs_sparse():
            # Any forward with gradients may be recomputed by activation checkpointing, whatever the layer's
            # train/eval mode (diffusers checkpoints whenever gradients are on): `_select` decides what to keep.
            indices, counts = select(self._runtime_id, hidden, q, k, list(grid), self.cfg.group_size, training,
                                     torch.is_grad_enabled(), check, autocast_dtype)
            index = SparseIndex(indices, counts, self.cfg.group_size, self.cfg.key_block, q.shape[2])
            check = False
        if learning or check:
            update(self._runtime_id, hidden, q, k, None if index is None else index.indices, list(grid), check,
                   learning, autocast_dtype, self.loss_ema, self.sparsity_ema, self.recall_ema, self.keep_boost)
        return index

    @property
    def sparse_backend(self) -> str:
        """The sparse-attention backend these inputs get ("triton" or "reference"; `backend_reason` says
        why not Triton)."""
        return self._last_backend

    def resolve_backends(self, q: torch.Tensor, seq_len: int) -> None:
        """Record the problem size for the dispatch, decide which sparse backend these inputs get, and
        warn (once) when the estimation cannot use Triton on CUDA."""
        self._last_shape = (q.shape[0], seq_len)
        if self.cfg.mode == "dense":
            return
        # Decided afresh each forward (a few host checks), not cached per device/dtype: a cache filled by
        # the first compiled call would change what torch.compile guards on, and recompile the graph.
        self._last_backend, self.backend_reason = resolve_backend(
            self.cfg.backend, q, self.cfg.group_size, self.cfg.key_block)
        # The warnings below come from eager forwards only: torch.compile cannot trace `warnings.warn` in a
        # fullgraph block, and the compiling check comes first so that Dynamo never reads (and guards on) the
        # once-flags. A compiled model shows the path instead: `last_path` and `backend_reason` in the
        # trainer's per-block lines and `state_summary`.
        if torch.compiler.is_compiling():
            return
        if q.is_cuda and self.cfg.mode == "dsv" and not self._warned_estimation:
            estimation_reason = triton_estimation_unsupported(q, self.cfg.key_block)
            if estimation_reason is not None:
                self._warned_estimation = True
                warnings.warn(f"DSVAttention layer {self.layer_index}: critical-KV estimation runs the PyTorch "
                              f"reference: {estimation_reason}", stacklevel=4)
        if self._last_backend == "triton" and not self._warned_forward_kernel:
            self._warned_forward_kernel = True
            why = hopper_forward_missing(q, self.cfg.group_size, self.cfg.key_block)
            if why is not None:
                warnings.warn(f"DSVAttention layer {self.layer_index}: the sparse forward runs the Triton kernel, "
                              f"not the faster warp-specialized Hopper one: {why}", stacklevel=4)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: SparseIndex | None,
               key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`q, k, v [B, H, S, D]` (grouped order) → `[B, H, S, D]`: dense SDPA when `index` is None (under
        `key_mask`, bool and broadcastable to ``[B, H, S, S_k]``, True where a key is attended, if given), else
        block-sparse over `index`; records the path in `last_path`."""
        if index is not None and key_mask is not None:
            raise ValueError("attend: key_mask applies to dense attention only (index must be None); a sparse "
                             "call leaves the masked keys out of its index")
        self._note_kernels(q, index)
        if index is None:
            self.last_path = "dense:sdpa"
            return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.scale)
        self._warn_if_slow(q)
        self.last_path = f"sparse:{self._last_backend}"
        return sparse_attention(q, k, v, index, scale=self.scale, backend=self._last_backend, check_index=False)

    def _keep_blocks(self, num_kv_blocks: int) -> torch.Tensor:
        """Per-head key-block budget from the dispatched kept fraction, or the step's (`set_step_budget`); host
        values: no device sync."""
        kept = self._keep_fraction_host if self._step_budget is None else self._step_budget[0]
        sparsity = 1.0 - torch.tensor(kept, dtype=torch.float64)  # the host values, unrounded
        # Stays on the CPU: the estimation kernel then reads K_max without a device synchronisation.
        return keep_blocks_from_sparsity(sparsity, num_kv_blocks, self.cfg.keep_floor_blocks)

    def _window(self, grid, batch: int, device: torch.device) -> SparseIndex:
        key = (tuple(grid), batch, device)
        if self._window_cache is None or self._window_cache[0] != key:
            with outside_inference_mode():
                cpu = window_index(tuple(grid), self.cfg.cube, self.cfg.key_block, batch, self.heads,
                                   self.cfg.window_frac)
                index = dataclasses.replace(cpu, indices=cpu.indices.to(device), counts=cpu.counts.to(device))
            self._window_cache = (key, index)
        return self._window_cache[1]

    def _select(self, hidden, q, k, grid, training: bool, recomputable: bool):
        # An activation-checkpointing recompute runs inside the backward pass: it must reuse the keys of
        # the original forward (the predictor has stepped since). Every other forward selects afresh, so
        # gradient-accumulation micro-batches each get their own keys. `recomputable` (a forward with grad
        # enabled, whose backward may recompute it) comes from the caller: a compiled graph runs its ops with
        # grad disabled.
        key = self._forward_key(q, grid)
        if torch._C._current_graph_task_id() != -1:
            return self.recall_selection(key, hidden, lambda: self._selection(hidden, q, k, grid)[0])
        # Outside training mode, only within a step (begin_step .. end_step), where the predictor may step before
        # the recompute: outside one nothing steps, a recompute selects the same keys again, and remembering
        # every such forward (a sampler that takes gradients) would keep their rows for good.
        remember = recomputable and (training or (self.controller is not None and self.controller.step_open))
        index, reselect = self._selection(hidden, q, k, grid, keep_for_recompute=remember)
        # A window's selection depends on the grid alone: a recompute selects it again. Remembered, it would
        # pile up without a controller's steps to clear it (window mode runs without one).
        if remember and self.cfg.mode != "window":
            self.remember_selection(key, hidden, reselect)
        return index

    def remember_selection(self, key: tuple, hidden: torch.Tensor, reselect: Callable) -> None:
        """Keep `reselect` (what gives this training forward's keys again) for its checkpointing recompute,
        under the forward's `key` and a fingerprint of its input `hidden`: several forwards of one step
        (the same key) can run before their backward, e.g. a loss over two model calls."""
        forward_id = self.controller.forward_id if self.controller is not None else None
        if any(cached[0] != forward_id for cached in self._selection_cache):
            self._selection_cache.clear()  # a new step: the previous one's backward is done
        self._selection_cache.setdefault(key, []).append([_fingerprint(hidden), reselect, False])

    def recall_selection(self, key: tuple, hidden: torch.Tensor, select_again: Callable) -> SparseIndex:
        """In a checkpointing recompute: the keys its training forward selected (`remember_selection`).
        Without a remembered forward the keys are selected again (`select_again()`) only while the predictor
        has not stepped since; otherwise raises, as the gradients would belong to other keys. Where several
        forwards are pending, the verdict is combined over the ranks of a distributed run (`any_rank`), so that
        all of them raise or none (data-parallel ranks see different data)."""
        if self.cfg.mode == "window":  # the grid's fixed window: the same keys again, whatever stepped since
            return select_again()
        entries = self._selection_cache.get(key, [])
        pending = [entry for entry in entries if not entry[2]]
        if len(pending) == 1:
            # The usual case, also for micro-batches that each run forward then backward in one step.
            pending[0][2] = True
            return pending[0][1]()
        if not entries and (self._learned_id != key[0] or key[0] is None):
            return select_again()
        index, matches = None, []
        if entries:
            # Several training forwards of this step before their backward (or a second backward): this one's
            # by its input. A host sync, in this case only; the recompute's input equals the forward's up to
            # kernel rounding.
            fingerprint = _fingerprint(hidden)
            matches = [entry for entry in pending or entries if _same_fingerprint(entry[0], fingerprint)]
            if matches:
                matches[0][2] = True
                index = matches[0][1]()
        # Forwards with the same input (as far as the fingerprint sees) cannot be told apart: fine while they
        # selected the same keys, else the gradients could belong to the other one's keys.
        same_keys = index is not None and all(_same_selection(index, other[1]()) for other in matches[1:])
        if not any_rank(torch.tensor(not same_keys, device=hidden.device)):
            return index
        if same_keys:
            problem = ("another rank of the run could not match its checkpointing recompute to the forward's "
                       "keys")
        elif matches:
            problem = (f"{len(matches)} training forwards of this step had the same input and selected different "
                       "keys (the predictor stepped between them), so a checkpointing recompute cannot tell which "
                       "keys are its own. Run the backward of each forward before the next one, or do not repeat "
                       "an input within a step (conditional and unconditional passes of guidance training whose "
                       "inputs agree at this layer: run them as one batch)")
        else:
            problem = (f"a checkpointing recompute found no selection of its forward among {len(entries)} of this "
                       "step, and the predictor has stepped since, so selecting again would give other keys than "
                       "the forward used. Run each training forward's backward before the next begin_step")
        raise RuntimeError(f"{type(self).__name__} layer {self.layer_index}: {problem}")

    def _forward_key(self, q: torch.Tensor, grid) -> tuple:
        # The grid too: one token count can tile several grids, whose forwards group the same input differently.
        forward_id = self.controller.forward_id if self.controller is not None else None
        return forward_id, tuple(q.shape), tuple(grid), q.device

    def predictor_positions(self, grid: tuple[int, int, int], device: torch.device) -> torch.Tensor | None:
        """The tokens' (t, h, w) in grouped order, `[S, 3]`, for a predictor with rotary dims; else None."""
        if self.predictor is None or not self.predictor.rotary_dims:
            return None
        return grouped_positions_on(tuple(grid), self.cfg.cube, device)

    def compute_index(self, hidden, q, k, grid, keep_blocks: torch.Tensor | None = None) -> SparseIndex:
        """This layer's key selection for `hidden [B, S, C]`, `q, k [B, H, S, D]` (grouped order), at its
        dispatched budget or the given per-head `keep_blocks`."""
        return self._selection(hidden, q, k, grid, keep_blocks)[0]

    def _selection(self, hidden, q, k, grid, keep_blocks: torch.Tensor | None = None, keep_for_recompute=False
                   ) -> tuple[SparseIndex, Callable[[], SparseIndex]]:
        """`compute_index`, and a call that gives the same selection again. For the learned selection that
        call keeps the pooled low-rank rows and the budgets, not the index: the index grows with S² (e.g.
        6.5 MB per layer at 64k tokens, ~0.4 GB at 500k), the pooled rows with S, and re-selecting from
        them is the deterministic top-k kernel alone. `keep_for_recompute`: the call is kept for a
        checkpointing recompute (with `cfg.host_offload` its rows then wait in host memory)."""
        cfg = self.cfg
        seq_len = q.shape[2]
        kv_block = cfg.key_block
        if cfg.mode == "window":
            index = self._window(grid, q.shape[0], q.device)
            return index, lambda: index
        if keep_blocks is None:
            keep_blocks = self._keep_blocks(-(-seq_len // kv_block))
        with torch.no_grad():
            if cfg.mode == "oracle":
                index = oracle_index(q, k, keep_blocks, cfg.group_size, kv_block, scale=self.scale)
                return index, lambda: index
            proxies, block_keys = self.predictor.pooled_project(hidden.detach(), cfg.group_size, kv_block,
                                                                self.predictor_positions(grid, hidden.device))
        reselect = RepeatableSelection(
            functools.partial(estimate_index_from_means, keep_blocks=keep_blocks, group_size=cfg.group_size,
                              kv_block=kv_block, seq_len=seq_len, backend=cfg.backend),
            (proxies, block_keys), offload=keep_for_recompute and cfg.host_offload)
        return reselect(), reselect

    def claim_step(self) -> bool:
        """Whether this call is the step's first training forward of this layer, which learns and profiles
        (then marked as done): not a second forward of the step, nor a checkpointing recompute (inside the
        backward). A recompute with no forward of the step before it means that forward ran without gradients,
        as under reentrant checkpointing: a layer with a predictor raises (stepping here would bypass the host
        offload's schedule; passing silently would leave the predictor untrained and the model dense for good);
        dense, window and oracle layers have nothing to train and skip."""
        if self.predictor is not None and self.controller.forward_id == 0 and not self.controller.warned_no_begin_step:
            # Layers learn once per begin_step: a loop that never calls it trains each predictor once, measures
            # once, and never switches, so DSV stays dense without a word.
            self.controller.warned_no_begin_step = True
            warnings.warn("DSV: a training forward before any controller.begin_step(step): call begin_step before "
                          "each optimizer step's forwards and end_step after it (they schedule the predictors' "
                          "learning, the profiling, the stage switch and the dispatch); without them the predictors "
                          "learn once and DSV stays dense", stacklevel=3)
        if self._learned_id == self.controller.forward_id:
            return False
        if torch._C._current_graph_task_id() != -1:
            if self.predictor is None:
                return False
            raise RuntimeError(
                f"DSVAttention layer {self.layer_index}: recomputed in the backward, but no forward of this step "
                "trained its predictor: the forward ran without gradients, as under reentrant activation "
                "checkpointing. Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
        self._learned_id = self.controller.forward_id
        if self._learned_step_id == self.controller.learn_id:
            # This optimizer step learned already: a micro-batch with a begin_step of its own, or a step begun
            # again after an abandoned attempt.
            return False
        self._learned_step_id = self.controller.learn_id
        return True

    def _learn_and_profile(self, hidden, q, k, grid, loss_ema, sparsity_ema, recall_ema, keep_boost) -> None:
        """Once per training step (`claim_step`): one predictor step, and on profiling steps the exact per-head
        sparsity and the recall of this layer's selection. Updates the given EMA tensors in place: the layer's
        buffers, or a compiled graph's copies of them."""
        cfg, controller = self.cfg, self.controller
        # Here, at run time, not in the traced forward: a compiled graph replays host writes after it has run.
        self._trained_shape = (q.shape[0], q.shape[2])
        self._trained_backend = resolve_backend(cfg.backend, q, cfg.group_size, cfg.key_block)[0]
        if not self.claim_step():
            return
        seq_len = q.shape[2]
        stride = min(seq_len, max(cfg.sample_stride, -(-seq_len // cfg.max_sample_rows)))
        learn_period = 1 if controller.current_stage == 1 else cfg.learn_every_stage2
        profile_period = cfg.profile_every_stage1 if controller.current_stage == 1 else cfg.profile_every_stage2
        if self.predictor is not None and controller.step % learn_period == 0:
            # Rotate the sampled rows by the number of updates so far, so that over time every row (and
            # every position inside a cube) is seen, whatever the period.
            rows = sample_query_rows(seq_len, stride, offset=controller.step // learn_period, device=q.device)
            keys = sample_key_positions(seq_len, cfg.predictor_keys, key_seed(controller.step, self.layer_index),
                                        device=q.device)
            loss = self.predictor.update(hidden, q, k, rows, self.scale, keys,
                                         self.predictor_positions(grid, hidden.device))
            loss_ema.copy_(_ema(loss_ema, loss, cfg.ema_momentum))
        if not controller.profile_due():
            return
        rows = sample_query_rows(seq_len, stride, offset=controller.step // profile_period, device=q.device)
        with torch.no_grad():
            sparsity = head_sparsity(q, k, rows, cfg.theta, scale=self.scale)
        self._check_profile_finite(loss_ema, sparsity)
        with torch.no_grad():
            sparsity_ema.copy_(_ema(sparsity_ema, mean_over_ranks(sparsity), cfg.ema_momentum))
            if cfg.mode == "dense":
                return
            # Recall of the selection this layer would make at its measured budget.
            keep_blocks = keep_blocks_from_sparsity(sparsity_ema, -(-seq_len // cfg.key_block),
                                                    cfg.keep_floor_blocks, self.budget_margin(keep_boost))
            index = self.compute_index(hidden, q, k, grid, keep_blocks=keep_blocks)
            recall = mean_over_ranks(index_recall(q, k, index, rows, scale=self.scale, check_index=False).mean(0))
            recall_ema.copy_(_ema(recall_ema, recall, cfg.ema_momentum))
            if controller.current_stage == 2:
                self.update_keep_boost(keep_boost, recall)

    def _check_profile_finite(self, loss_ema: torch.Tensor, sparsity: torch.Tensor) -> None:
        """Raise on a profiling step (one device sync, decided over all ranks) where the predictor loss is not
        finite or the measured sparsity is NaN (q or k not finite while the input x was: the layer's
        projections or norms diverged). A diverged predictor must not pass as "never measured" and let the
        stage switch go ahead on the other layers, nor a NaN head count as the sparsest there is."""
        bad_qk = torch.isnan(sparsity).any()
        bad_loss = ~torch.isfinite(loss_ema) if self.predictor is not None else None
        if not any_rank(bad_qk if bad_loss is None else bad_qk | bad_loss):
            return
        name = f"{type(self).__name__} layer {self.layer_index}"
        if bool(bad_qk):
            raise FloatingPointError(f"{name}: NaN or Inf in the attention's q or k while its input x is finite: "
                                     "the layer's projections or norms diverged")
        if bad_loss is not None and bool(bad_loss):
            raise FloatingPointError(f"{name}: the predictor loss is not finite")
        raise FloatingPointError(f"{name}: the predictor loss or the attention's q/k is not finite on another rank "
                                 "of the run")

    @property
    def has_learned(self) -> bool:
        """Whether a training forward has run this layer's predictor step (its loss EMA is measured)."""
        return self._learned_id != -1

    def will_use_predictor(self) -> bool:
        """Whether this layer's next training forward of the current step uses its predictor: a sparse block
        selects with it in every forward; learning and profiling use it in the step's first forward only."""
        if self.predictor is None or self.controller is None:
            return False
        if self.runs_sparse():
            return True
        controller = self.controller
        if self._learned_id == controller.forward_id or self._learned_step_id == controller.learn_id:
            return False
        learn_period = 1 if controller.current_stage == 1 else self.cfg.learn_every_stage2
        return controller.step % learn_period == 0 or controller.profile_due()

    def predictor_done(self) -> None:
        """After a training forward's predictor work (its selection, update and profiling), with
        `cfg.host_offload`: park this layer's predictor in host memory and start bringing back the predictor
        of the next layer that uses its own in this forward. Not in a checkpointing recompute: that
        re-selects from kept rows, and a predictor brought back then would sit on the GPU through the
        backward."""
        if not self.cfg.host_offload or self.predictor is None or torch._C._current_graph_task_id() != -1:
            return
        self.predictor.park()
        following = next((layer for layer in self.controller.layers[self.layer_index + 1:]
                          if layer.will_use_predictor()), None)
        if following is not None:
            following.predictor.prefetch()
        elif self.predictor.parked:
            # The last predictor of this forward: no later layer's start hands its memory back, and the rest of
            # the forward can hold the step's peak (at 32k tokens on one H200, the last block's MLP). Its copy
            # is waited for now (one ~12 MiB copy per forward at the 2.7B shape).
            release_parked(self.predictor._parked_from)

    def _note_kernels(self, q: torch.Tensor, index: SparseIndex | None) -> None:
        """Records which attention kernel this eager training forward runs (`forward_path`) and which backward
        its gradients will take (`backward_path`), by the launchers' own rules (they read the index's K_max, a
        shape: no device sync), and warns once where the fused Hopper backward lacks something for these inputs
        (a missing Hopper forward has warned in `resolve_backends`). Forwards that build a graph only, so that
        the two describe one forward (an evaluation in between changes neither); not while compiling."""
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and q.requires_grad):
            return
        if index is None or self._last_backend != "triton":
            self.forward_path = self.backward_path = "dense" if index is None else self._last_backend
            return
        rule = (q, self.cfg.group_size, self.cfg.key_block, index.indices.shape[3])
        why = hopper_forward_unsupported(*rule)
        self.forward_path = "Hopper warp-specialized" if why is None else f"Triton: {why}"
        why = hopper_backward_unsupported(*rule)
        self.backward_path = "fused Hopper" if why is None else f"split Triton: {why}"
        if not self._warned_backward_kernel:
            self._warned_backward_kernel = True
            missing = hopper_backward_missing(q)
            if missing is not None:
                warnings.warn(f"DSVAttention layer {self.layer_index}: the sparse backward runs the split Triton "
                              f"passes, not the faster fused Hopper kernel: {missing}", stacklevel=3)

    def _warn_if_slow(self, q: torch.Tensor) -> None:
        # Eager forwards only, as in `resolve_backends` (a compiled model reports the path in `state_summary`).
        if torch.compiler.is_compiling():
            return
        if self._last_backend == "reference" and q.is_cuda and not self._warned_backend:
            self._warned_backend = True
            warnings.warn(
                f"DSVAttention layer {self.layer_index}: sparse attention runs the slow PyTorch reference on "
                f"{q.device}: {self.backend_reason}",
                stacklevel=3,
            )


class HeadRMSNorm(nn.RMSNorm):
    """RMSNorm over the head dimension that computes in the input's dtype (fp32 accumulation inside), with
    autocast off: one fused kernel whose output has q's dtype, as attention needs.

    Under bf16 autocast PyTorch either keeps `rms_norm` in the input's dtype, where an fp32 weight sends it to
    the unfused composite path (torch 2.11: several fp32 kernels and fp32 intermediates at the size of q), or
    lists it among the ops it runs in fp32 (torch >= 2.12 on CUDA: fp32 q and k, while v stays bf16).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class DSVAttention(DSVAttentionCore):
    """Multi-head self-attention over a `(T, H, W)` token grid, dense or dynamically sparse.

    `forward(x [B, S, C], grid=(T, H, W)) -> [B, S, C]` with `S = T*H*W` tokens in raster order.
    Internally the tokens are permuted so that each query cube of `cfg.cube` is contiguous; the cube
    shares one key selection. A model whose other ops are per token can permute once for all its layers
    and pass `grouped=True` (tokens in and out already in grouped order), as `VideoDiT` does.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int | None = None,
        cfg: AttentionConfig | None = None,
        qk_norm: bool = True,
        bias: bool = True,
    ):
        if isinstance(heads, int) and heads >= 1 and head_dim is None:
            if dim % heads:
                raise ValueError(f"dim={dim} is not divisible by heads={heads}; pass head_dim explicitly")
            head_dim = dim // heads
        super().__init__(dim, heads, head_dim, cfg)
        inner = heads * head_dim
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=bias)
        self.to_out = nn.Linear(inner, dim, bias=bias)
        self.q_norm = HeadRMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = HeadRMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        # Set by `VideoDiT.enable_context_parallel`: the layer then sees this rank's chunk of the sequence.
        self.context_parallel = None

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int], grouped: bool = False) -> torch.Tensor:
        """`grouped=True`: `x` (and the output) are already in grouped order (`cube_permutation`), as a model
        that permutes its tokens once for all its layers passes them; else raster order."""
        weights = self.to_qkv.weight.dtype
        if (isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.dtype != weights
                and not torch.is_autocast_enabled(x.device.type)):
            raise ValueError(f"{type(self).__name__} layer {self.layer_index}: x is {x.dtype} but the layer's weights "
                             f"are {weights}: cast one to the other, or run under torch.autocast")
        if self.context_parallel is not None:
            return self.context_parallel.attention(self, x, grid)
        self.check_input(x, grid)
        batch, seq_len, _ = x.shape
        if grouped:
            hidden = x
        else:
            perm, inv = cube_permutation_on(tuple(grid), self.cfg.cube, x.device)
            hidden = x.index_select(1, perm)
        qkv = self.to_qkv(hidden).view(batch, seq_len, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, D]
        q, k = self.q_norm(q), self.k_norm(k)
        index = self.prepare_index(hidden, q, k, grid)
        out = self.attend(q, k, v, index)
        out = self.to_out(out.transpose(1, 2).reshape(batch, seq_len, self.heads * self.head_dim))
        return out if grouped else out.index_select(1, inv)


class RepeatableSelection:
    """`select_from_rows(*rows)` as a call that can run again (a checkpointing recompute re-selects). With
    `offload` (CUDA rows), after the first call the rows (`rows`) wait in pinned host memory, copied there and
    back asynchronously on the current stream, which orders the copies; the host never reads them."""

    def __init__(self, select_from_rows: Callable[..., SparseIndex], rows: tuple[torch.Tensor, ...],
                 offload: bool = False):
        self.select_from_rows = select_from_rows
        self.rows = rows
        self.device = rows[0].device
        self.offload = offload and self.device.type == "cuda"

    def __call__(self) -> SparseIndex:
        index = self.select_from_rows(*(row.to(self.device, non_blocking=True) for row in self.rows))
        if self.offload and self.rows[0].device == self.device:
            self.rows = tuple(row.to("cpu", non_blocking=True) for row in self.rows)  # pinned: non_blocking from CUDA
        return index


def _same_selection(a, b) -> bool:
    """Two selections (`SparseIndex` or a rank's `LocalIndex`) list the same keys."""
    return torch.equal(a.counts, b.counts) and torch.equal(a.indices, b.indices)


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """`values` averaged over all ranks of a distributed run (one all-reduce; unchanged in one process). A
    profiling measurement is averaged where it is made: the budget and the recall it feeds must be one process's
    on the whole batch, not each rank's on its share (averaging only the EMAs afterwards left the recall floor
    measured at each rank's own budget). Every rank calls it at the same point, as `any_rank`."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.AVG)
    return values


def any_rank(flag: torch.Tensor, group=None) -> bool:
    """Whether the 0-d `flag` is set here or, in a distributed run, on any rank of it (one all-reduce): a check
    that raises must raise on every rank alike, or the others wait in their next collective. Every rank must
    call it at the same point; the layers' checks do, as every rank runs the same layers. `group`: only the
    ranks of that process group (e.g. one context-parallel group) take part, and only they need to call it."""
    flag = flag.to(torch.int32).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag)


def _fingerprint(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 summary of a layer input, to tell the training forwards of one step apart: for each of up to
    ~64 sampled tokens per batch row, the sum of ~64 sampled channels and the sum of their magnitudes, `[B, R]`
    each (from a strided view: no copy). One sum over the whole sample matched independent inputs about once in
    a thousand pairs; every token's sum must match here."""
    _, seq_len, channels = hidden.shape
    sample = hidden.detach()[:, ::max(1, seq_len // 64), ::max(1, channels // 64)]
    return sample.sum(-1, dtype=torch.float64), sample.abs().sum(-1, dtype=torch.float64)


def _same_fingerprint(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two `_fingerprint`s come from the same input up to rounding: each token's sum within 1e-4 of its
    magnitude sum (a recompute's input equals the forward's up to kernel rounding)."""
    if a[0].shape != b[0].shape:
        return False
    return bool(((a[0] - b[0]).abs() <= 1e-4 * torch.maximum(a[1], b[1]) + 1e-6).all())


def predictor_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sparsity predictors' parameters: trained by their own optimizers inside the forward."""
    return [p for m in model.modules() if isinstance(m, LowRankPredictor) for p in m.parameters()]


def ddp_ignore_predictors(model: nn.Module) -> nn.Module:
    """Have `DistributedDataParallel(model)` leave the sparsity predictors alone; returns `model`. They take their
    gradients and all-reduce them inside the forward, which DDP's reducer reads as parameters that got no gradient
    in the backward, and it stops the next step. DDP reads the list this sets when it wraps `model`: the
    controller's `attach` sets it on the module it attaches; call this on any module above it that DDP (or
    `accelerate`) wraps."""
    predictor_ids = {id(p) for p in predictor_parameters(model)}
    ignored = [name for name, p in model.named_parameters() if id(p) in predictor_ids]
    if ignored:
        already = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        model._ddp_params_and_buffers_to_ignore = already + [n for n in ignored if n not in already]
    return model


def model_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters for the model's optimizer: all but the sparsity predictors, which step themselves."""
    predictor_params = {id(p) for p in predictor_parameters(model)}
    return [p for p in model.parameters() if id(p) not in predictor_params]


# ----- runtime ops: the layer's host-side work inside a compiled graph -----
# Key selection, the predictor's optimizer step, profiling and the finite check read per-step host state
# (the controller's step and forward id, the selection caches, whether autograd runs a backward pass) and
# step an optimizer. Traced by torch.compile they would break the graph or recompile every step; as custom
# ops they run eagerly at run time, the same code in eager and compiled mode. A layer travels as its id in a
# CPU tensor: an int would be a constant of the graph, a tensor lets every block share one compiled graph.

_LAYERS: weakref.WeakValueDictionary[int, DSVAttentionCore] = weakref.WeakValueDictionary()
_LAYER_IDS = itertools.count()


def _register_layer(layer: DSVAttentionCore) -> torch.Tensor:
    layer_id = next(_LAYER_IDS)
    _LAYERS[layer_id] = layer
    # On the CPU whatever the model's device (a plain attribute: `.to()` leaves it), read without a sync.
    # One element, not 0-d: torch.compile turns 0-d CPU int tensors into symbolic scalars.
    return torch.tensor([layer_id], device="cpu")


def _registered_layer(layer_id: torch.Tensor) -> DSVAttentionCore:
    layer = _LAYERS.get(int(layer_id))
    if layer is None:
        raise RuntimeError(f"DSV attention layer id {int(layer_id)} belongs to no live layer")
    return layer


def _autocast(device_type: str, dtype: torch.dtype | None):
    """The caller's autocast state, so that the ops inside a runtime op see the same state in a compiled graph
    (which runs them with autocast off) as in eager mode. DSV's own ops (projections, estimation, profiling)
    turn it off themselves and compute in float32."""
    return torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)


@contextlib.contextmanager
def _autograd_dispatch():
    """Autograd back on inside a custom op's kernel: the dispatcher runs kernels below autograd, while the
    predictor's step builds and backpropagates a graph of its own."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _release_parked_state(q: torch.Tensor) -> None:
    # Each layer's forward and recompute start by handing back the memory of predictors parked so far
    # (`attention.host_offload`): the backward's recompute of the last block then frees the last one parked
    # before the backward's peak allocations.
    if q.is_cuda:
        release_parked(q.device)


def _select_kernel(
    layer_id: torch.Tensor,
    hidden: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    grid: list[int],
    group_size: int,
    training: bool,
    recomputable: bool,
    check_finite: bool,
    autocast_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`DSVAttentionCore._select` (after the finite check, when asked; collective in training forwards): the
    index's `(indices, counts)`.

    Eager mode hands them on as they are: the layer's recompute cache keeps them only where the selection is
    fixed (window, oracle), and nothing writes an index in place."""
    layer = _registered_layer(layer_id)
    _release_parked_state(q)
    if check_finite:
        layer._check_finite(hidden, collective=training)
    with _autocast(q.device.type, autocast_dtype):
        index = layer._select(hidden, q, k, tuple(grid), training, recomputable)
    return index.indices, index.counts


@functools.wraps(_select_kernel)  # the custom op reads its schema from `_select_kernel`'s signature
def _select_op_kernel(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`_select_kernel` as a custom op returns copies: a compiled graph owns what an op returns (and may
    reuse its memory), while a window or oracle layer keeps its selection for the checkpointing recompute."""
    indices, counts = _select_kernel(*args, **kwargs)
    return indices.clone(), counts.clone()


_layer_select = torch.library.custom_op("dsv::layer_select", _select_op_kernel, mutates_args=())


@_layer_select.register_fake
def _(layer_id, hidden, q, k, grid, group_size, training, recomputable, check_finite, autocast_dtype):
    batch, heads, seq_len, _ = q.shape
    groups = -(-seq_len // group_size)
    # The row width is the largest per-head budget: host state of the layer, read when the op runs.
    width = torch.library.get_ctx().new_dynamic_size(min=1)
    return (q.new_empty((batch, heads, groups, width), dtype=torch.int32),
            q.new_empty((batch, heads, groups), dtype=torch.int32))


def _update_kernel(
    layer_id: torch.Tensor,
    hidden: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    selected: torch.Tensor | None,
    grid: list[int],
    check_finite: bool,
    learn: bool,
    autocast_dtype: torch.dtype | None,
    loss_ema: torch.Tensor,
    sparsity_ema: torch.Tensor,
    recall_ema: torch.Tensor,
    keep_boost: torch.Tensor,
) -> None:
    """The finite check (when asked) and `DSVAttentionCore._learn_and_profile` (when `learn`).

    `selected`, this forward's index if the layer selected, is not read: as an input it orders the op after
    the selection, which must see the predictor before its step. Mutating the EMAs keeps the op in a
    compiled graph, which drops ops whose results nobody uses."""
    layer = _registered_layer(layer_id)
    _release_parked_state(q)
    if check_finite:
        layer._check_finite(hidden, collective=learn)
    if not learn:
        return
    # Identity saved-tensor hooks: the predictor's own small graph must not be captured by an enclosing
    # activation checkpoint (it runs once per step, not again in the recompute).
    with (_autograd_dispatch(), _autocast(q.device.type, autocast_dtype),
          torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
        try:
            layer._learn_and_profile(hidden, q, k, tuple(grid), loss_ema, sparsity_ema, recall_ema, keep_boost)
        finally:
            layer.predictor_done()


_layer_update = torch.library.custom_op("dsv::layer_update", _update_kernel,
                                        mutates_args=("loss_ema", "sparsity_ema", "recall_ema", "keep_boost"))


@_layer_update.register_fake
def _(layer_id, hidden, q, k, selected, grid, check_finite, learn, autocast_dtype, loss_ema, sparsity_ema,
      recall_ema, keep_boost):
    return None
