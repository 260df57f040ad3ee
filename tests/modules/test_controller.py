"""Controller transitions: the stage switch, per-block dispatch, per-head budgets, and its saved state."""

import math
import warnings

import torch

from dsv.modules.config import AttentionConfig
from dsv.modules.dit import ModelConfig, VideoDiT


def model_with(**attention) -> VideoDiT:
    torch.manual_seed(0)
    cfg = AttentionConfig(cube=(2, 2, 2), **attention)
    return VideoDiT(ModelConfig(hidden=32, depth=3, heads=2), cfg)


def set_layer_state(model, losses, sparsities):
    for layer, loss, sparsity in zip(model.controller.layers, losses, sparsities):
        layer.loss_ema.fill_(loss)
        layer.sparsity_ema.copy_(torch.tensor(sparsity))


def test_switches_when_mean_predictor_loss_falls_below_threshold():
    model = model_with(switch_loss_threshold=0.1, profile_every_stage1=1, sparse_threshold=0.8)
    ctrl = model.controller
    set_layer_state(model, [0.2, 0.1, 0.05], [[0.9, 0.95], [0.5, 0.6], [0.99, 0.7]])
    ctrl.begin_step(0)
    assert not ctrl.end_step().switched and ctrl.current_stage == 1  # mean 0.117 >= 0.1
    model.controller.layers[0].loss_ema.fill_(0.1)
    ctrl.begin_step(1)
    events = ctrl.end_step()
    assert events.switched and ctrl.current_stage == 2 and int(ctrl.switch_step) == 2
    assert events.switch_reason == "mean predictor loss 0.0833 < 0.1"
    # Dispatch: block 0 (mean 0.925) and block 2 (0.845) go sparse; block 1 (0.55) stays dense.
    assert ctrl.sparse_layers() == [0, 2]
    torch.testing.assert_close(model.controller.layers[0].keep_fraction, torch.tensor([0.1, 0.05]))
    # The predictor's learning rate drops in stage 2.
    lr = model.controller.layers[0].predictor.optimizer.param_groups[0]["lr"]
    assert math.isclose(lr, 1e-3 * 0.1)


def test_min_and_max_stage1_steps_bound_the_switch():
    model = model_with(switch_loss_threshold=0.5, min_stage1_steps=5, max_stage1_steps=8, profile_every_stage1=1)
    ctrl = model.controller
    set_layer_state(model, [0.01] * 3, [[0.9, 0.9]] * 3)
    for step in range(4):  # loss is low, but min_stage1_steps holds the switch back
        ctrl.begin_step(step)
        assert not ctrl.end_step().switched
    ctrl.begin_step(4)
    assert ctrl.end_step().switched and int(ctrl.switch_step) == 5

    model = model_with(switch_loss_threshold=0.01, max_stage1_steps=8, profile_every_stage1=1)
    ctrl = model.controller
    set_layer_state(model, [0.9] * 3, [[0.9, 0.9]] * 3)
    for step in range(7):
        ctrl.begin_step(step)
        assert not ctrl.end_step().switched
    ctrl.begin_step(7)
    events = ctrl.end_step()
    assert events.switched and int(ctrl.switch_step) == 8 and events.switch_reason == "max_stage1_steps=8 reached"


def test_switch_is_checked_on_profiling_steps_only_and_dense_never_switches():
    model = model_with(switch_loss_threshold=0.5, profile_every_stage1=10)
    set_layer_state(model, [0.01] * 3, [[0.9, 0.9]] * 3)
    model.controller.begin_step(3)
    assert not model.controller.end_step().switched
    model.controller.begin_step(10)
    assert model.controller.end_step().switched
    dense = model_with(mode="dense", max_stage1_steps=1, profile_every_stage1=1)
    dense.controller.begin_step(0)
    dense.controller.end_step()
    assert dense.controller.current_stage == 1 and dense.controller.sparse_layers() == []


def test_state_round_trips_through_state_dict():
    model = model_with(switch_loss_threshold=0.5, profile_every_stage1=1, sparse_threshold=0.8)
    set_layer_state(model, [0.01] * 3, [[0.9, 0.85], [0.2, 0.3], [0.95, 0.99]])
    model.controller.begin_step(0)
    model.controller.end_step()
    fresh = model_with(switch_loss_threshold=0.5, profile_every_stage1=1, sparse_threshold=0.8)
    assert fresh.controller.current_stage == 1
    fresh.load_state_dict(model.state_dict())
    assert fresh.controller.current_stage == 2
    assert fresh.controller.sparse_layers() == model.controller.sparse_layers() == [0, 2]
    assert fresh.controller.layers[2]._keep_fraction_host == model.controller.layers[2]._keep_fraction_host


def test_recall_boost_steps_by_the_recall_gap_and_feeds_the_dispatch():
    model = model_with(recall_target=0.9, theta=0.9, sparse_threshold=0.5)  # target mass 0.81
    layer = model.controller.layers[0]
    layer.update_keep_boost(layer.keep_boost, torch.tensor([0.6, 0.9]))
    torch.testing.assert_close(layer.keep_boost, torch.tensor([0.21, 0.0]))  # a head above target: no boost
    layer.update_keep_boost(layer.keep_boost, torch.tensor([0.85, 0.2]))
    torch.testing.assert_close(layer.keep_boost, torch.tensor([0.17, 0.61]))  # narrows back above target
    layer.update_keep_boost(layer.keep_boost, torch.tensor([-0.5, -0.5]))
    torch.testing.assert_close(layer.keep_boost, torch.tensor([1.0, 1.0]))  # clamped to [0, 1]
    layer.keep_boost.copy_(torch.tensor([0.2, 0.0]))
    layer.sparsity_ema.copy_(torch.tensor([0.9, 0.95]))
    layer.dispatch()
    torch.testing.assert_close(layer.keep_fraction, torch.tensor([0.3, 0.05]))
    off = model_with(recall_target=0.0).controller.layers[0]
    off.update_keep_boost(off.keep_boost, torch.tensor([0.1, 0.1]))
    assert off.keep_boost.abs().sum() == 0


def test_a_step_whose_forwards_do_not_train_warns_once():
    """A training loop over a model left in eval mode (as diffusers' from_pretrained returns it) would keep its
    predictors untrained and DSV dense for good: end_step says so, once; steps without forwards (the tests
    above) and steps with a training forward say nothing."""
    import warnings

    import pytest

    model = model_with()
    ctrl = model.controller
    x = torch.randn(1, 3, 2, 8, 8)
    t = torch.rand(1)
    ctrl.begin_step(0)
    model(x, t).pow(2).mean().backward()  # in train mode: trains
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctrl.end_step()
        ctrl.begin_step(1)
        ctrl.end_step()  # no forward at all
    model.eval()
    ctrl.begin_step(2)
    model(x, t).pow(2).mean().backward()
    with pytest.warns(UserWarning, match="no forward of this step trained .* call model.train"):
        ctrl.end_step()
    ctrl.begin_step(3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x, t)
        ctrl.end_step()  # once


def test_the_step_protocol_is_checked():
    """A loop without begin_step trained the predictors once and then never again, silently (each layer learns
    once per begin_step); a float or string step failed deep inside; a controller built with a fixed mode over
    DSV layers never ran their stages."""
    import numpy as np
    import pytest

    from dsv.modules.controller import DSVController

    ctrl = model_with().controller
    with pytest.raises(RuntimeError, match=r"end_step: no begin_step\(step\) since the last end_step"):
        ctrl.end_step()
    ctrl.begin_step(np.int64(0))
    assert ctrl.step == 0 and type(ctrl.step) is int
    ctrl.end_step()
    with pytest.raises(RuntimeError, match="no begin_step"):
        ctrl.end_step()
    for bad in (2.0, "3", -1, True):
        with pytest.raises(ValueError, match="begin_step: step must be a non-negative int"):
            ctrl.begin_step(bad)
    model = model_with()
    with pytest.raises(ValueError, match=r"controller's cfg.mode is 'dense', but layers \[0, 1, 2\] have mode 'dsv'"):
        DSVController(AttentionConfig(mode="dense")).attach(model)
    with pytest.raises(ValueError, match="cfg must be a dsv.AttentionConfig, got NoneType"):
        DSVController(None)
    # A second controller over layers that follow the model's own would leave them reading the first's stage.
    with pytest.raises(ValueError, match=r"attach: layers \[0, 1, 2\] already follow another DSVController"):
        DSVController(model.controller.cfg).attach(model)
    assert all(layer.controller is model.controller for layer in model.controller.layers)
    assert model.controller.attach(model) is model.controller  # the same controller again: its own layers


def test_a_loop_without_end_step_is_refused_at_its_second_step():
    """Without end_step the stage switch and the dispatch never run: DSV stayed dense for good without a word.
    One training step left unended (abandoned by an exception, a skipped batch) passes; two in a row raise.
    Steps whose forwards do not train (evaluation) and fixed modes (no stages) are not counted."""
    import pytest

    x, t = torch.randn(1, 3, 2, 8, 8), torch.rand(1)
    model = model_with()
    ctrl = model.controller
    ctrl.begin_step(0)
    model(x, t).pow(2).mean().backward()
    ctrl.begin_step(1)  # step 0 abandoned
    model(x, t).pow(2).mean().backward()
    ctrl.end_step()
    for step in (2, 3):  # evaluation steps: no training forward
        ctrl.begin_step(step)
        with torch.no_grad():
            model(x, t)
    ctrl.begin_step(4)
    model(x, t).pow(2).mean().backward()
    ctrl.begin_step(5)
    model(x, t).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"begin_step\(6\): the last 2 training steps had no end_step\(\)"):
        ctrl.begin_step(6)
    dense = VideoDiT(ModelConfig(hidden=32, depth=3, heads=2), AttentionConfig(mode="dense", cube=(2, 2, 2)))
    for step in range(3):
        dense.controller.begin_step(step)
        dense(x, t).pow(2).mean().backward()
        dense.controller.end_step()


def test_a_state_written_in_place_is_read_again_before_it_is_used(tmp_path):
    """torch.distributed.checkpoint loads into the tensors of `model.state_dict()`, past `load_state_dict`: the host
    mirrors that the forward and `end_step` decide on kept a fresh model's stage 1, so the resumed run ran dense,
    switched a second time (its switch step overwritten) and its predictors learned at stage 1's rate. Taking a
    state_dict marks them stale; the next forward (sampling) or begin_step (training) reads them again."""
    import torch.distributed.checkpoint as dcp

    trained = model_with(switch_loss_threshold=0.1, profile_every_stage1=1, sparse_threshold=0.5)
    set_layer_state(trained, [0.01] * 3, [[0.9, 0.95], [0.5, 0.6], [0.99, 0.7]])
    trained.controller.begin_step(0)
    assert trained.controller.end_step().switched and trained.controller.sparse_layers() == [0, 1, 2]
    dcp.save(trained.state_dict(), checkpoint_id=tmp_path, no_dist=True)

    x = torch.randn(1, 3, 4, 16, 16)
    t = torch.rand(1)
    for use in ("sampling", "training"):
        resumed = model_with(switch_loss_threshold=0.1, profile_every_stage1=1, sparse_threshold=0.5)
        dcp.load(resumed.state_dict(), checkpoint_id=tmp_path, no_dist=True)
        ctrl = resumed.controller
        assert int(ctrl.stage) == 2 and ctrl.host_state_stale
        if use == "sampling":
            resumed.eval()
            with torch.no_grad():
                resumed(x, t)
            assert [layer.last_path for layer in ctrl.layers] == ["sparse:reference"] * 3
        else:
            ctrl.begin_step(1)
            assert ctrl.current_stage == 2 and ctrl.sparse_layers() == [0, 1, 2]
            assert not ctrl.end_step().switched and int(ctrl.switch_step) == 1
        lr = ctrl.layers[0].predictor.optimizer.param_groups[0]["lr"]
        assert math.isclose(lr, 1e-3 * 0.1) and not ctrl.host_state_stale
        torch.testing.assert_close(ctrl.layers[0].keep_fraction, trained.controller.layers[0].keep_fraction)
        assert ctrl.layers[0]._keep_fraction_host == trained.controller.layers[0]._keep_fraction_host

    # A rate set by hand survives a save (which marks the mirrors stale) while the stage stays.
    ctrl.layers[0].predictor.set_lr(5e-5)
    ctrl.state_dict()
    assert ctrl.host_state_stale
    ctrl.begin_step(2)
    assert not ctrl.host_state_stale
    assert ctrl.layers[0].predictor.optimizer.param_groups[0]["lr"] == 5e-5


def test_a_layer_left_untrained_inside_a_training_model_warns_once():
    """One block in eval mode (or run under no_grad) inside a model that trains: its predictor never learned and
    the block stayed dense for good, without a word (the warning covered only a model where nothing trained)."""
    import pytest

    model = model_with()
    ctrl = model.controller
    x = torch.randn(1, 3, 2, 8, 8)
    t = torch.rand(1)
    model.blocks[1].eval()
    ctrl.begin_step(0)
    model(x, t).pow(2).mean().backward()
    with pytest.warns(UserWarning, match=r"DSV layers \[1\] ran in this step but no forward of theirs trained"):
        ctrl.end_step()
    assert ctrl.layers[0].has_learned and not ctrl.layers[1].has_learned
    ctrl.begin_step(1)
    model(x, t).pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctrl.end_step()  # once


def test_a_step_learns_once_whatever_the_begin_steps_of_its_micro_batches(monkeypatch):
    """A gradient-accumulation loop that calls begin_step for each micro-batch gave the predictors one optimizer
    step per micro-batch, and weighted each profiling step's measurement as many times into the EMAs; a step
    begun again after an abandoned attempt did the same. A step learns and profiles once. A step number that
    has ended is refused at its next begin_step: a loop that ends each micro-batch (or never advances the step)
    would run the switch and the dispatch within a step."""
    import pytest

    from dsv.modules.predictor import LowRankPredictor

    calls = []
    update = LowRankPredictor.update
    monkeypatch.setattr(LowRankPredictor, "update", lambda self, *a, **k: calls.append(self) or update(self, *a, **k))
    x, t = torch.randn(3, 3, 2, 8, 8), torch.rand(3)
    model = model_with(profile_every_stage1=1)
    ctrl = model.controller
    for step in range(2):
        for micro in range(3):
            ctrl.begin_step(step)
            model(x[micro:micro + 1], t[micro:micro + 1]).pow(2).mean().backward()
        ctrl.end_step()
    assert len(calls) == 2 * 3  # two steps, once in each of the 3 layers
    with pytest.raises(ValueError, match=r"begin_step\(1\): step 1 has ended \(end_step\); pass the number of "
                                         "optimizer steps done so far"):
        ctrl.begin_step(1)
    ctrl.begin_step(2)
    model(x[:1], t[:1]).pow(2).mean().backward()
    ctrl.end_step()
    assert len(calls) == 3 * 3


def test_training_forwards_without_begin_step_warn_once():
    """A loop that never called begin_step trained each predictor once and never switched, without a word."""
    import pytest

    x, t = torch.randn(1, 3, 2, 8, 8), torch.rand(1)
    model = model_with()
    with pytest.warns(UserWarning, match=r"a training forward before any controller.begin_step\(step\)"):
        model(x, t).pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x, t).pow(2).mean().backward()  # once
        fresh = model_with()
        fresh.controller.begin_step(0)
        fresh(x, t).pow(2).mean().backward()  # with begin_step: no warning


def test_forwards_with_gradients_outside_a_step_keep_no_selection_and_a_stuck_step_warns():
    """Every grad-enabled forward remembered its keys for a recompute: a sampler that takes gradients of an eval
    model, with no begin_step, kept one more per forward for good. Outside a step nothing can step the predictor,
    so such forwards keep none. A loop whose step number never advances without end_step learned once and stayed
    dense in silence: it warns."""
    import pytest

    from dsv.modules.controller import REPEATED_BEGIN_WARNING

    x, t = torch.randn(1, 3, 2, 8, 8), torch.rand(1)
    model = model_with(max_stage1_steps=1, sparse_threshold=0.0, profile_every_stage1=1)
    model.controller.begin_step(0)
    model(x, t).sum().backward()
    model.controller.end_step()
    assert model.controller.sparse_layers() == [0, 1, 2]
    model.eval()
    xs = x.clone().requires_grad_(True)
    for _ in range(5):
        torch.autograd.grad(model(xs, t).sum(), xs)
    assert all(not layer._selection_cache for layer in model.controller.layers)

    stuck = model_with()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(REPEATED_BEGIN_WARNING):
            stuck.controller.begin_step(0)
            stuck(x, t).pow(2).mean().backward()
    with pytest.warns(UserWarning, match=rf"{REPEATED_BEGIN_WARNING} training forwards in a row under one step"):
        stuck.controller.begin_step(0)

