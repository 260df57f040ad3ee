"""Context parallelism for a whole DSV model: the sequence sharded over ranks, attention under HCP x SCP.

`ContextParallel(size, mode)` splits every sample's token sequence over `size` ranks (a CP group; the
world may hold several CP groups side by side for data parallelism). `VideoDiT.enable_context_parallel`
hands it to the model: the model puts its tokens in grouped (cube) order, keeps this rank's contiguous
chunk through every block — norms, MLPs and projections are per token — and gathers the output back.
`DSVAttention` then runs each block under the layout its plan names:

- ``(hcp, scp)`` with ``hcp * scp = size``: ranks ``[s * hcp, (s + 1) * hcp)`` form HCP group ``s``. An
  all-to-all inside it turns the rank's ``S / size`` tokens of every head into the group's ``S / scp``
  tokens of the rank's heads (placed by cost, the same in every group; `dsv.parallel.hcp`); across the
  ``scp`` groups the rank then attends with sequence-wise CP: sparse blocks fetch only the critical
  remote K/V blocks (`dsv.parallel.scp`), dense blocks gather K/V. The planner's layout convention
  (`dsv.parallel.planner`).
- mode ``hcp``: pure HCP with heads placed by LPT on their kept keys; ``naive_hcp``: equal contiguous
  head counts (Ulysses); ``scp``: pure SCP; ``hybrid``: per block the factorisation and placement that
  `hybrid_plan` predicts fastest. A block re-plans when its dispatch (dense/sparse, kept fractions)
  changes, which happens only on profiling steps; plans are cached.

What stays exact: every rank of a CP group selects the same keys as one process would (selection and
profiling run on the whole sequence of the rank's heads), and the predictor's loss is weighted so that
its rank-averaged gradient is the single-process gradient. The DSV state is identical on every rank of
a CP group (per-head measurements are summed over the HCP group, each head measured by one rank).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from dsv.modules.attention import DSVAttention, RepeatableSelection, _ema, any_rank, key_seed, mean_over_ranks
from dsv.modules.predictor import release_parked
from dsv.ops import (
    SparseIndex,
    estimate_index_from_means,
    estimate_rows_from_means,
    head_sparsity,
    index_recall,
    keep_blocks_from_sparsity,
    oracle_index,
    sample_key_positions,
    sample_query_rows,
    sparse_attention,
)
from dsv.ops.grouping import cube_permutation_on
from dsv.parallel.hcp import heads_to_sequence, select_heads, sequence_to_heads
from dsv.parallel.placement import place_heads
from dsv.parallel.planner import AttentionShape, Cluster, hybrid_plan
from dsv.parallel.scp import LocalIndex, check_sequence_split, fetched_fraction, scp_attention

CP_MODES = ("hcp", "naive_hcp", "scp", "hybrid")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One block's CP layout on this rank: ``hcp * scp`` ranks, this rank's heads and its groups."""

    hcp: int
    scp: int
    placement: tuple[tuple[int, ...], ...]  # heads of each HCP rank, the same in every SCP group
    hcp_rank: int
    scp_rank: int
    hcp_group: object
    scp_group: object

    @property
    def heads(self) -> list[int]:
        return list(self.placement[self.hcp_rank])

    def describe(self) -> str:
        return f"cp {self.hcp}x{self.scp} (hcp x scp), heads/rank {[len(p) for p in self.placement]}"


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim`; the backward hands each rank the sum of every rank's gradient of its chunk."""

    @staticmethod
    def forward(ctx, x, dim: int, group):
        world = dist.get_world_size(group)
        chunks = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(chunks, x.contiguous(), group=group)
        ctx.dim, ctx.group = dim, group
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        # Contiguous chunks, rank j's first: a reduce-scatter (as an all-to-all and a sum on gloo, which
        # has no reduce-scatter).
        stacked = torch.stack(grad.chunk(world, dim=ctx.dim))
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = stacked.new_empty(stacked.shape[1:])
            dist.reduce_scatter_tensor(out, stacked, group=ctx.group)
            return out, None, None
        received = torch.empty_like(stacked)
        dist.all_to_all_single(received, stacked, group=ctx.group)
        return received.sum(0), None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 2) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; differentiable (the gradient of a rank's
    chunk is the sum of every rank's gradient for it). Identity on one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, dim, group)


class ContextParallel:
    """The sequence of each sample split over `size` consecutive ranks, and DSV attention across them.

    Collective: every rank constructs it with the same arguments, after `init_process_group`. The world
    is `dp x size` ranks; CP group `d` holds ranks `[d * size, (d + 1) * size)`.

    Args:
        size: ranks per CP group; must divide the world size.
        mode: one of `CP_MODES`.
        device_type: "cuda" or "cpu" (the device meshes' type).
        cluster: links and speeds for the planner (mode "hybrid"); default one node of `size` GPUs at the
            H200 anchors (`default_cluster`).
        hcp_size: mode "hybrid" only: fix every block's HCP group size (a divisor of `size`, at most the
            heads) and place heads by LPT, instead of the planner's choice; 0 lets the planner choose.
    """

    def __init__(self, size: int, mode: str = "hybrid", device_type: str = "cpu", cluster: Cluster | None = None,
                 hcp_size: int = 0):
        if mode not in CP_MODES:
            raise ValueError(f"parallel.cp_mode must be one of {CP_MODES}, got {mode!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("context parallelism needs torch.distributed: launch with torchrun")
        world = dist.get_world_size()
        if not isinstance(size, int) or size < 2 or world % size:
            raise ValueError(f"parallel.cp={size} must be an int >= 2 that divides the world size {world}")
        if isinstance(hcp_size, bool) or not isinstance(hcp_size, int) or hcp_size < 0:
            raise ValueError(f"parallel.cp_hcp must be an int >= 0 (0: the planner chooses), got {hcp_size!r}")
        if hcp_size and (mode != "hybrid" or size % hcp_size):
            raise ValueError(f"parallel.cp_hcp={hcp_size} needs cp_mode 'hybrid' and must divide parallel.cp={size}")
        self.size, self.mode, self.hcp_size = size, mode, hcp_size
        # Per layer index: SCP volumes measured on profiling steps (hybrid planning), and those measured
        # during the current step, which apply from the next one (`_fetched_for`).
        self._fetched: dict[int, tuple] = {}
        self._fetched_pending: dict[int, tuple[int, tuple]] = {}
        self.cluster = cluster or default_cluster(size)
        if self.cluster.gpus != size:
            raise ValueError(f"cluster.gpus={self.cluster.gpus} must equal the CP size {size}")
        dp = world // size
        self.rank = dist.get_rank() % size
        self.group = init_device_mesh(device_type, (dp, size), mesh_dim_names=("dp", "cp")).get_group("cp")
        # One mesh per factorisation, built up front: creating groups is collective, while which layout a
        # block takes is decided later, per block.
        self._groups = {}
        for hcp in range(1, size + 1):
            if size % hcp == 0:
                mesh = init_device_mesh(device_type, (dp, size // hcp, hcp), mesh_dim_names=("dp", "scp", "hcp"))
                self._groups[hcp] = (mesh.get_group("hcp"), mesh.get_group("scp"))

    def __deepcopy__(self, memo: dict) -> ContextParallel:
        # A copy of the model (an EMA or a teacher copy) runs in the same CP group: process groups cannot be
        # copied, and a second set would be a collective every rank must make.
        return self

    def __reduce__(self):
        raise TypeError("ContextParallel holds process groups, which do not pickle: save the model's state_dict, "
                        "or call model.enable_context_parallel(None) before pickling the model")

    # ----- model-level sharding -----
    def shard_tokens(self, tokens: torch.Tensor, grid: tuple[int, int, int], cube, group_size: int,
                     kv_block: int) -> torch.Tensor:
        """`tokens [B, S, C]` in raster order -> this rank's `[B, S / size, C]` chunk in grouped order."""
        seq_len = tokens.shape[1]
        local_len = check_sequence_split(seq_len, self.size, group_size, kv_block)
        perm, _ = cube_permutation_on(tuple(grid), tuple(cube), tokens.device)
        return tokens.index_select(1, perm[self.rank * local_len:(self.rank + 1) * local_len])

    def gather_tokens(self, tokens: torch.Tensor, grid: tuple[int, int, int], cube) -> torch.Tensor:
        """Inverse of `shard_tokens`: every rank gets the whole `[B, S, C]` in raster order. Its backward
        sums the ranks' gradients, so with the same loss on every rank of a CP group each rank's parameter
        gradients are `size` x its tokens' share; FSDP's average over all ranks then yields the gradient
        of one process (`dsv.train.trainer`)."""
        _, inv = cube_permutation_on(tuple(grid), tuple(cube), tokens.device)
        return gather_sequence(tokens, self.group, dim=1).index_select(1, inv)

    # ----- per-block layout -----
    def layout(self, layer: DSVAttention, seq_len: int, batch: int) -> Layout:
        """This block's layout from its current dispatch; cached until the dispatch changes."""
        sparse = layer.runs_sparse()
        kept = tuple(layer._keep_fraction_host) if sparse else (1.0,) * layer.heads
        fetched = self._fetched_for(layer) if sparse else None
        key = (sparse, kept, seq_len, batch, fetched)
        cached = getattr(layer, "_cp_layout", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        layout = self.plan_layout(list(kept), sparse, layer.heads, layer.head_dim, seq_len, batch,
                                  dict(fetched) if fetched else None)
        object.__setattr__(layer, "_cp_layout", (key, layout))
        return layout

    def _fetched_for(self, layer: DSVAttention):
        """The layer's measured SCP volumes, as of the step's start: a measurement made during a step (on
        a profiling step) takes effect at the next training step, so that an activation-checkpointing
        recompute inside the backward plans the same layout as its forward did."""
        pending = self._fetched_pending.get(layer.layer_index)
        if pending is not None and pending[0] != layer.controller.forward_id:
            self._fetched[layer.layer_index] = pending[1]
            del self._fetched_pending[layer.layer_index]
        return self._fetched.get(layer.layer_index)

    def state_dict(self) -> dict:
        """Host state a resumed run needs to plan as the uninterrupted one would (the measured volumes)."""
        return {"fetched": dict(self._fetched), "fetched_pending": dict(self._fetched_pending)}

    def load_state_dict(self, state: dict) -> None:
        """`state_dict` of a run saved between steps: a measurement still pending then takes effect at the
        next step, the resumed run's first (whose forward ids start afresh, so they cannot tell)."""
        self._fetched = {**state["fetched"], **{layer: volumes for layer, (_, volumes)
                                                in state["fetched_pending"].items()}}
        self._fetched_pending = {}

    def plan_layout(self, kept: Sequence[float], sparse: bool, heads: int, head_dim: int, seq_len: int,
                    batch: int, fetched: dict[int, Sequence[float]] | None = None) -> Layout:
        """The layout of a block whose heads keep the fractions `kept` of their keys (all 1 when dense);
        `fetched` maps an SCP degree to the per-head fraction of remote keys SCP would move (measured on
        profiling steps; `dsv.parallel.planner.hybrid_plan`)."""
        if self.mode in ("hcp", "naive_hcp") or self.hcp_size:
            hcp = self.hcp_size or self.size
            if hcp > heads:
                raise ValueError(f"head-wise CP over {hcp} ranks needs at least {hcp} heads, the model has {heads}; "
                                 "use parallel.cp_mode 'scp' or 'hybrid' (or a smaller parallel.cp_hcp)")
            placement = place_heads(kept, hcp, "naive" if self.mode == "naive_hcp" else "lpt")
        elif self.mode == "scp":
            hcp, placement = 1, [list(range(heads))]
        else:
            shape = AttentionShape(seq_len, heads, head_dim, batch)
            plan = hybrid_plan([1.0 - k for k in kept], shape, self.cluster, sparse, fetched=fetched)
            hcp, placement = plan.hcp, plan.placement
        hcp_group, scp_group = self._groups[hcp]
        return Layout(hcp, self.size // hcp, tuple(tuple(int(h) for h in p) for p in placement),
                      self.rank % hcp, self.rank // hcp, hcp_group, scp_group)

    # ----- attention -----
    def attention(self, layer: DSVAttention, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """`DSVAttention.forward` under CP: `x [B, S / size, C]`, this rank's chunk of the grouped-order
        sequence of `grid` -> `[B, S / size, C]`. Collective (forward and backward)."""
        cfg = layer.cfg
        batch, local_len, _ = x.shape
        seq_len = local_len * self.size
        if math.prod(grid) != seq_len:
            raise ValueError(f"DSVAttention layer {layer.layer_index}: grid {tuple(grid)} has {math.prod(grid)} "
                             f"tokens, but {self.size} ranks x {local_len} local tokens = {seq_len}")
        self._check_input_values(layer, x)
        if layer.controller is not None:
            # As `prepare_index` does: the controller warns when the model ran but no forward trained.
            layer._seen_id = layer.controller.forward_id
        if x.is_cuda:
            release_parked(x.device)  # as each DSVAttention forward starts (the select/update runtime ops)
        check_sequence_split(seq_len, self.size, cfg.group_size, cfg.key_block)
        qkv = layer.to_qkv(x).view(batch, local_len, 3, layer.heads, layer.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = layer.q_norm(q), layer.k_norm(k)
        layer.resolve_backends(q, seq_len)
        if layer.observer is not None:
            # Observers (analysis, the train bench's estimation timer) expect the whole sequence's q and k.
            warnings.warn("DSVAttention observers are not called under context parallelism (each rank holds a "
                          "part of the sequence); measure on a single-process run", stacklevel=3)
        layout = self.layout(layer, seq_len, batch)
        # This rank's heads over its HCP group's S / scp tokens.
        q, k, v = (t.contiguous() for t in self.to_heads(torch.cat((q, k, v), -1), layout).chunk(3, dim=-1))
        learning = layer.training and torch.is_grad_enabled() and layer.controller is not None
        index = self._select(layer, x, q, k, layout, grid) if layer.runs_sparse() else None
        if learning:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                try:
                    self._learn_and_profile(layer, x, q, k, layout, grid)
                finally:
                    layer.predictor_done()
        if index is not None:
            layer._warn_if_slow(q)  # as the single-process path: the PyTorch reference on CUDA says so
        out = self.attend(q, k, v, index, layout, layer.scale, layer.sparse_backend)
        kind = "dense:sdpa" if index is None else f"sparse:{layer.sparse_backend}"
        layer.last_path = f"{kind} {layout.describe()}"
        layer.forward_path = layer.backward_path = None  # the layouts' own attention: not recorded
        out = self.from_heads(out, layout)
        return layer.to_out(out.transpose(1, 2).reshape(batch, local_len, layer.heads * layer.head_dim))

    def _check_input_values(self, layer: DSVAttention, x: torch.Tensor) -> None:
        """The finite check of `check_input_values` over the whole CP group: a rank whose chunk holds NaN/Inf
        must not raise alone while its peers wait in the next collective. (A `VideoDiT` always has its
        controller attached.)"""
        # Training: over the whole run (every rank steps together); evaluation: over this CP group only, which
        # alone must run the forward (e.g. one data-parallel group evaluating while the others do not).
        group = None if layer.training and torch.is_grad_enabled() else self.group
        if layer.cfg.check_finite and any_rank((~torch.isfinite(x)).any(), group):
            raise FloatingPointError(f"DSVAttention layer {layer.layer_index}: NaN or Inf in the attention input x "
                                     "on some rank of the run; the run is diverging or its input data is corrupt")

    def to_heads(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's `[B, H, S / size, E]` -> `[B, H_r, S / scp, E]`: its heads over its HCP group's tokens."""
        return heads_to_sequence(x, layout.placement, layout.hcp_group) if layout.hcp > 1 else x

    def from_heads(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Inverse of `to_heads`: `[B, H_r, S / scp, E]` -> this rank's `[B, H, S / size, E]`."""
        return sequence_to_heads(x, layout.placement, layout.hcp_group) if layout.hcp > 1 else x

    def _whole(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        """`[B, H_r, S / scp, E]` -> the whole sequence `[B, H_r, S, E]` of this rank's heads."""
        return gather_sequence(x, layout.scp_group) if layout.scp > 1 else x

    def _local_positions(self, layer: DSVAttention, x: torch.Tensor, grid) -> torch.Tensor | None:
        """(t, h, w) of this rank's tokens `x [B, S / size, C]` (its chunk of the grouped order), `[S / size, 3]`,
        for a predictor with rotary dims; else None."""
        positions = layer.predictor_positions(grid, x.device)
        if positions is None:
            return None
        local_len = x.shape[1]
        return positions[self.rank * local_len:(self.rank + 1) * local_len]

    def _low_rank(self, layer: DSVAttention, x: torch.Tensor, layout: Layout, grid) -> torch.Tensor:
        """The predictor's `[q_lr | k_lr]` of this rank's heads over the whole sequence, `[B, H_r, S, 2r]`;
        differentiable in the predictor's parameters."""
        q_lr, k_lr = layer.predictor.project(x.detach().to(layer.predictor.q_proj.weight.dtype),
                                             self._local_positions(layer, x, grid))
        return self._whole(self.to_heads(torch.cat((q_lr, k_lr), -1), layout), layout)

    def _pooled_low_rank(self, layer: DSVAttention, x: torch.Tensor, layout: Layout, grid,
                         whole_groups: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query group's mean `q_lr` and each key block's mean `k_lr`, this rank's heads over the whole
        sequence: `[B, H_r, NG, r]`, `[B, H_r, NKB, r]`; `whole_groups=False`: the groups of this rank's SCP
        share only, `[B, H_r, NG / scp, r]` (its own selection needs no other). Pooled on this rank's chunk,
        which holds whole groups and blocks (`check_sequence_split`), before the projections
        (`LowRankPredictor.pooled_project`) and the exchange: the collectives move one row per group and
        block instead of one per token."""
        cfg = layer.cfg
        proxies, block_keys = layer.predictor.pooled_project(x.detach(), cfg.group_size, cfg.key_block,
                                                             self._local_positions(layer, x, grid))
        if cfg.group_size == cfg.key_block:  # one exchange for both
            both = self.to_heads(torch.cat((proxies, block_keys), -1), layout)
            if whole_groups:
                return self._whole(both, layout).chunk(2, dim=-1)
            proxies, block_keys = both.chunk(2, dim=-1)
            return proxies, self._whole(block_keys.contiguous(), layout)
        proxies = self.to_heads(proxies.contiguous(), layout)
        block_keys = self._whole(self.to_heads(block_keys.contiguous(), layout), layout)
        return (self._whole(proxies, layout) if whole_groups else proxies), block_keys

    def _index(self, layer, x, q, k, layout, grid, keep_blocks: torch.Tensor) -> SparseIndex:
        """The whole-sequence index of this rank's heads (what one process selects for them)."""
        return self._selection(layer, x, q, k, layout, grid, keep_blocks)()

    def _selection(self, layer, x, q, k, layout, grid, keep_blocks: torch.Tensor, keep_for_recompute: bool = False,
                   local: bool = False) -> Callable[[], SparseIndex | LocalIndex]:
        """A call that gives `_index` (`local`: this rank's rows of it, a `LocalIndex` when `scp > 1`), and
        gives it again in the checkpointing recompute: as in `DSVAttentionCore._selection`, the learned
        selection keeps the pooled rows (after the exchange), not the index (in host memory with
        `host_offload`, when `keep_for_recompute`). Under SCP the local learned selection scores this rank's
        query groups only, not every group of the sequence."""
        cfg, heads = layer.cfg, layout.heads
        seq_len = q.shape[2] * layout.scp
        local_rows = local and layout.scp > 1

        def rows_of(index: SparseIndex) -> SparseIndex | LocalIndex:
            return LocalIndex.from_global(index, layout.scp_rank, layout.scp) if local_rows else index

        if cfg.mode == "window":
            index = rows_of(select_heads(layer._window(grid, q.shape[0], q.device), heads))
            return lambda: index
        keep = keep_blocks[heads]
        with torch.no_grad():
            if cfg.mode == "oracle":
                index = rows_of(oracle_index(self._whole(q, layout), self._whole(k, layout), keep, cfg.group_size,
                                             cfg.key_block, scale=layer.scale))
                return lambda: index
            proxies, block_keys = self._pooled_low_rank(layer, x, layout, grid, whole_groups=not local_rows)
        offload = keep_for_recompute and cfg.host_offload
        if not local_rows:
            return RepeatableSelection(
                functools.partial(estimate_index_from_means, keep_blocks=keep, group_size=cfg.group_size,
                                  kv_block=cfg.key_block, seq_len=seq_len, backend=cfg.backend),
                (proxies, block_keys), offload=offload)
        first_group = layout.scp_rank * proxies.shape[2]

        def select_local(proxies: torch.Tensor, block_keys: torch.Tensor) -> LocalIndex:
            indices, counts = estimate_rows_from_means(proxies, block_keys, keep, cfg.group_size, cfg.key_block,
                                                       seq_len, first_group, backend=cfg.backend)
            return LocalIndex(indices, counts, cfg.group_size, cfg.key_block, seq_len)

        return RepeatableSelection(select_local, (proxies, block_keys), offload=offload)

    def _select(self, layer, x, q, k, layout, grid) -> SparseIndex | LocalIndex:
        # As `DSVAttentionCore._select`: a checkpointing recompute (inside backward) reuses the forward's keys.
        key = (*layer._forward_key(q, grid), layout)
        keep_blocks = layer._keep_blocks(-(-q.shape[2] * layout.scp // layer.cfg.key_block))
        # As `DSVAttentionCore._select`: in training mode, or within a step whatever the mode.
        recomputable = torch.is_grad_enabled() and (
            layer.training or (layer.controller is not None and layer.controller.step_open))

        def selection(keep_for_recompute: bool = False) -> Callable[[], SparseIndex | LocalIndex]:
            return self._selection(layer, x, q, k, layout, grid, keep_blocks, keep_for_recompute, local=True)

        if torch._C._current_graph_task_id() != -1:
            return layer.recall_selection(key, x, lambda: selection()())
        select = selection(keep_for_recompute=recomputable)
        if recomputable and layer.cfg.mode != "window":  # as `DSVAttentionCore._select`: a window is selected again
            layer.remember_selection(key, x, select)
        return select()

    def attend(self, q, k, v, index: SparseIndex | LocalIndex | None, layout: Layout, scale: float,
               backend: str) -> torch.Tensor:
        """Attention of this rank's heads over its HCP group's tokens, `q, k, v [B, H_r, S / scp, D]`:
        dense when `index` is None, else over `index` (a `LocalIndex` of this rank's rows when `scp > 1`)."""
        if index is None:
            # Dense under SCP: every query needs every key, so K and V are gathered (ring attention's volume).
            return F.scaled_dot_product_attention(q, self._whole(k, layout), self._whole(v, layout), scale=scale)
        if layout.scp == 1:
            return sparse_attention(q, k, v, index, scale=scale, backend=backend, check_index=False)
        out, _ = scp_attention(q, k, v, index, scale=scale, group=layout.scp_group, backend=backend)
        return out

    def _sum_heads(self, values: torch.Tensor, heads: Sequence[int], total_heads: int, layout: Layout):
        """This rank's per-head values `[H_r]` -> `[H]` for all heads: each head is measured by one rank
        of the HCP group (and identically by every SCP group)."""
        full = values.new_zeros(total_heads).index_copy(0, torch.tensor(heads, device=values.device), values)
        if layout.hcp > 1:
            dist.all_reduce(full, group=layout.hcp_group)
        return full

    def _learn_and_profile(self, layer, x, q, k, layout: Layout, grid) -> None:
        """`DSVAttentionCore._learn_and_profile` on this rank's heads over the whole sequence."""
        cfg, controller = layer.cfg, layer.controller
        if not layer.claim_step():
            return
        learn_period = 1 if controller.current_stage == 1 else cfg.learn_every_stage2
        profile_period = cfg.profile_every_stage1 if controller.current_stage == 1 else cfg.profile_every_stage2
        learn = layer.predictor is not None and controller.step % learn_period == 0
        profile = controller.profile_due()
        if not (learn or profile):
            return
        heads = layout.heads
        with torch.no_grad():
            q_all, k_all = self._whole(q, layout), self._whole(k, layout)
        seq_len = q_all.shape[2]
        stride = min(seq_len, max(cfg.sample_stride, -(-seq_len // cfg.max_sample_rows)))
        if learn:
            rows = sample_query_rows(seq_len, stride, offset=controller.step // learn_period, device=q.device)
            keys = sample_key_positions(seq_len, cfg.predictor_keys, key_seed(controller.step, layer.layer_index),
                                        device=q.device)
            keys = slice(None) if keys is None else keys
            # The loss averages over heads; weighting by this rank's share of them makes the sum over the
            # HCP group — and the rank-averaged gradient — that of one process over all heads.
            weight = len(heads) * layout.hcp / layer.heads
            rank = layer.predictor.rank

            def weighted_loss():
                low_rank = self._low_rank(layer, x, layout, grid)
                return layer.predictor.factors_loss(low_rank[:, :, rows, :rank], low_rank[:, :, keys, rank:],
                                                    q_all[:, :, rows], k_all[:, :, keys], layer.scale) * weight

            loss = layer.predictor.step(weighted_loss, x.device.type)
            if layout.hcp > 1:
                # The weighted losses of the HCP group sum to hcp x the loss of one process.
                dist.all_reduce(loss, group=layout.hcp_group)
                loss = loss / layout.hcp
            layer.loss_ema.copy_(_ema(layer.loss_ema, loss, cfg.ema_momentum))
        if not profile:
            return
        rows = sample_query_rows(seq_len, stride, offset=controller.step // profile_period, device=q.device)
        with torch.no_grad():
            sparsity = self._sum_heads(head_sparsity(q_all, k_all, rows, cfg.theta, scale=layer.scale), heads,
                                       layer.heads, layout)
        layer._check_profile_finite(layer.loss_ema, sparsity)
        with torch.no_grad():
            # Over every rank: the CP group's ranks hold the same value, data-parallel groups their own shares.
            layer.sparsity_ema.copy_(_ema(layer.sparsity_ema, mean_over_ranks(sparsity), cfg.ema_momentum))
            if cfg.mode == "dense":
                return
            keep_blocks = keep_blocks_from_sparsity(layer.sparsity_ema, -(-seq_len // cfg.key_block),
                                                    cfg.keep_floor_blocks, layer.budget_margin(layer.keep_boost))
            index = self._index(layer, x, q, k, layout, grid, keep_blocks.cpu())
            recall = index_recall(q_all, k_all, index, rows, scale=layer.scale, check_index=False).mean(0)
            recall = mean_over_ranks(self._sum_heads(recall, heads, layer.heads, layout))
            layer.recall_ema.copy_(_ema(layer.recall_ema, recall, cfg.ema_momentum))
            if controller.current_stage == 2:
                layer.update_keep_boost(layer.keep_boost, recall)
            if self.mode == "hybrid":
                # What SCP would move at each degree with this selection: the planner's SCP volume.
                fetched = {}
                for scp in (c for c in range(2, self.size + 1) if self.size % c == 0):
                    per_head = torch.tensor(fetched_fraction(index, scp), device=q.device)
                    fetched[scp] = tuple(round(x, 3) for x in
                                         self._sum_heads(per_head, heads, layer.heads, layout).tolist())
                self._fetched_pending[layer.layer_index] = (controller.forward_id, tuple(sorted(fetched.items())))


# Per-block fwd+bwd time of each layout beyond its FLOPs and bytes, measured on 2 H200s (16 heads x 128,
# S = 32k and 64k, benchmarks/results/2026-11-29-2xh200-cp-attention.md): measured minus the FLOP-and-byte
# model was 3.2-5.5 ms under HCP and 7.3-8.7 ms under SCP (its index remapping and host synchronisations).
MEASURED_HCP_OVERHEAD_S = 3.5e-3
MEASURED_SCP_OVERHEAD_S = 8.0e-3


def default_cluster(gpus: int, gpus_per_node: int | None = None, intra_node_gbps: float = 300.0,
                    inter_node_gbps: float = 25.0, block: int = 128) -> Cluster:
    """Links and kernel speeds for the planner: the H200 kernel-speed model's dense rate and sparse
    efficiency for `block`-token query groups and key blocks (`dsv.modules.dispatch.speed_model`), the
    layouts' measured overheads, NVLink inside a node, a 200 Gb/s NIC per GPU between nodes."""
    from dsv.modules.dispatch import speed_model

    speed, _ = speed_model("triton", block, block)
    return Cluster(gpus=gpus, gpus_per_node=gpus_per_node or gpus, intra_node_gbps=intra_node_gbps,
                   inter_node_gbps=inter_node_gbps, dense_tflops=speed.dense_tflops,
                   sparse_efficiency=1.0 / speed.relative_cost, hcp_overhead_s=MEASURED_HCP_OVERHEAD_S,
                   scp_overhead_s=MEASURED_SCP_OVERHEAD_S)

