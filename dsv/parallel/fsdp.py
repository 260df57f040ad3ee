"""FSDP2 for a DSV model: shard the DiT's parameters, keep the sparsity predictors replicated.

`shard_model` applies `torch.distributed.fsdp.fully_shard` to every transformer block and to the root,
excluding the predictors' parameters, and keeps DSV's per-layer state identical on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dsv.modules.attention import DSVAttentionCore
from dsv.modules.controller import DSVController
from dsv.modules.dit import VideoDiT
from dsv.modules.predictor import LowRankPredictor


def _dsv_layers(model: nn.Module) -> list[DSVAttentionCore]:
    return [m for m in model.modules() if isinstance(m, DSVAttentionCore)]


def _block_units(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the members of every `nn.ModuleList` that hold DSV layers
    (`VideoDiT.blocks`). Each becomes one FSDP unit, so one block's parameters are gathered at a time."""
    return [
        block
        for module in model.modules() if isinstance(module, nn.ModuleList)
        for block in module if _dsv_layers(block)
    ]


def _replicated_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every DSV tensor that each rank holds whole and identical: each DSV layer's buffers (EMAs, recall
    boost, budgets, dispatch) and predictor parameters, and the controller's buffers (stage, switch step)."""
    named = []
    for module_name, module in model.named_modules():
        if isinstance(module, (DSVAttentionCore, DSVController)):
            named += [(f"{module_name}.{name}", t) for name, t in module.named_buffers(recurse=False)]
        predictor = getattr(module, "predictor", None) if isinstance(module, DSVAttentionCore) else None
        if isinstance(predictor, LowRankPredictor):
            predictor.unpark()  # parked weights may still be on their way to host memory
            named += [(f"{module_name}.predictor.{name}", p) for name, p in predictor.named_parameters()]
    return named


@torch.no_grad()
def replica_divergence(model: nn.Module) -> dict[str, float]:
    """Largest difference from rank 0's copy, over all ranks, of every DSV replicated tensor
    (`_replicated_tensors`; the predictors' AdamW moments are not compared: they follow from identical
    gradients). A collective: every rank calls it. Returns ``{name: max |x_rank - x_rank0|}`` (0.0 where
    identical; NaN in the same place on every rank counts as identical, a NaN on some ranks only as ``inf``).

    Why: these replicas are kept identical by construction (averaged gradients, averaged EMAs), not by
    FSDP; a rank that drifted would dispatch or select differently without any error. Checking them when
    a checkpoint is written, which saves rank 0's copy for all, turns such a drift into an error. Tensor by
    tensor, so the extra memory is two copies of the largest one (a predictor weight), not of them all."""
    named = _replicated_tensors(model)
    if not named:
        return {}
    largest = []
    for _, tensor in named:
        value = tensor.detach().float()
        reference = value.clone()
        dist.broadcast(reference, src=0)
        diff = (value - reference).abs().nan_to_num(nan=float("inf"))
        diff = torch.where(value.isnan() & reference.isnan(), torch.zeros_like(diff), diff)
        largest.append(diff.max() if diff.numel() else diff.new_zeros(()))
    per_tensor = torch.stack(largest)
    dist.all_reduce(per_tensor, op=dist.ReduceOp.MAX)
    return {name: float(value) for (name, _), value in zip(named, per_tensor.tolist())}


def check_replicas_in_sync(model: nn.Module) -> int:
    """Raise `RuntimeError` naming every DSV replica (see `replica_divergence`) that differs between ranks,
    on every rank; return how many tensors were compared. A collective."""
    divergence = replica_divergence(model)
    drifted = {name: value for name, value in divergence.items() if value != 0.0}
    if drifted:
        listed = ", ".join(f"{name} (max difference {value:.3g})" for name, value in list(drifted.items())[:8])
        raise RuntimeError(f"DSV replicas differ between ranks: {listed}"
                           f"{f' and {len(drifted) - 8} more' if len(drifted) > 8 else ''}. Predictors and DSV "
                           "state must be identical on every rank; this checkpoint is not written (earlier ones "
                           "are intact)")
    return len(divergence)


def shard_model(
    model: VideoDiT,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mixed_precision: bool = False,
) -> VideoDiT:
    """Shard `model` in place with FSDP2 (one unit per block, plus the root) and return it.

    Call after `torch.distributed.init_process_group` and before building the model's optimizer (which
    must then see the sharded `DTensor` parameters: `model_parameters(model)`). Input and output shapes
    are unchanged: `forward(x [B, C, T, H, W], t [B], y [B] | None) -> [B, C, T, H, W]`, each rank with
    its own local batch.

    Why the predictors stay out of FSDP: a `LowRankPredictor` is detached from the model graph and
    steps its own AdamW *inside* the forward pass, on gradients it all-reduces (AVG) itself. FSDP would
    replace its parameters with new sharded `DTensor` parameters, while the predictor's optimizer still
    holds the original tensors: it would step tensors the model no longer uses, and the live predictor
    would never learn (the test checks the optimizer holds the live parameters). So every predictor
    parameter is passed as `ignored_params`: it stays a plain, full tensor on every rank, and the
    predictor's own all-reduce keeps the replicas identical. They are small (2·C·H·rank per layer), so
    replicating them costs little memory and no extra collective beyond that all-reduce.

    DSV's buffers (EMAs, dispatch, kept fractions, the controller's stage) are never sharded: FSDP
    leaves buffers as plain tensors. With data parallelism each rank measures on its own data: the profiling
    measurements (sparsity, and the recall at the budget it gives) are averaged over the ranks where they are
    made (`mean_over_ranks`), so budgets and recall floor are one process's on the whole batch, and the
    controller's `end_step` averages the EMAs (the predictor loss's too) before it switches and dispatches.

    Args:
        model: a DSV model whose repeated blocks sit in an `nn.ModuleList` (`VideoDiT.blocks`).
        mesh: 1-D data-parallel mesh; default: all ranks, on the device type of the model's parameters.
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3) and
            gather again for backward (and for an activation-checkpointing recompute); False keeps
            them until backward (ZeRO-2-like: more memory, one all-gather less per block).
        mixed_precision: compute in bf16 (parameters all-gathered in bf16) with fp32 gradient
            reduction and fp32 sharded master parameters; the predictors keep fp32 throughout.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the model has no DSV attention layer, or no block list to shard.
    """
    if not _dsv_layers(model):
        raise ValueError("shard_model: the model has no DSV attention layers (DSVAttention or an integration)")
    blocks = _block_units(model)
    if not blocks:
        raise ValueError("shard_model: found no nn.ModuleList of blocks holding DSV layers to shard")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "shard_model: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group (e.g. under torchrun) before sharding"
        )
    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    ignored = {p for m in model.modules() if isinstance(m, LowRankPredictor) for p in m.parameters()}
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "ignored_params": ignored}
    for block in blocks:
        fully_shard(block, mp_policy=policy, **options)
    # The root does not cast its inputs: the timesteps `t` must stay fp32 (bf16 rounds 0.9987 to 1.0), as
    # under autocast on one GPU; the model casts the video to its patch embedding's dtype itself.
    root_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    fully_shard(model, mp_policy=root_policy, **options)
    return model
