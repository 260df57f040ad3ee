"""DSV self-attention in diffusers video transformers: `WanTransformer3DModel`, `WanVACETransformer3DModel`,
`CogVideoXTransformer3DModel`, `CosmosTransformer3DModel`, `HunyuanVideoTransformer3DModel`,
`HunyuanVideo15Transformer3DModel`, `LTXVideoTransformer3DModel`, `MochiTransformer3DModel`.

`install_dsv(transformer, cfg)` swaps the processor of every video *self*-attention module for a DSV processor and
registers a `DSVController` as `transformer.dsv_controller`. The processors reuse the module's own
projections (`to_q`, `to_k`, `to_v`, `to_out`), query/key norms and rotary embeddings, so pretrained weights
keep working; they are `nn.Module`s, so each layer's predictor and DSV state (sparsity, recall and loss EMAs,
dispatch, kept fraction) sit in the transformer's `state_dict` under `<attention>.processor.`. Cross-attention
is not touched.

The latent token grid `(T, H, W)` is read at every forward by a forward pre-hook on the transformer: it
divides the input's frame/height/width sizes by the model's patch size (Mochi's patches are spatial only: one
frame of tokens per latent frame); for LTX-Video, whose input is packed tokens, it is the forward's
`num_frames`, `height` and `width` as given (token counts). A grid the query cube (`cfg.cube`) does not tile
runs as it is: the whole cubes first, the edge tokens after them in groups of neighbours (`dsv.ops.grouping`).

Text tokens of CogVideoX, HunyuanVideo, HunyuanVideo 1.5 and Mochi: their attention is joint over video and text
tokens. DSV applies to the video-to-video part only. Every video query attends to all text keys on top of its
selected video keys (text keys are never pruned, whatever the budget; the padded text keys that HunyuanVideo's,
HunyuanVideo 1.5's and Mochi's masks hide never count), and every text query attends densely to all tokens (a
padded one of HunyuanVideo 1.5 to none, as its processor masks it). The predictor, the profiled sparsity and the
recall of such a layer describe the video-to-video attention.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import numbers
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    from diffusers import (
        CogVideoXTransformer3DModel,
        CosmosTransformer3DModel,
        HunyuanVideo15Transformer3DModel,
        HunyuanVideoTransformer3DModel,
        LTXVideoTransformer3DModel,
        MochiTransformer3DModel,
        WanTransformer3DModel,
        WanVACETransformer3DModel,
    )
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, MochiAttnProcessor2_0
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_apply_rotary_emb
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    from diffusers.utils.constants import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFETENSORS_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dsv.integrations.diffusers needs diffusers (tested with 0.42): pip install 'dsv[integrations]'"
    ) from err
from safetensors import safe_open

from dsv.modules.attention import DSVAttentionCore, ddp_ignore_predictors
from dsv.modules.config import AttentionConfig
from dsv.modules.controller import (
    CONTROLLER_NAME,
    LAYOUT_BUFFER,
    DSVController,
    check_layout,
    check_layout_on_load,
    layout_record,
)
from dsv.ops import PAD, SparseIndex
from dsv.ops.grouping import cube_permutation_on

__all__ = [
    "CogVideoXDSVProcessor",
    "CosmosDSVProcessor",
    "HunyuanVideo15DSVProcessor",
    "HunyuanVideoDSVProcessor",
    "LTXVideoDSVProcessor",
    "MochiDSVProcessor",
    "WanDSVProcessor",
    "WanVideoModel",
    "build_wan_for_training",
    "from_pretrained_local",
    "install_dsv",
]



# ----------------------------------------------------------------------------------------------------
# Token grid of the current forward
# ----------------------------------------------------------------------------------------------------


def _integer(value) -> int | None:
    """`value` as an int (a Python or NumPy integer, or a one-element integer tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() and \
            value.dtype != torch.bool:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _raster_coordinates(coords: torch.Tensor, grid: tuple[int, int, int]) -> bool:
    """Whether `coords [B, 3, S]` (LTX-Video's `video_coords`) give every token of the raster grid `(T, H, W)` a
    (t, h, w) position that depends on its own grid axis alone and rises along it (LTX's pipelines scale them
    unevenly, e.g. clamping the first frame's). One device synchronisation."""
    if coords.dim() != 3 or coords.shape[1] != 3 or coords.shape[2] != math.prod(grid):
        return False
    checks = []
    for axis, values in enumerate(coords.reshape(coords.shape[0], 3, *grid).unbind(1)):
        along = values.movedim(axis + 1, 1).flatten(2)  # [B, grid[axis], the other two axes]
        checks.append((along == along[..., :1]).all())  # constant along the other axes
        line = along[..., 0]  # [B, grid[axis]]
        checks.append((line[:, 1:] > line[:, :-1]).all())  # rising along its own (empty where the axis has 1)
    return bool(torch.stack(checks).all())


class _LatentGrid:
    """Forward pre- and post-hook of a patched transformer: the token grid `(T, H, W)` of the forward running
    now (None outside the transformer's forward), checked against the patch and the cube, and the grids of
    this step's forwards with gradients, for checkpointing recomputes (which run in the backward, after their
    forward has ended).

    `frames_axis` is the axis of the frame count in `hidden_states` (Wan `[B, C, F, H, W]`: 2; CogVideoX
    `[B, F, C, H, W]`: 1); height and width are the last two axes. None: `hidden_states` are packed tokens
    `[B, S, C]` in raster order and the forward's `num_frames`, `height` and `width` arguments give their grid
    (LTX-Video). The hooks run eagerly around the transformer (a compiled block only reads `grid`, a constant of
    its graph).
    """

    def __init__(self, patch: tuple[int, int, int], frames_axis: int | None, layout: str, cube: tuple[int, int, int]):
        self.patch, self.frames_axis, self.layout, self.cube = patch, frames_axis, layout, cube
        self.grid: tuple[int, int, int] | None = None
        self.controller: DSVController | None = None  # set by `install_dsv`: its forward_id marks a new step
        # (name, attention module, its DSV processor), set by `install_dsv`: checked before every forward.
        self.installed: list[tuple[str, nn.Module, nn.Module]] = []
        # Distinct grids of grad-enabled forwards whose backward has not run yet (in forward order), and the step
        # they belong to; a backward that recomputes drops those recorded before it began, when it ends.
        self._pending: list[tuple[int, int, int]] = []
        self._pending_step: int | None = None
        self._backward_cutoff: int | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # A block or attention module replaced (or appended) after install_dsv runs diffusers' processor while the
        # controller drives the removed DSV layer: the self-attention modules must be the ones DSV was set on.
        running = _self_attention_layout(module)[0]
        replaced = [name for (name, now), (_, then, _) in zip(running, self.installed) if now is not then]
        if replaced or len(running) != len(self.installed):
            what = (f"{replaced[0]} is not the self-attention module that install_dsv set its DSV processor on"
                    if replaced else
                    f"it has {len(running)} self-attention modules, install_dsv set {len(self.installed)}")
            raise RuntimeError(
                f"{type(module).__name__}: {what}, so DSV does not run there while its controller drives the "
                "layers it replaced. Replace or add blocks before install_dsv, on a model without DSV"
            )
        for name, attn, processor in self.installed:
            # diffusers' processor switches (fuse_qkv_projections, set_attn_processor, set_default_attn_processor)
            # replace the DSV processors without a word: the controller would drive layers that no longer run.
            if attn.processor is not processor:
                raise RuntimeError(
                    f"{type(module).__name__}: {name} runs {type(attn.processor).__name__}, not the DSV processor "
                    "that install_dsv set, so DSV no longer runs there (fuse_qkv_projections, set_attn_processor "
                    "and set_default_attn_processor replace it). DSV needs the unfused projections: after "
                    "fuse_qkv_projections(), unfuse_qkv_projections() puts the DSV processors back")
        grid = self._packed_grid(module, args, kwargs) if self.frames_axis is None else \
            self._latent_grid(module, args, kwargs)
        self.grid = grid
        if self.controller is not None:
            self.controller.refresh_host_state_if_stale()  # a state written in place since (compiled blocks cannot)
        if getattr(module, "gradient_checkpointing", False):
            self.keep_grid_in_checkpoints(module)
        if torch.is_grad_enabled():  # a forward a backward (and its recomputes) may follow
            forward_id = self.controller.forward_id if self.controller is not None else None
            if self._pending_step != forward_id:  # a new step: the previous one's backward is done
                self._pending, self._pending_step = [], forward_id
            # Once per distinct grid: a backward retires every grid recorded before it began, so repeats add
            # nothing, and without them the list stays as short as the shapes seen (a loop of grad-enabled
            # forwards without `begin_step` or a backward would otherwise grow it for good).
            if grid not in self._pending:
                self._pending.append(grid)

    def _latent_grid(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int]:
        """The token grid of a video latent `hidden_states` (5-D, `layout`) under the model's patch."""
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            found = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{type(module).__name__}: hidden_states must be a video latent {self.layout}, got {found}"
            )
        sizes = (x.shape[self.frames_axis], x.shape[-2], x.shape[-1])
        for name, size, extent in zip(("frames", "height", "width"), sizes, self.patch):
            if size % extent:
                raise ValueError(
                    f"{type(module).__name__}: hidden_states {name}={size} is not divisible by the model's patch "
                    f"extent {extent} (patch (t, h, w) = {self.patch})"
                )
        grid = tuple(size // extent for size, extent in zip(sizes, self.patch))
        if min(grid) < 1:  # any cube fits a non-empty grid (partial cubes at its edges, `cube_permutation`)
            raise ValueError(
                f"{type(module).__name__}: hidden_states {self.layout}={tuple(x.shape)} with patch {self.patch} "
                f"gives the empty token grid (T, H, W)={grid}"
            )
        # Wan's rotary table holds `rope_max_seq_len` positions per axis; a longer axis fails inside its reshape.
        limit = getattr(module.config, "rope_max_seq_len", None)  # Wan's only
        if limit is not None and max(grid) > limit:
            raise ValueError(
                f"{type(module).__name__}: the token grid (T, H, W)={grid} of hidden_states {tuple(x.shape)} has an "
                f"axis longer than the model's rope_max_seq_len={limit} positions"
            )
        return grid

    def _packed_grid(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int]:
        """The token grid `(num_frames, height, width)` of packed tokens `hidden_states [B, S, C]` (LTX-Video)."""
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        x = bound.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            found = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{type(module).__name__}: hidden_states must be packed latent tokens {self.layout}, "
                             f"got {found}")
        sizes = tuple(_integer(bound.get(name)) for name in ("num_frames", "height", "width"))
        if any(size is None or size < 1 for size in sizes):
            raise ValueError(
                f"{type(module).__name__}: DSV needs the token grid of hidden_states as num_frames, height and width "
                f"(positive ints), got {tuple(bound.get(name) for name in ('num_frames', 'height', 'width'))}; a "
                "token layout given by video_coords alone is not supported")
        grid = tuple(sizes)
        if math.prod(grid) != x.shape[1]:
            raise ValueError(
                f"{type(module).__name__}: num_frames, height, width = {grid} give {math.prod(grid)} tokens, but "
                f"hidden_states holds {x.shape[1]} (DSV groups the tokens of one latent grid; tokens appended for "
                "conditioning are not supported)")
        coords = bound.get("video_coords")
        if coords is not None and not _raster_coordinates(coords, grid):
            # LTX then takes the positions from video_coords alone: tokens placed elsewhere than in the raster
            # order of the grid (a conditioning frame appended and placed at t = 0) would be grouped with the
            # wrong neighbours.
            raise ValueError(
                f"{type(module).__name__}: video_coords [B, 3, S] must place the tokens on the raster grid {grid} "
                "(each coordinate rising along its own axis of num_frames, height, width and constant along the "
                "others), as DSV groups them by that grid; tokens appended for conditioning are not supported")
        return grid

    def keep_grid_in_checkpoints(self, module: nn.Module) -> None:
        """Wrap diffusers' `_gradient_checkpointing_func` of the transformer (set by `enable_gradient_checkpointing`,
        which may come after install_dsv) so that each checkpointed block runs with this forward's grid, in the
        forward and in its recompute."""
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if checkpoint is None or (isinstance(checkpoint, _CheckpointWithGrid) and checkpoint.latent_grid is self):
            return
        module._gradient_checkpointing_func = _CheckpointWithGrid(checkpoint, self)

    def forward_done(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        self.grid = None  # a processor called after this is a checkpointing recompute, or a misuse

    @torch.compiler.disable  # host-side lookup in a recompute: the forward's graph never reaches it
    def recompute_grid(self, layer_index: int, seq_len: int) -> tuple[int, int, int]:
        """The grid of a checkpointing recompute over `seq_len` tokens: the grid of that many tokens among the
        forwards whose backward has not run. Raises where there is none (a call outside the transformer's
        forward) or several shapes of that count (forwards at one token count but other shapes before one
        backward: the recompute cannot tell which). When this backward ends, the forwards recorded before it
        began count as done (gradient accumulation: forward, backward, forward, backward)."""
        if torch._C._current_graph_task_id() != -1 and self._backward_cutoff is None:
            self._backward_cutoff = len(self._pending)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        grids = sorted({grid for grid in self._pending if math.prod(grid) == seq_len})
        if torch._C._current_graph_task_id() == -1 or not grids:
            raise RuntimeError(
                "DSV processor called outside its transformer's forward: the token grid is recorded by the "
                "transformer's forward hooks, so call the transformer (`transformer(...)`, not "
                "`transformer.forward(...)` or the attention module alone)")
        if len(grids) > 1:
            raise RuntimeError(
                f"DSV processor layer {layer_index}: a checkpointing recompute cannot tell which of the token "
                f"grids {grids} ({seq_len} tokens each) of the forwards before this backward its forward had; "
                "run each forward's backward before the next forward at another shape of as many tokens")
        return grids[0]

    def _backward_done(self) -> None:
        self._pending = self._pending[self._backward_cutoff:]
        self._backward_cutoff = None

    def of_call(self, layer_index: int, hidden_states: torch.Tensor):
        """`(grid, perm, inv)` of a processor call on `hidden_states [B, S, C]`, `perm`/`inv` on its device."""
        grid = self.grid if self.grid is not None else self.recompute_grid(layer_index, hidden_states.shape[1])
        perm, inv = cube_permutation_on(grid, self.cube, hidden_states.device)
        return grid, perm, inv


class _CheckpointWithGrid:
    """diffusers' gradient-checkpointing call with the forward's token grid set around the checkpointed block, so
    that its recompute (inside the backward, after the forward has ended) runs with the grid of its own forward.
    Without it the recompute looked the grid up among the step's pending forwards: a compiled block traced that
    lookup, a graph unlike its forward's (regional compilation failed on the first backward), and a second
    backward through one graph (`retain_graph=True`) found none left."""

    def __init__(self, checkpoint, latent_grid: _LatentGrid):
        self.checkpoint, self.latent_grid = checkpoint, latent_grid

    def __call__(self, block, *args, **kwargs):
        grid = self.latent_grid.grid

        def with_grid(*block_args, **block_kwargs):
            latent_grid = self.latent_grid
            saved, latent_grid.grid = latent_grid.grid, grid
            try:
                return block(*block_args, **block_kwargs)
            finally:
                latent_grid.grid = saved

        return self.checkpoint(with_grid, *args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# Processors
# ----------------------------------------------------------------------------------------------------


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved channel pairs `(x[2i], x[2i+1])` of `x [..., D]` by the angles whose `cos, sin`
    (one per pair, broadcastable to `[..., D/2]`) are given; computed in the promoted dtype of `x` and the tables,
    not rounded."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on `x [..., D]` with `cos, sin` broadcastable to it (`[1, S, 1, D]` on `[B, S, H, D]`).

    Wan rotates interleaved channel pairs `(x[2i], x[2i+1])` and stores each pair's cos/sin twice. diffusers
    keeps this function inside `WanAttnProcessor.__call__`, so it is restated here with the same arithmetic
    (products in the frequency dtype, one rounding to `x`'s dtype), which keeps the dense path bit-compatible.
    """
    return _rotate_pairs(x, cos[..., 0::2], sin[..., 1::2]).type_as(x)


def _mochi_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Mochi's rotary embedding on `x [..., D]` with `cos, sin` broadcastable to `[..., D/2]` (one angle per
    interleaved channel pair; Mochi's tables are per head, `[S, H, D/2]`).

    diffusers keeps this function inside `MochiAttnProcessor2_0.__call__`, so it is restated here with the same
    arithmetic: `x` taken to float32 whatever its dtype (float64 included), one rounding back to it.
    """
    return _rotate_pairs(x.float(), cos, sin).to(x.dtype)


class _DSVProcessor(DSVAttentionCore):
    """What every DSV processor shares: a `DSVAttentionCore` of the attention module's shape that reads the token
    grid from the transformer's hooks, called as diffusers calls processors; and its own attention (SDPA when
    dense, DSV's kernels when sparse), so that diffusers' `set_attention_backend`, which sets
    `_attention_backend` on every processor, does not apply to it and says so instead of being dropped silently
    (the cross-attention layers keep the backend)."""

    def __init__(self, attn: nn.Module, cfg: AttentionConfig, grid: _LatentGrid):
        heads = attn.heads
        # DSV selects and attends key blocks per query head: keys and values as wide as the queries, a head of each
        # for each query head (a module built with narrower key/value projections, which some stock processors widen
        # by repetition, is not supported).
        widths = {name: getattr(attn, name).out_features for name in ("to_q", "to_k", "to_v")}
        if len(set(widths.values())) != 1:
            raise ValueError(
                f"{type(self).__name__}: to_k and to_v must be as wide as to_q (one key/value head per query head; "
                f"DSV has no grouped-query attention), got out_features {widths}")
        super().__init__(attn.to_q.in_features, heads, attn.to_q.out_features // heads, cfg)
        self._grid = grid

    @staticmethod
    def _in_attention_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`tensors` (the layer's q, k and v, video and text) in the one dtype attention computes in: autocast's where
        it is on (SDPA casts them so under it), else the last tensor's (v). A model's own q/k norms can return float32
        under bf16 autocast with float32 weights while v is bf16: diffusers' RMSNorm multiplies by its float32
        weight, and CUDA autocast runs `rms_norm` (torch >= 2.12) and `layer_norm` in float32; DSV's selection and
        sparse kernels take one dtype."""
        device = tensors[0].device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensors[-1].dtype
        return tuple(t.to(dtype) for t in tensors)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        # diffusers' attention modules pass on only the keyword arguments named in the processor's `__call__`
        # signature; nn.Module.__call__ is `(*args, **kwargs)` and would lose image_rotary_emb.
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    def _rotary_table_shape(self, seq_len: int) -> tuple[int, ...]:
        """The shape of each rotary table for `seq_len` video tokens: `[S, D]` (CogVideoX, Cosmos, HunyuanVideo)."""
        return seq_len, self.head_dim

    def _grouped_rotary_tables(self, image_rotary_emb, seq_len: int, perm: torch.Tensor):
        """The model's rotary tables `(cos, sin)`, each of `_rotary_table_shape(seq_len)` with one row per video token
        in raster order, checked and taken to grouped order (`perm`: raster to grouped)."""
        expected = self._rotary_table_shape(seq_len)
        if any(tuple(f.shape) != expected for f in image_rotary_emb):
            # Tables of another grid would be read row by row as this grid's positions, without an error.
            raise ValueError(
                f"{type(self).__name__}: image_rotary_emb must be (cos, sin), each of shape {list(expected)} for this "
                f"latent's {seq_len} video tokens; got {[tuple(f.shape) for f in image_rotary_emb]}"
            )
        return tuple(f.index_select(0, perm) for f in image_rotary_emb)

    @property
    def _attention_backend(self):
        return None

    @_attention_backend.setter
    def _attention_backend(self, backend) -> None:
        if backend is not None:
            warnings.warn(f"set_attention_backend({getattr(backend, 'value', backend)!r}) does not apply to the DSV "
                          f"self-attention layers ({type(self).__name__}: SDPA when dense, DSV's kernels when "
                          "sparse); other attention layers use it", stacklevel=3)


class _SelfAttentionProcessor(_DSVProcessor):
    """A DSV processor for a video self-attention module (`attn1`) with q/k norms that `_normalize` applies (by
    default across heads: RMSNorm over all heads, before the head split) and a rotary embedding that `_rotate`
    applies."""

    def forward(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(f"{type(self).__name__} is self-attention: encoder_hidden_states and attention_mask "
                             "must be None (it is installed on attn1 only)")
        grid, perm, inv = self._grid.of_call(self.layer_index, hidden_states)
        self.check_input(hidden_states, grid)
        hidden = hidden_states.index_select(1, perm)  # grouped order: each query cube is contiguous
        q, k, v = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
        q, k = self._normalize(attn, q, k)
        q, k = self._rotate(q, k, rotary_emb, perm)
        out_dtype = q.dtype  # the stock processors return attention in q's dtype, whatever it computed in
        q, k, v = self._in_attention_dtype(q, k, v)
        q, k, v = (t.unflatten(2, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        index = self.prepare_index(hidden, q, k, grid)
        out = self.attend(q, k, v, index).transpose(1, 2).flatten(2, 3).to(out_dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out.index_select(1, inv)

    def _normalize(self, attn, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's query/key norms on `q, k [B, S, heads * head_dim]`: across heads (Wan, LTX-Video)."""
        return attn.norm_q(q), attn.norm_k(k)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rotary_emb, perm: torch.Tensor):
        """The model's rotary embedding on `q, k [B, S, heads * head_dim]` in grouped order (`perm`: raster to
        grouped)."""
        raise NotImplementedError


class WanDSVProcessor(_SelfAttentionProcessor):
    """DSV self-attention processor for a `WanAttention` used as self-attention (`attn1`).

    Called by `WanAttention.forward(hidden_states [B, S, C], None, None, rotary_emb)` with `S = T*H*W`
    tokens in raster order and `rotary_emb = (cos, sin)`, each `[1, S, 1, D]`; returns `[B, S, C]`.
    Uses the module's `to_q/to_k/to_v/to_out` and its `norm_q/norm_k` (RMSNorm across heads); a fused
    `to_qkv` copy made by `fuse_projections()` is not used.
    """

    def _rotate(self, q, k, rotary_emb, perm):
        expected = (1, q.shape[1], 1, self.head_dim)
        if rotary_emb is None or any(tuple(f.shape) != expected for f in rotary_emb):
            found = None if rotary_emb is None else [tuple(f.shape) for f in rotary_emb]
            raise ValueError(
                f"WanDSVProcessor: rotary_emb must be (cos, sin), each of shape {list(expected)}, as "
                f"WanTransformer3DModel passes from its WanRotaryPosEmbed; got {found}"
            )
        cos, sin = (f.index_select(1, perm) for f in rotary_emb)  # [1, S, 1, D], grouped order
        return tuple(_wan_rotary(t.unflatten(2, (self.heads, -1)), cos, sin).flatten(2) for t in (q, k))


class LTXVideoDSVProcessor(_SelfAttentionProcessor):
    """DSV self-attention processor for an `LTXAttention` used as self-attention (`attn1`) of LTX-Video.

    Called by `LTXAttention.forward(hidden_states [B, S, C], None, None, image_rotary_emb)` with `S = T*H*W`
    tokens in raster order and `image_rotary_emb = (cos, sin)`, each `[B or 1, S, heads * head_dim]`; returns
    `[B, S, C]`. Uses the module's `to_q/to_k/to_v/to_out` and its `norm_q/norm_k` (RMSNorm across heads) and
    LTX's rotary embedding (across heads, before the head split), as `LTXVideoAttnProcessor` does.
    """

    def _rotate(self, q, k, rotary_emb, perm):
        if rotary_emb is None:
            return q, k
        # One table for the whole batch (video_coords of batch 1) broadcasts, as in LTX's own processor.
        if any(f.dim() != 3 or f.shape[0] not in (1, q.shape[0]) or tuple(f.shape[1:]) != q.shape[1:]
               for f in rotary_emb):
            raise ValueError(
                f"LTXVideoDSVProcessor: image_rotary_emb must be (cos, sin), each of shape [B or 1, {q.shape[1]}, "
                f"{q.shape[2]}], as LTXVideoTransformer3DModel passes from its rope; got "
                f"{[tuple(f.shape) for f in rotary_emb]}"
            )
        freqs = tuple(f.index_select(1, perm) for f in rotary_emb)  # grouped order
        return ltx_apply_rotary_emb(q, freqs), ltx_apply_rotary_emb(k, freqs)


class CosmosDSVProcessor(_SelfAttentionProcessor):
    """DSV self-attention processor for the `Attention` used as self-attention (`attn1`) of a `CosmosTransformerBlock`.

    Called by `Attention.forward(hidden_states [B, S, C], image_rotary_emb=(cos, sin))` with `S = T*H*W` tokens in
    raster order and each table `[S, D]` (float32, as `CosmosRotaryPosEmbed` builds it); returns `[B, S, C]`. Uses
    the module's `to_q/to_k/to_v/to_out`, its per-head `norm_q/norm_k` (RMSNorm over each head's channels, after the
    head split) and Cosmos's rotary embedding (the two halves of each head rotated, `use_real_unbind_dim=-2`), as
    `CosmosAttnProcessor2_0` does. The model's learnable positional embedding (`extra_pos_embed_type="learnable"`)
    is already in `hidden_states`: the block adds it before its norm.
    """

    def _normalize(self, attn, q, k):
        # Cosmos's norms are RMSNorm(head_dim): each head normalised on its own channels.
        return tuple(norm(t.unflatten(2, (self.heads, -1))).flatten(2)
                     for norm, t in ((attn.norm_q, q), (attn.norm_k, k)))

    def _rotate(self, q, k, rotary_emb, perm):
        if rotary_emb is None:  # as the stock processor: no rotation without tables
            return q, k
        freqs = self._grouped_rotary_tables(rotary_emb, q.shape[1], perm)
        # On [B, S, H, D] (`sequence_dim=1`), the arithmetic of the stock processor on [B, H, S, D]: q and k taken
        # to float32 whatever their dtype, one rounding back.
        return tuple(apply_rotary_emb(t.unflatten(2, (self.heads, -1)), freqs, use_real=True, use_real_unbind_dim=-2,
                                      sequence_dim=1).flatten(2) for t in (q, k))


def _append_always_kept(index: SparseIndex, extra_len: int) -> SparseIndex:
    """Extend an index over `S` grouped tokens to the sequence `[grouped tokens; extra_len extra tokens]`.

    Every original query group keeps its selected blocks plus all key blocks that hold extra tokens (appended
    after its valid entries, so rows stay ascending). Where `S` ends inside a key block, that block holds both
    the last video keys and the first extra ones: every group keeps it (with its video keys), and a group
    that had selected it lists it once. Where `S` ends
    inside a query group, that group's extra-token queries share its row; like the query groups of only
    extra tokens (which list only the extra key blocks), their outputs are placeholders that the caller
    recomputes densely.

    Args:
        index: rows `[B, H, ceil(S / G), K]` over `S` tokens.
        extra_len: number of appended tokens, `L >= 0` (0: `index` itself).

    Returns:
        `SparseIndex` with rows `[B, H, ceil((S + L) / G), K + E]`, `E` the key blocks holding extra tokens,
        and `seq_len = S + L`.
    """
    if extra_len == 0:  # no text tokens (an empty prompt's embedding): nothing to append
        return index
    seq_len, group_size, kv_block = index.seq_len, index.group_size, index.kv_block
    total = seq_len + extra_len
    batch, heads, groups, width = index.indices.shape
    device = index.indices.device
    extra_ids = torch.arange(seq_len // kv_block, -(-total // kv_block), device=device, dtype=torch.int32)
    extra_blocks = len(extra_ids)
    # The block shared with the last video keys (only when S ends inside it) may already be listed.
    listed = ((index.indices == extra_ids[0]).any(-1) if seq_len % kv_block
              else torch.zeros(index.counts.shape, dtype=torch.bool, device=device))
    # One scratch column takes the duplicate, dropped after the scatter.
    indices = torch.full((batch, heads, groups, width + extra_blocks + 1), PAD, dtype=torch.int32, device=device)
    indices[..., :width] = index.indices
    slots = index.counts.long().unsqueeze(-1) + torch.arange(extra_blocks, device=device) - listed.long().unsqueeze(-1)
    slots[..., 0] = torch.where(listed, width + extra_blocks, slots[..., 0])
    indices.scatter_(-1, slots, extra_ids.expand(batch, heads, groups, extra_blocks))
    indices = indices[..., :-1]
    extra_groups = -(-total // group_size) - groups
    extra_rows = torch.full((batch, heads, extra_groups, width + extra_blocks), PAD, dtype=torch.int32, device=device)
    extra_rows[..., :extra_blocks] = extra_ids
    counts = torch.cat([index.counts + extra_blocks - listed.int(),
                        torch.full((batch, heads, extra_groups), extra_blocks, dtype=torch.int32, device=device)], 2)
    return SparseIndex(torch.cat([indices, extra_rows], 2), counts, group_size, kv_block, total)


class _JointVideoTextProcessor(_DSVProcessor):
    """What the processors of joint video+text attention (CogVideoX, HunyuanVideo, HunyuanVideo 1.5, Mochi) share: the
    video tokens' rotary embeddings, and attention in which DSV selects the video keys of each video query cube, every
    unpadded text key is kept for every video query, and text queries attend densely."""

    def _heads(self, x: torch.Tensor, projections, norms) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x [B, N, C]` → `q, k, v [B, H, N, D]` through the projections `(to_q, to_k, to_v)` and the per-head
        query/key `norms` (either may be None)."""
        q, k, v = (proj(x).unflatten(2, (self.heads, -1)).transpose(1, 2) for proj in projections)
        norm_q, norm_k = norms
        return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v

    def _rotate_video(self, q: torch.Tensor, k: torch.Tensor, image_rotary_emb, perm: torch.Tensor):
        """The model's rotary embedding `(cos, sin)`, tables of `_rotary_table_shape` with one row per video token
        in raster order, on the video `q, k [B, H, S, D]` in grouped order."""
        if image_rotary_emb is None:
            return q, k
        freqs = self._grouped_rotary_tables(image_rotary_emb, q.shape[2], perm)
        return self._apply_rotary(q, freqs), self._apply_rotary(k, freqs)

    @staticmethod
    def _apply_rotary(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The rotary embedding of `freqs` (tables of `_rotary_table_shape`, grouped order) on `x [B, H, S, D]`."""
        return apply_rotary_emb(x, freqs)

    def _joint_attention(self, video: tuple, text: tuple, index: SparseIndex | None, text_lengths: list[int] | None,
                         key_mask: torch.Tensor | None) -> torch.Tensor:
        """`video = (q, k, v)` each `[B, H, S, D]` (grouped order), `text = (q, k, v)` each `[B, H, L, D]` →
        `[B, H, S + L, D]`, video rows first.

        Dense where `index` is None: under `key_mask` without `text_lengths`; with them, each sample over its
        video and its first `text_lengths[b]` text tokens, unmasked (its padded text rows zero). Sparse otherwise:
        each video query group attends to its selected video key blocks and to its sample's first
        `text_lengths[b]` text keys (None: all `L`), and text queries attend densely under `key_mask`."""
        seq_len, text_len = video[0].shape[2], text[0].shape[2]
        # Video first, text after: the video groups and key blocks keep their ids, text keys get the last ids.
        q, k, v = (torch.cat(pair, 2) for pair in zip(video, text))
        if index is None and text_lengths is None:
            return self.attend(q, k, v, None, key_mask)
        # The padded text keys are left out by giving each sample the sequence of its own unpadded text (an index
        # keeps whole key blocks; SDPA's fast kernels take no mask): the whole batch at once where the lengths
        # agree, else one sample at a time (video training runs small batches).
        lengths = [text_len] * q.shape[0] if text_lengths is None else text_lengths
        runs = [(0, len(lengths), lengths[0])] if len(set(lengths)) == 1 else \
            [(b, b + 1, n) for b, n in enumerate(lengths)]
        if index is None:
            return torch.cat([F.pad(self.attend(*(t[start:stop, :, :seq_len + n] for t in (q, k, v)), None),
                                    (0, 0, 0, text_len - n)) for start, stop, n in runs])
        video_out = torch.cat([self.attend(
            *(t[start:stop, :, :seq_len + n] for t in (q, k, v)),
            _append_always_kept(SparseIndex(index.indices[start:stop], index.counts[start:stop], index.group_size,
                                            index.kv_block, seq_len), n))[:, :, :seq_len]
            for start, stop, n in runs])
        # Text queries attend densely to every attended key (their rows in the sparse call saw text keys only).
        text_out = (F.scaled_dot_product_attention(text[0], k, v, attn_mask=key_mask, scale=self.scale)
                    if text_len else text[0])
        return torch.cat([video_out, text_out], 2)


class CogVideoXDSVProcessor(_JointVideoTextProcessor):
    """DSV processor for the joint text+video self-attention (`attn1`) of a `CogVideoXBlock`.

    Called with `hidden_states [B, S, C]` (video tokens, raster order, `S = T*H*W`),
    `encoder_hidden_states [B, L, C]` (text tokens) and optionally `image_rotary_emb = (cos, sin)`, each
    `[S, D]`; returns `(video [B, S, C], text [B, L, C])` like `CogVideoXAttnProcessor2_0`. DSV selects
    the video keys of each video query cube; text keys are always kept and text queries attend densely.
    """

    def forward(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
        if encoder_hidden_states is None:
            raise ValueError("CogVideoXDSVProcessor: encoder_hidden_states (the text tokens [B, L, C]) is required")
        if attention_mask is not None:
            raise ValueError("CogVideoXDSVProcessor: attention_mask is not supported (CogVideoX passes None)")
        grid, perm, inv = self._grid.of_call(self.layer_index, hidden_states)
        self.check_input(hidden_states, grid)
        seq_len = hidden_states.shape[1]
        hidden = hidden_states.index_select(1, perm)  # grouped order: each query cube is contiguous
        projections, norms = (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)
        q_video, k_video, v_video = self._heads(hidden, projections, norms)
        text = self._heads(encoder_hidden_states, projections, norms)
        q_video, k_video = self._rotate_video(q_video, k_video, image_rotary_emb, perm)
        out_dtype = q_video.dtype  # the stock processors return attention in q's dtype, whatever it computed in
        *text, q_video, k_video, v_video = self._in_attention_dtype(*text, q_video, k_video, v_video)
        index = self.prepare_index(hidden, q_video, k_video, grid)
        out = self._joint_attention((q_video, k_video, v_video), text, index, None, None)
        out = out.transpose(1, 2).flatten(2, 3).to(out_dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out[:, :seq_len].index_select(1, inv), out[:, seq_len:]


@torch.compiler.disable  # values read on the host: a compiled block breaks its graph here (fullgraph refuses)
def _text_key_lengths_on_host(attention_mask: torch.Tensor | None, seq_len: int, text_len: int) -> list[int] | None:
    """Each sample's number of attended text keys under HunyuanVideo's key mask `attention_mask [B, 1, 1, S + L]`
    (bool; every video key and the first `L_b` text keys True, the padding after them False; Mochi's and
    HunyuanVideo 1.5's processors build one of this form from their prompt masks), or None where every key is
    attended (no mask, or one without padding). One device synchronisation."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1) or \
            attention_mask.shape[3] != seq_len + text_len:
        raise ValueError(f"HunyuanVideoDSVProcessor: attention_mask must be a bool key mask of shape [B, 1, 1, "
                         f"{seq_len + text_len}] (as HunyuanVideoTransformer3DModel builds it), got "
                         f"{tuple(attention_mask.shape)} {attention_mask.dtype}")
    keys = attention_mask[:, 0, 0]
    lengths = keys[:, seq_len:].sum(1)
    positions = torch.arange(keys.shape[1], device=keys.device)
    valid = (keys == (positions < (seq_len + lengths).unsqueeze(1))).all()
    valid, *lengths = torch.cat([valid.view(1).long(), lengths.long()]).tolist()  # the one read
    if not valid:
        raise ValueError("HunyuanVideoDSVProcessor: attention_mask must attend every video key and, per sample, a "
                         "leading run of its text keys (the padding after them masked), as "
                         "HunyuanVideoTransformer3DModel builds it from encoder_attention_mask; DSV's sparse path "
                         "has no other masks")
    return None if min(lengths) == text_len else lengths


class _TwoStreamProcessor(_JointVideoTextProcessor):
    """The joint attention of HunyuanVideo, HunyuanVideo 1.5 and Mochi: text projected by the module's
    `add_q_proj/add_k_proj/add_v_proj` and per-head norms `norm_added_q/norm_added_k` where it has them (else like
    video), outputs through `to_out` (video) and `to_add_out` (text) where it has them, and a key mask that hides each
    sample's padded text keys."""

    # Whether a dense layer runs each sample over its own unpadded sequence without a mask (Mochi's processor does;
    # HunyuanVideo 1.5's attends no padded key either; SDPA's fast kernels take no mask; one host read of the lengths
    # per call) instead of under the key mask (HunyuanVideo's processor does).
    _dense_over_unpadded_text = False

    def _attend_streams(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        key_mask: torch.Tensor | None, image_rotary_emb,
                        text_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states [B, S, C]` (video, raster order), `encoder_hidden_states [B, L, C_text]` → `(video [B, S,
        C_out], text [B, L, C_text_out])`.

        `key_mask [B, 1, 1, S + L]` (bool, True where a key is attended: every video key and a leading run of each
        sample's text keys; None: all) is taken as it is by dense attention (unless `_dense_over_unpadded_text`);
        a sparse layer reads its text lengths on the host. `text_rows [B, L]` (bool), where given, zeroes the text
        attention outputs where it is False, before `to_add_out`."""
        grid, perm, inv = self._grid.of_call(self.layer_index, hidden_states)
        self.check_input(hidden_states, grid)
        seq_len = hidden_states.shape[1]
        text_len = encoder_hidden_states.shape[1]
        hidden = hidden_states.index_select(1, perm)  # grouped order: each query cube is contiguous
        projections, norms = (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)
        q_video, k_video, v_video = self._heads(hidden, projections, norms)
        if attn.add_q_proj is not None:  # dual-stream block: text has projections and norms of its own
            projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            norms = (attn.norm_added_q, attn.norm_added_k)
        text = self._heads(encoder_hidden_states, projections, norms)
        q_video, k_video = self._rotate_video(q_video, k_video, image_rotary_emb, perm)
        out_dtype = q_video.dtype  # the stock processors return attention in q's dtype, whatever it computed in
        *text, q_video, k_video, v_video = self._in_attention_dtype(*text, q_video, k_video, v_video)
        index = self.prepare_index(hidden, q_video, k_video, grid)
        if index is not None or self._dense_over_unpadded_text:
            lengths = _text_key_lengths_on_host(key_mask, seq_len, text_len)
            key_mask = key_mask if lengths is not None else None  # None: no padding, every key attended
        else:  # dense attention under the mask as it is
            lengths = None
        out = self._joint_attention((q_video, k_video, v_video), text, index, lengths, key_mask)
        out = out.transpose(1, 2).flatten(2, 3).to(out_dtype)
        video, text_out = out[:, :seq_len], out[:, seq_len:]
        if text_rows is not None:
            text_out = text_out.masked_fill(~text_rows.unsqueeze(-1), 0)
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return video.index_select(1, inv), text_out


class HunyuanVideoDSVProcessor(_TwoStreamProcessor):
    """DSV processor for the joint video+text attention (`attn`) of HunyuanVideo's dual-stream blocks (text
    projected by the module's `add_q_proj/add_k_proj/add_v_proj`, output through `to_out` and `to_add_out`) and
    single-stream blocks (text projected like video, no output projection).

    Called with `hidden_states [B, S, C]` (video tokens, raster order, `S = T*H*W`), `encoder_hidden_states
    [B, L, C]` (text tokens), `attention_mask [B, 1, 1, S + L]` (bool, True where a key is attended: every video
    key and each sample's unpadded text keys) and `image_rotary_emb = (cos, sin)`, each `[S, D]`; returns `(video
    [B, S, C], text [B, L, C])` like `HunyuanVideoAttnProcessor2_0`. DSV selects the video keys of each video
    query cube; each sample's unpadded text keys are always kept, its padded ones never; text queries attend
    densely under the mask. A sparse layer reads the mask's text lengths on the host (one synchronisation per
    call; a compiled block breaks its graph there, so `fullgraph=True` holds for dense layers only); where
    samples' text is padded unequally, their sparse attention runs one sample at a time.
    """

    def forward(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
        if encoder_hidden_states is None:
            raise ValueError("HunyuanVideoDSVProcessor: encoder_hidden_states (the text tokens [B, L, C]) is required")
        return self._attend_streams(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class _PromptMaskProcessor(_TwoStreamProcessor):
    """The joint attention of Mochi and HunyuanVideo 1.5, whose models pass the prompt mask `attention_mask [B, L]`
    (nonzero where a text token is valid) and whose stock processors attend each sample's valid text tokens only,
    wherever the mask puts them. The valid tokens are moved to the front (a stable sort: the identity where the
    mask is a leading run, as the models build it), which gives the shared joint attention a key mask of a leading
    run of text keys; every layer runs each sample over its own valid text, dense layers without a mask (both stock
    processors attend no padded key, and SDPA's fast kernels take no mask)."""

    _dense_over_unpadded_text = True
    # How the model passes the prompt mask, for the error that refuses another.
    _prompt_mask_origin = ""
    # Whether each text output goes back to its token's position (HunyuanVideo 1.5's processor keeps the order) or
    # stays in the sorted order, the valid tokens' outputs first (Mochi's processor writes them so).
    _text_outputs_in_place = False

    def forward(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
        name = type(self).__name__
        if encoder_hidden_states is None:
            raise ValueError(f"{name}: encoder_hidden_states (the text tokens [B, L, C_text]) is required")
        expected = tuple(encoder_hidden_states.shape[:2])
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != expected:
            found = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            raise ValueError(
                f"{name}: attention_mask must be the prompt mask of encoder_hidden_states, shape [B, L] = "
                f"{list(expected)}, nonzero where a text token is valid ({self._prompt_mask_origin}); got {found}")
        valid = attention_mask != 0  # [B, L]
        order = torch.sort((~valid).int(), dim=1, stable=True).indices  # [B, L]: the valid tokens first, in order
        text = encoder_hidden_states.gather(1, order.unsqueeze(-1).expand_as(encoder_hidden_states))
        text_len = text.shape[1]
        positions = torch.arange(text_len, device=valid.device)
        text_rows = positions < valid.sum(1, keepdim=True)  # [B, L]: True on the valid tokens, now first
        video_keys = text_rows.new_ones(text_rows.shape[0], hidden_states.shape[1])
        key_mask = torch.cat([video_keys, text_rows], 1)[:, None, None]  # [B, 1, 1, S + L]
        video, text_out = self._attend_streams(attn, hidden_states, text, key_mask, image_rotary_emb, text_rows)
        if self._text_outputs_in_place:
            unsort = torch.empty_like(order).scatter_(1, order, positions.expand_as(order))  # [B, L]
            text_out = text_out.gather(1, unsort.unsqueeze(-1).expand_as(text_out))
        return video, text_out


class MochiDSVProcessor(_PromptMaskProcessor):
    """DSV processor for the joint video+text attention (`attn1`) of a `MochiTransformerBlock`.

    Called with `hidden_states [B, S, C]` (video tokens, raster order, `S = T*H*W`), `encoder_hidden_states
    [B, L, C_text]` (text tokens, of their own width), `attention_mask [B, L]` (the prompt mask, nonzero where a
    text token is valid) and `image_rotary_emb = (cos, sin)`, each `[S, heads, D/2]` (per head, one angle per
    interleaved channel pair, applied in float32); returns `(video [B, S, C], text [B, L, C_text])` like
    `MochiAttnProcessor2_0` (text `[B, L, heads * D]` in the last block, which is `context_pre_only` and has no
    `to_add_out`). Uses the module's `to_q/to_k/to_v/to_out`, `add_q_proj/add_k_proj/add_v_proj/to_add_out` and
    its per-head RMS norms.

    As the stock processor, each sample attends to its valid text tokens only, and its text outputs are those of
    its valid tokens, in order, then zeros (before `to_add_out`) for as many as it has padded ones; a mask that
    is not a leading run of valid tokens is honoured the same way. DSV selects the video keys of each video query
    cube; each sample's valid text keys are always kept, its padded ones never; text queries attend densely. A
    sparse layer reads the prompt lengths on the host, as `HunyuanVideoDSVProcessor` does.
    """

    _prompt_mask_origin = "as MochiTransformer3DModel passes its encoder_attention_mask"

    def _rotary_table_shape(self, seq_len: int) -> tuple[int, ...]:
        return seq_len, self.heads, self.head_dim // 2

    @staticmethod
    def _apply_rotary(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = (f.transpose(0, 1) for f in freqs)  # [H, S, D/2], against x [B, H, S, D]
        return _mochi_rotary(x, cos, sin)


class HunyuanVideo15DSVProcessor(_PromptMaskProcessor):
    """DSV processor for the joint video+text attention (`attn`) of a `HunyuanVideo15TransformerBlock` (dual-stream:
    text projected by the module's `add_q_proj/add_k_proj/add_v_proj`, per-head RMS norms, output through `to_out`
    and `to_add_out`).

    Called with `hidden_states [B, S, C]` (video tokens, raster order, `S = T*H*W`), `encoder_hidden_states
    [B, L, C]` (the image, ByT5 and prompt tokens, each sample's valid ones first as the model orders them),
    `attention_mask [B, L]` (nonzero where a text token is valid) and `image_rotary_emb = (cos, sin)`, each `[S, D]`;
    returns `(video [B, S, C], text [B, L, C])` like `HunyuanVideo15AttnProcessor2_0`.

    The stock processor masks pairs: a query attends to a key where both are valid. So every query attends to all
    video keys and its sample's valid text keys, and a padded text token's query attends to nothing: its output is
    zero before `to_add_out` (its bias after), as SDPA gives for a row with every key masked. A mask that is not a
    leading run of valid tokens is honoured the same way, each text output at its token's position. DSV selects
    the video keys of each video query cube; each sample's valid text keys are always kept, its padded ones never;
    text queries attend densely. Every layer reads the valid-token counts on the host (one synchronisation per
    call; the model's forward already has one, when it reorders the text) and runs each sample over its own valid
    text, the whole batch at once where the counts agree.
    """

    _prompt_mask_origin = ("as HunyuanVideo15Transformer3DModel passes the mask of its image, ByT5 and prompt "
                           "tokens")
    _text_outputs_in_place = True


# ----------------------------------------------------------------------------------------------------
# Installation
# ----------------------------------------------------------------------------------------------------


def _self_attention_layout(transformer: nn.Module):
    """`(named self-attention modules, processor class, expected original processor class, _LatentGrid args,
    whether rotary embeddings give q and k their positions)` for a supported transformer, or TypeError."""
    if isinstance(transformer, (WanTransformer3DModel, WanVACETransformer3DModel)):
        # Wan VACE's control blocks attend over the control tokens, which its forward pads to the video's grid.
        stacks = ("blocks", "vace_blocks") if isinstance(transformer, WanVACETransformer3DModel) else ("blocks",)
        modules = [(f"{stack}.{i}.attn1", block.attn1) for stack in stacks
                   for i, block in enumerate(getattr(transformer, stack))]
        patch = tuple(int(p) for p in transformer.config.patch_size)
        return modules, WanDSVProcessor, WanAttnProcessor, (patch, 2, "[B, C, F, H, W]"), True
    if isinstance(transformer, CogVideoXTransformer3DModel):
        blocks = transformer.transformer_blocks
        modules = [(f"transformer_blocks.{i}.attn1", block.attn1) for i, block in enumerate(blocks)]
        p = int(transformer.config.patch_size)
        patch = (int(transformer.config.patch_size_t or 1), p, p)
        rotary = bool(transformer.config.use_rotary_positional_embeddings)
        return modules, CogVideoXDSVProcessor, CogVideoXAttnProcessor2_0, (patch, 1, "[B, F, C, H, W]"), rotary
    if isinstance(transformer, HunyuanVideoTransformer3DModel):
        modules = [(f"{stack}.{i}.attn", block.attn) for stack in ("transformer_blocks", "single_transformer_blocks")
                   for i, block in enumerate(getattr(transformer, stack))]
        p = int(transformer.config.patch_size)
        patch = (int(transformer.config.patch_size_t), p, p)
        return modules, HunyuanVideoDSVProcessor, HunyuanVideoAttnProcessor2_0, (patch, 2, "[B, C, F, H, W]"), True
    if isinstance(transformer, HunyuanVideo15Transformer3DModel):
        blocks = transformer.transformer_blocks  # dual-stream only; the text refiner's attention is not DSV's
        modules = [(f"transformer_blocks.{i}.attn", block.attn) for i, block in enumerate(blocks)]
        p = int(transformer.config.patch_size)
        patch = (int(transformer.config.patch_size_t), p, p)
        return (modules, HunyuanVideo15DSVProcessor, HunyuanVideo15AttnProcessor2_0, (patch, 2, "[B, C, F, H, W]"),
                True)
    if isinstance(transformer, MochiTransformer3DModel):
        blocks = transformer.transformer_blocks
        modules = [(f"transformer_blocks.{i}.attn1", block.attn1) for i, block in enumerate(blocks)]
        p = int(transformer.config.patch_size)  # spatial only: every latent frame is a frame of tokens
        return modules, MochiDSVProcessor, MochiAttnProcessor2_0, ((1, p, p), 2, "[B, C, F, H, W]"), True
    if isinstance(transformer, CosmosTransformer3DModel):
        blocks = transformer.transformer_blocks  # attn2, text (or text and image) cross-attention, is not DSV's
        modules = [(f"transformer_blocks.{i}.attn1", block.attn1) for i, block in enumerate(blocks)]
        # Its patch embedding flattens the (T, H, W) patches in raster order; the condition- and padding-mask
        # channels that its forward concatenates to hidden_states add channels, not tokens.
        patch = tuple(int(p) for p in transformer.config.patch_size)
        return modules, CosmosDSVProcessor, CosmosAttnProcessor2_0, (patch, 2, "[B, C, F, H, W]"), True
    if isinstance(transformer, LTXVideoTransformer3DModel):
        blocks = transformer.transformer_blocks
        modules = [(f"transformer_blocks.{i}.attn1", block.attn1) for i, block in enumerate(blocks)]
        # Packed tokens: the forward's num_frames, height and width give the grid (the patch is not applied).
        patch = (int(transformer.config.patch_size_t), int(transformer.config.patch_size),
                 int(transformer.config.patch_size))
        return modules, LTXVideoDSVProcessor, LTXVideoAttnProcessor, (patch, None, "[B, S, C]"), True
    raise TypeError(
        "install_dsv supports diffusers WanTransformer3DModel, WanVACETransformer3DModel, "
        "CogVideoXTransformer3DModel, CosmosTransformer3DModel, HunyuanVideoTransformer3DModel, "
        "HunyuanVideo15Transformer3DModel, LTXVideoTransformer3DModel and MochiTransformer3DModel, got "
        f"{type(transformer).__name__}"
    )


def _check_cfg(cfg, caller: str) -> None:
    if not isinstance(cfg, AttentionConfig):
        raise TypeError(f"{caller}: cfg must be a dsv.AttentionConfig, got {type(cfg).__name__}")


def install_dsv(transformer: nn.Module, cfg: AttentionConfig) -> DSVController:
    """Install DSV on every self-attention layer of a diffusers video transformer.

    Args:
        transformer: a `WanTransformer3DModel` (its `attn1` modules), `WanVACETransformer3DModel` (the `attn1` of
            its blocks and of its control blocks, over the control tokens on the video's grid),
            `CogVideoXTransformer3DModel` (its joint
            `attn1` modules; text tokens are always attended, see the module docstring) or
            `CosmosTransformer3DModel` (the `attn1` of its blocks, with per-head q/k norms; its `attn2`, text or
            text and image cross-attention, is left as it is, whichever processor it has) or
            `HunyuanVideoTransformer3DModel` (the joint `attn` of its dual- and single-stream blocks; unpadded text
            tokens always attended, padded ones never; its text refiner is left as it is) or
            `HunyuanVideo15Transformer3DModel` (the joint `attn` of its dual-stream blocks; valid image, ByT5 and
            prompt tokens always attended, padded ones never, text outputs as its processor gives them; its text
            refiner is left as it is) or
            `LTXVideoTransformer3DModel` (its `attn1` modules; the forward must give `num_frames`, `height` and
            `width`) or `MochiTransformer3DModel` (the joint `attn1` of its blocks; valid prompt tokens always
            attended, padded ones never, text outputs as its processor gives them), with the default processors.
            Cross-attention (Wan's, Cosmos's and LTX's `attn2`) is left as it is.
        cfg: the DSV attention config; a `cfg.cube` that does not tile an input's token grid gives partial cubes
            at its edges (window mode needs whole cubes and says so). `cfg.predictor_rotary=None` (the default)
            gives the predictors 6 rotary dims where the model's rotary embeddings position q and k (Wan, Cosmos,
            HunyuanVideo, HunyuanVideo 1.5, LTX-Video, Mochi; CogVideoX with `use_rotary_positional_embeddings`),
            none otherwise.

    Returns:
        The controller, also registered as `transformer.dsv_controller` (its stage buffers are in the
        state_dict). Drive it like any DSV model: `begin_step(step)` before the forward, `end_step()`
        after the optimizer step; optimise `dsv.model_parameters(transformer)` (predictors step themselves).

    The processors are created in float32 on each attention module's device; each predictor casts its
    input to its own dtype. diffusers calls that switch processors afterwards (`set_attn_processor`,
    `fuse_qkv_projections`, ...) would drop the DSV layers that the controller drives: the next forward
    raises.
    """
    _check_cfg(cfg, "install_dsv")
    modules, processor_cls, original_cls, grid_args, rotary_embeddings = _self_attention_layout(transformer)
    cfg = cfg.with_rotary_default(rotary_embeddings)
    if hasattr(transformer, CONTROLLER_NAME):
        raise ValueError(f"install_dsv: {type(transformer).__name__} already has DSV installed ({CONTROLLER_NAME})")
    for name, attn in modules:
        if type(attn.processor) is not original_cls:
            raise ValueError(
                f"install_dsv: {name} runs {type(attn.processor).__name__}, expected diffusers' "
                f"{original_cls.__name__}; DSV replaces the default processor only (for fused projections, "
                "call unfuse_qkv_projections() first)"
            )
    grid = _LatentGrid(*grid_args, cube=tuple(cfg.cube))
    # Every processor built before any is set: one that refuses its module leaves the model as it was.
    processors = [processor_cls(attn, cfg, grid).to(attn.to_q.weight.device) for _, attn in modules]
    for (name, attn), processor in zip(modules, processors):
        if hasattr(attn, "set_processor"):
            attn.set_processor(processor)
        else:  # MochiAttention: diffusers' set_processor of an nn.Module processor is this assignment
            attn.processor = processor
        grid.installed.append((name, attn, processor))
    controller = DSVController(cfg)
    # What the saved DSV state is measured with, so that `from_pretrained_local` can refuse another layout
    # (sparsity EMAs and budgets of one cube or θ mean something else under another).
    controller.register_buffer(LAYOUT_BUFFER, layout_record(cfg))
    # On the transformer's device, as the processors: its stage buffers are read with the layers' state.
    controller.to(modules[0][1].to_q.weight.device)
    controller.register_load_state_dict_pre_hook(check_layout_on_load)  # also for a state loaded by hand
    transformer.add_module(CONTROLLER_NAME, controller)
    controller.attach(transformer)
    # diffusers' layerwise casting (`enable_layerwise_casting`) would store the predictors in its storage dtype
    # (fp8), rounding their trained weights, and hand the selection weights of another dtype than its input.
    skip = list(getattr(transformer, "_skip_layerwise_casting_patterns", None) or [])
    transformer._skip_layerwise_casting_patterns = [*skip, r"\.processor\."]
    grid.controller = controller
    transformer.register_forward_pre_hook(grid, with_kwargs=True)
    transformer.register_forward_hook(grid.forward_done, with_kwargs=True)
    return controller


# ----------------------------------------------------------------------------------------------------
# Loading a local from_pretrained folder
# ----------------------------------------------------------------------------------------------------

_SUPPORTED = {cls.__name__: cls for cls in (WanTransformer3DModel, WanVACETransformer3DModel,
                                            CogVideoXTransformer3DModel, CosmosTransformer3DModel,
                                            HunyuanVideoTransformer3DModel, HunyuanVideo15Transformer3DModel,
                                            LTXVideoTransformer3DModel, MochiTransformer3DModel)}
# state_dict keys that install_dsv adds: the self-attention processors (Wan, CogVideoX, Cosmos, LTX-Video, Mochi:
# `attn1`; HunyuanVideo's and HunyuanVideo 1.5's joint blocks: `attn`) and the controller.
_DSV_KEY_PATTERNS = (r"(^|\.)attn1?\.processor\.", rf"^{CONTROLLER_NAME}\.")


@contextlib.contextmanager
def _dsv_keys_expected(cls: type):
    """Within the block, diffusers' loader does not warn that DSV keys in a checkpoint are unused: they are
    restored by `from_pretrained_local` right after, and checked there."""
    name, unset = "_keys_to_ignore_on_load_unexpected", object()
    own = cls.__dict__.get(name, unset)
    setattr(cls, name, list(getattr(cls, name) or []) + list(_DSV_KEY_PATTERNS))
    try:
        yield
    finally:
        if own is unset:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


def _with_variant(name: str, variant: str | None) -> str:
    """diffusers' weight-file naming: the variant goes before the last suffix."""
    if variant is None:
        return name
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{variant}.{suffix}"


def _tensors_not_in(folder: Path, variant: str | None, known: set[str]) -> dict[str, torch.Tensor]:
    """Tensors of the folder's weight files (safetensors first, as diffusers) whose keys are not in `known`."""
    formats = ((SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME), (WEIGHTS_INDEX_NAME, WEIGHTS_NAME))
    for index_name, single_name in formats:
        index_file, single = folder / _with_variant(index_name, variant), folder / _with_variant(single_name, variant)
        if index_file.is_file():
            files = sorted({folder / f for f in json.loads(index_file.read_text())["weight_map"].values()})
        elif single.is_file():
            files = [single]
        else:
            continue
        found = {}
        for file in files:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    found.update({key: f.get_tensor(key) for key in f.keys() if key not in known})
            else:
                state = torch.load(file, map_location="cpu", weights_only=True)
                found.update({key: value for key, value in state.items() if key not in known})
        return found
    raise FileNotFoundError(f"no diffusers weight file (variant={variant!r}) in {folder}")


def from_pretrained_local(
    path: str | Path,
    cfg: AttentionConfig,
    *,
    subfolder: str | None = None,
    variant: str | None = None,
    torch_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Load a local `save_pretrained` folder of a Wan (or Wan VACE), CogVideoX, Cosmos, HunyuanVideo, HunyuanVideo
    1.5, LTX-Video or Mochi transformer and install DSV on it.

    Nothing is downloaded (`local_files_only=True`). A plain pretrained folder gets fresh DSV state
    (stage 1, untrained predictors). A folder saved from a model with DSV installed also holds the DSV
    state (predictors, EMAs, dispatch, stage); it is restored and must match `cfg`: the same mode, rank and
    predictor_rotary, and the cube, key block and θ it was measured with (a ValueError names what differs).

    Args:
        path: the folder (holding `config.json` and the weights), or a pipeline folder with `subfolder`.
        cfg: DSV attention config.
        subfolder, variant, torch_dtype: as in diffusers' `from_pretrained`.

    Returns:
        The transformer, with its controller at `.dsv_controller`.
    """
    _check_cfg(cfg, "from_pretrained_local")  # before the weights load (minutes for a large model)
    folder = Path(path) / subfolder if subfolder else Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"from_pretrained_local: {folder} has no config.json; pass a folder written by save_pretrained "
            "(for a pipeline folder add subfolder='transformer')"
        )
    class_name = json.loads(config_file.read_text()).get("_class_name")
    if class_name not in _SUPPORTED:
        raise ValueError(f"from_pretrained_local: {folder} holds a {class_name}; supported: {sorted(_SUPPORTED)}")
    cls = _SUPPORTED[class_name]
    with _dsv_keys_expected(cls):
        transformer = cls.from_pretrained(path, subfolder=subfolder, variant=variant, torch_dtype=torch_dtype,
                                          local_files_only=True)
    base_keys = set(transformer.state_dict())
    install_dsv(transformer, cfg)
    dsv_keys = set(transformer.state_dict()) - base_keys
    # Only DSV's keys: others the model does not know are diffusers' to ignore or warn about (an older Wan I2V
    # checkpoint's `norm_added_q`, which the class lists in `_keys_to_ignore_on_load_unexpected`).
    saved = {key: value for key, value in _tensors_not_in(folder, variant, base_keys).items()
             if any(re.search(pattern, key) for pattern in _DSV_KEY_PATTERNS)}
    if saved:
        check_layout(saved, f"{CONTROLLER_NAME}.{LAYOUT_BUFFER}", layout_record(cfg),
                     f"from_pretrained_local: the DSV state in {folder}", "cfg")
        installed = transformer.state_dict()
        reshaped = {key for key in dsv_keys & set(saved) if saved[key].shape != installed[key].shape}
        if set(saved) != dsv_keys or reshaped:
            def first(keys: set[str]) -> str:
                keys = sorted(keys)
                return f"{keys[:4]}{' ...' if len(keys) > 4 else ''}"

            offsets = [value for key, value in saved.items() if key.endswith("predictor.q_rotary_offset")]
            saved_rotary = f"predictor_rotary={offsets[0].shape[-1] if offsets else 0}" if any(
                key.endswith("predictor.q_proj.weight") for key in saved) else "no predictors"
            raise ValueError(
                f"from_pretrained_local: the DSV state in {folder} ({saved_rotary}) does not match cfg "
                f"(mode={cfg.mode!r}, rank={cfg.rank}, "
                f"predictor_rotary={getattr(transformer, CONTROLLER_NAME).cfg.predictor_rotary}); load it with the "
                f"config it was saved with. Missing: {first(dsv_keys - set(saved))}; unexpected: "
                f"{first(set(saved) - dsv_keys)}; of another shape: {first(reshaped)}"
            )
        transformer.load_state_dict(saved, strict=False)
    return transformer


# ----------------------------------------------------------------------------------------------------
# A small Wan for DSV's trainer
# ----------------------------------------------------------------------------------------------------


class WanVideoModel(nn.Module):
    """A Wan transformer with DSV, in the interface of `dsv.VideoDiT`:
    `forward(x [B, C, T, H, W], t [B] in [0, 1], y=None) -> velocity [B, C, T, H, W]`.

    There is no text: cross-attention reads a learned null text embedding `[1, text_tokens, text_dim]`.
    """

    def __init__(self, transformer: WanTransformer3DModel, cfg: AttentionConfig, text_tokens: int):
        super().__init__()
        self.transformer = transformer
        install_dsv(transformer, cfg)
        text_dim = transformer.config.text_dim
        self.null_text = nn.Parameter(torch.randn(1, text_tokens, text_dim) * text_dim**-0.5)
        ddp_ignore_predictors(self)  # DDP may wrap this module, above the transformer that install_dsv set it on

    @property
    def controller(self) -> DSVController:
        # A property, not an attribute: the controller is registered once, under the transformer.
        return getattr(self.transformer, CONTROLLER_NAME)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        channels = self.transformer.config.in_channels
        if x.dim() != 5 or x.shape[1] != channels:
            raise ValueError(f"x must be [B, {channels}, T, H, W], got {tuple(x.shape)}")
        if t.shape != (x.shape[0],):
            raise ValueError(f"t must be [B]={x.shape[0]} timesteps in [0, 1], got {tuple(t.shape)}")
        if y is not None:
            raise ValueError("WanVideoModel has no class conditioning: y must be None")
        # Under FSDP mixed precision the weights arrive in bf16 and the inputs are not cast for us (shard_model
        # leaves the root's inputs alone so that `t` stays fp32), so cast the video, and with it the null text,
        # to the patch embedding's dtype, as VideoDiT does. `t` stays fp32: Wan's sinusoidal embedding is taken
        # in fp32 and only then cast to the time embedder's dtype.
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.transformer.patch_embedding.weight.dtype)
        text = self.null_text.expand(x.shape[0], -1, -1).to(x.dtype)
        # Wan's sinusoidal timestep embedding is scaled for its schedulers' timesteps in [0, 1000].
        return self.transformer(x, t * 1000.0, text, return_dict=False)[0]


def build_wan_for_training(
    cfg: AttentionConfig,
    *,
    in_channels: int = 3,
    patch: tuple[int, int, int] = (1, 2, 2),
    num_layers: int = 4,
    num_heads: int = 4,
    head_dim: int = 32,
    ffn_dim: int = 512,
    text_dim: int = 64,
    text_tokens: int = 4,
    rope_max_seq_len: int = 256,
) -> WanVideoModel:
    """A small, randomly initialised Wan transformer with DSV installed, for `dsv.train.data` clips.

    Defaults: 4 layers, 4 heads × 32 (hidden 128), RGB input, patch (1, 2, 2). `rope_max_seq_len` bounds the
    token grid's largest extent. Nothing is downloaded.
    """
    transformer = WanTransformer3DModel(
        patch_size=tuple(patch), num_attention_heads=num_heads, attention_head_dim=head_dim,
        in_channels=in_channels, out_channels=in_channels, text_dim=text_dim, freq_dim=256, ffn_dim=ffn_dim,
        num_layers=num_layers, rope_max_seq_len=rope_max_seq_len,
    )
    return WanVideoModel(transformer, cfg, text_tokens)
