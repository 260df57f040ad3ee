"""DSVAttention: every mode against a float64 dense reference, checkpointing, and bad input."""

import copy
import dataclasses
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from dsv.modules.attention import DSVAttention
from dsv.modules.config import AttentionConfig
from dsv.modules.controller import DSVController
from dsv.ops import cube_permutation, window_index

GRID = (4, 4, 4)
DIM, HEADS = 32, 2
# float64 end to end: only summation order differs from the reference, so errors are ~1e-15 relative.
TOL64 = dict(rtol=1e-9, atol=1e-10)


class Wrapper(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn = DSVAttention(DIM, HEADS, cfg=cfg)
        self.controller = DSVController(cfg).attach(self)

    def forward(self, x):
        return self.attn(x, GRID)


def manual_dense(layer: DSVAttention, x: torch.Tensor) -> torch.Tensor:
    """Dense attention in raster order, written without DSV's grouping or ops."""
    b, s, _ = x.shape
    q, k, v = layer.to_qkv(x).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = layer.q_norm(q), layer.k_norm(k)
    attn = torch.softmax((q @ k.transpose(-1, -2)) * layer.scale, dim=-1)
    return layer.to_out((attn @ v).transpose(1, 2).reshape(b, s, -1))


def make(mode: str, **overrides) -> Wrapper:
    torch.manual_seed(0)
    cfg = AttentionConfig(**{"mode": mode, "cube": (2, 2, 2), "sample_stride": 4, **overrides})
    model = Wrapper(cfg).double()
    # Non-zero output projection (DiT blocks zero-init it) so that outputs and gradients are informative.
    torch.nn.init.normal_(model.attn.to_out.weight)
    return model


def in_stage2(x: torch.Tensor, **overrides) -> Wrapper:
    """A dsv-mode layer after one stage-1 training step on `x`: in stage 2, sparse, at the start of step 1."""
    model = make("dsv", max_stage1_steps=1, sparse_threshold=0.0, profile_every_stage1=1, **overrides)
    model.controller.begin_step(0)
    model(x).sum().backward()
    model.controller.end_step()
    model.zero_grad()
    model.controller.begin_step(1)
    return model


def grads(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()
                                  if p.grad is not None and "predictor" not in n}


@pytest.mark.parametrize("mode", ["dense", "window", "dsv"])
def test_grouped_input_is_the_raster_result_permuted(mode):
    """`grouped=True` (a model that permutes its tokens once) skips the layer's own permutation only; in
    dsv mode the layer runs sparse in stage 2, its selection read from the grouped hidden states."""
    model = make(mode, max_stage1_steps=0, sparse_threshold=0.0)
    x = torch.randn(2, 64, DIM, dtype=torch.float64)
    if mode == "dsv":
        model.attn.sparsity_ema.fill_(0.5)
        model.controller.stage.fill_(2)
        model.controller._refresh_host_state()
        model.attn.dispatch()
        assert model.attn.runs_sparse()
    perm, _ = cube_permutation(GRID, model.attn.cfg.cube)
    with torch.no_grad():  # no predictor step between the two calls
        torch.testing.assert_close(model.attn(x.index_select(1, perm), GRID, grouped=True),
                                   model.attn(x, GRID).index_select(1, perm), **TOL64)
    if mode == "dsv":
        assert model.attn.last_path == "sparse:reference"


def test_dense_mode_equals_plain_attention():
    model = make("dense")
    x = torch.randn(2, 64, DIM, dtype=torch.float64)
    out = model(x)
    assert model.attn.last_path == "dense:sdpa"
    torch.testing.assert_close(out, manual_dense(model.attn, x), **TOL64)


def test_oracle_with_all_keys_equals_dense_forward_and_backward():
    oracle = make("oracle", keep_floor_blocks=10_000, max_stage1_steps=1)
    dense = make("dense")
    x = torch.randn(2, 64, DIM, dtype=torch.float64)
    oracle.controller.begin_step(0)
    oracle(x)
    oracle.controller.end_step()
    assert oracle.controller.current_stage == 2
    oracle.attn.use_sparse.fill_(True)
    oracle.attn._refresh_host_state()
    oracle.controller.begin_step(1)
    out_o, gx_o, gp_o = grads(oracle, x)
    assert oracle.attn.last_path == "sparse:reference"
    out_d, gx_d, gp_d = grads(dense, x)
    torch.testing.assert_close(out_o, out_d, **TOL64)
    torch.testing.assert_close(gx_o, gx_d, **TOL64)
    for name in gp_d:
        torch.testing.assert_close(gp_o[name], gp_d[name], **TOL64)


def test_window_mode_attends_to_the_window_only():
    grid, seq = (4, 8, 8), 256  # large enough that a 2/3 window leaves cubes out
    model = make("window")
    layer = model.attn
    x = torch.randn(1, seq, DIM, dtype=torch.float64)
    out = layer(x, grid)
    assert layer.last_path == "sparse:reference"
    perm, inv = cube_permutation(grid, (2, 2, 2))
    q, k, v = layer.to_qkv(x[:, perm]).view(1, seq, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = layer.q_norm(q), layer.k_norm(k)
    index = window_index(grid, (2, 2, 2), 8, 1, HEADS, 2 / 3)
    groups = seq // 8
    assert index.counts[0, 0, 0] < groups
    # Dense reference with the window as a boolean mask.
    blocks = torch.zeros(1, HEADS, groups, groups, dtype=torch.bool)
    for g in range(groups):
        blocks[0, :, g, index.indices[0, 0, g].long()] = True
    mask = blocks.repeat_interleave(8, dim=2).repeat_interleave(8, dim=3)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale)
    expected = layer.to_out(expected.transpose(1, 2).reshape(1, seq, -1))[:, inv]
    torch.testing.assert_close(out, expected, **TOL64)



@pytest.mark.parametrize("rotary", [0, 6], ids=["plain-predictor", "rotary-predictor"])
def test_stage2_sparse_with_checkpointing_matches_plain_backward(rotary):
    x = torch.randn(2, 64, DIM, dtype=torch.float64)

    def run(checkpointing: bool):
        model = in_stage2(x, profile_every_stage2=1, predictor_rotary=rotary)
        xin = x.clone().requires_grad_(True)
        if checkpointing:
            out = torch.utils.checkpoint.checkpoint(model, xin, use_reentrant=False)
        else:
            out = model(xin)
        out.pow(2).sum().backward()
        assert model.attn.last_path == "sparse:reference"
        return out.detach(), xin.grad, model.attn.to_qkv.weight.grad

    assert_checkpointing_matches_plain(run)


def forward_and_input_gradients(model: Wrapper, outs, ins) -> tuple:
    """What a checkpointed run must reproduce: the outputs, the inputs' and the qkv weight's gradients."""
    return (*(out.detach() for out in outs), *(x.grad for x in ins), model.attn.to_qkv.weight.grad)


def assert_checkpointing_matches_plain(run) -> None:
    """`run(checkpointing)` with and without activation checkpointing gives the same results."""
    for plain, checkpointed in zip(run(False), run(True)):
        torch.testing.assert_close(plain, checkpointed, **TOL64)


@pytest.mark.parametrize("order", ["forward-forward-backward", "micro-batches"])
def test_two_checkpointed_forwards_of_a_step_match_plain_backward(order):
    """Two training forwards of one step (the predictor steps in the first): a loss over both, or two
    micro-batches each with its backward. Each checkpointing recompute must find its own forward's keys,
    not the other forward's nor a fresh selection."""
    x1, x2 = torch.randn(1, 64, DIM, dtype=torch.float64), torch.randn(1, 64, DIM, dtype=torch.float64)

    def run(checkpointing: bool):
        model = in_stage2(x1, keep_floor_blocks=1)
        ins = [x.clone().requires_grad_(True) for x in (x1, x2)]
        call = (lambda x: torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)) if checkpointing else model
        if order == "micro-batches":
            outs = []
            for x, power in zip(ins, (2, 3)):
                outs.append(call(x))
                outs[-1].pow(power).sum().backward()
        else:
            outs = [call(x) for x in ins]
            (outs[0].pow(2).sum() + outs[1].pow(3).sum()).backward()
        assert model.attn.last_path == "sparse:reference"
        return forward_and_input_gradients(model, outs, ins)

    assert_checkpointing_matches_plain(run)


def test_an_eval_mode_forward_with_gradients_recomputes_its_own_keys():
    """diffusers checkpoints whenever gradients are on, whatever the train/eval mode: a training forward's keys
    pending, an eval-mode forward's checkpointing recompute took them (the only pending entry) for its own, and its
    gradients belonged to other keys. Every forward with gradients now remembers its keys."""
    x1, x2 = torch.randn(1, 64, DIM, dtype=torch.float64), torch.randn(1, 64, DIM, dtype=torch.float64)

    def run(checkpointing: bool):
        model = in_stage2(x1, keep_floor_blocks=1)
        ins = [x.clone().requires_grad_(True) for x in (x1, x2)]
        call = (lambda x: torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)) if checkpointing else model
        model.train()
        first = call(ins[0])  # a training forward: learns, its keys pending
        model.eval()
        second = call(ins[1])  # with gradients in eval mode; its backward alone
        second.pow(2).sum().backward()
        assert model.attn.last_path == "sparse:reference"
        return (second.detach(), ins[1].grad, model.attn.to_qkv.weight.grad, first.detach())

    assert_checkpointing_matches_plain(run)


@pytest.mark.parametrize("predictor_lr", [1e-3, 0.3], ids=["same-keys", "keys-changed"])
def test_two_forwards_of_one_input_in_a_step_match_plain_backward_or_raise(predictor_lr):
    """The same input twice in one step before the backward: the recompute cannot tell the two forwards
    apart by their input. While both selected the same keys that is harmless and the gradients equal the
    plain backward's; once the predictor's step between them changed the keys, it raises instead of
    computing one forward's gradients with the other's keys (a plain backward differs there)."""
    torch.manual_seed(3)
    x = torch.randn(1, 64, DIM, dtype=torch.float64)

    def run(checkpointing: bool):
        model = in_stage2(x, keep_floor_blocks=1, predictor_lr=predictor_lr)
        ins = [x.clone().requires_grad_(True) for _ in range(2)]
        call = (lambda x: torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)) if checkpointing else model
        outs = [call(x) for x in ins]
        (outs[0].pow(2).sum() + outs[1].pow(3).sum()).backward()
        return forward_and_input_gradients(model, outs, ins)

    plain = run(False)
    if predictor_lr == 0.3:
        with pytest.raises(RuntimeError, match="same input and selected different keys"):
            run(True)
        return
    for a, b in zip(plain, run(True)):
        torch.testing.assert_close(a, b, **TOL64)


def test_two_forwards_whose_inputs_have_equal_sums_match_plain_backward():
    """Two different inputs of one step with the same total (the second is the first with its tokens reversed)
    and keys that differ (the predictor's step between them changes them): the recompute tells them apart.
    A fingerprint of one sum matched them and raised "same input"; it matched independent random inputs about
    once in a thousand pairs."""
    torch.manual_seed(3)
    x1 = torch.randn(1, 64, DIM, dtype=torch.float64)
    x2 = x1.flip(1)

    def run(checkpointing: bool):
        model = in_stage2(x1, keep_floor_blocks=1, predictor_lr=0.3)
        ins = [x.clone().requires_grad_(True) for x in (x1, x2)]
        call = (lambda x: torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)) if checkpointing else model
        outs = [call(x) for x in ins]
        (outs[0].pow(2).sum() + outs[1].pow(3).sum()).backward()
        return forward_and_input_gradients(model, outs, ins)

    assert_checkpointing_matches_plain(run)


@pytest.mark.parametrize("with_controller", [True, False])
def test_window_layers_keep_no_selection_between_steps(with_controller):
    """A window's keys depend on the grid alone: its recompute selects them again, and nothing piles up per
    forward, also without a controller or its begin_step (window mode needs neither)."""
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    if with_controller:
        model = make("window")
    else:
        torch.manual_seed(0)
        model = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode="window", cube=(2, 2, 2))).double()
    call = model if with_controller else (lambda inp: model(inp, GRID))
    for _ in range(5):
        out = torch.utils.checkpoint.checkpoint(call, x.clone().requires_grad_(True), use_reentrant=False)
        out.sum().backward()
    layer = model.attn if with_controller else model
    assert layer.last_path.startswith("sparse:") and not any(layer._selection_cache.values())


def test_two_forwards_of_one_input_on_different_grids_match_plain_backward():
    """One input read as two grids of the same token count in one step before the backward (the predictor
    steps between them and changes the keys): each checkpointing recompute must find its own grid's keys,
    though the input (and its order-blind fingerprint) is the same."""
    torch.manual_seed(3)
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    grids = [GRID, (2, 8, 4)]

    def run(checkpointing: bool):
        model = in_stage2(x, keep_floor_blocks=1, predictor_lr=0.3)
        ins = [x.clone().requires_grad_(True) for _ in grids]
        if checkpointing:
            outs = [torch.utils.checkpoint.checkpoint(model.attn, xin, grid, use_reentrant=False)
                    for xin, grid in zip(ins, grids)]
        else:
            outs = [model.attn(xin, grid) for xin, grid in zip(ins, grids)]
        (outs[0].pow(2).sum() + outs[1].pow(3).sum()).backward()
        assert model.attn.last_path == "sparse:reference"
        return forward_and_input_gradients(model, outs, ins)

    assert_checkpointing_matches_plain(run)


def test_recompute_without_its_forward_after_a_predictor_step_raises():
    """A recompute whose forward was not remembered must not select again once the predictor has stepped:
    its keys would differ from the forward's and the gradients would silently belong to other keys."""
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    model = in_stage2(x)
    out = torch.utils.checkpoint.checkpoint(model, x.clone().requires_grad_(True), use_reentrant=False)
    model.attn._selection_cache.clear()
    with pytest.raises(RuntimeError, match="found no selection of its forward"):
        out.sum().backward()


@pytest.mark.parametrize("stage", [1, 2])
def test_reentrant_checkpointing_is_refused_not_left_untrained(stage):
    """Under reentrant checkpointing the forward runs without gradients (no predictor step, no profile) and
    the recompute runs inside the backward: the predictor would never learn and the model stay dense, with
    nothing said. The recompute raises instead; the non-reentrant form trains."""
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    model = make("dsv", profile_every_stage1=1) if stage == 1 else in_stage2(x)
    model.controller.begin_step(model.controller.step)
    out = torch.utils.checkpoint.checkpoint(model, x.clone().requires_grad_(True), use_reentrant=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        out.sum().backward()
    model.controller.begin_step(model.controller.step + 1)
    weights = model.attn.predictor.q_proj.weight.detach().clone()
    torch.utils.checkpoint.checkpoint(model, x.clone().requires_grad_(True), use_reentrant=False).sum().backward()
    assert not torch.equal(weights, model.attn.predictor.q_proj.weight)


@pytest.mark.parametrize("mode", ["dense", "window", "oracle"])
def test_reentrant_checkpointing_trains_the_modes_without_a_predictor(mode):
    """Dense, window and oracle layers have no predictor to train: reentrant checkpointing runs them."""
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    model = make(mode)
    model.controller.begin_step(0)
    torch.utils.checkpoint.checkpoint(model, x.clone().requires_grad_(True), use_reentrant=True).sum().backward()
    assert all(p.grad is not None for p in model.attn.to_qkv.parameters())


def test_observer_sees_each_forward_once_under_checkpointing():
    """The measurement hook runs in the forward, not again in the checkpointing recompute, which would count
    the same forward twice."""
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    model = in_stage2(x)
    seen = []
    model.attn.observer = lambda layer, hidden, q, k, grid: seen.append(q.shape)
    out = torch.utils.checkpoint.checkpoint(model, x.clone().requires_grad_(True), use_reentrant=False)
    out.sum().backward()
    assert len(seen) == 1


def test_recompute_reselects_the_forward_keys_without_keeping_the_index():
    """For the checkpointing recompute the layer keeps the pooled low-rank rows and budgets, not the index
    (which grows with S²): re-selecting from them gives the forward's keys, also after the predictor's step
    in that forward, and shares no memory with the forward's index."""
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    model = in_stage2(x)
    layer = model.attn
    hidden = x.index_select(1, cube_permutation(GRID, layer.cfg.cube)[0])
    q, k, _ = layer.to_qkv(hidden).view(1, 64, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
    weights = layer.predictor.q_proj.weight.detach().clone()
    index = layer.prepare_index(hidden, q, k, GRID)
    assert index is not None, "stage 2 with threshold 0 must run sparse"
    assert not torch.equal(weights, layer.predictor.q_proj.weight), "the predictor must have stepped in between"
    (_, reselect, _), = layer._selection_cache[layer._forward_key(q, GRID)]
    again = reselect()
    assert torch.equal(again.indices, index.indices) and torch.equal(again.counts, index.counts)
    assert again.indices.data_ptr() != index.indices.data_ptr()


@pytest.fixture(params=[False, True], ids=["params-kept", "params-overwritten"])
def conversion_overwrites_params(request):
    """Both ways `Module.to` may convert: in place (the default), or into new Parameter objects
    (`torch.__future__.set_overwrite_module_params_on_conversion(True)`)."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_overwrite_module_params_on_conversion(before)


def test_dsv_state_keeps_float32_when_the_model_is_cast_to_half_precision(conversion_overwrites_params):
    """A model cast to bf16 (as diffusers pipelines do) casts its weights, not DSV's EMAs and predictor: in
    bf16 their small steps would round away. A cast to float64 (wider) applies to them too."""
    x = torch.randn(1, 64, DIM)
    torch.manual_seed(0)
    model = Wrapper(AttentionConfig(mode="dsv", cube=(2, 2, 2), sample_stride=4, max_stage1_steps=1,
                                    sparse_threshold=0.0, profile_every_stage1=1))  # float32
    model.controller.begin_step(0)
    model(x).sum().backward()  # a stage-1 step: the predictor's AdamW moments exist, in float32
    model.controller.end_step()
    model.controller.begin_step(1)
    layer = model.attn
    # Values bf16 cannot hold: the cast must leave them as they were, not round them and widen them back.
    layer.sparsity_ema.fill_(0.9234567)
    state = {name: t.detach().clone() for name, t in (*layer.predictor.named_parameters(),
                                                       ("sparsity_ema", layer.sparsity_ema))}
    model.to(torch.bfloat16)
    assert layer.to_qkv.weight.dtype == torch.bfloat16
    for name, value in (*layer.predictor.named_parameters(), ("sparsity_ema", layer.sparsity_ema)):
        assert torch.equal(value, state[name]), name
    assert all(p.dtype == torch.float32 for p in layer.predictor.parameters())
    assert all(v.dtype == torch.float32 for entry in layer.predictor.optimizer.state.values() for v in entry.values())
    assert all(b.dtype == torch.float32 for b in (layer.sparsity_ema, layer.recall_ema, layer.loss_ema,
                                                   layer.keep_fraction, layer.keep_boost))
    assert layer.use_sparse.dtype == torch.bool
    weights = layer.predictor.q_proj.weight.detach().clone()
    model(x.to(torch.bfloat16)).float().sum().backward()  # trains on: the predictor steps in float32
    assert layer.predictor.q_proj.weight.dtype == torch.float32
    assert not torch.equal(weights, layer.predictor.q_proj.weight)
    model.double()
    assert layer.predictor.q_proj.weight.dtype == layer.sparsity_ema.dtype == torch.float64
    weights = layer.predictor.q_proj.weight.detach().clone()
    model.controller.end_step()
    model.controller.begin_step(2)
    model(x.double()).sum().backward()  # the moments went to float64 with the weights: the predictor steps on
    assert not torch.equal(weights, layer.predictor.q_proj.weight)


def test_a_loaded_stage2_state_gets_the_stage2_predictor_learning_rate():
    """The predictor's learning rate is not in the state_dict: a model loading a stage-2 state (outside the
    trainer, which restores the predictors' optimizers) must still train its predictors at the stage-2 rate."""
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    trained = in_stage2(x)
    assert trained.controller.current_stage == 2
    fresh = make("dsv", max_stage1_steps=1, sparse_threshold=0.0, profile_every_stage1=1)
    rate = fresh.attn.predictor.optimizer.param_groups[0]["lr"]
    fresh.load_state_dict(trained.state_dict())
    cfg = fresh.attn.cfg
    assert fresh.controller.current_stage == 2 and rate == cfg.predictor_lr
    assert fresh.attn.predictor.optimizer.param_groups[0]["lr"] == cfg.predictor_lr * cfg.stage2_lr_scale
    with pytest.raises(ValueError, match="max_stage1_steps=3 is below"):
        AttentionConfig(min_stage1_steps=8, max_stage1_steps=3)


def test_bad_inputs_raise_clear_errors():
    model = make("dense")
    with pytest.raises(ValueError, match=r"\[B, S, C\]"):
        model.attn(torch.randn(64, DIM, dtype=torch.float64), GRID)
    with pytest.raises(ValueError, match="grid"):
        model.attn(torch.randn(1, 60, DIM, dtype=torch.float64), GRID)
    bad = torch.randn(1, 64, DIM, dtype=torch.float64)
    bad[0, 3, 1] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        model(bad)
    window = make("window")
    with pytest.raises(ValueError, match="window attention .* needs whole cubes: grid T=3 is not divisible"):
        window.attn(torch.randn(1, 3 * 4 * 4, DIM, dtype=torch.float64), (3, 4, 4))
    lonely = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode="dsv", cube=(2, 2, 2)))
    with pytest.raises(RuntimeError, match="DSVController"):
        lonely(torch.randn(1, 64, DIM), GRID)
    with pytest.raises(ValueError, match="attention.mode"):
        dataclasses.replace(AttentionConfig(), mode="sparse")
    with pytest.raises(ValueError, match=r"attention.recall_target must be in \[0, 1\]"):
        AttentionConfig(recall_target=1.5)
    for bad in (-1, 1):
        with pytest.raises(ValueError, match=r"attention.predictor_keys must be an int, 0 \(every key\) or >= 2"):
            AttentionConfig(predictor_keys=bad)
    with pytest.raises(ValueError, match="min_stage1_steps and max_stage1_steps must be >= 0"):
        AttentionConfig(max_stage1_steps=-3)


@pytest.mark.parametrize("mode", ["dense", "dsv", "window"])
def test_inputs_of_the_wrong_form_name_x_or_grid(mode):
    """Each raised deep inside before (a matmul's shape or dtype error, a NaN predictor loss for an empty
    batch, a grid silently truncated to ints)."""
    model = make(mode)
    expected = rf"expects x of shape \[B, S, C\] with B >= 1 and C = {DIM}, floating"
    for x in (torch.randn(1, 64, DIM + 1, dtype=torch.float64), torch.randn(0, 64, DIM, dtype=torch.float64),
              torch.ones(1, 64, DIM, dtype=torch.int64)):
        with pytest.raises(ValueError, match=expected):
            model.attn(x, GRID)
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    for grid in ((4.5, 4, 4), ("4", "4", "4"), "444", (True, 8, 8)):
        with pytest.raises(ValueError, match="grid must be a sequence of three ints"):
            model.attn(x, grid)
    import numpy as np

    assert model.attn(x, (np.int64(4), torch.tensor(4), 4)).shape == x.shape  # integers of any library
    with pytest.raises(ValueError, match="x is torch.float32 but the layer's weights are torch.float64: cast one"):
        model.attn(x.float(), GRID)  # a matmul's dtype error before


@pytest.mark.parametrize("kwargs,match", [
    (dict(dim=0, heads=2), "dim must be a positive int, got 0"),
    (dict(dim=DIM, heads=0), "heads must be a positive int, got 0"),
    (dict(dim=DIM, heads=-2), "heads must be a positive int, got -2"),
    (dict(dim=DIM, heads=2, head_dim=0), "head_dim must be a positive int, got 0"),  # was replaced by dim // heads
    (dict(dim=DIM, heads=2, cfg={"mode": "dsv"}), "cfg must be a dsv.AttentionConfig or None, got dict"),
])
def test_bad_constructor_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DSVAttention(**kwargs)


def test_nan_in_q_or_k_with_finite_input_raises_at_the_next_profile():
    """Diverged projections make q/k NaN while x is finite: before, the NaN rows counted as the sparsest heads
    there are and the predictor went NaN in silence; now the profiling step names the layer and the cause."""
    model = make("dsv", profile_every_stage1=1)
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    with torch.no_grad():
        model.attn.to_qkv.weight[0, 0] = float("nan")  # the first q channel of head 0
    model.controller.begin_step(0)
    with pytest.raises(FloatingPointError, match="DSVAttention layer 0: NaN or Inf in the attention's q or k while "
                                                 "its input x is finite"):
        model(x)
    assert torch.isnan(model.attn.sparsity_ema).all()  # never measured: the NaN did not reach the EMA



@pytest.mark.parametrize("section,field,value", [
    ("attention", "cube", (2.7, 4, 4)),  # int() would truncate it to (2, 4, 4) without a word
    ("attention", "kv_block", 16.5),
    ("attention", "predictor_keys", True),
    ("attention", "check_finite", "yes"),
    ("attention", "theta", "0.9"),
    ("model", "patch", (1.0, 4, 4)),
    ("model", "depth", 2.0),
    ("optim", "betas", ("0.9", 0.999)),
    ("train", "steps", 10.5),
    ("parallel", "cp", True),
])
def test_config_values_of_the_wrong_type_name_their_field(section, field, value):
    """Configs built in Python or read from a stored JSON config are not parsed: a value of the wrong type
    raises naming `section.field`, instead of being truncated or failing at the first forward."""
    from dsv.train.config import Config

    cls = type(getattr(Config(), section))
    with pytest.raises(ValueError, match=rf"^{section}\.{field} must be "):
        cls(**{field: value})


def test_config_takes_numpy_scalars_as_python_numbers():
    """Values computed with numpy (a sweep script) are numbers too: stored as Python ints and floats, so that
    the config serialises and compares as before."""
    import numpy as np

    from dsv.modules.dit import ModelConfig

    cfg = AttentionConfig(cube=tuple(np.array([2, 4, 4])), theta=np.float32(0.5), kv_block=np.int64(16))
    assert cfg.cube == (2, 4, 4) and cfg.kv_block == 16 and cfg.theta == 0.5
    assert all(type(v) is int for v in (*cfg.cube, cfg.kv_block)) and type(cfg.theta) is float
    assert type(ModelConfig(hidden=np.int64(64)).hidden) is int

def test_model_builds_on_the_meta_device():
    """Large models are built on meta and materialised by FSDP: construction must not read buffers."""
    from dsv.modules.dit import ModelConfig, VideoDiT

    with torch.device("meta"):
        model = VideoDiT(ModelConfig(hidden=64, depth=2, heads=2), AttentionConfig(cube=(2, 2, 2)))
    assert all(p.is_meta for p in model.parameters())
    assert model.controller.current_stage == 1 and not model.controller.layers[0].runs_sparse()


def test_head_rms_norm_keeps_the_input_dtype_under_autocast():
    """q and k must leave the norm in v's dtype whatever autocast's policy for rms_norm (fp32 on CUDA from
    torch 2.12), and the fp32 weight must still learn."""
    from dsv.modules.attention import HeadRMSNorm

    norm = HeadRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 40, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    # bf16 output of an fp32-accumulated norm, with a bf16-rounded weight: a few bf16 ulps (2^-8 relative).
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32
    assert torch.isfinite(norm.weight.grad).all() and norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["dense", "window"])
def test_training_after_a_forward_under_inference_mode(mode):
    """Sampling under torch.inference_mode fills the layer's caches (permutation, window index); tensors made
    there can never be saved for backward, so the training that follows must not find them in the caches."""
    from dsv.modules.dit import ModelConfig, VideoDiT
    from dsv.ops.grouping import _cached_permutation_on

    # The device permutations are one cache shared by every layer and model: empty it, so that this test
    # fills it under inference mode whatever ran before.
    _cached_permutation_on.cache_clear()
    layer = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode=mode, cube=(2, 2, 2)))
    x = torch.randn(1, 64, DIM)
    with torch.inference_mode():
        layer(x, GRID)
    x = x.clone().requires_grad_(True)
    layer(x, GRID).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # The same through a model, which permutes its tokens once for all blocks.
    _cached_permutation_on.cache_clear()
    model = VideoDiT(ModelConfig(hidden=DIM, depth=1, heads=HEADS), AttentionConfig(mode=mode, cube=(2, 2, 2)))
    video, t = torch.randn(1, 3, 4, 16, 16), torch.rand(1)
    with torch.inference_mode():
        model(video, t)
    video = video.clone().requires_grad_(True)
    model(video, t).sum().backward()
    assert video.grad is not None and torch.isfinite(video.grad).all()


def test_model_permuting_once_equals_every_layer_permuting():
    """`VideoDiT` runs its blocks on tokens in grouped order: the same output as a raster-order model whose
    every attention layer permutes its own input and output (float64: only summation order differs)."""
    from dsv.modules.dit import ModelConfig, VideoDiT, modulate, sincos_position_3d, timestep_embedding

    torch.manual_seed(0)
    model = VideoDiT(ModelConfig(hidden=32, depth=2, heads=2, patch=(1, 2, 2)),
                     AttentionConfig(mode="dense", cube=(1, 2, 2))).double()
    for p in model.parameters():  # the zero-initialised output paths would hide a wrong order
        if not p.abs().sum():
            torch.nn.init.normal_(p, std=0.1)
    video, t = torch.randn(2, 3, 2, 12, 8, dtype=torch.float64), torch.rand(2, dtype=torch.float64)
    grid = model.token_grid(video.shape)
    tokens = model.patch_embed(video).flatten(2).transpose(1, 2)
    tokens = tokens + sincos_position_3d(grid, 32, video.device).to(tokens.dtype)
    cond = model.t_embed(timestep_embedding(t, 256).to(tokens.dtype))
    t_mod = model.t_block(cond).view(-1, 6, 32)
    for block in model.blocks:
        shift1, scale1, gate1, shift2, scale2, gate2 = (block.scale_shift_table[None] + t_mod).unbind(1)
        tokens = tokens + gate1[:, None] * block.attn(modulate(block.norm1(tokens), shift1, scale1), grid)
        tokens = tokens + gate2[:, None] * block.mlp(modulate(block.norm2(tokens), shift2, scale2))
    shift, scale = (model.final_table[None] + cond[:, None]).unbind(1)
    reference = model.unpatchify(model.final_linear(modulate(model.final_norm(tokens), shift, scale)), grid)
    torch.testing.assert_close(model(video, t), reference, **TOL64)


def test_residual_stream_is_contiguous_in_every_block():
    """The patch embedding's transposed view must not become the residual stream's layout: its strides carry
    through every elementwise op, and each norm, linear and gather then copies the stream again."""
    from dsv.modules.dit import ModelConfig, VideoDiT

    model = VideoDiT(ModelConfig(hidden=32, depth=2, heads=2), AttentionConfig(mode="dense", cube=(2, 2, 2)))
    layouts = []
    for block in model.blocks:
        block.register_forward_hook(lambda _, args, out: layouts.append((args[0].is_contiguous(), out.is_contiguous())))
    model(torch.randn(1, 3, 4, 16, 16), torch.rand(1)).sum().backward()
    assert layouts == [(True, True)] * 2


def test_each_forward_of_a_step_selects_its_own_keys():
    """Gradient accumulation: a second training forward in the same step must not reuse the first's keys."""
    model = make("dsv", max_stage1_steps=1, sparse_threshold=0.0, profile_every_stage1=1, keep_floor_blocks=2)
    x1, x2 = torch.randn(1, 64, DIM, dtype=torch.float64), torch.randn(1, 64, DIM, dtype=torch.float64)
    model.controller.begin_step(0)
    model(x1).sum().backward()
    model.controller.end_step()
    model.controller.begin_step(1)
    model(x1).sum().backward()
    second = model(x2)  # same step, other input
    assert model.attn.last_path == "sparse:reference"
    with torch.no_grad():
        own_keys = model(x2)  # selects for x2 with the same predictor state
    torch.testing.assert_close(second.detach(), own_keys, **TOL64)


def test_sequences_shorter_than_the_sample_stride_train():
    model = make("dsv", sample_stride=64, profile_every_stage1=1)  # 32 tokens < stride 64
    x = torch.randn(1, 32, DIM, dtype=torch.float64)
    for step in range(40):
        model.controller.begin_step(step)
        model.attn(x, (2, 4, 4)).sum().backward()
        model.controller.end_step()
    assert not torch.isnan(model.attn.sparsity_ema).any()


def profiled_recalls(recall_target: float, steps: int = 6, stage1_steps: int = 1
                     ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-step measured recall (the EMA with momentum 0, so each is that step's own) of a layer profiled
    every step on fixed inputs, with no model update: only the recall boost differs between targets."""
    model = make("dsv", max_stage1_steps=stage1_steps, sparse_threshold=0.0, profile_every_stage1=1,
                 profile_every_stage2=1, keep_floor_blocks=1, ema_momentum=0.0, recall_target=recall_target,
                 predictor_lr=0.0)
    x = torch.randn(2, 64, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    recalls = []
    for step in range(steps):
        model.controller.begin_step(step)
        model(x)
        model.controller.end_step()
        recalls.append(model.attn.recall_ema.clone())
    return recalls, model.attn.keep_boost.clone()


def test_recall_boost_waits_for_stage_2_and_starts_from_stage_1s_recall():
    """In stage 1 the predictor is still learning: its low recall must not wind the budget up. At the switch
    the boost takes one step from the smoothed stage-1 recall, so the first sparse steps keep their mass."""
    recalls, boost = profiled_recalls(1.0, steps=4, stage1_steps=8)
    assert boost.abs().sum() == 0
    recalls, boost = profiled_recalls(1.0, steps=4, stage1_steps=4)  # switches after step 3, no profile since
    theta = AttentionConfig().theta
    torch.testing.assert_close(boost, (theta - recalls[-1].double()).clamp(0, 1), **TOL64)
    assert (boost > 0).all()


def test_recall_target_widens_the_budget_until_the_selection_keeps_its_mass():
    theta = AttentionConfig().theta
    plain, plain_boost = profiled_recalls(0.0, steps=10)
    held, boost = profiled_recalls(1.0, steps=10)
    assert plain_boost.abs().sum() == 0  # off: the paper's budget
    torch.testing.assert_close(held[0], plain[0], **TOL64)  # the first step measures before any boost
    assert (boost > 0).all()
    # Each step samples other rows, the same in both runs: more kept blocks never lose mass there (the
    # selection is top-k by predicted score).
    assert all((h >= p - 1e-12).all() for h, p in zip(held, plain))
    # After two profiling steps the recall hovers at the target (theta); without the boost it stays below.
    settled = torch.stack(held[2:]).mean(0)
    assert (settled - theta).abs().max() < 0.03, settled
    assert (torch.stack(plain[2:]).mean(0) < theta - 0.08).all(), "setup: the plain budget must miss mass"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_grid_the_cube_does_not_tile_runs_the_triton_kernels_on_gpu():
    """Grid (3, 6, 10) with 2x4x4 cubes: 64 tokens in whole cubes, 116 in partial ones, a last group of 20.
    Keeping every key block, the sparse Triton path (estimation skipped: oracle) equals dense attention in
    float32, output and input gradient."""
    grid, dim, heads = (3, 6, 10), 128, 2
    cfg = AttentionConfig(mode="oracle", cube=(2, 4, 4), keep_floor_blocks=100, sparse_threshold=0.0,
                          speed_dispatch=False)
    layer = DSVAttention(dim, heads, cfg=cfg).cuda()
    DSVController(cfg).attach(layer)
    layer.sparsity_ema.fill_(0.5)
    layer.controller.stage.fill_(2)
    layer.controller._refresh_host_state()
    layer.dispatch()
    reference = copy.deepcopy(layer).float()
    layer = layer.to(torch.bfloat16)
    x = torch.randn(1, math.prod(grid), dim, device="cuda")
    x_bf16, x_ref = x.to(torch.bfloat16).requires_grad_(True), x.clone().requires_grad_(True)
    out = layer(x_bf16, grid)
    assert layer.last_path == "sparse:triton"
    # Head dim 64 and 32-token groups (or a GPU other than Hopper): the split backward, with the reason.
    assert layer.backward_path.startswith("split Triton: "), layer.backward_path
    b, s, _ = x_ref.shape
    q, k, v = reference.to_qkv(x_ref).view(b, s, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = reference.q_norm(q), reference.k_norm(k)
    want = reference.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))
    weight = torch.randn_like(want)
    (out.float() * weight).sum().backward()
    (want * weight).sum().backward()
    for got, expected in ((out.float(), want), (x_bf16.grad.float(), x_ref.grad)):
        error = ((got - expected).norm() / expected.norm()).item()
        # bf16 weights, activations and kernel outputs against float32: a few units of bf16 eps (2^-8).
        assert error < 4 * 2**-8, error


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.version.hip is None
                         and torch.cuda.get_device_capability()[0] == 9), reason="needs a Hopper GPU")
def test_a_training_forward_records_the_fused_backward_on_hopper():
    """Head dim 128, 128-token cubes and key blocks, 12 listed blocks a group: the layer's training forward
    records the fused Hopper backward and warns of nothing; under no_grad it records nothing new."""
    import warnings

    grid, dim, heads = (4, 16, 24), 256, 2
    cfg = AttentionConfig(mode="oracle", cube=(2, 8, 8), keep_floor_blocks=100, sparse_threshold=0.0,
                          speed_dispatch=False)
    layer = DSVAttention(dim, heads, cfg=cfg).cuda().to(torch.bfloat16)
    DSVController(cfg).attach(layer)
    layer.sparsity_ema.fill_(0.5)
    layer.controller.stage.fill_(2)
    layer.controller._refresh_host_state()
    layer.dispatch()
    x = torch.randn(1, math.prod(grid), dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        layer(x, grid)
    assert layer.last_path == "sparse:triton" and layer.backward_path is None and layer.forward_path is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x, grid).sum().backward()
    assert layer.state_summary()["backward"] == "fused Hopper"
    assert layer.state_summary()["forward"] == "Hopper warp-specialized"
    assert torch.isfinite(x.grad).all()


def test_backward_path_recorded_and_its_warning_once(monkeypatch):
    """A training forward records which attention backward its gradients take; on the Triton backend, where
    the fused Hopper kernel lacks something, it warns once; no_grad, inputs without grad and compiling record
    nothing."""
    import warnings

    import dsv.modules.attention as attention_module
    from dsv.ops.index import SparseIndex

    seen = []
    monkeypatch.setattr(attention_module, "hopper_backward_unsupported",
                        lambda q, group, block, listed: seen.append(listed) or "head dim 96; it takes 128")
    monkeypatch.setattr(attention_module, "hopper_backward_missing", lambda q: "head dim 96; it takes 128")
    q = torch.randn(1, HEADS, 64, DIM // HEADS, requires_grad=True)
    index = SparseIndex.from_topk(torch.randn(1, HEADS, 8, 8), torch.tensor([3] * HEADS), 8, 8, 64)
    layer = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode="dsv", cube=(2, 2, 2)))
    assert layer.state_summary()["backward"] is None
    layer._note_kernels(q.detach(), index)  # no graph: nothing recorded
    assert layer.backward_path is None
    layer._note_kernels(q, index)  # the reference backend: its own backward
    assert layer.state_summary()["backward"] == "reference"
    layer._note_kernels(q, None)
    assert layer.backward_path == "dense"
    layer._last_backend = "triton"
    with torch.no_grad():
        layer._note_kernels(q, index)
    assert layer.backward_path == "dense" and seen == []
    with pytest.warns(UserWarning, match="split Triton passes, not the faster fused Hopper kernel: head dim 96"):
        layer._note_kernels(q, index)
    assert layer.state_summary()["backward"] == "split Triton: head dim 96; it takes 128"
    assert seen == [3]  # the index's K_max, a shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer._note_kernels(q, index)
    compiling = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode="dsv", cube=(2, 2, 2)))
    compiling._last_backend = "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiling._note_kernels(q, index)
    assert compiling.backward_path is None and not compiling._warned_backward_kernel


def test_forward_path_recorded_by_the_launchers_rule(monkeypatch):
    """An eager training forward records which attention kernel it runs, asking the launcher's rule with the
    index's K_max (a shape); forwards without a graph (evaluation, sampling) and compiling ones record nothing."""
    import dsv.modules.attention as attention_module
    from dsv.ops.index import SparseIndex

    asked = []
    monkeypatch.setattr(attention_module, "hopper_forward_unsupported",
                        lambda q, group, block, listed: asked.append((group, block, listed)) or "groups list 3")
    q = torch.randn(1, HEADS, 64, DIM // HEADS, requires_grad=True)
    index = SparseIndex.from_topk(torch.randn(1, HEADS, 8, 8), torch.tensor([3] * HEADS), 8, 8, 64)
    layer = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode="dsv", cube=(2, 2, 2)))
    assert layer.state_summary()["forward"] is None
    layer._note_kernels(q.detach(), index)  # no graph: nothing recorded
    with torch.no_grad():
        layer._note_kernels(q, index)
    assert layer.forward_path is None
    layer._note_kernels(q, index)
    assert layer.state_summary()["forward"] == "reference" and asked == []
    layer._note_kernels(q, None)
    assert layer.forward_path == "dense"
    layer._last_backend = "triton"
    layer._note_kernels(q, index)
    assert layer.forward_path == "Triton: groups list 3" and asked == [(8, 8, 3)]
    monkeypatch.setattr(attention_module, "hopper_forward_unsupported", lambda *args: None)
    layer._note_kernels(q, index)
    assert layer.forward_path == "Hopper warp-specialized"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layer._note_kernels(q, None)
    assert layer.forward_path == "Hopper warp-specialized"  # unchanged


def test_forward_kernel_warning_once_and_only_from_eager_forwards(monkeypatch):
    """A layer whose inputs the Hopper forward cannot take warns once with the reason; while compiling it
    neither checks nor reads its flag (Dynamo would guard on it)."""
    import warnings

    import dsv.modules.attention as attention_module

    monkeypatch.setattr(attention_module, "resolve_backend", lambda *args: ("triton", None))
    monkeypatch.setattr(attention_module, "hopper_forward_missing", lambda *args: "head dim 96; it takes 64 or 128")
    q = torch.randn(1, HEADS, 64, DIM // HEADS)
    layer = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode="dsv", cube=(2, 2, 2)))
    with pytest.warns(UserWarning, match="head dim 96"):
        layer.resolve_backends(q, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.resolve_backends(q, 64)
    compiling = DSVAttention(DIM, HEADS, cfg=AttentionConfig(mode="dsv", cube=(2, 2, 2)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiling.resolve_backends(q, 64)
    assert not compiling._warned_forward_kernel


@pytest.mark.parametrize("rotary", [0, 6])
def test_a_model_materialised_off_the_meta_device_starts_dsv_fresh(rotary):
    """`to_empty` leaves memory unwritten. A model built on the meta device and materialised that way, given
    its pretrained weights but no DSV state (a fresh DSV run on a pretrained model), must start DSV as a
    freshly built model: the layers' and the controller's state as initialised (it held a stage of
    94232658510208), predictors drawn like a fresh module's; then it learns, switches and dispatches."""
    cfg = AttentionConfig(mode="dsv", cube=(2, 2, 2), sample_stride=4, max_stage1_steps=2, sparse_threshold=0.0,
                          profile_every_stage1=1, predictor_rotary=rotary, rank=8)
    fresh = Wrapper(cfg)
    with torch.device("meta"):
        model = Wrapper(cfg)
    model.to_empty(device="cpu")
    dsv_buffers = fresh.attn._initial_buffers()
    pretrained = {name: value for name, value in fresh.state_dict().items()
                  if ".predictor." not in name and not name.startswith("controller.")
                  and name.rsplit(".", 1)[-1] not in dsv_buffers}
    assert "attn.to_qkv.weight" in pretrained and model.load_state_dict(pretrained, strict=False).unexpected_keys == []
    for name, value in dsv_buffers.items():
        torch.testing.assert_close(getattr(model.attn, name), value, rtol=0, atol=0, equal_nan=True)
    assert (int(model.controller.stage), int(model.controller.switch_step)) == (1, -1)
    bound = DIM**-0.5  # nn.Linear's init bound for DIM inputs, and the offsets'
    for name, param in model.attn.predictor.named_parameters():
        assert torch.isfinite(param).all() and param.abs().max() <= bound, name
        assert param.std() > bound / 4, name  # drawn, not left at zero
    x = torch.randn(1, 64, DIM)
    for step in range(3):
        model.controller.begin_step(step)
        model(x).sum().backward()
        model.controller.end_step()
    assert model.controller.current_stage == 2 and model.attn.last_path == "sparse:reference"
    assert torch.isfinite(model.attn.loss_ema) and torch.isfinite(model.attn.sparsity_ema).all()


def test_a_copied_layer_belongs_to_the_copy_of_its_model_and_alone_to_no_controller():
    """A whole model's copy drives its own layers (its controller copy, not the original's). A layer copied
    alone (a block copied to grow a model) used to bring a stand-in controller that nothing drove, and stayed
    dense while the model went sparse: alone it now raises until a controller attaches it."""
    cfg = AttentionConfig(mode="dsv", cube=(2, 2, 2), sample_stride=4, max_stage1_steps=1, sparse_threshold=0.0,
                          profile_every_stage1=1)
    model = Wrapper(cfg)
    x = torch.randn(1, 64, DIM)
    # Pickled whole (torch.save of the module) too: its load hooks were lambdas, which do not pickle.
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.attn.controller is twin.controller and twin.controller.layers == [twin.attn]
        for step in range(2):
            twin.controller.begin_step(step)
            twin(x).sum().backward()
            twin.controller.end_step()
        assert twin.attn.last_path == "sparse:reference" and model.controller.current_stage == 1
        twin.load_state_dict(model.state_dict())  # the copy's load hooks act on the copy
        assert twin.controller.current_stage == 1 and not twin.attn.runs_sparse()
    lone = copy.deepcopy(model.attn)
    with pytest.raises(RuntimeError, match="needs a DSVController: call DSVController\\(cfg\\).attach\\(model\\)"):
        lone(x, GRID)
