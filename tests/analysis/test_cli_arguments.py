"""`dsv sample`, `dsv profile` and `dsv observe` refuse arguments that would give silently wrong results: a
sparse sampling mode on a checkpoint that would run dense, no Euler steps or samples, an output suffix found
out only after sampling, θ = 0 taken as the run's θ, and clip counts beyond (or below) the held-out clips."""

import json

import pytest
import torch

import dsv.analysis.sample
import dsv.train.video_io
from dsv.analysis.observations import observe_checkpoint
from dsv.analysis.profile import profile_checkpoint
from dsv.analysis.sample import sample_videos
from dsv.cli import main
from dsv.train.trainer import Trainer
from tests.train.test_training import tiny_config

HELDOUT = 4  # data.heldout_clips of tiny_config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four 1-step tiny runs: DSV still in stage 1, DSV in stage 2 (switched at its one step), the same with
    compiled blocks, and dense."""
    root = tmp_path_factory.mktemp("runs")
    schedules = {
        "stage1": ["attention.max_stage1_steps=100"],  # switch_loss_threshold=0: only max_stage1_steps switches
        "stage2": ["attention.max_stage1_steps=1"],
        "compiled": ["attention.max_stage1_steps=1", "model.compile=eager"],
        "dense": ["attention.mode=dense"],
    }
    for name, extra in schedules.items():
        if "model.compile=eager" in extra:
            # Compiled models of earlier tests in this process count against dynamo's recompile limit on the
            # blocks' shared code: run after them (another test order), this one would exceed it.
            torch._dynamo.reset()
        Trainer(tiny_config(root / name, "train.steps=1", "train.ckpt_every=1", *extra), quiet=True).run()
    return root


def test_a_run_with_compiled_blocks_is_analysed_with_eager_ones(runs, tmp_path):
    """Profiling and observations read attention through Python hooks that a compiled block cannot run: the
    analysis loads the checkpoint of a compiled run with eager blocks."""
    from dsv.analysis.checkpointed_model import load_model

    model, cfg, step = load_model(str(runs / "compiled"), "cpu")
    assert step == 1 and cfg.model.compile == "" and all(block._compiled_call_impl is None for block in model.blocks)
    profiled = profile_checkpoint(str(runs / "compiled"), str(tmp_path / "profile"), clips=1)
    assert len(profiled["recall"]) == len(model.blocks)
    observed = observe_checkpoint(str(runs / "compiled"), str(tmp_path / "observe"), clips=1, rows=16)
    assert observed["grid"] == [4, 8, 8]


def _fail_if_sampling(*args, **kwargs):
    raise AssertionError("sampled before checking the arguments")


def test_sample_refuses_a_sparse_mode_that_would_sample_densely(runs, tmp_path, capsys):
    out = tmp_path / "s.gif"
    for run, mode, reason in (("stage1", "oracle", "still in stage 1"), ("stage1", "dsv", "still in stage 1"),
                              ("dense", "oracle", "no stage switch"), ("dense", "dsv", "no trained predictors")):
        assert main(["sample", "--checkpoint", str(runs / run), "--attention-mode", mode, "--out", str(out),
                     "--num", "1", "--steps", "1", "--device", "cpu"]) == 2, (run, mode)
        err = capsys.readouterr().err
        assert f"--attention-mode {mode}" in err and reason in err, err
        assert not out.exists()
    # A checkpoint in stage 2 with sparse blocks samples sparsely under the mode it reports.
    assert main(["sample", "--checkpoint", str(runs / "stage2"), "--attention-mode", "oracle", "--out", str(out),
                 "--num", "1", "--steps", "1", "--device", "cpu"]) == 0
    sampled = json.loads(capsys.readouterr().out)
    assert sampled["mode"] == "oracle" and sampled["attention_paths"] == ["sparse:reference"]
    assert sampled["sparse_blocks"] == [0, 1] and out.stat().st_size > 0


def test_sampling_that_ran_every_block_densely_says_so(runs, tmp_path):
    """A DSV checkpoint from before the switch samples with dense attention in every block under mode "dsv": its
    time and its PSNR against dense were dense against dense, without a word."""
    with pytest.warns(UserWarning, match="ran every block densely: no block is dispatched sparse"):
        stage1 = sample_videos(str(runs / "stage1"), str(tmp_path / "a.gif"), num=1, steps=1, device="cpu")
    assert stage1["mode"] == "dsv" and stage1["ran_sparse"] is False
    stage2 = sample_videos(str(runs / "stage2"), str(tmp_path / "b.gif"), num=1, steps=1, device="cpu")
    assert stage2["ran_sparse"] is True


def test_sample_checks_its_arguments_before_sampling(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dsv.analysis.sample, "_generate", _fail_if_sampling)
    checkpoint = str(runs / "stage2")
    for option, value in (("--steps", "0"), ("--num", "0"), ("--num", "-2")):
        with pytest.raises(SystemExit) as exit_info:
            main(["sample", "--checkpoint", checkpoint, "--out", str(tmp_path / "s.gif"), option, value])
        assert exit_info.value.code == 2
        assert f"argument {option}: expected an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # torch.Generator overflowed after the model had loaded
        main(["sample", "--checkpoint", checkpoint, "--out", str(tmp_path / "s.gif"), "--seed", str(2**64)])
    assert f"argument --seed: expected an integer in [0, {2**64 - 2}]" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", checkpoint, "--out", str(tmp_path / "s.avi"), "--num", "1",
                 "--steps", "1"]) == 2
    assert "unsupported suffix '.avi'" in capsys.readouterr().err
    # .mp4 where PyAV is missing (as on a host with OpenCV alone): refused before sampling, not after.
    monkeypatch.setattr(dsv.train.video_io, "av", None)
    assert main(["sample", "--checkpoint", checkpoint, "--out", str(tmp_path / "s.mp4"), "--num", "1",
                 "--steps", "1"]) == 2
    assert ".mp4 needs PyAV (pip install av)" in capsys.readouterr().err
    for option, value, expected in (("--device", "cpux", "must be auto, cpu, cuda or cuda:N, got 'cpux'"),
                                    ("--device", "mps", "must be auto, cpu, cuda or cuda:N, got 'mps'")):
        with pytest.raises(SystemExit):  # a torch traceback, or an error naming train.device, before
            main(["sample", "--checkpoint", checkpoint, "--out", str(tmp_path / "s.gif"), option, value])
        assert f"argument {option}: {expected}" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["sample", "--checkpoint", checkpoint, "--out", str(tmp_path / "s.gif"), "--device", "cuda"])
        assert "argument --device: 'cuda', but no CUDA device is available here" in capsys.readouterr().err
    for kwargs, match in (({"steps": 0}, "steps must be >= 1"), ({"num": 0}, "num must be >= 1"),
                          ({"fps": 0}, r"fps must be a number > 0 \(frames per second\), got 0")):
        with pytest.raises(ValueError, match=match):
            sample_videos(checkpoint, str(tmp_path / "s.gif"), **kwargs)
    assert not any(tmp_path.iterdir())


def test_profile_takes_theta_0_as_given_and_checks_and_records_the_clips(runs, tmp_path, capsys):
    checkpoint = str(runs / "stage2")
    for theta in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="theta must lie in"):
            profile_checkpoint(checkpoint, str(tmp_path / "p"), device="cpu", clips=1, theta=theta)
    assert main(["profile", "--checkpoint", checkpoint, "--out", str(tmp_path / "p"), "--theta", "0",
                 "--device", "cpu"]) == 2
    assert "theta must lie in (0, 1), got 0.0" in capsys.readouterr().err
    for kept in ("0", "1.5"):  # refused after the checkpoint had loaded and the measurement run, before
        with pytest.raises(SystemExit):
            main(["profile", "--checkpoint", checkpoint, "--out", str(tmp_path / "p"), "--granularity", kept])
        assert f"argument --granularity: expected a fraction in (0, 1], got {float(kept)}" in capsys.readouterr().err
    for clips in (0, -3):
        with pytest.raises(ValueError, match="clips must be an integer >= 1"):
            profile_checkpoint(checkpoint, str(tmp_path / "p"), device="cpu", clips=clips)
    # An --out that cannot be a folder: named before the model runs (a raw error after it had run, before).
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        for command in ("profile", "observe"):
            assert main([command, "--checkpoint", checkpoint, "--out", str(out), "--device", "cpu"]) == 2
            assert f"--out {out}: {tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["profile", "--checkpoint", checkpoint, "--out", str(tmp_path / "p"), "--clips", str(clips)])
        assert "argument --clips" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"holds out {HELDOUT} clips"):
        profile_checkpoint(checkpoint, str(tmp_path / "p"), device="cpu", clips=HELDOUT + 1)
    assert not (tmp_path / "p").exists()

    result = profile_checkpoint(checkpoint, str(tmp_path / "p"), device="cpu", clips=2, theta=0.5)
    written = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert written["clips"] == result["clips"] == 2 and written["theta"] == 0.5
    assert "2 held-out clips" in (tmp_path / "p" / "profile.md").read_text()
    # Which noise levels the clips were profiled at, in the table's words and in the JSON.
    levels = written["noise_levels"]
    assert len(levels) == 2 and all(0.0 <= level <= 1.0 for level in levels)
    assert "t = " + ", ".join(f"{level:.2f}" for level in levels) + "." in (tmp_path / "p" / "profile.md").read_text()


def test_profile_by_noise_level_measures_each_sparse_blocks_own_selection_at_each_t(runs, tmp_path):
    checkpoint = str(runs / "stage2")
    for levels in ((0.5, 1.5), (-0.1,)):
        with pytest.raises(ValueError, match=r"noise_levels \(--noise-levels\) must lie in \[0, 1\]"):
            profile_checkpoint(checkpoint, str(tmp_path / "p"), device="cpu", clips=1, noise_levels=levels)
    assert not (tmp_path / "p").exists()
    assert main(["profile", "--checkpoint", checkpoint, "--out", str(tmp_path / "p"), "--clips", "2",
                 "--device", "cpu", "--noise-levels", "0.2", "0.8"]) == 0
    written = json.loads((tmp_path / "p" / "profile.json").read_text())
    levels, sparse_blocks = written["by_noise_level"], written["sparse_blocks"]
    assert [entry["t"] for entry in levels] == [0.2, 0.8] and sparse_blocks  # the stage-2 run has sparse blocks
    for entry in levels:
        assert len(entry["sparsity"]) == len(written["sparsity"]) and all(0 <= s <= 1 for s in entry["sparsity"])
        assert [i for i, r in enumerate(entry["recall"]) if r is not None] == sparse_blocks
        assert all(0 < entry["recall"][block] <= 1 for block in sparse_blocks)
    assert levels[0]["sparsity"] != levels[1]["sparsity"]  # each level's own inputs
    assert (tmp_path / "p" / "by_noise_level.png").stat().st_size > 0
    table = (tmp_path / "p" / "profile.md").read_text()
    head = "| t | mean sparsity | " + " | ".join(f"recall block {b}" for b in sparse_blocks) + " |"
    assert head in table and "|---|---|" + "---|" * len(sparse_blocks) + "\n" in table
    assert table.count("\n| 0.20 | ") == table.count("\n| 0.80 | ") == 1
    # The extra forwards leave the main profile as it is without levels; without levels: none, no plot.
    plain = profile_checkpoint(checkpoint, str(tmp_path / "q"), device="cpu", clips=2)
    assert (plain["sparsity"], plain["recall"], plain["by_noise_level"]) == (written["sparsity"], written["recall"], [])
    assert not (tmp_path / "q" / "by_noise_level.png").exists()
    # A run whose blocks all run dense: sparsity per level, no recall columns, a well-formed table.
    stage1 = profile_checkpoint(str(runs / "stage1"), str(tmp_path / "s1"), device="cpu", clips=1, noise_levels=(0.5,))
    assert stage1["sparse_blocks"] == [] and stage1["by_noise_level"][0]["recall"] == [None] * len(stage1["sparsity"])
    assert "| t | mean sparsity |\n|---|---|\n| 0.50 | " in stage1["table"]
    assert "no block runs sparse" in stage1["table"]


def test_profile_window_compares_the_window_boxes_with_the_best_and_the_runs_selection_at_their_budget(runs, tmp_path):
    """`dsv profile --window`: in every block, the mass inside the window baseline's boxes, the exact top key
    blocks and (a DSV run) its predictor's selection, each with the window's number of key blocks; the rest of
    the profile as without it."""
    for run, names in (("stage2", ["window", "oracle", "selection"]), ("dense", ["window", "oracle"])):
        out = tmp_path / run
        assert main(["profile", "--checkpoint", str(runs / run), "--out", str(out), "--clips", "2", "--device", "cpu",
                     "--window"]) == 0
        written = json.loads((out / "profile.json").read_text())
        budget = written["window_budget"]
        assert [n for n in ("window", "oracle", "selection") if n in budget] == names
        assert 0 < budget["kept_fraction"] < 1 and budget["window_frac"] == pytest.approx(2 / 3)
        for name in names:
            assert len(budget[name]) == len(written["sparsity"]) and all(0 < r <= 1 for r in budget[name])
        # The exact top blocks hold at least what the boxes hold (float32 sums: 1e-6).
        assert all(best >= box - 1e-6 for best, box in zip(budget["oracle"], budget["window"]))
        table = (out / "profile.md").read_text()
        assert "Attention mass kept at the window baseline's budget" in table
        assert table.count("\n| 0 | ") == 2  # block 0 in the main table and in the window table
        plain = profile_checkpoint(str(runs / run), str(tmp_path / f"{run}-plain"), device="cpu", clips=2)
        assert plain["window_budget"] is None and "window baseline" not in plain["table"]
        assert (plain["sparsity"], plain["recall"]) == (written["sparsity"], written["recall"])


def test_own_budget_selection_is_the_one_the_sparse_layer_attends_with(runs):
    """What the profile by noise level measures is the selection sparse sampling uses: compute_index at the
    dispatched budget gives the index the layer's attention receives in the same forward."""
    from dsv.analysis.checkpointed_model import load_model
    from dsv.analysis.profile import heldout_clips

    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    layer = next(layer for layer in model.controller.layers if layer.runs_sparse())
    own, attended = [], []
    layer.observer = lambda layer, hidden, q, k, grid: own.append(layer.compute_index(hidden, q, k, grid))
    attend = layer.attend
    layer.attend = lambda q, k, v, index: attended.append(index) or attend(q, k, v, index)
    x0 = heldout_clips(cfg, 2)
    t = torch.full((2,), 0.5)
    with torch.no_grad():
        model(0.5 * x0 + 0.5 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(0)), t)
    assert len(own) == len(attended) == 1
    assert torch.equal(own[0].indices, attended[0].indices) and torch.equal(own[0].counts, attended[0].counts)


def test_observe_checks_theta_and_the_clips_available(runs, tmp_path):
    checkpoint = str(runs / "stage2")
    with pytest.raises(ValueError, match=f"holds out {HELDOUT} clips"):
        observe_checkpoint(checkpoint, str(tmp_path / "o"), device="cpu", clips=HELDOUT + 1, rows=16)
    with pytest.raises(ValueError, match="theta must lie in"):
        observe_checkpoint(checkpoint, str(tmp_path / "o"), device="cpu", clips=1, theta=0.0, rows=16)
    with pytest.raises(ValueError, match="clips must be an integer >= 1"):
        observe_checkpoint(checkpoint, str(tmp_path / "o"), device="cpu", clips=0, rows=16)
    assert not (tmp_path / "o").exists()
