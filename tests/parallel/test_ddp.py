"""DistributedDataParallel + DSV on 2 gloo ranks, as `accelerate` wraps a model: each rank measures its own data,
and DDP broadcasts rank 0's buffers at every forward. The controller's `end_step` averages the measurements over
the ranks, so every rank switches and dispatches alike, and its host copies of the dispatch stay true."""

import torch
from torch.nn.parallel import DistributedDataParallel

from dsv.modules.attention import model_parameters
from dsv.modules.dit import flow_matching_loss
from tests.parallel import run_distributed
from tests.parallel.test_fsdp import WORLD, assert_close_dicts, build_model, dsv_state, make_batches


def host_copies_hold(model) -> bool:
    """The host copies the forward decides on (no device sync) equal the buffers they copy."""
    controller = model.controller
    return controller.current_stage == int(controller.stage) and all(
        layer._use_sparse_host == bool(layer.use_sparse) and layer._keep_fraction_host == layer.keep_fraction.tolist()
        for layer in controller.layers)


def ddp_worker(rank, world, batches_per_rank):
    model = build_model()
    wrapped = DistributedDataParallel(model)  # broadcast_buffers=True: the default, and accelerate's
    optimizer = torch.optim.AdamW(model_parameters(model), lr=2e-3)
    losses, paths, states, host_copies = [], [], [], []
    for step, (x0, t, noise) in enumerate(batches_per_rank[rank]):
        model.train()
        model.controller.begin_step(step)
        loss = flow_matching_loss(wrapped, x0, t, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        host_copies.append(host_copies_hold(model))  # after this step's broadcast of rank 0's buffers
        model.controller.end_step()
        losses.append(loss.item())
        paths.append([layer.last_path for layer in model.controller.layers])
        states.append(dsv_state(model))
    return {"losses": losses, "paths": paths, "states": states, "host_copies": host_copies}


def test_ddp_ranks_on_their_own_data_switch_and_dispatch_alike(tmp_path):
    batches_per_rank = [make_batches(seed=rank + 1) for rank in range(WORLD)]
    rank0, rank1 = run_distributed(ddp_worker, WORLD, batches_per_rank, out_dir=tmp_path)
    assert rank0["losses"] != rank1["losses"]  # each rank trained on its own data
    for state0, state1 in zip(rank0["states"], rank1["states"]):
        assert_close_dicts(state1, state0, rtol=0, atol=0, equal_nan=True)
    assert rank0["host_copies"] == rank1["host_copies"] == [True] * len(rank0["states"])
    assert rank0["states"][-1]["stage"] == 2 and rank0["states"][-1]["sparse_layers"] == [0, 1]
    assert rank0["paths"] == rank1["paths"] and rank0["paths"][-1] == ["sparse:reference"] * 2


def uneven_batch_worker(rank, world, batches_per_rank, fixed_ms):
    import dsv.modules.attention as attention
    from dsv.modules.dispatch import SparseSpeedModel

    # A kernel-speed model whose fixed cost makes sparse attention pay at 3 samples but not at 1.
    attention.speed_model = lambda backend, group, block: (SparseSpeedModel(565.0, 1.25, fixed_ms, "test"), "test")
    return ddp_worker(rank, world, batches_per_rank)


def test_ranks_with_uneven_batches_dispatch_alike(tmp_path):
    """The speed model decides by batch size: a rank of 1 sample went dense where one of 3 went sparse, and the
    replicas drifted apart without a word. Every rank now decides at the largest batch of the ranks."""
    four = [tuple(torch.cat(pair) for pair in zip(a, b)) for a, b in zip(make_batches(seed=1), make_batches(seed=2))]
    uneven = [[tuple(t[:1] for t in batch) for batch in four], [tuple(t[1:] for t in batch) for batch in four]]
    assert uneven[0][0][0].shape[0] == 1 and uneven[1][0][0].shape[0] == 3
    rank0, rank1 = run_distributed(uneven_batch_worker, WORLD, uneven, 3e-6, out_dir=tmp_path)
    assert rank0["paths"] == rank1["paths"] and rank0["paths"][-1] == ["sparse:reference"] * 2
    for state0, state1 in zip(rank0["states"], rank1["states"]):
        assert_close_dicts(state1, state0, rtol=0, atol=0, equal_nan=True)
