"""`dsv bench train` runs every mode on a tiny shape and reports DSV in stage 2 with sparse blocks."""

import re

import pytest
import torch

import dsv.bench.train as bench_train
from dsv.bench.train import _peaks_against_dense, _Run, paper_profile
from dsv.cli import main
from dsv.modules.predictor import LowRankPredictor
from dsv.train.config import apply_overrides
from dsv.train.recipes import get_recipe


def test_bench_train_reports_all_modes(tmp_path, capsys):
    out = tmp_path / "report.md"
    code = main(["bench", "train", "--recipe", "debug_cpu", "--device", "cpu", "--tokens", "128", "--spatial", "8",
                 "--set", "model.depth=5", "--set", "model.hidden=32", "--set", "model.heads=2",
                 "--set", "attention.cube=2,2,2", "--warmup", "0", "--steps", "1", "--out", str(out),
                 "--op-profile", str(tmp_path / "ops"), "--memory-history", str(tmp_path / "mem")])
    assert code == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 128 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["dense", "window", "dsv"]
    dsv_row = rows[-1].split("|")
    # The paper profile: blocks 4-31 (here 4 of 5) are >= 0.70 sparse; with the reference backend the
    # 0.8 threshold alone dispatches, so blocks with mean sparsity >= 0.8 run sparse.
    assert dsv_row[5].strip() == dsv_row[6].strip() == "nan"  # peaks allocated and requested: CUDA only
    assert int(dsv_row[7]) >= 1
    assert "predictor update" in dsv_row[8]
    estimation = float(re.search(r"critical-KV estimation ([0-9.]+) ms/step", dsv_row[8]).group(1))
    assert estimation > 0  # timed in the sparse layers of one step
    # One operator table per run (host time on the CPU); the allocator history exists on CUDA only.
    for mode in ("dense", "window", "dsv"):
        assert "Self CPU" in (tmp_path / "ops" / f"128-{mode}.txt").read_text()
    assert not (tmp_path / "mem").exists()


def test_peaks_against_dense_are_printed_in_mib():
    gib = 1 / 1024  # one MiB in GiB
    rows = [dict(tokens=64, mode="dense", peak_gib=40.0, peak_requested_gib=39.5),
            dict(tokens=64, mode="dsv", peak_gib=40.0 + 2 * gib, peak_requested_gib=39.5 - 0.5 * gib),
            dict(tokens=128, mode="dsv", peak_gib=41.0, peak_requested_gib=41.0)]  # no dense run at 128
    assert _peaks_against_dense(rows) == [
        "", "- dsv at 64 tokens, peak against dense: +2.0 MiB allocated, -0.5 MiB requested"]
    nan = float("nan")  # off CUDA no peak is tracked: nothing to compare
    assert _peaks_against_dense([dict(tokens=64, mode=mode, peak_gib=nan, peak_requested_gib=nan)
                                 for mode in ("dense", "dsv")]) == []


def test_bench_train_with_compiled_blocks(tmp_path):
    """Compiled blocks (aot_eager on the CPU) through stage 2; the estimation, timed from a Python hook that
    a compiled block cannot run, is reported as not available instead of failing."""
    out = tmp_path / "report.md"
    code = main(["bench", "train", "--recipe", "debug_cpu", "--device", "cpu", "--tokens", "128", "--spatial", "8",
                 "--set", "model.depth=5", "--set", "model.hidden=32", "--set", "model.heads=2",
                 "--set", "attention.cube=2,2,2", "--set", "model.compile=aot_eager", "--modes", "dense", "dsv",
                 "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert code == 0
    report = out.read_text()
    assert "blocks compiled (aot_eager)" in report
    assert "recompute rows kept on the GPU (attention.host_offload)" in report  # debug_cpu: no offload
    assert "critical-KV estimation n/a (compiled blocks)" in report


def test_profiling_steps_keep_the_profile_under_test():
    """A profiling step measures the random model's own sparsity and re-dispatches on it; the bench puts the
    profile under test back after each, so the steps timed after it run the same sparse work."""
    cfg = apply_overrides(get_recipe("debug_cpu"), ["model.depth=5", "model.hidden=32", "model.heads=2",
                                                    "attention.cube=2,2,2"])
    run = _Run(cfg, "dsv", 128, 8, torch.device("cpu"))
    run.step()
    run.enter_stage2(paper_profile(5, 2))
    state = run.dsv_state()
    sparse_before = [layer.runs_sparse() for layer in run.model.controller.layers]
    run.set_attention(profile_every_stage2=1)
    run.step()
    changed = any(not torch.equal(layer.sparsity_ema, saved["sparsity_ema"]) or layer.dispatch_reason != reason
                  for layer, (saved, reason) in zip(run.model.controller.layers, state))
    assert changed  # the profiling step did move the EMA: the restore below has something to undo
    run.median_ms(0, 1, state=state)
    for layer, (saved, reason) in zip(run.model.controller.layers, state):
        for name, value in saved.items():
            assert torch.equal(getattr(layer, name), value), name
        assert layer.dispatch_reason == reason
    assert [layer.runs_sparse() for layer in run.model.controller.layers] == sparse_before


TINY = ["--recipe", "debug_cpu", "--device", "cpu", "--tokens", "128", "--spatial", "8", "--set", "model.depth=5",
        "--set", "model.hidden=32", "--set", "model.heads=2", "--set", "attention.cube=2,2,2"]


@pytest.mark.parametrize("learn_every", [1, 3])
def test_dsv_step_time_carries_the_periodic_predictor_update(tmp_path, monkeypatch, learn_every):
    """With a predictor update every k steps, DSV's ms/step is the mean over whole update periods: it carries
    the update's cost / k, and so does the "predictor update" note (a median of single steps left the update
    step out). A fake clock makes it exact: 10 ms a step, 100 ms more for a step that updates a predictor.
    With k = 1 every step updates, and the numbers are medians of single steps as before."""
    updates = []
    update = LowRankPredictor.update

    def counted_update(self, *args, **kwargs):
        updates.append(1)
        return update(self, *args, **kwargs)

    def fake_timed(fn, device):
        before = len(updates)
        fn()
        return 10.0 + (100.0 if len(updates) > before else 0.0)

    monkeypatch.setattr(LowRankPredictor, "update", counted_update)
    monkeypatch.setattr(bench_train, "_timed", fake_timed)
    out = tmp_path / "report.md"
    code = main(["bench", "train", *TINY, "--set", f"attention.learn_every_stage2={learn_every}",
                 "--modes", "dense", "dsv", "--warmup", "0", "--steps", "2", "--out", str(out)])
    assert code == 0
    rows = {row.split("|")[2].strip(): row.split("|") for row in out.read_text().splitlines()
            if row.startswith("| 128 |")}
    expected = 10.0 + 100.0 / learn_every
    assert float(rows["dense"][3]) == 10.0
    assert float(rows["dsv"][3]) == pytest.approx(expected, abs=0.05)  # the report rounds to 0.1 ms
    assert float(rows["dsv"][4]) == pytest.approx(10.0 / expected, abs=0.005)
    update_ms = float(re.search(r"predictor update ([0-9.-]+) ms/step", rows["dsv"][8]).group(1))
    assert update_ms == pytest.approx(100.0 / learn_every, abs=0.5)
    assert ("one update every 3 steps" in rows["dsv"][8]) == (learn_every == 3)


@pytest.mark.parametrize("override, why", [
    ("train.batch_size=8", "model.* and attention.* overrides only"),
    ("optim.lr=5", "model.* and attention.* overrides only"),
    ("train.bf16=false", "model.* and attention.* overrides only"),
    ("model.arch=wan", "runs only model.arch=dit"),
    ("model.activation_checkpointing=false", "runs only model.activation_checkpointing=true"),
    ("attention.mode=window", "--modes"),
    ("attention.check_finite=true", "runs only attention.check_finite=false"),
    ("attention.max_stage1_steps=100", "stage 1 only"),
    ("attention.switch_loss_threshold=0.5", "stage 1 only"),
])
def test_bench_train_refuses_overrides_it_does_not_apply(tmp_path, capsys, override, why):
    """An override that the bench would silently drop (it builds a VideoDiT with activation checkpointing at
    batch 1, its own optimizer and precision, the mode from --modes, stage 2 entered directly) is an error
    naming the key and why, before any model is built."""
    out = tmp_path / "report.md"
    code = main(["bench", "train", *TINY, "--set", override, "--modes", "dense", "--warmup", "0", "--steps", "1",
                 "--out", str(out)])
    assert code == 2
    error = capsys.readouterr().err
    assert f"--set {override.split('=')[0]}" in error and why in error
    assert not out.exists()


def test_bench_train_report_records_the_overrides(tmp_path):
    """The overrides that the bench applies, fixed fields at the value it runs included, head the report."""
    out = tmp_path / "report.md"
    code = main(["bench", "train", *TINY, "--set", "model.arch=dit", "--set", "model.activation_checkpointing=true",
                 "--modes", "dense", "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert code == 0
    assert ("Overrides of the recipe: `model.depth=5`, `model.hidden=32`, `model.heads=2`, `attention.cube=2,2,2`, "
            "`model.arch=dit`, `model.activation_checkpointing=true`.") in out.read_text().splitlines()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_offload", [False, True])
def test_stage2_training_step_has_no_host_sync_on_gpu(host_offload):
    """A stage-2 training step (sparse Triton blocks, predictor update, activation checkpointing, AdamW) never
    waits for the GPU, so the host stays ahead, also when DSV's state moves to host memory and back:
    profiling steps and `check_finite` sync by design and are off here (the bench turns them off too)."""
    cfg = apply_overrides(get_recipe("debug_cpu"), ["model.depth=3", "model.hidden=64", "model.heads=2",
                                                    "attention.cube=4,4,4", "attention.speed_dispatch=false",
                                                    "attention.predictor_keys=256",  # its draw too
                                                    f"attention.host_offload={host_offload}"])
    run = _Run(cfg, "dsv", 512, 8, torch.device("cuda"))
    run.step()  # stage 1
    run.enter_stage2([[0.9, 0.9]] * 3)
    run.step()  # the first sparse step compiles its kernels
    assert all(layer.runs_sparse() for layer in run.model.controller.layers)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
