"""End-to-end training on the bundled real data: smoke run, all modes, exact resume, checkpoint safety, CLI."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from dsv.cli import EXIT_UNFINISHED, main
from dsv.train.checkpoint import CheckpointError, list_checkpoints
from dsv.train.config import apply_overrides
from dsv.train.recipes import get_recipe
from dsv.train.trainer import EMA_WARMUP, Trainer, ema_decay_at, lr_scale_at

# A model small enough for CI: 4 frames of 16×16 pixels, 1×2×2 patches → a 4×8×8 grid of 256 tokens.
TINY = [
    "model.hidden=32", "model.depth=2", "model.heads=2", "model.patch=1,2,2",
    "data.frames=4", "data.size=16", "data.load_short_side=24", "data.heldout_clips=4",
    "attention.cube=2,2,2", "attention.rank=4", "attention.sample_stride=4",
    "attention.profile_every_stage1=2", "attention.profile_every_stage2=4",
    "attention.sparse_threshold=0.0", "attention.switch_loss_threshold=0.0", "attention.min_stage1_steps=0",
    "train.batch_size=2", "train.log_every=2", "train.eval_every=100", "train.tensorboard=false",
    "optim.warmup_steps=0", "optim.lr=2e-3",
]


def tiny_config(tmp_path, *extra):
    return apply_overrides(get_recipe("debug_cpu"), TINY + [f"train.out_dir={tmp_path}", *extra])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_smoke_run_learns_switches_and_runs_sparse(tmp_path):
    cfg = tiny_config(tmp_path, "train.steps=40", "attention.max_stage1_steps=20", "train.ckpt_every=40")
    result = Trainer(cfg, quiet=True).run()
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    first, last = records[0], records[-1]
    assert last["loss"] < 0.8 * first["loss"], (first["loss"], last["loss"])
    assert result["switch_step"] == 20
    assert result["sparse_blocks_list"] == [0, 1]
    assert all(layer["path"] == "sparse:reference" for layer in last["layers"])
    stage1_losses = [r["predictor_loss"] for r in records if r["stage"] == 1 and r["predictor_loss"] is not None]
    assert stage1_losses[-1] < stage1_losses[0], stage1_losses
    assert all(0.0 <= s <= 1.0 for layer in last["layers"] for s in layer["sparsity"])
    assert all(0.0 < r <= 1.0 for layer in last["layers"] for r in layer["recall"])


@pytest.mark.parametrize("mode", ["dense", "dsv", "window", "oracle"])
def test_every_attention_mode_trains(tmp_path, mode, capsys):
    cfg = tiny_config(tmp_path, f"attention.mode={mode}", "train.steps=6", "attention.max_stage1_steps=2",
                      "train.ckpt_every=6", "train.log_every=3")
    trainer = Trainer(cfg, quiet=False)
    result = trainer.run()
    assert torch.isfinite(torch.tensor(result["loss"]))
    # Gradients are freed after each optimizer step, so no step's forward holds the last step's.
    assert all(p.grad is None for p in trainer.model.parameters())
    expected = {"dense": "dense:sdpa", "dsv": "sparse:reference", "window": "sparse:reference",
                "oracle": "sparse:reference"}[mode]
    assert {layer["path"] for layer in result["layers"]} == {expected}
    # The log says what runs: a window or dense run has no stage or predictor to report, and its blocks' state
    # names the mode instead of a dispatch that never comes.
    log = capsys.readouterr().out
    fixed = mode in ("window", "dense")
    assert (f"| mode {mode} |" in log) == fixed and ("| predictor loss" in log) != fixed
    dispatch = {layer["dispatch"] for layer in result["layers"]}
    if mode == "window":
        assert dispatch == {"attention.mode=window: the fixed 3-D window in every step"}
    elif mode == "dense":
        assert dispatch == {"attention.mode=dense"}
    else:  # dispatched in stage 2, each saying which side of the threshold its sparsity fell
        assert all(d.startswith("mean sparsity") and ("≥ threshold" in d or "< threshold" in d) for d in dispatch)


def test_a_failed_predictor_stops_the_step_it_fails_in(tmp_path):
    """A predictor whose weights went NaN (a bad update) makes its loss NaN: the trainer stops at that step,
    before the model's optimizer steps, not at the next profiling step with garbage keys selected meanwhile."""
    cfg = tiny_config(tmp_path, "train.steps=1", "train.ckpt_every=1", "attention.max_stage1_steps=100")
    trainer = Trainer(cfg, quiet=True)
    trainer.run()
    assert trainer.step % cfg.attention.profile_every_stage1 != 0  # no profiling check at this step
    layer = trainer.controller.layers[0]
    with torch.no_grad():
        layer.predictor.q_proj.weight[0, 0] = float("nan")
    model_params = [p for group in trainer.optimizer.param_groups for p in group["params"]]  # no predictors
    weights = [p.detach().clone() for p in model_params]
    with pytest.raises(FloatingPointError, match="predictor"):
        trainer.train_step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model_params))


def test_a_non_finite_gradient_stops_the_step_before_any_weight_changes(tmp_path):
    """A finite loss whose backward overflows (here an inf gradient on one weight) stops the step: clipping
    would otherwise scale every gradient by inf/inf = NaN and the optimizer write NaN into all weights."""
    cfg = tiny_config(tmp_path, "train.steps=1", "train.ckpt_every=1", "attention.max_stage1_steps=100")
    trainer = Trainer(cfg, quiet=True)
    trainer.run()
    model_params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    weights = [p.detach().clone() for p in model_params]
    model_params[0].register_hook(lambda grad: torch.full_like(grad, float("inf")))
    with pytest.raises(FloatingPointError, match="gradient norm"):
        trainer.train_step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model_params))
    assert all(p.grad is None for p in model_params)  # a caller that retries does not add to NaN gradients


def test_a_run_that_raises_releases_its_folder_for_the_next_trainer(tmp_path, monkeypatch):
    """An exception inside the training loop (here the third step's) still closes the run: its lock and logs
    are released, so that the same process (a notebook) can resume the folder from its last checkpoint."""
    cfg = tiny_config(tmp_path, "train.steps=6", "train.ckpt_every=2", "attention.max_stage1_steps=100")
    trainer = Trainer(cfg, quiet=True)
    step = trainer.train_step

    def failing_step():
        if trainer.step == 2:
            raise RuntimeError("a failure in the third step")
        return step()

    monkeypatch.setattr(trainer, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="third step"):
        trainer.run()
    assert trainer.metrics_file.closed
    resumed = Trainer(cfg, resume=True, quiet=True)  # refused while the failed trainer held the lock
    assert resumed.step == 2
    assert resumed.run()["stopped_at_time_limit"] is False and resumed.step == 6


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, where NaN (a never-measured EMA) equals NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def final_state(run_dir, *schedule):
    trainer = Trainer(tiny_config(run_dir, "train.steps=12", *schedule), resume=True, quiet=True)
    weights, state = trainer.full_state()
    trainer.close()
    return weights, state


@pytest.mark.parametrize("predictor_keys,rotary", [(0, []), (96, []),
                                                  (96, ["attention.rank=6", "attention.predictor_rotary=6"])],
                         ids=["all-keys", "key-sample", "key-sample-rotary"])
def test_resume_continues_the_run_exactly(tmp_path, predictor_keys, rotary):
    schedule = ["attention.max_stage1_steps=4", "train.ckpt_every=6", *rotary,
                f"attention.predictor_keys={predictor_keys}"]
    Trainer(tiny_config(tmp_path / "straight", "train.steps=12", *schedule), quiet=True).run()
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=6", *schedule), quiet=True).run()
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=12", *schedule), resume=True, quiet=True).run()
    # The resumed run's log holds each step once, as the straight run's does.
    assert [r["step"] for r in read_metrics(tmp_path / "resumed") if "loss" in r] == \
        [r["step"] for r in read_metrics(tmp_path / "straight") if "loss" in r]
    straight_w, straight_s = final_state(tmp_path / "straight", *schedule)
    resumed_w, resumed_s = final_state(tmp_path / "resumed", *schedule)
    assert straight_s["step"] == resumed_s["step"] == 12
    assert int(straight_w["controller.stage"]) == 2  # the run crossed the stage switch
    assert any("rotary_offset" in name for name in straight_w) == bool(rotary)
    for name, value in straight_w.items():
        assert bitwise_equal(value, resumed_w[name]), name
    for a, b in zip(straight_s["predictor_optimizers"], resumed_s["predictor_optimizers"]):
        for key in a["state"]:
            assert torch.equal(a["state"][key]["exp_avg"], b["state"][key]["exp_avg"])
    assert torch.equal(straight_s["rng_per_rank"][0]["data_generator"], resumed_s["rng_per_rank"][0]["data_generator"])
    if predictor_keys:  # the key sample reached the training path: the predictors learned otherwise
        Trainer(tiny_config(tmp_path / "all-keys", "train.steps=12", *schedule[:-1]), quiet=True).run()
        all_keys_w, _ = final_state(tmp_path / "all-keys", *schedule[:-1])
        predictor_names = [name for name in straight_w if ".predictor." in name]
        assert predictor_names
        assert any(not torch.equal(straight_w[n], all_keys_w[n]) for n in predictor_names)


def test_the_learning_rate_warms_up_then_stays_or_decays_along_a_cosine():
    """The rate of each update against the curve written out: torch's CosineAnnealingLR after a linear warmup,
    the constant schedule unchanged from before the field existed."""
    import math

    from dsv.train.config import OptimConfig

    warmup, steps, lr, floor = 3, 11, 1e-3, 0.1
    for schedule in ("constant", "cosine"):
        optim = OptimConfig(lr=lr, warmup_steps=warmup, schedule=schedule, final_lr_ratio=floor)
        expected = [(u + 1) / warmup if u < warmup else 1.0 if schedule == "constant"
                    else floor + (1 - floor) * (1 + math.cos(math.pi * (u - warmup) / (steps - warmup))) / 2
                    for u in range(steps)]
        assert [lr_scale_at(u, optim, steps) for u in range(steps)] == pytest.approx(expected, rel=1e-12)
    cosine = [lr_scale_at(u, OptimConfig(warmup_steps=warmup, schedule="cosine"), steps) for u in range(steps)]
    assert cosine[warmup] == 1.0 and all(a > b for a, b in zip(cosine[warmup:], cosine[warmup + 1:]))
    assert cosine[-1] == pytest.approx((1 + math.cos(math.pi * (steps - 1 - warmup) / (steps - warmup))) / 2)


# The recorder below wraps optimizer.step after the scheduler was built, which torch warns of.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")
def test_the_trainer_logs_the_scheduled_learning_rate(tmp_path):
    cfg = tiny_config(tmp_path, "train.steps=8", "train.log_every=1", "train.ckpt_every=8", "attention.mode=dense",
                      "optim.schedule=cosine", "optim.warmup_steps=2", "optim.final_lr_ratio=0.25")
    trainer = Trainer(cfg, quiet=True)
    taken, step = [], trainer.optimizer.step

    def recording_step(*args, **kwargs):
        taken.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.run()
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path) if "lr" in r}
    assert [logged[n] for n in range(1, 9)] == pytest.approx(taken, rel=1e-12)
    # The record of step n names the rate of the update that made it, update n - 1, which the optimizer took.
    assert sorted(logged) == list(range(1, 9))
    assert all(lr == pytest.approx(cfg.optim.lr * lr_scale_at(step - 1, cfg.optim, 8)) for step, lr in logged.items())
    assert logged[1] == pytest.approx(0.5 * cfg.optim.lr) and logged[3] == cfg.optim.lr  # warmup, then the peak
    assert 0.25 * cfg.optim.lr < logged[8] < logged[7]


def test_a_decaying_learning_rate_resumes_exactly_and_refuses_another_length(tmp_path):
    """With optim.schedule=cosine the remaining steps' rates depend on train.steps: a resume under the same
    length ends where the uninterrupted run does, one that changes it is refused before anything is written."""
    schedule = ["train.steps=6", "train.ckpt_every=6", "attention.max_stage1_steps=2", "optim.schedule=cosine",
                "optim.warmup_steps=1", "optim.final_lr_ratio=0.1"]
    Trainer(tiny_config(tmp_path / "straight", *schedule), quiet=True).run()
    legs = tmp_path / "legs"
    assert Trainer(tiny_config(legs, *schedule, "train.max_minutes=1e-6"), quiet=True).run()["stopped_at_time_limit"]
    saved = sorted(path.name for path in legs.rglob("*"))
    with pytest.raises(CheckpointError, match=r"train.steps: checkpoint 6, run 9 \(optim.schedule='cosine'"):
        Trainer(tiny_config(legs, *schedule, "train.steps=9"), resume=True, quiet=True)
    assert sorted(path.name for path in legs.rglob("*")) == saved
    Trainer(tiny_config(legs, *schedule), resume=True, quiet=True).run()
    straight_w, straight_s = final_state(tmp_path / "straight", *schedule)
    legs_w, legs_s = final_state(legs, *schedule)
    assert straight_s["step"] == legs_s["step"] == 6
    for name, value in straight_w.items():
        assert bitwise_equal(value, legs_w[name]), name


def test_the_average_warms_up_as_diffusers_ema_model():
    """diffusers' EMAModel (decay 0 at its first update, then (1 + step) / (10 + step) up to its decay)."""
    assert ema_decay_at(0, 0.99) == 0.0  # the first update copies the weights
    assert ema_decay_at(1, 0.99) == 2 / 11 and ema_decay_at(100, 0.99) == 101 / 110
    assert ema_decay_at(889, 0.99) < 0.99 == ema_decay_at(890, 0.99) == ema_decay_at(5000, 0.99)
    assert ema_decay_at(3, 0.2) == 0.2


def test_the_weights_moving_average_is_evaluated_resumed_exactly_and_leaves_training_alone(tmp_path):
    decay = 0.5  # the warm-up's (1 + step) / (10 + step) below it for steps 0-7, above it from step 8
    schedule = ["attention.max_stage1_steps=4", "train.ckpt_every=6", "train.eval_every=3",
                f"train.ema_decay={decay}"]
    Trainer(tiny_config(tmp_path / "plain", "train.steps=12", *schedule[:-1]), quiet=True).run()
    trainer = Trainer(tiny_config(tmp_path / "straight", "train.steps=12", *schedule), quiet=True)
    names = [name for name, _ in trainer._ema_weights]
    assert names and not any(".predictor." in name for name in names)  # predictors step themselves
    params = dict(trainer.model.named_parameters())
    expected = {name: params[name].detach().clone() for name in names}
    train_step = trainer.train_step

    def step_and_average():
        step = trainer.step
        out = train_step()
        decay_now = ema_decay_at(step, decay)
        for name in names:
            expected[name] = decay_now * expected[name] + (1 - decay_now) * params[name].detach()
        return out

    trainer.train_step = step_and_average
    trainer.run()
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=6", *schedule), quiet=True).run()
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=12", *schedule), resume=True, quiet=True).run()

    plain_w, _ = final_state(tmp_path / "plain", *schedule[:-1])
    straight_w, straight_s = final_state(tmp_path / "straight", *schedule)
    resumed_w, resumed_s = final_state(tmp_path / "resumed", *schedule)
    # fp32 lerp against multiply-add: a few ulps per step over 12 steps.
    for name in names:
        torch.testing.assert_close(straight_s["ema"][name], expected[name], rtol=1e-5, atol=1e-6)
        assert torch.equal(straight_s["ema"][name], resumed_s["ema"][name]), name
    assert any(not torch.equal(straight_s["ema"][n], straight_w[n]) for n in names)
    # Averaging and evaluating the average change nothing the run learns: the weights are the plain run's.
    for name, value in plain_w.items():
        assert bitwise_equal(value, straight_w[name]), name
    held = {run: [r for r in read_metrics(tmp_path / run) if "heldout_loss" in r]
            for run in ("plain", "straight", "resumed")}
    assert [r["step"] for r in held["straight"]] == [3, 6, 9, 12]
    assert [r["heldout_loss"] for r in held["straight"]] == [r["heldout_loss"] for r in held["plain"]]
    assert all("heldout_loss_ema" not in r for r in held["plain"])
    assert held["straight"] == held["resumed"]
    # The warm-up rule is saved with the average; a checkpoint averaged under another one is refused on resume.
    assert straight_s["ema_warmup"] == EMA_WARMUP
    _rewrite_state(list_checkpoints(tmp_path / "resumed")[-1], lambda state: state.update(ema_warmup="fixed decay"))
    with pytest.raises(CheckpointError, match="averaged its weights under another warm-up .'fixed decay'."):
        Trainer(tiny_config(tmp_path / "resumed", "train.steps=12", *schedule), resume=True, quiet=True).run()
    # The logged average's loss is that of a model holding the averaged weights.
    check = Trainer(tiny_config(tmp_path / "straight", "train.steps=12", *schedule), resume=True, quiet=True)
    check.model.load_state_dict({**straight_w, **straight_s["ema"]})
    assert check.heldout_loss() == held["straight"][-1]["heldout_loss_ema"] != held["straight"][-1]["heldout_loss"]
    check.close()
    with pytest.raises(ValueError, match=r"train.ema_decay must be in \[0, 1\)"):
        tiny_config(tmp_path, "train.ema_decay=1")
    # Sampling from the average: the loaded model holds it; a run without one says so.
    from dsv.analysis.checkpointed_model import load_model

    for mode in (None, "dense"):  # the average goes in before another mode's weights are picked
        averaged, _, _ = load_model(str(tmp_path / "straight"), "cpu", mode, average_weights=True)
        assert all(torch.equal(p, straight_s["ema"][n]) for n, p in averaged.named_parameters() if n in names)
    with pytest.raises(ValueError, match="keeps no moving average of its weights"):
        load_model(str(tmp_path / "plain"), "cpu", average_weights=True)
    assert main(["sample", "--checkpoint", str(tmp_path / "straight"), "--out", str(tmp_path / "a.gif"), "--num", "1",
                 "--steps", "1", "--average-weights"]) == 0
    assert (tmp_path / "a.gif").stat().st_size > 0


def test_compiled_blocks_train_like_eager_through_the_switch_and_resume(tmp_path):
    """model.compile compiles each block in place: same losses and weights as eager (aot_eager on the CPU:
    the graph's own ops, so fp32 sums agree to rounding), the same checkpoint keys, and a resume."""
    schedule = ["train.steps=8", "attention.max_stage1_steps=4", "train.ckpt_every=4",
                "model.activation_checkpointing=true"]
    torch._dynamo.reset()
    Trainer(tiny_config(tmp_path / "eager", *schedule), quiet=True).run()
    Trainer(tiny_config(tmp_path / "compiled", *schedule, "model.compile=aot_eager"), quiet=True).run()
    eager = [r["loss"] for r in read_metrics(tmp_path / "eager") if "loss" in r]
    compiled = [r["loss"] for r in read_metrics(tmp_path / "compiled") if "loss" in r]
    # fp32 rounding of reordered sums, grown over 8 optimizer steps: 1e-4 relative.
    assert compiled == pytest.approx(eager, rel=1e-4)
    eager_w, _ = final_state(tmp_path / "eager", *schedule[1:], "train.steps=8")
    trainer = Trainer(tiny_config(tmp_path / "compiled", *schedule, "model.compile=aot_eager", "train.steps=10"),
                      resume=True, quiet=True)
    assert all(block._compiled_call_impl is not None for block in trainer.model.blocks)  # really compiled
    result = trainer.run()
    assert result["sparse_blocks_list"] == [0, 1] and torch.isfinite(torch.tensor(result["loss"]))
    compiled_w, _ = final_state(tmp_path / "compiled", *schedule[1:], "train.steps=10")
    assert set(compiled_w) == set(eager_w)  # checkpoints load into an eager model and back
    with pytest.raises(ValueError, match="model.compile='inductor' compiles the blocks of model.arch='dit'"):
        apply_overrides(get_recipe("debug_cpu"), ["model.arch=wan", "model.compile=inductor"])
    with pytest.raises(ValueError, match="does not run under context parallelism"):
        trainer.model.enable_context_parallel(None)


def test_checkpoints_from_before_the_recall_floor_resume(tmp_path):
    """A checkpoint without the `keep_boost` buffers (saved before they existed) resumes with zero boost."""
    from safetensors.torch import load_file, save_file

    from dsv.train.checkpoint import MANIFEST, WEIGHTS, _sha256

    schedule = ["attention.max_stage1_steps=2", "train.ckpt_every=4"]
    Trainer(tiny_config(tmp_path, "train.steps=4", *schedule), quiet=True).run()
    ckpt = list_checkpoints(tmp_path)[-1]
    weights = {k: v for k, v in load_file(ckpt / WEIGHTS).items() if not k.endswith(".keep_boost")}
    assert len(weights) < len(load_file(ckpt / WEIGHTS))
    save_file(weights, ckpt / WEIGHTS)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["sha256"][WEIGHTS] = _sha256(ckpt / WEIGHTS)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    trainer = Trainer(tiny_config(tmp_path, "train.steps=6", *schedule), resume=True, quiet=True)
    assert all(layer.keep_boost.abs().sum() == 0 for layer in trainer.model.controller.layers)
    assert torch.isfinite(torch.tensor(trainer.run()["loss"]))


def test_checkpoints_from_before_the_layout_record_are_completed_from_their_config():
    """A diffusers model's controller `layout` (added later) is filled in from the run's attention config, where
    a checkpoint lacks it; a checkpoint that has it, or a model without that controller, is left as it is."""
    from dsv.modules.config import AttentionConfig
    from dsv.modules.controller import layout_record
    from dsv.train.checkpoint import with_added_buffers

    attention = AttentionConfig(cube=(2, 4, 4), theta=0.85)
    stage = torch.tensor(2)
    older = with_added_buffers({"transformer.dsv_controller.stage": stage}, attention)
    assert torch.equal(older["transformer.dsv_controller.layout"], torch.tensor([2, 4, 4, 32, 850000]))
    assert torch.equal(older["transformer.dsv_controller.layout"], layout_record(attention))
    recorded = torch.tensor([1, 2, 2, 4, 900000])
    newer = with_added_buffers({"dsv_controller.stage": stage, "dsv_controller.layout": recorded}, attention)
    assert newer["dsv_controller.layout"] is recorded
    assert set(with_added_buffers({"controller.stage": stage}, attention)) == {"controller.stage"}


def test_checkpoint_errors_are_clear_and_keep_saved_files(tmp_path):
    cfg = tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2", "train.keep_checkpoints=3")
    Trainer(cfg, quiet=True).run()
    checkpoints = list_checkpoints(tmp_path)
    assert [p.name for p in checkpoints] == ["step_00000002", "step_00000004"]
    snapshot = {p: p.read_bytes() for c in checkpoints for p in c.iterdir()}

    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(cfg, quiet=True)
    with pytest.raises(CheckpointError, match="model.hidden"):
        Trainer(tiny_config(tmp_path, "train.steps=6", "model.hidden=48"), resume=True, quiet=True)
    # Only schedule fields of `train` may change on resume; anything else would break exactness silently.
    with pytest.raises(CheckpointError, match="optim.lr: checkpoint 0.002, run 0.05"):
        Trainer(tiny_config(tmp_path, "train.steps=6", "optim.lr=5e-2"), resume=True, quiet=True)
    with pytest.raises(CheckpointError, match="train.batch_size"):
        Trainer(tiny_config(tmp_path, "train.steps=6", "train.batch_size=3"), resume=True, quiet=True)
    weights = checkpoints[-1] / "model.safetensors"
    weights.write_bytes(snapshot[weights][: len(snapshot[weights]) // 2])  # a truncated file
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        Trainer(tiny_config(tmp_path, "train.steps=6"), resume=True, quiet=True)
    weights.write_bytes(snapshot[weights])
    manifest = checkpoints[-1] / "manifest.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(snapshot[manifest]).items() if k != "sha256"}))
    with pytest.raises(CheckpointError, match="lacks the SHA-256"):  # unchecked files are not loaded
        Trainer(tiny_config(tmp_path, "train.steps=6"), resume=True, quiet=True)
    manifest.write_text(json.dumps({k: v for k, v in json.loads(snapshot[manifest]).items() if k != "config"}))
    with pytest.raises(CheckpointError, match="lacks the run's config"):  # was a KeyError
        Trainer(tiny_config(tmp_path, "train.steps=6"), resume=True, quiet=True)
    # A stored config this version cannot read names the checkpoint (not a bare error that reads like a bad --set).
    for broken in ({"attention": {"mode": "future_mode"}}, {"optim": None}):
        saved = json.loads(snapshot[manifest])
        for section, fields in broken.items():
            saved["config"][section] = None if fields is None else {**saved["config"][section], **fields}
        manifest.write_text(json.dumps(saved))
        with pytest.raises(CheckpointError, match=f"checkpoint {checkpoints[-1]}: its stored configuration cannot be "
                                                  "read by this version"):
            Trainer(tiny_config(tmp_path, "train.steps=6"), resume=True, quiet=True)
    manifest.write_bytes(snapshot[manifest])
    # Nothing the failed attempts touched was lost or changed.
    assert {p: p.read_bytes() for c in list_checkpoints(tmp_path) for p in c.iterdir()} == snapshot
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Trainer(tiny_config(tmp_path / "empty", "train.steps=2"), resume=True, quiet=True)
    assert not (tmp_path / "empty").exists()  # a mistyped out_dir is not created by the refused resume
    with pytest.raises(ValueError, match="no class labels"):  # it would train on the null class alone
        Trainer(tiny_config(tmp_path / "labels", "model.num_classes=4"), quiet=True)
    # Shapes the clips cannot feed: refused before any run folder exists, naming the field.
    for overrides, message in ((["model.in_channels=4"], r"model.in_channels=4: the trainer's clips are RGB"),
                               (["data.size=15"], r"data.size=15 is not a multiple of model.patch=\(1, 2, 2\)"),
                               (["model.patch=2,2,2", "data.frames=3"],
                                r"data.frames=3 is not a multiple of model.patch=\(2, 2, 2\)"),
                               # 3×6×6 tokens, 54 a rank: not whole 2×2×2 cubes (found at the first step before)
                               (["data.frames=3", "data.size=12", "parallel.cp=2", "parallel.cp_mode=scp"],
                                r"parallel.cp=2 cannot split the 108 tokens .* whole number of query groups")):
        with pytest.raises(ValueError, match=message):
            Trainer(tiny_config(tmp_path / "shapes", *overrides), quiet=True)
        assert not (tmp_path / "shapes").exists()


def test_resume_recovers_from_a_crash_in_the_logs(tmp_path):
    """A crash while writing leaves a cut-short last metrics line and TensorBoard events past the checkpoint:
    resuming drops both, so each step is logged once; a corrupt earlier line is an error instead."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(tmp_path, "train.steps=6", "train.ckpt_every=4", "train.tensorboard=true")
    Trainer(cfg, quiet=True).run()  # logs steps 2, 4, 6 and checkpoints at 4 (and at the end, 6)
    shutil.rmtree(list_checkpoints(tmp_path)[-1])  # as if the run had crashed before step 6's save
    metrics = tmp_path / "metrics.jsonl"
    intact = metrics.read_text()
    metrics.write_text(intact + '{"step": 7, "lo')
    with pytest.warns(UserWarning, match="cut short"):
        Trainer(tiny_config(tmp_path, "train.steps=8", "train.ckpt_every=4", "train.tensorboard=true"),
                resume=True, quiet=True).run()
    steps = [r["step"] for r in read_metrics(tmp_path) if "loss" in r]
    assert steps == [2, 4, 6, 8]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = [event.step for event in events.Scalars(events.Tags()["scalars"][0])]
    assert sorted(logged) == sorted(set(logged)) and 6 in logged, logged

    metrics.write_text('{"step": 2}\nnot json\n' + metrics.read_text())
    with pytest.raises(CheckpointError, match="line 2 is not JSON"):
        Trainer(tiny_config(tmp_path, "train.steps=10", "train.ckpt_every=4"), resume=True, quiet=True)


def test_resume_on_another_device_type_is_refused(tmp_path, monkeypatch):
    import dsv.train.trainer as trainer_module

    Trainer(tiny_config(tmp_path, "train.steps=2", "train.ckpt_every=2"), quiet=True).run()
    load = trainer_module.load_checkpoint

    def saved_on_cuda(path):
        weights, state, manifest = load(path)
        state["rng_per_rank"][0]["cuda_rng"] = torch.zeros(16, dtype=torch.uint8)
        return weights, state, manifest

    monkeypatch.setattr(trainer_module, "load_checkpoint", saved_on_cuda)
    with pytest.raises(CheckpointError, match="saved by a run on cuda; this run is on cpu"):
        Trainer(tiny_config(tmp_path, "train.steps=4"), resume=True, quiet=True)


def test_resume_with_another_number_of_ranks_names_the_cause_on_every_rank(tmp_path):
    """A rank the checkpoint has no state for (resumed with more processes) reports the rank count, as rank 0
    does, instead of failing with an IndexError on the per-rank state."""
    Trainer(tiny_config(tmp_path, "train.steps=2", "train.ckpt_every=2"), quiet=True).run()
    trainer = Trainer(tiny_config(tmp_path / "other", "train.steps=4"), quiet=True)
    trainer.rank, trainer.world = 1, 2  # what rank 1 of a two-process resume sees
    with pytest.raises(CheckpointError, match="saved by 1 ranks; this run has 2"):
        trainer._restore(list_checkpoints(tmp_path)[-1])


def test_config_overrides_reject_bad_input():
    base = get_recipe("debug_cpu")
    with pytest.raises(ValueError, match="unknown field"):
        apply_overrides(base, ["model.hiden=3"])
    with pytest.raises(ValueError, match="unknown section"):
        apply_overrides(base, ["modle.hidden=3"])
    with pytest.raises(ValueError, match="attention.mode"):
        apply_overrides(base, ["attention.mode=sparse"])
    with pytest.raises(ValueError, match="boolean"):
        apply_overrides(base, ["train.bf16=maybe"])
    with pytest.raises(ValueError, match="optim.grad_clip must be >= 0"):
        apply_overrides(base, ["optim.grad_clip=-1"])
    # Values that trained on without an error before: the learning rate's sign flipped, the predictor stepped
    # backwards or switched at once on a zero loss, no block (or every block) went sparse, no position signal.
    for override, message in [
        ("optim.warmup_steps=-5", "optim.warmup_steps must be >= 0"),
        ("optim.lr=inf", "optim.lr must be finite"),
        # NaN passes every range comparison: each float is checked finite first.
        ("optim.grad_clip=nan", "optim.grad_clip must be finite"),
        ("attention.switch_loss_threshold=nan", "attention.switch_loss_threshold must be finite"),
        ("attention.keep_margin=inf", "attention.keep_margin must be finite"),
        ("model.mlp_ratio=nan", "model.mlp_ratio must be finite"),
        ("parallel.intra_node_gbps=nan", "parallel.intra_node_gbps must be finite"),
        ("parallel.inter_node_gbps=0", "link speeds > 0"),
        ("parallel.gpus_per_node=0", "parallel.gpus_per_node must be >= 1"),
        ("attention.switch_loss_threshold=0", "never leaves stage 1"),  # with max_stage1_steps=0 below
        ("optim.betas=0.9", "optim.betas must be two numbers"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
        ("optim.schedule=linear", "optim.schedule must be one of constant, cosine"),
        ("optim.final_lr_ratio=1.5", r"optim.final_lr_ratio must be a fraction of optim.lr in \[0, 1\]"),
        ("optim.final_lr_ratio=nan", "optim.final_lr_ratio must be finite"),
        ("attention.loss_cosine_weight=0", "positive sum"),  # with loss_mse_weight=0 below
        ("attention.loss_cosine_weight=-1", "must be >= 0 with a positive sum"),
        ("attention.predictor_lr=-1e-3", "attention.predictor_lr must be >= 0"),
        ("attention.stage2_lr_scale=-1", "attention.stage2_lr_scale must be >= 0"),
        ("attention.sparse_threshold=2", r"attention.sparse_threshold must be a sparsity in \[0, 1\]"),
        ("attention.keep_margin=-1", "attention.keep_margin must be >= 0"),
        ("attention.switch_loss_threshold=-1", "attention.switch_loss_threshold must be >= 0"),
        ("attention.window_frac=1.5", r"attention.window_frac must be in \(0, 1\]"),
        ("model.heads=0", "model.heads must be >= 1"),
        ("model.hidden=4", "model.hidden must be >= 6"),
        ("model.head_dim=7", "model.arch='wan' needs an even head dim"),  # with model.arch=wan below
        ("attention.kv_block=4", "attention.kv_block must be 0 or 1 .* for attention.mode=window"),  # at the
        # first forward, after the data had loaded, before; with attention.mode=window below
        ("train.threads=-1", "train.threads must be >= 0"),
        ("train.out_dir=", "train.out_dir must name a folder"),
        # Raw torch errors (or a silent default) before: named now, before any run folder exists.
        ("train.device=gpu0", "train.device must be auto, cpu, cuda or cuda:N"),
        ("train.device=meta", "train.device must be auto, cpu, cuda or cuda:N"),  # valid torch devices the
        ("train.device=mps", "train.device must be auto, cpu, cuda or cuda:N"),   # trainer cannot run on
        ("model.compile=inductr", "model.compile must be '' \\(eager\\) or a torch.compile backend"),
        ("data.path=", "expected a value, or none for the default"),  # e.g. data.path=$UNSET: not the bundled data
    ]:
        extra = {"attention.loss_cosine_weight=0": ["attention.loss_mse_weight=0"],
                 "attention.switch_loss_threshold=0": ["attention.max_stage1_steps=0"],
                 "model.head_dim=7": ["model.arch=wan"],
                 "attention.kv_block=4": ["attention.mode=window"]}.get(override, [])
        with pytest.raises(ValueError, match=message):
            apply_overrides(base, [override, *extra])
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("nope")
    assert apply_overrides(base, ["attention.cube=4x4x4"]).attention.cube == (4, 4, 4)


def test_the_config_the_trainer_and_the_cli_check_a_device_by_one_rule(monkeypatch):
    """train.device's form is checked with the config (it may run on another machine), its presence when the
    trainer or an analysis resolves it, and both by the CLI's --device; one rule, each message naming its field."""
    import argparse

    from dsv.cli import device_name
    from dsv.train.trainer import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU, as far as these see
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert apply_overrides(get_recipe("debug_cpu"), ["train.device=cuda:3"]).train.device == "cuda:3"
    assert resolve_device("cuda:0") == torch.device("cuda", 0) and device_name("cuda:0") == "cuda:0"
    assert resolve_device("auto") == torch.device("cuda")
    one_gpu = re.escape("'cuda:1', but this machine has 1 CUDA device(s): cuda:0 to cuda:0")
    with pytest.raises(ValueError, match=f"^train.device={one_gpu}$"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match=f"^device={one_gpu}$"):
        resolve_device("cuda:1", field="device")
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{one_gpu}$"):
        device_name("cuda:1")
    with pytest.raises(ValueError, match="^device must be auto, cpu, cuda or cuda:N, got 'mps'$"):
        resolve_device("mps", field="device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^train.device='cuda', but no CUDA device is available here$"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_a_single_process_run_makes_its_indexed_gpu_current(monkeypatch):
    """Code that names no device (Triton's launches, synchronize) acts on the current one: `train.device=cuda:1`
    makes cuda:1 current; "cuda" and "auto" leave the current device as it is (set_device refuses a device without
    an index), and the CPU touches no GPU."""
    from dsv.train.trainer import init_distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs, as far as these see
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    for name, device in (("cuda:1", torch.device("cuda", 1)), ("cuda", torch.device("cuda")),
                         ("auto", torch.device("cuda")), ("cpu", torch.device("cpu"))):
        assert init_distributed(name) == (0, 1, device), name
    assert made_current == [torch.device("cuda", 1)]


def test_float_fields_given_ints_in_python_take_float_overrides():
    """A config built in Python with an int in a float field (`lr=1`, `betas=(0, 0.99)`) keeps the declared
    type: `--set` parsed such a field with int() and refused 5e-4."""
    from dsv.train.config import OptimConfig

    cfg = get_recipe("debug_cpu")
    cfg.optim = OptimConfig(lr=1, betas=(0, 0.99))
    assert type(cfg.optim.lr) is float and all(type(b) is float for b in cfg.optim.betas)
    changed = apply_overrides(cfg, ["optim.lr=5e-4", "optim.betas=0.9,0.999"])
    assert changed.optim.lr == 5e-4 and changed.optim.betas == (0.9, 0.999)


def test_a_stored_config_without_newer_fields_loads_with_a_warning():
    """A checkpoint's config from before a field existed takes today's default for it, and says which."""
    from dsv.train.config import config_from_dict, config_to_dict

    data = config_to_dict(get_recipe("debug_cpu"))
    assert config_from_dict(data) == get_recipe("debug_cpu")  # a complete config loads as it was
    del data["attention"]["recall_target"], data["train"]["threads"]
    with pytest.warns(UserWarning, match=r"lacks attention.recall_target, train.threads"):
        loaded = config_from_dict(data)
    assert loaded.attention.recall_target == 0.0 and loaded.train.threads == 0
    # A field whose default changed behaviour takes the value the saving run behaved with: a resume of a run
    # from before the dispatch margin is then refused unless the margin is set back, not silently changed.
    del data["attention"]["dispatch_margin"]
    with pytest.warns(UserWarning, match=r"attention.dispatch_margin=0.0 as before the field existed"):
        loaded = config_from_dict(data)
    assert loaded.attention.dispatch_margin == 0.0 and get_recipe("debug_cpu").attention.dispatch_margin == 0.1


def test_cli_sample_and_profile_write_their_files(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [item for o in TINY + [f"train.out_dir={run}", "train.steps=6", "train.ckpt_every=6",
                                       "attention.max_stage1_steps=2"] for item in ("--set", o)]
    assert main(["train", "--recipe", "debug_cpu", *overrides]) == 0
    assert ", switch step 2, sparse blocks [0, 1]" in capsys.readouterr().out  # the training log's last line
    assert main(["sample", "--checkpoint", str(run), "--out", str(tmp_path / "s.gif"), "--num", "2",
                 "--steps", "2", "--compare-dense"]) == 0
    assert (tmp_path / "s.gif").stat().st_size > 0
    sampled = json.loads(capsys.readouterr().out)
    assert sampled["attention_paths"] == ["sparse:reference"] and sampled["dense_seconds"] > 0
    # Sparse and dense sampling from the same noise agree closely (after 6 steps the zero-initialised
    # attention outputs still contribute little, so they may agree exactly).
    assert 0.5 < sampled["ssim"] <= 1.0 and sampled["frames"] > 0
    if sampled["psnr_db"] is None:  # every frame identical: no finite PSNR to average
        assert sampled["identical_frames"] == sampled["frames"]
    else:
        assert sampled["psnr_db"] > 20.0 and sampled["identical_frames"] < sampled["frames"]
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "by_noise_level.png").write_bytes(b"from an earlier profile with --noise-levels")
    assert main(["profile", "--checkpoint", str(run), "--out", str(tmp_path / "prof"), "--clips", "2",
                 "--granularity", "0.5"]) == 0
    assert not (tmp_path / "prof" / "by_noise_level.png").exists()  # would contradict profile.json
    table = (tmp_path / "prof" / "profile.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| 0.50 |"))
    token_recall, cube_recall = (float(x) for x in row.strip("|").split("|")[1:])
    assert 0.0 < cube_recall <= 1.0 and 0.0 < token_recall <= 1.0
    for name in ("sparsity.png", "recall.png", "profile.md", "profile.json"):
        assert (tmp_path / "prof" / name).stat().st_size > 0
    profile = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert len(profile["sparsity"]) == 2 and len(profile["sparsity"][0]) == 2
    assert main(["train", "--recipe", "debug_cpu", "--set", "model.hiden=3"]) == 2
    assert "unknown field" in capsys.readouterr().err


def test_an_interrupted_resave_is_recovered(tmp_path):
    """A crash between moving a step's old copy aside and moving the new one in loses nothing: readers load
    the old copy where it is (they hold no lock: a live trainer may be between the two renames), and the next
    trainer, holding the run folder's lock, moves it back."""
    from dsv.train.checkpoint import load_checkpoint

    cfg = tiny_config(tmp_path, "train.steps=2", "train.ckpt_every=2")
    Trainer(cfg, quiet=True).run()
    root = tmp_path / "checkpoints"
    (root / "step_00000002").rename(root / ".stale_step_00000002_1234")  # the state right after the crash
    weights, state, _ = load_checkpoint(tmp_path)
    assert state["step"] == 2 and (root / ".stale_step_00000002_1234").is_dir()
    assert not (root / "step_00000002").exists()  # a reader renames nothing
    Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2"), resume=True, quiet=True).run()
    assert (root / "step_00000002" / "manifest.json").is_file() and not (root / ".stale_step_00000002_1234").exists()


def test_pruning_renames_before_it_deletes(tmp_path, monkeypatch):
    """An old checkpoint's deletion cut short leaves a `.tmp_` folder, not a `step_` folder whose manifest
    makes it look complete; and a failed deletion warns instead of failing the save."""
    from dsv.train import checkpoint

    def cut_short(path, *args, **kwargs):
        (Path(path) / checkpoint.WEIGHTS).unlink()
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(checkpoint.shutil, "rmtree", cut_short)
    with pytest.warns(UserWarning, match="could not delete the old checkpoint"):
        Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2", "train.keep_checkpoints=1"),
                quiet=True).run()
    root = tmp_path / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000004"]
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp_")] == [f".tmp_step_00000002_prune{os.getpid()}"]


def test_a_users_copy_of_a_checkpoint_is_neither_resumed_from_nor_pruned(tmp_path):
    """Only the names a save writes are checkpoints: a copy kept by hand (`step_00000004_keep`) sorted after the
    real step 4, was resumed from, and was pruned with the real one at the next saves."""
    Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2", "train.keep_checkpoints=2"),
            quiet=True).run()
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step_00000004", root / "step_00000004_keep")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    Trainer(tiny_config(tmp_path, "train.steps=8", "train.ckpt_every=2", "train.keep_checkpoints=2"),
            resume=True, quiet=True).run()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000006", "step_00000008"]
    assert (root / "step_00000004_keep" / "manifest.json").is_file()


def test_checkpoints_are_ordered_by_step_past_eight_digits(tmp_path):
    """Names grow a digit at step 100,000,000: ordered by name, the newest sorted first and `keep=1` deleted the
    checkpoint just written."""
    from dsv.train.checkpoint import save_checkpoint

    weights = {"w": torch.zeros(1)}
    save_checkpoint(tmp_path, 99_999_999, weights, {}, {}, keep=1)
    newest = save_checkpoint(tmp_path, 100_000_000, weights, {}, {}, keep=1)
    assert list_checkpoints(tmp_path) == [newest] and newest.name == "step_100000000"


def test_a_resume_deletes_what_crashed_saves_left_and_keeps_every_checkpoint(tmp_path, monkeypatch):
    """Unfinished `.tmp_` folders and stale copies of completed re-saves go at the next start; a stale copy
    that is a step's only copy is moved back instead; a folder that cannot be deleted warns and stays."""
    import shutil

    from dsv.train import checkpoint

    Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2", "train.keep_checkpoints=3"),
            quiet=True).run()
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step_00000004", root / ".tmp_step_00000006_99")  # a save cut short
    shutil.copytree(root / "step_00000004", root / ".stale_step_00000004_98")  # a completed re-save's old copy
    (root / "step_00000002").rename(root / ".stale_step_00000002_97")  # a re-save cut between its renames
    with pytest.warns(UserWarning, match="deleted .tmp_step_00000006_99, left by a crashed save"):
        Trainer(tiny_config(tmp_path, "train.steps=6", "train.ckpt_every=2", "train.keep_checkpoints=3"),
                resume=True, quiet=True).run()
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_00000002", "step_00000004",
                                                                   "step_00000006"]

    shutil.copytree(root / "step_00000006", root / ".tmp_step_00000008_96")

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint.shutil, "rmtree", refuse)
    with pytest.warns(UserWarning, match="could not delete .*tmp_step_00000008_96"):
        assert checkpoint.remove_unfinished_saves(tmp_path) == []
    assert (root / ".tmp_step_00000008_96").is_dir()


def test_readers_take_the_checkpoint_a_resume_continues_from_when_latest_lags(tmp_path):
    """A save renames its checkpoint into place, then writes `latest`: a crash between the two left `latest`
    naming the step before (or none after the first save). `dsv sample`/`profile`/`observe` and the quality
    bench followed `latest` and loaded the older step while a resume continued from the newer; now every
    reader takes the newest complete checkpoint, and the next start deletes the crash's temporary file."""
    from dsv.analysis.checkpointed_model import load_model
    from dsv.train.checkpoint import checkpoint_step, resolve_checkpoint

    Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2", "train.keep_checkpoints=3"),
            quiet=True).run()
    root = tmp_path / "checkpoints"
    (root / "latest").write_text("step_00000002\n")  # the crash came before `latest` named step 4
    (root / ".latest.tmp4242").write_text("step_00000004\n")
    assert resolve_checkpoint(tmp_path).name == "step_00000004" and checkpoint_step(tmp_path) == 4
    assert load_model(str(tmp_path), "cpu")[2] == 4
    (root / "latest").unlink()  # a crash in the run's first save: no `latest` at all
    assert resolve_checkpoint(tmp_path).name == "step_00000004"
    with pytest.warns(UserWarning, match="deleted .latest.tmp4242, left by a crashed save"):
        Trainer(tiny_config(tmp_path, "train.steps=6", "train.ckpt_every=2", "train.keep_checkpoints=3"),
                resume=True, quiet=True).run()
    assert not (root / ".latest.tmp4242").exists() and (root / "latest").read_text() == "step_00000006\n"


def test_a_new_run_sets_aside_the_logs_of_one_that_saved_no_checkpoint(tmp_path):
    """A run that died before its first checkpoint left logs; a new run in that folder keeps them under another
    name and logs afresh, instead of appending to them (steps 2, 4, 2, 4, 6 in one file)."""
    import shutil

    Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=100", "train.tensorboard=true"),
            quiet=True).run()
    shutil.rmtree(tmp_path / "checkpoints")  # as if it had died before saving
    with pytest.warns(UserWarning, match="saved no checkpoint: kept as metrics.jsonl.unfinished-1"):
        Trainer(tiny_config(tmp_path, "train.steps=6", "train.ckpt_every=6", "train.tensorboard=true"),
                quiet=True).run()
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [2, 4, 6]
    old = [json.loads(line) for line in (tmp_path / "metrics.jsonl.unfinished-1").read_text().splitlines()]
    assert [r["step"] for r in old if "loss" in r] == [2, 4]
    assert (tmp_path / "tensorboard.unfinished-1").is_dir() and (tmp_path / "tensorboard").is_dir()


def test_resume_from_an_older_checkpoint_logs_each_step_once(tmp_path):
    import shutil

    Trainer(tiny_config(tmp_path, "train.steps=6", "train.ckpt_every=4", "train.keep_checkpoints=3"), quiet=True).run()
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000006")  # as if the run died after logging step 6
    Trainer(tiny_config(tmp_path, "train.steps=6", "train.ckpt_every=4", "train.keep_checkpoints=3"),
            resume=True, quiet=True).run()
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [2, 4, 6]


def test_resume_with_no_steps_left_is_refused_before_it_touches_the_run(tmp_path, capsys):
    """`--resume` with train.steps at or below the checkpoint's step trains nothing: an error, not a "done"
    line that reports train.steps as the step reached."""
    overrides = TINY + [f"train.out_dir={tmp_path}", "train.ckpt_every=2", "attention.mode=dense"]
    Trainer(apply_overrides(get_recipe("debug_cpu"), overrides + ["train.steps=2"]), quiet=True).run()
    metrics = (tmp_path / "metrics.jsonl").read_text()
    for steps in (1, 2):
        args = [item for o in overrides + [f"train.steps={steps}"] for item in ("--set", o)]
        assert main(["train", "--recipe", "debug_cpu", "--resume", *args]) == 2
        captured = capsys.readouterr()
        assert "done" not in captured.out
        assert f"train.steps={steps} leaves nothing to train" in captured.err
        assert "checkpoint" in captured.err and "at step 2" in captured.err
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]


def test_a_run_out_of_time_saves_stops_and_resumes_into_the_uninterrupted_run(tmp_path, capsys):
    """train.max_minutes: a leg whose budget has run out trains the step in progress, saves it (off the
    checkpoint schedule), says so and exits 0; legs resumed under the same limit each add a step, and the last
    leg, unlimited, ends where the uninterrupted run does: the same weights and the same records."""
    schedule = ["train.steps=8", "train.log_every=4", "train.ckpt_every=8", "attention.max_stage1_steps=4"]
    Trainer(tiny_config(tmp_path / "straight", *schedule), quiet=True).run()
    run = tmp_path / "legs"
    # 1e-6 minutes has run out by the end of the first step.
    args = [item for o in TINY + schedule + [f"train.out_dir={run}", "train.max_minutes=1e-6"] for item in ("--set", o)]
    assert main(["train", "--recipe", "debug_cpu", *args]) == EXIT_UNFINISHED  # a job script can requeue on it
    out = capsys.readouterr().out
    assert "stopped at step 1 of 8 (train.max_minutes); continue with --resume" in out and "done" not in out
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001"]
    # A stop on a scheduled checkpoint step saves it once.
    assert main(["train", "--recipe", "debug_cpu", "--resume", *args, "--set", "train.ckpt_every=1"]) == EXIT_UNFINISHED
    out = capsys.readouterr().out
    assert "stopped at step 2 of 8" in out and out.count("| checkpoint ") == 1
    result = Trainer(tiny_config(run, *schedule), resume=True, quiet=True).run()
    assert not result["stopped_at_time_limit"]
    straight_w, straight_s = final_state(tmp_path / "straight", *schedule)
    legs_w, legs_s = final_state(run, *schedule)
    assert straight_s["step"] == legs_s["step"] == 8
    for name, value in straight_w.items():
        assert bitwise_equal(value, legs_w[name]), name
    # The legs' off-schedule checkpoints (steps 1 and 2) counted towards keep_checkpoints and stayed for good.
    assert [p.name for p in list_checkpoints(run)] == [p.name for p in list_checkpoints(tmp_path / "straight")]

    def without_speed(folder):
        return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in read_metrics(folder)]

    assert without_speed(run) == without_speed(tmp_path / "straight")
    with pytest.raises(ValueError, match="train.max_minutes must be a finite number >= 0"):
        tiny_config(tmp_path, "train.max_minutes=-1")


def test_a_second_process_training_into_the_same_folder_is_refused(tmp_path):
    """Two trainers writing one run folder would interleave checkpoints and logs: the second stops before it
    writes anything, whether it starts a run or resumes one; the folder is free again once the first ends."""
    import subprocess
    import sys

    cfg = tiny_config(tmp_path, "train.steps=2", "train.ckpt_every=2")
    Trainer(cfg, quiet=True).run()
    holder = Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2"), resume=True, quiet=True)
    # Another process (flock is per open file: a second lock in this process would conflict just the same).
    probe = ("import sys; from dsv.train.checkpoint import lock_run_dir, CheckpointError\n"
             "try:\n    lock_run_dir(sys.argv[1])\nexcept CheckpointError as err:\n    print(err); sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    assert other.returncode == 3 and "another process is training into" in other.stdout
    with pytest.raises(CheckpointError, match="another process is training into"):
        Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2"), resume=True, quiet=True)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    holder.run()  # it trains on, and releases the folder when it ends
    assert (tmp_path / "metrics.jsonl").read_text().startswith(metrics)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    assert subprocess.run([sys.executable, "-c", probe, str(tmp_path)]).returncode == 0


def _drifting_video(frames: int, phase: float) -> torch.Tensor:
    """uint8 [frames, 24, 24, 3]: a pattern drifting by 2 px per frame (``phase`` changes its pixels only)."""
    y, x = torch.meshgrid(torch.arange(24.0), torch.arange(24.0), indexing="ij")
    video = [torch.stack([128 + 100 * torch.sin((x - 2 * k) / 5 + phase) * torch.cos(y / 7)] * 3, dim=-1)
             for k in range(frames)]
    return torch.stack(video).round().clamp(0, 255).to(torch.uint8)


def test_resume_checks_the_data_itself_not_the_path_string(tmp_path):
    """The same videos under another folder name resume; a changed set of videos is refused, naming it; the
    same videos decoded to other pixels (another FFmpeg build) resume with a warning."""
    import shutil

    from dsv.train.video_io import write_video

    folder = tmp_path / "videos"
    folder.mkdir()
    for name, phase in (("a.mp4", 0.0), ("b.mp4", 1.0)):
        write_video(_drifting_video(20, phase), folder / name)
    run = tmp_path / "run"
    Trainer(tiny_config(run, "train.steps=2", "train.ckpt_every=2", f"data.path={folder}"), quiet=True).run()
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    assert Trainer(tiny_config(run, "train.steps=3", f"data.path={moved}"), resume=True, quiet=True).run()["step"] == 3

    write_video(_drifting_video(20, 2.0), moved / "c.mp4")
    with pytest.raises(CheckpointError, match=r"trained on other data: missing now \[\], new \['c.mp4'\]"):
        Trainer(tiny_config(run, "train.steps=4", f"data.path={moved}"), resume=True, quiet=True)
    (moved / "c.mp4").unlink()
    write_video(_drifting_video(20, 0.5), moved / "a.mp4")  # same frames and size, other pixels
    with pytest.warns(UserWarning, match=r"decoded pixels of \['a.mp4'\] differ"):
        Trainer(tiny_config(run, "train.steps=4", f"data.path={moved}"), resume=True, quiet=True)


def test_resumed_log_averages_the_same_steps_as_an_uninterrupted_one(tmp_path):
    """A run that dies after its checkpoint at step 6, between two records (every 4 steps), resumes with the
    open window's steps 5-6: its record at step 8 averages steps 5-8, as the uninterrupted run's does."""
    import shutil

    schedule = ["train.steps=12", "train.log_every=4", "train.ckpt_every=6", "train.keep_checkpoints=3",
                "attention.max_stage1_steps=4"]
    Trainer(tiny_config(tmp_path / "straight", *schedule), quiet=True).run()
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_00000012")  # as if the run died after step 6
    Trainer(tiny_config(tmp_path / "resumed", *schedule), resume=True, quiet=True).run()
    straight = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "straight") if "loss" in r]
    resumed = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "resumed") if "loss" in r]
    assert [s for s, _ in straight] == [4, 8, 12]
    assert resumed == straight


def test_a_run_resumed_where_an_earlier_leg_ended_logs_what_an_uninterrupted_one_does(tmp_path):
    """A leg that ends off the log/eval schedule (step 6; records every 4, held-out loss every 100) logs a
    final loss and held-out record; resuming drops those extras, carries the loss window on, and restores
    each layer's dispatch text: every record equals the uninterrupted run's but for the speed."""
    schedule = ["train.log_every=4", "train.ckpt_every=6", "attention.max_stage1_steps=4"]
    Trainer(tiny_config(tmp_path / "straight", "train.steps=12", *schedule), quiet=True).run()
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=6", *schedule), quiet=True).run()
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [4, 6, 6]  # the leg's own end records
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=12", *schedule), resume=True, quiet=True).run()

    def without_speed(run):
        return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in read_metrics(tmp_path / run)]

    straight, resumed = without_speed("straight"), without_speed("resumed")
    assert [r["step"] for r in straight] == [4, 8, 12, 12]
    assert any(layer["dispatch"] != "not dispatched yet" for r in straight if "layers" in r for layer in r["layers"])
    assert resumed == straight


def _rewrite_state(ckpt, edit):
    """Edit a checkpoint's training state in place, keeping its manifest's digest right."""
    from dsv.train.checkpoint import MANIFEST, STATE, _sha256

    state = torch.load(ckpt / STATE, weights_only=False)
    edit(state)
    torch.save(state, ckpt / STATE)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["sha256"][STATE] = _sha256(ckpt / STATE)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_resume_keeps_end_records_that_were_on_schedule_or_cannot_be_logged_again(tmp_path):
    """Records an end of run logged on its own schedule stay when the resume logs on another one; with no step
    left to train, or from a checkpoint without the saved loss window, nothing is dropped either."""
    Trainer(tiny_config(tmp_path / "a", "train.steps=6", "train.ckpt_every=6", "train.log_every=3"), quiet=True).run()
    Trainer(tiny_config(tmp_path / "a", "train.steps=12", "train.log_every=4"), resume=True, quiet=True).run()
    assert [r["step"] for r in read_metrics(tmp_path / "a") if "loss" in r] == [3, 6, 8, 12]

    Trainer(tiny_config(tmp_path / "b", "train.steps=6", "train.ckpt_every=6", "train.log_every=4"), quiet=True).run()
    Trainer(tiny_config(tmp_path / "b", "train.steps=6", "train.log_every=4"), resume=True, quiet=True).run()
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [4, 6, 6]  # nothing trained, nothing dropped

    Trainer(tiny_config(tmp_path / "c", "train.steps=6", "train.ckpt_every=6", "train.log_every=4"), quiet=True).run()
    _rewrite_state(list_checkpoints(tmp_path / "c")[-1], lambda state: state["rng_per_rank"][0].pop("log_window"))
    Trainer(tiny_config(tmp_path / "c", "train.steps=8", "train.log_every=4"), resume=True, quiet=True).run()
    assert [r["step"] for r in read_metrics(tmp_path / "c") if "loss" in r] == [4, 6, 8]


def test_a_checkpoint_without_a_data_fingerprint_still_refuses_another_data_path(tmp_path):
    from dsv.train.video_io import write_video

    run, videos = tmp_path / "run", tmp_path / "videos"
    videos.mkdir()
    for name, phase in (("a.mp4", 0.0), ("b.mp4", 1.0)):
        write_video(_drifting_video(20, phase), videos / name)
    Trainer(tiny_config(run, "train.steps=2", "train.ckpt_every=2"), quiet=True).run()
    _rewrite_state(list_checkpoints(run)[-1], lambda state: state.pop("data"))
    with pytest.raises(CheckpointError, match="saved before data fingerprints.*data.path=None"):
        Trainer(tiny_config(run, "train.steps=4", f"data.path={videos}"), resume=True, quiet=True)
    with pytest.warns(UserWarning, match="only data.path is checked"):
        Trainer(tiny_config(run, "train.steps=4"), resume=True, quiet=True).run()


def test_cleanup_keeps_an_old_copy_whose_new_copy_is_incomplete(tmp_path):
    from dsv.train.checkpoint import MANIFEST, remove_unfinished_saves

    Trainer(tiny_config(tmp_path, "train.steps=2", "train.ckpt_every=2"), quiet=True).run()
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step_00000002", root / ".stale_step_00000002_7")
    (root / "step_00000002" / MANIFEST).unlink()  # the new copy is not complete
    assert remove_unfinished_saves(tmp_path) == []
    assert (root / ".stale_step_00000002_7" / MANIFEST).is_file()


def test_tensorboard_of_a_resumed_run_has_the_uninterrupted_runs_points(tmp_path):
    """The end-of-leg records a resume drops from metrics.jsonl go from TensorBoard too (the step is purged and
    its kept records written again)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    schedule = ["train.log_every=4", "train.ckpt_every=6", "attention.max_stage1_steps=4", "train.tensorboard=true"]
    Trainer(tiny_config(tmp_path / "straight", "train.steps=12", *schedule), quiet=True).run()
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=6", *schedule), quiet=True).run()
    Trainer(tiny_config(tmp_path / "resumed", "train.steps=12", *schedule), resume=True, quiet=True).run()

    def points(run):
        events = EventAccumulator(str(tmp_path / run / "tensorboard"))
        events.Reload()
        return {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in ("loss", "heldout_loss")}

    straight = points("straight")
    assert [step for step, _ in straight["loss"]] == [4, 8, 12] and straight == points("resumed")


def test_block_lines_name_the_slow_path_and_the_kernels_on_a_gpu():
    """The trainer's per-block lines say which Triton-backend kernels a sparse block ran (a layout that the
    fastest ones leave out shows there) and, on a GPU only, why a sparse block runs the reference."""
    from types import SimpleNamespace

    def layer(path, forward=None, backward=None, reason=None, sparse=None):
        sparse = path.startswith("sparse") if sparse is None else sparse
        return {"path": path, "sparsity": [0.9, None], "recall": [0.95, None], "sparse": sparse,
                "dispatch": "pays", "backend_reason": reason, "forward": forward, "backward": backward}

    summary = {"layers": [
        layer("sparse:triton", "Hopper warp-specialized", "split Triton: key blocks of 64"),
        layer("sparse:reference", reason="head dim 320 > 256"),
        layer("dense:sdpa", "dense", "dense"),
        layer("sparse:triton"),  # compiled: nothing recorded
        layer("dense:sdpa", sparse=True),  # dispatched sparse at this step (the switch): dense until the next
        layer("none", sparse=True),  # no forward recorded a path
    ]}
    gpu = Trainer._describe_layers(SimpleNamespace(device=torch.device("cuda")), summary).splitlines()
    assert gpu[0].endswith("| sparse: pays | kernels: forward Hopper warp-specialized, backward split Triton: "
                           "key blocks of 64")
    assert gpu[1].endswith("| sparse: pays | slow path: head dim 320 > 256")
    assert gpu[2].endswith("| dense: pays") and gpu[3].endswith("| sparse: pays")
    assert "0.90   -   recall 0.950" in gpu[0]
    assert gpu[4].endswith("| sparse from the next step: pays") and gpu[5].endswith("| sparse: pays")
    cpu = Trainer._describe_layers(SimpleNamespace(device=torch.device("cpu")), summary).splitlines()
    assert "slow path" not in cpu[1] and cpu[0].endswith("kernels: forward Hopper warp-specialized, backward "
                                                         "split Triton: key blocks of 64")


def test_a_failed_save_keeps_its_cause_and_the_logs_up_to_it(tmp_path, monkeypatch):
    """An error inside the save (here a stand-in for an internal one) stops the run with a CheckpointError
    that keeps the original exception (its traceback) as its cause; the logs up to the step are on disk."""
    import dsv.train.trainer as trainer_module

    def broken_save(*args, **kwargs):
        raise TypeError("cannot pickle 'generator' object")

    monkeypatch.setattr(trainer_module, "save_checkpoint", broken_save)
    trainer = Trainer(tiny_config(tmp_path, "train.steps=4", "train.ckpt_every=2", "train.log_every=1"), quiet=True)
    with pytest.raises(CheckpointError, match="saving step 2 failed on rank 0: TypeError: cannot pickle") as caught:
        trainer.run()
    assert isinstance(caught.value.__cause__, TypeError)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2]


def test_a_resume_on_another_cpu_thread_count_or_compile_setting_warns(tmp_path):
    """train.threads may change on resume, but CPU sums round by the thread count: the continuation is then not
    bitwise that of an uninterrupted run, and the resume says so; on the saved count it says nothing. The same
    for model.compile."""
    import warnings

    threads = torch.get_num_threads()
    try:
        Trainer(tiny_config(tmp_path, "train.steps=2", "train.ckpt_every=2", "train.threads=1"), quiet=True).run()
        with pytest.warns(UserWarning, match="resuming on 2 CPU threads, saved on 1: .* not bitwise"):
            Trainer(tiny_config(tmp_path, "train.steps=3", "train.threads=2"), resume=True, quiet=True).close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Trainer(tiny_config(tmp_path, "train.steps=3", "train.threads=1"), resume=True, quiet=True).close()
        # Likewise model.compile, also a resumable change: it said nothing.
        with pytest.warns(UserWarning, match="resuming with model.compile='eager', saved with '': .* not bitwise"):
            Trainer(tiny_config(tmp_path, "train.steps=3", "train.threads=1", "model.compile=eager"), resume=True,
                    quiet=True).close()
    finally:
        torch.set_num_threads(threads)
