"""Low-rank sparsity predictor: learns Q_lr·K_lrᵀ ≈ QKᵀ·scale for one attention layer.

The predictor is detached from the model graph: its loss is computed and its own optimizer steps inside
the layer's forward pass, so no S×S intermediate is kept alive for the model's backward.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv.ops.grouping import outside_inference_mode


def predictor_loss(
    pred_scores: torch.Tensor, true_scores: torch.Tensor, cosine_weight: float, mse_weight: float
) -> torch.Tensor:
    """Weighted row-cosine + MSE of row-standardised scores, both `[..., R, S]`.

    The cosine term matches the rows' direction; the MSE term compares rows after removing each row's
    mean and scale, because softmax ignores a per-row shift and only the ranking decides the selection.
    """
    cosine = F.cosine_similarity(pred_scores, true_scores, dim=-1, eps=1e-6)

    def standardise(rows: torch.Tensor) -> torch.Tensor:
        centred = rows - rows.mean(dim=-1, keepdim=True)
        return centred / centred.pow(2).mean(dim=-1, keepdim=True).add(1e-6).sqrt()

    mse = (standardise(pred_scores) - standardise(true_scores)).pow(2).mean(dim=-1)
    return cosine_weight * (1.0 - cosine).mean() + mse_weight * mse.mean()


def predictor_loss_from_factors(
    q_lr: torch.Tensor,
    k_lr: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    cosine_weight: float,
    mse_weight: float,
) -> torch.Tensor:
    """`predictor_loss(q_lr @ k_lrᵀ, q @ kᵀ · scale)` without forming the `[..., R, S]` score rows.

    Both losses depend on each row only through five moments over the keys — the sums of p, t, p², t²
    and p·t (p the predicted, t the true scores) — and each moment is a quadratic form of the row's query
    with a key Gram matrix: with centred keys `K_c`, `var(p) = q_lrᵀ (K_lr,cᵀ K_lr,c) q_lr / S`,
    `var(t) = qᵀ (K_cᵀ K_c) q · scale² / S`, `cov(p, t) = q_lrᵀ (K_lr,cᵀ K_c) q · scale / S`. The Grams cost
    O(S·D²) per head instead of the O(R·S) score rows and the ~15 elementwise passes over them that
    `predictor_loss` makes forward and backward (memory-bound: GBs per layer at S = 32k). Centring the keys
    first keeps the variances free of cancellation.

    Args:
        q_lr: `[..., R, r]` low-rank queries of the sampled rows; k_lr: `[..., S, r]` low-rank keys
            (gradients flow to both).
        q: `[..., R, D]` the sampled rows' queries; k: `[..., S, D]` keys (targets; no gradient).
        scale: the attention's softmax scale.

    Returns:
        The 0-d loss, equal to `predictor_loss` on the explicit scores up to rounding.
    """
    seq_len = k_lr.shape[-2]
    k_lr_mean = k_lr.mean(dim=-2, keepdim=True)
    k_lr_c = k_lr - k_lr_mean
    with torch.no_grad():
        k = k.to(k_lr.dtype)
        k_mean = k.mean(dim=-2, keepdim=True)
        k_c = k - k_mean
        true_gram = k_c.transpose(-1, -2) @ k_c  # [..., D, D]
        q = q.to(k_lr.dtype) * scale
        mean_t = (q * k_mean).sum(-1)  # [..., R]
        var_t = ((q @ true_gram) * q).sum(-1) / seq_len
    mean_p = (q_lr * k_lr_mean).sum(-1)
    var_p = ((q_lr @ (k_lr_c.transpose(-1, -2) @ k_lr_c)) * q_lr).sum(-1) / seq_len
    cov = ((q_lr @ (k_lr_c.transpose(-1, -2) @ k_c)) * q).sum(-1) / seq_len
    # Cosine of the raw rows: Σ p·t = S (mean_p mean_t + cov), ‖p‖² = S (mean_p² + var_p); the same
    # per-norm eps clamp as torch's cosine_similarity (1e-6), applied to the squares before the root: the
    # same values, but a zero row (an all-zero hidden state) gets a zero gradient, not sqrt's 0/0 = NaN.
    norm_p = (seq_len * (mean_p.square() + var_p)).clamp_min(1e-12).sqrt()
    norm_t = (seq_len * (mean_t.square() + var_t)).clamp_min(1e-12).sqrt()
    cosine = seq_len * (mean_p * mean_t + cov) / (norm_p * norm_t)
    # MSE of the rows standardised as in `predictor_loss` (centred / sqrt(var + 1e-6)).
    var_p_eps, var_t_eps = var_p + 1e-6, var_t + 1e-6
    mse = var_p / var_p_eps + var_t / var_t_eps - 2 * cov / (var_p_eps * var_t_eps).sqrt()
    return cosine_weight * (1.0 - cosine).mean() + mse_weight * mse.mean()


def _keep_fused(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict`: the fused AdamW step again, with its step counts as float32 tensors beside their
    parameters. A state saved by a foreach AdamW (earlier versions) carries `fused=None` in its groups, which
    loading restores, and host step counts, which the fused kernel refuses."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def rotary_frequencies(pairs_per_axis: int, cube: tuple[int, int, int]) -> torch.Tensor:
    """Angular frequencies (radians per token), float32 `[3, pairs_per_axis]`, of a predictor's rotary dims
    along t, h, w: wavelengths of 4, 8, 16, ... cube extents. The selection is shared by a cube and made over
    cube-sized key blocks, so structure finer than a cube cannot change it; and over a cube the phase of the
    fastest pair turns by less than a quarter turn, so a cube's mean row keeps most of its rows' position term."""
    # On the host whatever the default device (a model built on the meta device keeps them as its master copy).
    octaves = 2.0 ** torch.arange(pairs_per_axis, dtype=torch.float32, device="cpu")
    extents = torch.tensor(cube, dtype=torch.float32, device="cpu")
    return 2 * math.pi / (4 * extents[:, None] * octaves[None, :])


def position_phasors(positions: torch.Tensor, frequencies: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)`, each `[S, m]` (`m = frequencies.numel()`, pairs ordered t, h, w), of the angles
    `position[axis] * frequency` for `positions [S, 3]`; computed in float64 for float64, else float32."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    angles = (positions.to(compute)[:, :, None] * frequencies.to(positions.device, compute)).flatten(1)
    return angles.cos(), angles.sin()


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Multiply the last `2m` dims of `x [..., N, r]` as `m` complex numbers (dims `i` and `i + m`, the half-split
    convention) by `cos + i sin`, each `[N, m]`: a rotation where `(cos, sin)` is a unit phasor, and the mean of
    rotations where it is the mean of unit phasors."""
    m = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    plain, first, second = x[..., :-2 * m], x[..., -2 * m:-m], x[..., -m:]
    return torch.cat((plain, first * cos - second * sin, first * sin + second * cos), dim=-1)


class LowRankPredictor(nn.Module):
    """Two low-rank projections per layer: hidden `[B, S, C]` → `q_lr, k_lr` of `[B, H, S, rank]`.

    With `rotary_frequencies` (`[3, n]`, see `rotary_frequencies`) the last `6n` of each head's `rank` dims also
    carry the token's `(t, h, w)` position: a learned per-head offset is added to them and they are rotated by
    the position (`turn` by `position_phasors`), so the predicted scores can depend on the distance between query and
    key, as the scores of a model with rotary embeddings do (Wan; CogVideoX with rotary position embeddings),
    whose hidden states carry no position. The methods then take the rows' `positions`."""

    def __init__(
        self,
        dim: int,
        heads: int,
        rank: int = 16,
        lr: float = 1e-3,
        cosine_weight: float = 0.9,
        mse_weight: float = 0.1,
        rotary_frequencies: torch.Tensor | None = None,
    ):
        super().__init__()
        if rank < 1:
            raise ValueError(f"predictor rank must be >= 1, got {rank}")
        rotary_dims = 0 if rotary_frequencies is None else 2 * rotary_frequencies.numel()
        if rotary_frequencies is not None and (rotary_frequencies.dim() != 2 or rotary_frequencies.shape[0] != 3
                                               or rotary_dims > rank):
            raise ValueError(f"rotary_frequencies must be [3, n] with 6n <= rank={rank}, got "
                             f"{list(rotary_frequencies.shape)}")
        self.heads, self.rank = heads, rank
        self.cosine_weight, self.mse_weight = cosine_weight, mse_weight
        self.q_proj = nn.Linear(dim, heads * rank, bias=False)
        self.k_proj = nn.Linear(dim, heads * rank, bias=False)
        self.rotary_dims = rotary_dims
        if rotary_dims:
            self.q_rotary_offset = nn.Parameter(torch.empty(heads, rotary_dims))
            self.k_rotary_offset = nn.Parameter(torch.empty(heads, rotary_dims))
            self._initialise_rotary_offsets()
            # Constants of the config, not state: a float32 master on the host that every `.to()` copies to the
            # device (`_apply`), so a cast of the model to bf16 cannot round the angles.
            self._rotary_master = rotary_frequencies.detach().to("cpu", torch.float32).clone()
            # The buffer on the default device, as the weights (a model built under `with torch.device("cuda")`
            # is never moved): on the host it would cost a synchronising copy at every use.
            self.register_buffer("rotary_frequencies", self._rotary_master.to(torch.empty(0).device, copy=True),
                                 persistent=False)
        # The optimizer lives with the predictor: it is not part of the model's optimizer, and the trainer saves
        # its state apart (`predictor_optimizers` in a checkpoint's training state).
        # Fused (torch's fused AdamW devices: CPU, CUDA, MPS, XPU): two host calls a step instead of ~16 foreach
        # ones. The update runs once per layer and step on the host's critical path under compiled blocks (a
        # runtime op), where each host call costs GPU idle time.
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0, fused=True)
        # Parking (`park`): the device the state was parked from, pinned host buffers by slot, and a
        # prefetch in flight. Whatever reads or writes the state from outside first brings it back.
        self._parked_from: torch.device | None = None
        self._host_buffers: list[torch.Tensor] = []
        self._incoming: tuple[list[torch.Tensor], list[torch.Tensor], torch.cuda.Event, torch.cuda.Stream] | None = None
        # The stream the last prefetch allocated on, and the storages it made: parking hands those back through
        # `release_parked` instead of `record_stream`. A state tensor made since (AdamW's moments on their first
        # step, a loaded state) is of no known stream and goes under `record_stream`.
        self._allocated_on: torch.cuda.Stream | None = None
        self._prefetched: set[int] = set()
        self.register_state_dict_pre_hook(self._unpark_hook)
        self.register_load_state_dict_pre_hook(self._unpark_hook)
        self.register_load_state_dict_post_hook(self._follow_assigned_tensors)
        self._hook_optimizer()

    def _hook_optimizer(self) -> None:
        self.optimizer.register_state_dict_pre_hook(self._unpark_hook)
        self.optimizer.register_load_state_dict_pre_hook(self._unpark_hook)
        self.optimizer.register_load_state_dict_post_hook(_keep_fused)

    # ----- parking: the state in pinned host memory between uses -----
    def _state_tensors(self) -> list[torch.Tensor]:
        """Weights and AdamW moments (not the step counts: 0-d tensors of 4 bytes), in a fixed order."""
        params = list(self.parameters())
        moments = [value for p in params for value in self.optimizer.state.get(p, {}).values()
                   if isinstance(value, torch.Tensor) and value.dim() > 0]
        return params + moments

    @property
    def parked(self) -> bool:
        return self._parked_from is not None

    def park(self) -> None:
        """Move the weights and AdamW moments to pinned host memory until their next use, which brings them
        back (`unpark`): between a training step's update and the next step's selection a layer needs none of
        it, and at the backward's memory peak it would sit on the GPU in every layer. Asynchronous: the
        copies run on a side stream after the work queued so far. CUDA only (elsewhere a no-op).

        While parked, `parameters()` and the optimizer's moments are host tensors that a copy may still be
        writing: read them through `state_dict()` (or after `unpark()`), not directly."""
        tensors = self._state_tensors()
        device = tensors[0].device
        if self._parked_from is not None:
            self._drop_incoming()  # a prefetch nobody used
            return
        if device.type != "cuda":
            return
        release_parked(device)  # earlier parks' memory: their copies are long queued
        stream = _copy_stream(device)
        # No autograd record and no inference tensors: the buffers outlive this call (a forward may run
        # under grad or under torch.inference_mode).
        with torch.no_grad(), outside_inference_mode():
            stream.wait_stream(torch.cuda.current_stream(device))  # after the update that wrote them
            while len(self._host_buffers) < len(tensors):
                self._host_buffers.append(torch.empty(0))
            with torch.cuda.stream(stream):
                for slot, tensor in enumerate(tensors):
                    host = self._host_buffers[slot]
                    if host.shape != tensor.shape or host.dtype != tensor.dtype:
                        host = self._host_buffers[slot] = torch.empty(tensor.shape, dtype=tensor.dtype,
                                                                      pin_memory=True)
                    host.copy_(tensor, non_blocking=True)
            on_device = [tensor.data for tensor in tensors]
            known = [data for data in on_device if data.data_ptr() in self._prefetched]
            for data in on_device:
                if data.data_ptr() not in self._prefetched:
                    # Not from a prefetch, so of a stream not known here: the allocator keeps the block until it
                    # sees the copy that reads it finish.
                    data.record_stream(stream)
            if known:
                _hold_until(device, self._allocated_on, stream.record_event(), known)
            for tensor, host in zip(tensors, self._host_buffers):
                tensor.data = host
        self._parked_from, self._prefetched = device, set()

    def prefetch(self) -> None:
        """Start bringing parked state back to the device on the side stream (a no-op unless parked), so that
        the next use (`unpark`) finds it there: a layer prefetches the next layer's predictor."""
        if self._parked_from is None or self._incoming is not None:
            return
        device = self._parked_from
        tensors = self._state_tensors()
        stream = _copy_stream(device)
        allocated_on = torch.cuda.current_stream(device)
        with torch.no_grad(), outside_inference_mode():
            copies = [torch.empty_like(tensor, device=device) for tensor in tensors]
            # The new blocks may have been freed by work still queued on the current stream.
            stream.wait_stream(allocated_on)
            with torch.cuda.stream(stream):
                for copy, tensor in zip(copies, tensors):
                    copy.copy_(tensor, non_blocking=True)
        ready = stream.record_event()
        # Whatever becomes of the copies (used, dropped, or their predictor deleted), their memory returns
        # to the allocator only after the current stream has waited for the copies into it.
        _hold_until(device, allocated_on, ready, copies)
        self._incoming = (tensors, copies, ready, allocated_on)

    def _drop_incoming(self) -> None:
        if self._incoming is not None:
            _, _, ready, allocated_on = self._incoming
            allocated_on.wait_event(ready)  # their blocks may be reused on that stream from now on
            self._incoming = None

    def unpark(self) -> None:
        """Bring parked state back to the device (a no-op unless parked); later work on the current stream
        waits for the copies, the host does not."""
        if self._parked_from is None:
            return
        self.prefetch()
        tensors, copies, ready, allocated_on = self._incoming
        current = torch.cuda.current_stream(self._parked_from)
        current.wait_event(ready)
        with torch.no_grad(), outside_inference_mode():
            for tensor, copy in zip(tensors, copies):
                if current != allocated_on:
                    copy.record_stream(current)  # used on another stream than its memory's
                tensor.data = copy
        self._allocated_on, self._prefetched = allocated_on, {copy.data_ptr() for copy in copies}
        self._incoming, self._parked_from = None, None

    def __getstate__(self) -> dict:
        # A copy or pickle reads the state where it belongs, with no copy in flight; the host buffers are
        # scratch space of this object.
        self.unpark()
        state = super().__getstate__()
        state["_host_buffers"] = []
        state["_allocated_on"], state["_prefetched"] = None, set()  # a copy's tensors are its own
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._hook_optimizer()  # an optimizer's copy (or unpickling) starts without hooks

    def _initialise_rotary_offsets(self) -> None:
        # The offsets let a head's rotary dims be nonzero whatever the content: a score term that depends on
        # the distance alone (locality). Drawn like a Linear's bias: zero offsets would give each other zero
        # gradient.
        bound = self.q_proj.in_features**-0.5
        with torch.no_grad():
            self.q_rotary_offset.uniform_(-bound, bound)
            self.k_rotary_offset.uniform_(-bound, bound)

    def _initialise_weights(self) -> None:
        self.q_proj.reset_parameters()
        self.k_proj.reset_parameters()
        if self.rotary_dims:
            self._initialise_rotary_offsets()

    def _follow_assigned_tensors(self, *_args) -> None:
        """After `load_state_dict(assign=True)` (how a model built on the meta device gets its weights): the
        optimizer steps the loaded Parameters (`_optimizer_follows_parameters`), and a rotary buffer built on
        the meta device takes the host master's values on the weights' device."""
        self._optimizer_follows_parameters()
        if self.rotary_dims and self._buffers["rotary_frequencies"].is_meta:
            self._buffers["rotary_frequencies"] = self._rotary_master.to(self.q_proj.weight.device, copy=True)

    def _optimizer_follows_parameters(self) -> None:
        """Point the optimizer at the module's Parameter objects, with their state. `load_state_dict(
        assign=True)` and `to_empty` off the meta device (meta-device init) put new Parameters in place of the
        ones the optimizer was built with: it would step those, which get no gradient, and the predictor would
        silently stop learning."""
        (group,) = self.optimizer.param_groups  # built from `self.parameters()`, whose order never changes
        for i, (old, new) in enumerate(zip(group["params"], self.parameters(), strict=True)):
            if new is not old:
                group["params"][i] = new
                if old in self.optimizer.state:
                    self.optimizer.state[new] = self.optimizer.state.pop(old)

    def _unpark_hook(self, *_args) -> None:
        # state_dict / load_state_dict of the module or its optimizer: they read or write the tensors directly.
        self.unpark()

    def _apply(self, fn, recurse=True):
        self.unpark()  # `.to()`, `.cuda()`, `.float()` act on the state where it belongs
        self._allocated_on, self._prefetched = None, set()  # the tensors they make: whichever stream is current
        from_meta = any(p.is_meta for p in self.parameters())
        moved = super()._apply(fn, recurse)
        self._optimizer_follows_parameters()  # `to_empty` off the meta device makes new Parameters
        if from_meta and not any(p.is_meta for p in self.parameters()):
            # `to_empty` leaves the weights unwritten; a state loaded next replaces them, and a run on
            # pretrained model weights that loads none starts its predictors as a fresh module would.
            self._initialise_weights()
        if self.rotary_dims:
            self._buffers["rotary_frequencies"] = self._rotary_master.to(self._buffers["rotary_frequencies"].device,
                                                                         copy=True)  # never the master itself
        # The optimizer is the predictor's own: its moments follow their parameters (a `.double()` after a step
        # left float32 moments that the fused kernel refuses), its step counts stay float32 beside them.
        for param in self.parameters():
            state = self.optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = (fn(value) if value.dim() > 0
                                  else value.to(device=param.device, dtype=torch.float32))
        release_parked()  # memory of the state it leaves behind, held since the last park or prefetch
        return moved

    def _heads(self, rows: torch.Tensor, offset: torch.Tensor | None,
               phasors: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Projected rows `[B, N, H * rank]` → `[B, H, N, rank]`; with rotary dims, those offset and turned by the
        rows' `phasors` (`(cos, sin)`, each `[N, m]`)."""
        b, n, _ = rows.shape
        rows = rows.view(b, n, self.heads, self.rank).transpose(1, 2)
        if not self.rotary_dims:
            return rows
        rows = torch.cat((rows[..., :-self.rotary_dims], rows[..., -self.rotary_dims:] + offset[:, None]), dim=-1)
        return turn(rows, *phasors)

    def _offset(self, which: str) -> torch.Tensor | None:
        return getattr(self, f"{which}_rotary_offset") if self.rotary_dims else None

    def _phasors(self, positions: torch.Tensor | None, seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tokens' unit phasors (`position_phasors`) for a predictor with rotary dims (else None), after
        checking that `positions` is `[seq_len, 3]`."""
        if not self.rotary_dims:
            return None
        if positions is None or tuple(positions.shape) != (seq_len, 3):
            raise ValueError(f"this predictor has rotary dims: positions must be the tokens' (t, h, w), a "
                             f"[{seq_len}, 3] tensor, got {None if positions is None else list(positions.shape)}")
        return position_phasors(positions, self.rotary_frequencies, self.q_proj.weight.dtype)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden [B, S, C]` → `(q_lr, k_lr)`, each `[B, H, S, rank]`; `positions [S, 3]`: the tokens' (t, h, w),
        needed with rotary dims."""
        self.unpark()
        phasors = self._phasors(positions, hidden.shape[1])
        q_lr = self._heads(self.q_proj(hidden), self._offset("q"), phasors)
        k_lr = self._heads(self.k_proj(hidden), self._offset("k"), phasors)
        return q_lr, k_lr

    def pooled_project(self, hidden: torch.Tensor, group_size: int, kv_block: int,
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimation's inputs: each query group's mean `q_lr` row and each key block's mean `k_lr` row,
        `[B, H, NG, rank]` and `[B, H, NKB, rank]` in the predictor's dtype (a partial tail averages its valid
        rows).

        The projections are linear without bias, so the mean of projected rows is the projection of the mean
        hidden state: pooling `hidden [B, S, C]` first (one read, accumulated in fp32 or fp64) replaces the
        `S x C x 2r` projection of every token by one of `NG + NKB` rows, with autocast off. Rotary dims
        (`positions [S, 3]` needed) are turned by the mean of the rows' unit phasors: exact for the offset, the
        term of position alone, in every group (edge groups of a grid the cube does not tile spanning several
        partial cubes included); for content it leaves out how content and phase vary together inside a group."""
        self.unpark()
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        phasors = self._phasors(positions, hidden.shape[1])

        def means(rows: torch.Tensor, segment: int) -> torch.Tensor:
            b, s, c = rows.shape
            full = s // segment
            parts = []
            if full:
                parts.append(rows[:, :full * segment].reshape(b, full, segment, c).sum(2, dtype=accumulate)
                             / segment)
            if s % segment:
                parts.append(rows[:, full * segment:].sum(1, keepdim=True, dtype=accumulate) / (s % segment))
            return torch.cat(parts, 1) if len(parts) > 1 else parts[0]

        def mean_phasors(segment: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            if phasors is None:
                return None
            pooled = means(torch.cat(phasors, dim=-1)[None], segment)[0]
            return pooled.chunk(2, dim=-1)

        dtype = self.q_proj.weight.dtype
        pooled_queries = means(hidden, group_size).to(dtype)
        pooled_keys = pooled_queries if kv_block == group_size else means(hidden, kv_block).to(dtype)
        query_phasors = mean_phasors(group_size)
        key_phasors = query_phasors if kv_block == group_size else mean_phasors(kv_block)
        with torch.autocast(hidden.device.type, enabled=False):
            proxies, block_keys = self.q_proj(pooled_queries), self.k_proj(pooled_keys)
            return (self._heads(proxies, self._offset("q"), query_phasors),
                    self._heads(block_keys, self._offset("k"), key_phasors))

    def loss(
        self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float,
        keys: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss on sampled query rows: `hidden [B,S,C]`, `q, k [B,H,S,D]`, `rows` LongTensor `[R]`; over
        the key positions `keys` LongTensor `[M]` only when given (see `sample_key_positions`), else all;
        `positions [S, 3]` the tokens' (t, h, w), needed with rotary dims."""
        self.unpark()
        dtype = self.q_proj.weight.dtype  # the predictor keeps its own (fp32) precision under autocast
        hidden = hidden.to(dtype)
        phasors = self._phasors(positions, hidden.shape[1])
        row_phasors = key_phasors = phasors
        if phasors is not None:
            row_phasors = tuple(part[rows] for part in phasors)
            key_phasors = phasors if keys is None else tuple(part[keys] for part in phasors)
        # Only the sampled rows need low-rank queries; only the scored keys need low-rank keys.
        q_lr = self._heads(self.q_proj(hidden[:, rows]), self._offset("q"), row_phasors)
        if keys is not None:
            hidden, k = hidden[:, keys], k[:, :, keys]
        k_lr = self._heads(self.k_proj(hidden), self._offset("k"), key_phasors)
        return self.factors_loss(q_lr, k_lr, q[:, :, rows], k, scale)

    def update(
        self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float,
        keys: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One optimizer step on detached inputs (`loss`'s arguments); returns the loss before the step (a
        0-d tensor, so no device synchronisation is forced)."""
        return self.step(lambda: self.loss(hidden.detach(), q.detach(), k.detach(), rows, scale, keys, positions),
                         hidden.device.type)

    def factors_loss(self, q_lr: torch.Tensor, k_lr: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     scale: float) -> torch.Tensor:
        """`predictor_loss_from_factors` with this predictor's weights: `q_lr [..., R, r]`, `k_lr [..., S, r]`,
        the rows' `q [..., R, D]` and `k [..., S, D]`."""
        return predictor_loss_from_factors(q_lr, k_lr, q, k, scale, self.cosine_weight, self.mse_weight)

    def step(self, compute_loss, device_type: str) -> torch.Tensor:
        """One optimizer step on the 0-d loss that `compute_loss()` builds from this predictor's
        parameters (fp32: autocast is off inside); returns the loss, detached, or NaN when the step left a
        weight non-finite (a finite loss can still have an overflowing gradient): the loss EMA then goes NaN
        in this step and `DSVController.predictor_failed` stops the run before the weights select keys."""
        self.unpark()
        if not all(p.requires_grad for p in self.parameters()):
            # Frozen with the model (`model.requires_grad_(False)` before LoRA or fine-tuning): the loss would
            # have no graph, and a predictor that never learns keeps DSV dense or selects badly.
            raise RuntimeError("a DSV predictor's parameters do not require grad (frozen with the model?): DSV's "
                               "predictors train themselves; unfreeze them with `for p in "
                               "dsv.predictor_parameters(model): p.requires_grad_(True)`, or freeze them by config "
                               "with attention.predictor_lr=0")
        if any(live is not held for live, held in zip(self.parameters(), self.optimizer.param_groups[0]["params"])):
            # Replaced outside `_apply` and `load_state_dict` (an init that assigns new `nn.Parameter`s, say).
            # (Sharded by FSDP they are other objects in each forward too: `DSVController.end_step` refuses that.)
            self._optimizer_follows_parameters()
        with torch.enable_grad(), torch.autocast(device_type, enabled=False):
            loss = compute_loss()
            loss.backward()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Predictors are replicated on every rank and must stay identical: average their gradients
            # separately from the model's.
            for p in self.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        self.optimizer.step()
        # Freed at once: kept, the gradients would sit through the rest of the step (and its peak).
        self.optimizer.zero_grad(set_to_none=True)
        # 0 · (sum of the weights) is 0 when every weight is finite and NaN otherwise (0 · ±inf is NaN): a few
        # small ops, no device sync.
        params = [p.detach() for p in self.parameters()]
        weight_sum = params[0].sum()
        for p in params[1:]:
            weight_sum = weight_sum + p.sum()
        return loss.detach() + weight_sum * 0.0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr


# Device memory that parking and prefetching leave behind, held until the stream it was allocated on has
# waited for the side stream's copy that reads or writes it (`release_parked`); dropped then, in that stream's
# order, its blocks return to the allocator at once. Freed under `record_stream` instead, each block stays
# unusable until the allocator sees its copy finish, and on the host's timeline (the host runs layers ahead
# of the GPU) that is several layers' state at any moment: +0.047 GiB over dense at the step's peak of the
# 2.7B shape at 64k tokens on one H200 (the allocator's requested-bytes peak; `max_memory_allocated` does not
# count such blocks).
_HELD: dict[torch.device, list[tuple[torch.cuda.Stream, torch.cuda.Event, list[torch.Tensor]]]] = {}
_HELD_LOCK = threading.Lock()  # the autograd thread releases during a recompute


def _hold_until(device: torch.device, stream: torch.cuda.Stream, copied: torch.cuda.Event,
                tensors: list[torch.Tensor]) -> None:
    with _HELD_LOCK:
        _HELD.setdefault(device, []).append((stream, copied, tensors))


def release_parked(device: torch.device | None = None) -> None:
    """Give the allocator back the device memory of earlier parks and prefetches on `device` (None: every
    device): each allocating stream waits for its copy on the GPU (no host synchronisation), then the blocks
    are dropped. Cheap; DSV layers call it as each forward (and recompute) starts, parking and each training
    step's start call it first."""
    with _HELD_LOCK:
        released = [_HELD.pop(device, [])] if device is not None else [_HELD.pop(d) for d in list(_HELD)]
    for held in released:
        for stream, copied, _tensors in held:
            stream.wait_event(copied)


@functools.lru_cache(maxsize=None)
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the parking copies: they then overlap the compute stream's work."""
    return torch.cuda.Stream(device)
