"""Context parallelism inside the model: every CP mode equals one process, forward and gradients."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist

from dsv.modules.config import AttentionConfig
from dsv.modules.dit import ModelConfig, VideoDiT, flow_matching_loss
from dsv.parallel.context import ContextParallel
from tests.parallel import run_distributed

# fp32 on CPU; the CP result sums the same products in another order (all-to-all, gathered K/V, per-rank
# partial gradients summed over ranks): a few ulps of the O(1) values, far above float32's 1.2e-7.
TOL = dict(rtol=2e-4, atol=2e-5)


def _model(mode: str, checkpointing: bool = False, predictor_keys: int = 0, predictor_lr: float = 1e-3,
           predictor_rotary: int = 0) -> VideoDiT:
    torch.manual_seed(0)
    attn = AttentionConfig(mode=mode, cube=(2, 2, 2), min_stage1_steps=0, max_stage1_steps=1,
                           profile_every_stage1=1, profile_every_stage2=1, sparse_threshold=0.0,
                           keep_floor_blocks=2, sample_stride=4, window_frac=0.5, recall_target=0.95,
                           predictor_keys=predictor_keys, predictor_lr=predictor_lr,
                           predictor_rotary=predictor_rotary)
    model = VideoDiT(ModelConfig(in_channels=3, patch=(1, 2, 2), hidden=32, depth=2, heads=4,
                                 activation_checkpointing=checkpointing), attn)
    # Non-zero output paths, so that every block's attention reaches the loss and its gradients.
    for p in model.parameters():
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _steps(model: VideoDiT, steps: int = 3) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Forward + backward of `steps` training steps (predictor updates, profiling, the switch at step 1);
    the model's weights stay fixed so that every step compares like with like."""
    torch.manual_seed(1)
    x0, noise = torch.randn(2, 3, 4, 16, 16), torch.randn(2, 3, 4, 16, 16)
    t = torch.tensor([0.3, 0.8])
    results = []
    for step in range(steps):
        model.controller.begin_step(step)
        model.zero_grad(set_to_none=True)
        loss = flow_matching_loss(model, x0, t, noise)
        loss.backward()
        model.controller.end_step()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()
                 if p.grad is not None and ".predictor." not in name}
        results.append((float(loss.detach()), grads))
    return results


def _worker(rank, world, mode, cp_mode, hcp_size, checkpointing, predictor_keys=0, predictor_rotary=0):
    # The one-process reference never checkpoints: a CP recompute that selected other keys would show. Where
    # the model checkpoints, a large predictor learning rate makes one predictor step change the selection,
    # so that a recompute selecting afresh (not its forward's keys) changes the gradients.
    predictor_lr = 0.3 if checkpointing else 1e-3
    single_model = _model(mode, False, predictor_keys, predictor_lr, predictor_rotary)
    single = _steps(single_model)
    model = _model(mode, checkpointing, predictor_keys, predictor_lr, predictor_rotary)
    cp = ContextParallel(world, cp_mode, "cpu", hcp_size=hcp_size)
    model.enable_context_parallel(cp)
    parallel = _steps(model)
    for (loss_1, grads_1), (loss_n, grads_n) in zip(single, parallel):
        torch.testing.assert_close(torch.tensor(loss_n), torch.tensor(loss_1), **TOL)
        for name, grad in grads_n.items():
            # Each rank holds `world` x its tokens' share (the gathered output's backward sums over ranks).
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / world, grads_1[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    layers = model.controller.layers
    # The predictors stepped on the whole-sequence loss of their heads: the same updates as one process.
    for layer, single_layer in zip(layers, single_model.controller.layers):
        if layer.predictor is not None:
            for p, p_single in zip(layer.predictor.parameters(), single_layer.predictor.parameters()):
                torch.testing.assert_close(p, p_single, **TOL)
        torch.testing.assert_close(layer.sparsity_ema, single_layer.sparsity_ema, **TOL)
        torch.testing.assert_close(layer.recall_ema, single_layer.recall_ema, **TOL)
        torch.testing.assert_close(layer.keep_boost, single_layer.keep_boost, **TOL)  # the recall floor's budget
        torch.testing.assert_close(layer.loss_ema, single_layer.loss_ema, **TOL, equal_nan=True)  # NaN: no predictor
    # A copy of the model (an EMA or teacher copy) runs in the same CP group and equals its source; copying
    # failed on the process groups before. Pickling, which cannot hold them, names what to do instead.
    twin = copy.deepcopy(model)
    assert twin.context_parallel is cp and all(block.attn.context_parallel is cp for block in twin.blocks)
    x0, t = torch.randn(2, 3, 4, 16, 16), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        torch.testing.assert_close(twin(x0, t), model(x0, t))
    with pytest.raises(TypeError, match="ContextParallel holds process groups, which do not pickle"):
        pickle.dumps(model)
    return {
        "paths": [layer.last_path for layer in layers],
        "stage": model.controller.current_stage,
        "sparsity": torch.stack([layer.sparsity_ema for layer in layers]),
        "keep_boost": torch.stack([layer.keep_boost for layer in layers]),
        "predictor": [p.detach().clone() for layer in layers if layer.predictor is not None
                      for p in layer.predictor.parameters()],
    }


@pytest.mark.parametrize("world,cp_mode,hcp_size,mode,checkpointing,predictor_keys,predictor_rotary", [
    (2, "hcp", 0, "dsv", False, 0, 0), (2, "scp", 0, "dsv", True, 0, 0),  # True: checkpointing recomputes
    (4, "hybrid", 2, "dsv", False, 0, 0),  # 4 ranks as 2 x 2: HCP inside SCP
    (2, "scp", 0, "dsv", True, 96, 0),  # the predictor scores a key sample: the same keys as one process
    (4, "hybrid", 2, "dsv", True, 0, 6),  # rotary dims: each rank's tokens rotated by their own positions
    (4, "naive_hcp", 0, "window", False, 0, 0), (2, "hybrid", 0, "window", True, 0, 0),
])
def test_cp_training_steps_equal_one_process(tmp_path, world, cp_mode, hcp_size, mode, checkpointing,
                                             predictor_keys, predictor_rotary):
    ranks = run_distributed(_worker, world, mode, cp_mode, hcp_size, checkpointing, predictor_keys,
                            predictor_rotary, out_dir=tmp_path, timeout_s=120)
    for result in ranks:
        assert result["stage"] == (2 if mode == "dsv" else 1)  # window mode is sparse from the start
        assert all(path.startswith("sparse:") for path in result["paths"]), result["paths"]
        torch.testing.assert_close(result["sparsity"], ranks[0]["sparsity"])
        torch.testing.assert_close(result["keep_boost"], ranks[0]["keep_boost"])
        if mode == "dsv":  # the recall floor widened some budget (and equalled one process, above)
            assert result["keep_boost"].sum() > 0
        for a, b in zip(result["predictor"], ranks[0]["predictor"]):
            torch.testing.assert_close(a, b)
    if hcp_size:
        assert all(f"cp {hcp_size}x{world // hcp_size}" in path for path in ranks[0]["paths"])


def _bad_configurations(rank, world):
    errors = {}

    def expect(name, fn):
        try:
            fn()
        except ValueError as err:
            errors[name] = str(err)

    expect("size", lambda: ContextParallel(3, "hcp", "cpu"))
    expect("mode", lambda: ContextParallel(world, "ring", "cpu"))
    expect("hcp_size", lambda: ContextParallel(world, "hybrid", "cpu", hcp_size=-2))  # 4 % -2 == 0 passed
    x0 = torch.randn(1, 3, 4, 16, 16)
    t = torch.tensor([0.5])
    few_heads = VideoDiT(ModelConfig(in_channels=3, patch=(1, 2, 2), hidden=32, depth=1, heads=2),
                         AttentionConfig(mode="dense", cube=(2, 2, 2)))
    few_heads.enable_context_parallel(ContextParallel(world, "hcp", "cpu"))
    expect("heads", lambda: few_heads(x0, t))
    model = _model("dense")
    model.enable_context_parallel(ContextParallel(world, "scp", "cpu"))
    # A 4 x 6 x 6 grid: 144 tokens, 36 per rank, not a whole number of 8-token cubes.
    expect("split", lambda: model(torch.randn(1, 3, 4, 12, 12), t))
    return errors


def test_bad_configurations_raise_clear_errors(tmp_path):
    errors = run_distributed(_bad_configurations, 4, out_dir=tmp_path, timeout_s=60)[0]
    assert "divides the world size 4" in errors["size"]
    assert "cp_mode must be one of" in errors["mode"]
    assert "cp_hcp must be an int >= 0" in errors["hcp_size"]
    assert "needs at least 4 heads, the model has 2" in errors["heads"]
    assert "whole number of" in errors["split"]


def _nan_on_one_rank(rank, world, context_parallel):
    model = _model("dense")
    if context_parallel:  # else each rank its own batch, as data parallelism runs
        model.enable_context_parallel(ContextParallel(world, "hcp", "cpu"))
    x0 = torch.randn(1, 3, 4, 16, 16)
    if rank == 1:
        x0[..., :8, :] = float("nan")  # under CP only rank 1's chunk of the sequence (grouped order) need see it
    try:
        model(x0, torch.tensor([0.5]))
    except FloatingPointError as err:
        return str(err)
    return None


@pytest.mark.parametrize("context_parallel", [True, False], ids=["context-parallel", "data-parallel"])
def test_nan_on_one_rank_raises_on_every_rank(tmp_path, context_parallel):
    """A rank whose input holds NaN must not raise alone while the other ranks go on into their next
    collective (CP's exchanges; FSDP's gathers and the predictors' gradient all-reduce under data parallelism)."""
    messages = run_distributed(_nan_on_one_rank, 2, context_parallel, out_dir=tmp_path, timeout_s=60)
    assert all(m is not None and "of the run" in m for m in messages), messages


def _untrained_step(rank, world):
    model = _model("dsv")
    model.enable_context_parallel(ContextParallel(world, "scp", "cpu"))
    model.eval()  # a training loop that forgot model.train()
    model.controller.begin_step(0)
    with pytest.warns(UserWarning, match="no forward of this step trained") as record:
        flow_matching_loss(model, torch.randn(1, 3, 4, 16, 16), torch.tensor([0.5]), torch.randn(1, 3, 4, 16, 16))
        model.controller.end_step()
    return len(record)


def test_a_step_that_trained_nothing_warns_under_context_parallelism(tmp_path):
    """The CP path skipped what marks a layer as run this step, so a loop in eval mode (or under no_grad) left
    the predictors untrained without the warning that one process gives."""
    assert run_distributed(_untrained_step, 2, out_dir=tmp_path, timeout_s=60) == [1, 1]


def _reentrant_checkpointing(rank, world):
    model = _model("dsv")
    model.enable_context_parallel(ContextParallel(world, "hybrid", "cpu"))
    model.controller.begin_step(0)
    x = torch.randn(1, 3, 4, 16, 16, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model, x, torch.tensor([0.5]), use_reentrant=True)
    try:
        out.float().pow(2).mean().backward()
    except RuntimeError as err:
        return str(err)
    return None


def test_reentrant_checkpointing_is_refused_under_context_parallelism(tmp_path):
    """The CP path shares the layer's check: under reentrant checkpointing its forward runs without gradients,
    and every rank's recompute raises alike, instead of leaving the predictors silently untrained."""
    messages = run_distributed(_reentrant_checkpointing, 2, out_dir=tmp_path, timeout_s=120)
    assert all(m is not None and "use_reentrant=False" in m for m in messages), messages


def _nan_in_an_evaluation_on_one_rank(rank, world):
    if rank != 0:
        return None  # an evaluation forward on rank 0 alone, as sampling at the end of training may run
    model = _model("dense").eval()
    x0 = torch.full((1, 3, 4, 16, 16), float("nan"))
    try:
        with torch.no_grad():
            model(x0, torch.tensor([0.5]))
    except FloatingPointError as err:
        return str(err)
    return None


def test_nan_in_an_evaluation_on_one_rank_raises_there_without_a_collective(tmp_path):
    """Only training forwards, which every rank makes, decide their checks over the run: an evaluation on one
    rank raises there at once instead of waiting for ranks that never join."""
    messages = run_distributed(_nan_in_an_evaluation_on_one_rank, 2, out_dir=tmp_path, timeout_s=60)
    assert messages[1] is None and "NaN or Inf" in messages[0], messages


def _evaluation_in_one_cp_group(rank, world):
    model = _model("dense").eval()
    model.enable_context_parallel(ContextParallel(2, "hcp", "cpu"))  # 2 data-parallel groups of 2 CP ranks
    if rank >= 2:
        return None  # the second group does not evaluate
    seen = []
    model.controller.layers[0].observer = lambda *args: seen.append(args)
    with torch.no_grad(), pytest.warns(UserWarning, match="observers are not called under context parallelism"):
        out = model(torch.randn(1, 3, 4, 16, 16), torch.tensor([0.5]))
    return bool(torch.isfinite(out).all()) and not seen


def test_an_evaluation_in_one_cp_group_needs_no_other_group(tmp_path):
    """An evaluation forward under CP checks its input over its own CP group only: one data-parallel group
    evaluating alone finishes (a check over the whole run waited for the other group's ranks, which never
    join). An observer set on a layer is not called under CP, and says so."""
    results = run_distributed(_evaluation_in_one_cp_group, 4, out_dir=tmp_path, timeout_s=120)
    assert results == [True, True, None, None], results


def _same_input_twice(rank, world, disagree_on_rank):
    import dsv.modules.attention as attention

    if rank == disagree_on_rank:  # as if this rank's two forwards had selected different keys
        attention._same_selection = lambda a, b: False
    model = _model("dsv", checkpointing=True, predictor_lr=0.0)  # a predictor that does not move: the same keys
    model.enable_context_parallel(ContextParallel(world, "scp", "cpu"))
    torch.manual_seed(1)
    x0, noise, t = torch.randn(2, 3, 4, 16, 16), torch.randn(2, 3, 4, 16, 16), torch.tensor([0.3, 0.8])
    model.controller.begin_step(0)
    flow_matching_loss(model, x0, t, noise).backward()
    model.controller.end_step()
    model.controller.begin_step(1)
    losses = [flow_matching_loss(model, x0, t, noise) for _ in range(2)]  # one input twice, then one backward
    sparse = all(layer.last_path.startswith("sparse") for layer in model.controller.layers)
    try:
        (losses[0] + losses[1]).backward()
    except RuntimeError as err:
        return sparse, str(err)
    return sparse, None


@pytest.mark.parametrize("disagree_on_rank", [None, 1], ids=["keys-agree", "rank-1-disagrees"])
def test_recompute_of_repeated_input_decides_on_every_rank_alike(tmp_path, disagree_on_rank):
    """The same input twice in a step before the backward: a recompute whose forwards' keys differ raises, and
    under context parallelism every rank raises together (a rank raising alone would leave the others
    waiting in the next collective); with equal keys every rank trains on."""
    results = run_distributed(_same_input_twice, 2, disagree_on_rank, out_dir=tmp_path, timeout_s=120)
    assert all(sparse for sparse, _ in results)
    messages = [message for _, message in results]
    if disagree_on_rank is None:
        assert messages == [None, None]
    else:
        assert "another rank of the run" in messages[0]
        assert "same input and selected different keys" in messages[1]


def _layouts_after_switching_mode(rank, world):
    model = _model("dense")
    x0, t = torch.randn(1, 3, 4, 16, 16), torch.tensor([0.5])
    paths = []
    for mode in ("hcp", "scp"):
        model.enable_context_parallel(ContextParallel(world, mode, "cpu"))
        model(x0, t)
        paths.append(model.blocks[0].attn.last_path)
    return paths


def test_enabling_another_context_parallel_plans_its_own_layouts(tmp_path):
    """A layer's cached layout holds its `ContextParallel`'s process groups: enabling another one (here SCP
    after HCP) must not run the old layout."""
    for hcp_path, scp_path in run_distributed(_layouts_after_switching_mode, 2, out_dir=tmp_path, timeout_s=60):
        assert "cp 2x1" in hcp_path and "cp 1x2" in scp_path, (hcp_path, scp_path)


def test_scp_volumes_measured_in_a_step_apply_from_the_next_step():
    from types import SimpleNamespace

    cp = ContextParallel.__new__(ContextParallel)  # the bookkeeping alone: no process group needed
    cp._fetched, cp._fetched_pending = {}, {}
    layer = SimpleNamespace(layer_index=3, controller=SimpleNamespace(forward_id=7))
    cp._fetched_pending[3] = (7, ((2, (0.5, 0.5)),))  # measured during forward 7 (a profiling step)
    assert cp._fetched_for(layer) is None  # forward 7's recompute still plans with the old volumes
    layer.controller.forward_id = 8
    assert cp._fetched_for(layer) == ((2, (0.5, 0.5)),)
    # Saved between steps with a measurement still pending: the resumed run's first step applies it, even
    # though its forward ids start afresh (here equal to the measuring one's).
    cp._fetched_pending[3] = (8, ((2, (0.25, 0.75)),))
    restored = ContextParallel.__new__(ContextParallel)
    restored.load_state_dict(cp.state_dict())
    assert restored._fetched_for(layer) == ((2, (0.25, 0.75)),) and not restored._fetched_pending
