"""FSDP2 + activation checkpointing + DSV on 2 gloo ranks: sharded training equals the single-process
run, the predictors stay replicated plain tensors, and DSV's state stays identical under data parallelism."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import dsv.modules.attention as attention_module
from dsv.modules.attention import DSVAttention, model_parameters
from dsv.modules.config import AttentionConfig
from dsv.modules.controller import EMA_BUFFERS
from dsv.modules.dit import ModelConfig, VideoDiT, flow_matching_loss
from dsv.parallel.fsdp import (
    check_replicas_in_sync,
    replica_divergence,
    shard_model,
)
from tests.parallel import run_distributed

WORLD, STEPS, BATCH = 2, 4, 2
VIDEO = (3, 4, 16, 16)  # C, T, H, W: with 1×2×2 patches a 4×8×8 grid of 256 tokens
# Same batch on both ranks: FSDP's gradient average and the predictors' AVG all-reduce of two equal
# values are exact, so only summation orders differ from one process (sharded grad norm for clipping,
# GEMMs on other shapes): we measure <= 1.2e-7 after 4 AdamW steps; 1e-5 leaves ~100x headroom.
TOL = {"rtol": 1e-5, "atol": 1e-5}
# bf16 compute: the loss is an fp32 mean of outputs computed in bf16, so one bf16 rounding (2^-8
# relative) bounds its gap to the fp32 run; we measure 2e-4 relative.
BF16_LOSS_TOL = {"rtol": 2**-8, "atol": 0.0}


def build_model(**attention) -> VideoDiT:
    torch.manual_seed(0)  # every rank and the reference start from the same weights
    model_cfg = ModelConfig(in_channels=VIDEO[0], patch=(1, 2, 2), hidden=32, depth=2, heads=2,
                            activation_checkpointing=True)
    # Profile every step so the EMAs move each step; switch after 2 steps; threshold 0 sends every block sparse.
    attn_cfg = AttentionConfig(mode="dsv", cube=(2, 2, 2), backend="reference", rank=4, sample_stride=4,
                               profile_every_stage1=1, profile_every_stage2=1, max_stage1_steps=2,
                               sparse_threshold=0.0, **attention)
    return VideoDiT(model_cfg, attn_cfg)


def make_batches(seed: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *VIDEO, generator=gen), torch.rand(batch, generator=gen),
             torch.randn(batch, *VIDEO, generator=gen)) for _ in range(STEPS)]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def dsv_state(model: VideoDiT) -> dict:
    """Every DSV buffer and the dispatch, per layer, plus the controller's stage."""
    state = {"stage": model.controller.current_stage, "sparse_layers": model.controller.sparse_layers()}
    for i, layer in enumerate(model.controller.layers):
        for name in (*EMA_BUFFERS, "use_sparse", "keep_fraction"):
            state[f"{i}.{name}"] = getattr(layer, name).clone()
    return state


def predictor_params(model: VideoDiT) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".predictor." in name}


def train(model: VideoDiT, batches) -> dict:
    """The trainer's step (dsv.train.trainer.Trainer.train_step) on the given batches."""
    block_calls = [0] * len(model.blocks)

    def count_call(block_index: int):
        def hook(_module, _args) -> None:
            block_calls[block_index] += 1
        return hook

    for i, block in enumerate(model.blocks):
        # Counts the block's forward and its activation-checkpointing recompute in backward.
        block.register_forward_pre_hook(count_call(i))
    compute_dtypes = set()
    for layer in model.controller.layers:
        layer.observer = lambda _layer, _hidden, q, _k, _grid: compute_dtypes.add(q.dtype)
    optimizer = torch.optim.AdamW(model_parameters(model), lr=2e-3)
    losses, paths, states = [], [], []
    for step, (x0, t, noise) in enumerate(batches):
        model.train()
        model.controller.begin_step(step)
        loss = flow_matching_loss(model, x0, t, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model_parameters(model), 1.0)
        optimizer.step()
        model.controller.end_step()
        losses.append(loss.item())
        paths.append([layer.last_path for layer in model.controller.layers])
        states.append(dsv_state(model))
    return {
        "losses": losses,
        "paths": paths,
        "states": states,
        "params": {name: full(p) for name, p in model.named_parameters()},
        "predictors": predictor_params(model),
        "block_calls": block_calls,
        "compute_dtypes": compute_dtypes,
        "param_dtypes": {p.dtype for p in model.parameters()},
    }


def single_process_reference(batches, **attention) -> dict:
    """`train` in this process, on one thread like each rank (run_distributed sets that): two OpenMP
    threads on the two shared cores were ~60x slower here than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(build_model(**attention), batches)
    finally:
        torch.set_num_threads(threads)


def fsdp_worker(rank, world, batches_per_rank, reshard_after_forward=True, mixed_precision=False):
    model = shard_model(build_model(), reshard_after_forward=reshard_after_forward, mixed_precision=mixed_precision)
    # The predictors stay plain full tensors that their own optimizers step; the rest is sharded.
    kinds = {name: (type(p).__name__, getattr(p, "placements", None)) for name, p in model.named_parameters()}
    same_objects = all(
        live is stepped
        for layer in model.controller.layers
        for live, stepped in zip(layer.predictor.parameters(), layer.predictor.optimizer.param_groups[0]["params"])
    )
    measured = {"loss": [], "sparsity": []}
    record_measurements(model, measured)
    result = train(model, batches_per_rank[rank])
    return {**result, "kinds": kinds, "same_objects": same_objects, "measured": measured}


def record_measurements(model: VideoDiT, measured: dict) -> None:
    """Record each layer's rank-local predictor loss and profiled head sparsity, before any averaging."""
    for layer in model.controller.layers:
        update = layer.predictor.update

        def recording_update(*args, update=update):
            loss = update(*args)
            measured["loss"].append(loss.clone())
            return loss

        layer.predictor.update = recording_update
    head_sparsity = attention_module.head_sparsity

    def recording_head_sparsity(*args, **kwargs):
        sparsity = head_sparsity(*args, **kwargs)
        measured["sparsity"].append(sparsity.clone())
        return sparsity

    # This process is a rank process of its own: the patch does not leak into other tests.
    attention_module.head_sparsity = recording_head_sparsity


def assert_close_dicts(actual: dict, expected: dict, **tol) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("reshard_after_forward,mixed_precision", [(True, False), (False, False), (True, True)],
                         ids=["fp32", "fp32-no-reshard", "bf16"])
def test_fsdp_same_data_matches_single_process(tmp_path, reshard_after_forward, mixed_precision):
    batches = make_batches(seed=0)
    reference = single_process_reference(batches)
    per_rank = run_distributed(fsdp_worker, WORLD, [batches] * WORLD, reshard_after_forward, mixed_precision,
                               out_dir=tmp_path)

    # Stage 2 ran sparse (through the checkpointed blocks) on every rank, as in one process.
    assert reference["paths"][-1] == ["sparse:reference"] * 2
    assert reference["states"][-1]["stage"] == 2
    for result in per_rank:
        assert result["paths"] == reference["paths"]
        # Activation checkpointing recomputed every block in backward, under FSDP as in one process.
        assert result["block_calls"] == reference["block_calls"] == [2 * STEPS] * 2
        kinds = result["kinds"]
        sharded = {n for n, (kind, placements) in kinds.items() if kind == "DTensor" and placements == (Shard(0),)}
        plain = {n for n, (kind, _) in kinds.items() if kind == "Parameter"}
        assert plain == set(reference["predictors"]) and sharded == kinds.keys() - plain
        assert result["same_objects"]
        # fp32 master weights (and fp32 predictors) either way; bf16 only in the computation.
        assert result["param_dtypes"] == {torch.float32}
        assert result["compute_dtypes"] == {torch.bfloat16 if mixed_precision else torch.float32}
        losses, expected = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
        if mixed_precision:
            # Parameters are not compared: AdamW moves each coordinate by ~lr per step whatever the
            # gradient's size, so bf16 noise in small gradients shows up at ~lr in the weights.
            torch.testing.assert_close(losses, expected, **BF16_LOSS_TOL)
            continue
        torch.testing.assert_close(losses, expected, **TOL)
        assert_close_dicts(result["params"], reference["params"], **TOL)
        assert_close_dicts(result["predictors"], reference["predictors"], **TOL)
        assert_close_dicts(result["states"][-1], reference["states"][-1], **TOL, equal_nan=True)
    # The predictors trained and are bitwise identical replicas on both ranks.
    initial = build_model().state_dict()
    assert all(not torch.equal(p, initial[n]) for n, p in per_rank[0]["predictors"].items())
    assert_close_dicts(per_rank[1]["predictors"], per_rank[0]["predictors"], rtol=0, atol=0)


def test_fsdp_data_parallel_keeps_dsv_state_identical(tmp_path):
    batches_per_rank = [make_batches(seed=rank + 1) for rank in range(WORLD)]
    rank0, rank1 = run_distributed(fsdp_worker, WORLD, batches_per_rank, out_dir=tmp_path)

    # The problem: each rank measures its own predictor loss and sparsity on its own data ...
    layers = 2
    for kind in ("loss", "sparsity"):
        assert len(rank0["measured"][kind]) == STEPS * layers
        assert not torch.allclose(torch.stack(rank0["measured"][kind]), torch.stack(rank1["measured"][kind]))
    assert rank0["losses"] != rank1["losses"]
    # ... the solution: every EMA is the EMA of the rank average (first step: exactly the average) ...
    first = rank0["states"][0]
    for i in range(layers):
        for kind, buffer in (("loss", "loss_ema"), ("sparsity", "sparsity_ema")):
            mean = (rank0["measured"][kind][i] + rank1["measured"][kind][i]) / 2
            torch.testing.assert_close(first[f"{i}.{buffer}"], mean, rtol=1e-6, atol=1e-7)
    # ... so every rank holds the same EMAs, dispatch, budgets and stage after every step.
    for state0, state1 in zip(rank0["states"], rank1["states"]):
        assert_close_dicts(state1, state0, rtol=0, atol=0, equal_nan=True)
    assert rank0["states"][-1]["sparse_layers"] == [0, 1]
    assert rank0["paths"][-1] == rank1["paths"][-1] == ["sparse:reference"] * 2
    # Predictor gradients are averaged, so the replicas stay bitwise identical despite different data.
    assert_close_dicts(rank1["predictors"], rank0["predictors"], rtol=0, atol=0)


def test_shard_model_errors():
    with pytest.raises(ValueError, match="no DSV attention layers"):
        shard_model(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="no nn.ModuleList of blocks"):
        shard_model(nn.Sequential(DSVAttention(8, 2)))
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        shard_model(build_model())


def hand_sharded_worker(rank, world, batches):
    """fully_shard applied by hand, as a user or a launcher would, without the predictors in ignored_params."""
    model = build_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    try:
        train(model, batches[:1])
    except RuntimeError as err:
        return str(err)
    return None


def test_predictors_sharded_by_hand_raise_instead_of_silently_not_learning(tmp_path):
    """Sharded, a predictor's weights are DTensors gathered afresh for each forward: its optimizer would step
    the gathered copies and the predictor silently stop learning. The first step's end_step raises, naming the
    two ways out."""
    (error,) = run_distributed(hand_sharded_worker, 1, make_batches(seed=0), out_dir=tmp_path)
    assert error is not None and "predictor's parameters are sharded" in error
    assert "dsv.parallel.shard_model" in error and "ignored_params" in error


def replica_check_worker(rank, world, batches_per_rank):
    model = shard_model(build_model())
    train(model, batches_per_rank[rank])
    in_sync = replica_divergence(model)
    compared = check_replicas_in_sync(model)
    # One rank's predictor drifts (as a missed gradient all-reduce would make it): every rank must refuse.
    layer = model.controller.layers[1]
    if rank == 1:
        with torch.no_grad():
            next(layer.predictor.parameters()).add_(1e-3)
    try:
        check_replicas_in_sync(model)
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"in_sync": in_sync, "compared": compared, "error": error}


def test_replica_check_passes_in_sync_and_names_a_drifted_predictor(tmp_path):
    batches_per_rank = [make_batches(seed=rank + 1) for rank in range(WORLD)]
    results = run_distributed(replica_check_worker, WORLD, batches_per_rank, out_dir=tmp_path)
    for result in results:
        # After data-parallel training on different data, every replicated tensor is identical ...
        assert result["in_sync"] and set(result["in_sync"].values()) == {0.0}
        assert result["compared"] == len(result["in_sync"])
        assert any(".predictor." in name for name in result["in_sync"])
        assert any(name.endswith("sparsity_ema") for name in result["in_sync"])
        assert any(name.endswith("controller.stage") for name in result["in_sync"])
        # ... and a drift on one rank is reported on every rank, naming the tensor.
        assert result["error"] is not None and "DSV replicas differ between ranks" in result["error"]
        assert "blocks.1.attn.predictor.q_proj.weight (max difference 0.001)" in result["error"]


def halves_worker(rank, world, batches_per_rank):
    return train(shard_model(build_model(recall_target=0.95)), batches_per_rank[rank])


def test_ranks_on_halves_of_a_batch_equal_one_process_on_all_of_it(tmp_path):
    """Each rank profiles its half of the batch. The recall floor (`recall_target`) measured each rank's recall
    at that rank's own budget and widened by it, before the end of the step averaged the EMAs: per-head budgets
    and weights then differed from one process's on the whole batch (8.9e-4 in the weights after 4 steps). The
    measurements are now averaged over the ranks where they are made."""
    whole = make_batches(seed=0, batch=WORLD * BATCH)
    halves = [[tuple(t[rank * BATCH:(rank + 1) * BATCH] for t in batch) for batch in whole] for rank in range(WORLD)]
    reference = single_process_reference(whole, recall_target=0.95)
    assert any(float(value.abs().sum()) > 0 for key, value in reference["states"][-1].items()
               if key.endswith("keep_boost"))  # the recall floor acted
    for result in run_distributed(halves_worker, WORLD, halves, out_dir=tmp_path):
        assert result["paths"] == reference["paths"]
        for state, expected in zip(result["states"], reference["states"]):
            assert_close_dicts(state, expected, **TOL, equal_nan=True)
        assert_close_dicts(result["params"], reference["params"], **TOL)
        assert_close_dicts(result["predictors"], reference["predictors"], **TOL)
