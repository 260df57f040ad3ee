"""`dsv bench train` runs every mode on a tiny shape and reports DSV in stage 2 with sparse blocks, after
correctness gates that fail the command on NaN steps or wrong sparse attention."""

import json
import math
import pickle
import re

import pytest
import torch

import dsv.bench.train as bench_train
from dsv.bench.train import (
    GateFailure,
    _finite_gate,
    _peaks_against_dense,
    _Run,
    gate_tolerance,
    paper_profile,
    square_grid,
)
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
    report = out.read_text()
    rows = [line for line in report.splitlines() if line.startswith("| 128 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["dense", "window", "dsv"]
    # The gates ran before each mode's timing, and the report lists them.
    printed = capsys.readouterr().out
    for mode in ("dense", "window", "dsv"):
        assert printed.index(f"128 {mode:>6} gate:") < printed.index(f"128 {mode:>6}: ")
        finite = re.search(rf"- {mode} at 128 tokens: one step's loss ([0-9.]+) and the gradients of all (\d+) "
                           "parameters finite", report)
        assert finite and math.isfinite(float(finite.group(1))) and int(finite.group(2)) > 0
    assert "- dense at 128 tokens: no layer runs sparse: no sparse-attention check" in report
    assert "Before any timing, each run passed a correctness gate" in report
    for mode, layer in (("window", 0), ("dsv", 3)):  # the paper profile's first sparse block here: 3 (of 0-4)
        sparse = re.search(rf"- {mode} at 128 tokens: layer {layer}'s sparse attention \(reference, float32, 2 of 2 "
                           r"heads, its own index\) against the float32 reference: relative L2 error (\S+) <= (\S+) "
                           r"\(out \S+, dq \S+, dk \S+, dv \S+\)",
                           report)
        assert sparse, mode
        assert float(sparse.group(1)) <= float(sparse.group(2)) == gate_tolerance(torch.float32)
    dsv_row = rows[-1].split("|")
    # The paper profile: blocks 4-31 (here 4 of 5) are >= 0.70 sparse; with the reference backend the
    # 0.8 threshold alone dispatches, so blocks with mean sparsity >= 0.8 run sparse.
    assert dsv_row[7].strip() == dsv_row[8].strip() == "nan"  # peaks allocated and requested: CUDA only
    assert int(dsv_row[9]) >= 1
    assert "predictor update" in dsv_row[10]
    # Which kernels the sparse layers ran, counted over them (here the reference on the CPU, both ways).
    for mode, sparse_blocks in (("window", 5), ("dsv", int(dsv_row[9]))):
        assert f"- {mode} at 128 tokens: {sparse_blocks} × forward reference, backward reference" in report
    kernels = report.split("Sparse layers' attention kernels")[1].split("Correctness gates:")[0]
    assert "window at 128 tokens" in kernels and "dense at 128 tokens" not in kernels
    estimation = float(re.search(r"critical-KV estimation ([0-9.]+) ms/step", dsv_row[10]).group(1))
    assert estimation > 0  # timed in the sparse layers of one step
    # One operator table per run (host time on the CPU); the allocator history exists on CUDA only.
    for mode in ("dense", "window", "dsv"):
        assert "Self CPU" in (tmp_path / "ops" / f"128-{mode}.txt").read_text()
    assert "GPU time by kernel category" not in report  # no kernels on the CPU
    assert not (tmp_path / "mem").exists()


def test_category_table_has_a_column_per_profiled_run():
    rows = [dict(tokens=64, mode="dense", categories=[("dense attention", 7922.0e3, 96), ("GEMM", 1081.8e3, 512)]),
            dict(tokens=64, mode="window"),  # not profiled (e.g. no --op-profile): no column
            dict(tokens=64, mode="dsv", categories=[("GEMM", 1099.7e3, 600), ("sparse attention backward", 412.8e3, 56),
                                                    ("dense attention", 1072.1e3, 12)])]
    lines = bench_train.category_table(rows)
    assert lines[3] == "| category | 64 dense | 64 dsv |"
    assert lines[5:] == ["| dense attention | 7922.0 | 1072.1 |", "| GEMM | 1081.8 | 1099.7 |",
                         "| sparse attention backward | — | 412.8 |", "| **all** | **9003.8** | **2584.6** |"]
    assert bench_train.category_table([dict(tokens=64, mode="dense", categories=[])]) == []  # off CUDA


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
    sparse = int(next(line for line in report.splitlines() if line.startswith("| 128 | dsv |")).split("|")[9])
    assert sparse >= 1 and f"- dsv at 128 tokens: {sparse} × not recorded (compiled blocks)" in report


def test_profiling_steps_keep_the_profile_under_test():
    """A profiling step measures the random model's own sparsity and re-dispatches on it; the bench puts the
    profile under test back after each, so the steps timed after it run the same sparse work."""
    cfg = apply_overrides(get_recipe("debug_cpu"), ["model.depth=5", "model.hidden=32", "model.heads=2",
                                                    "attention.cube=2,2,2"])
    run = _Run(cfg, "dsv", square_grid(128, 8), torch.device("cpu"))
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


def test_step_flops_count_the_linear_layers_and_each_layers_attention_pairs():
    """Linear and convolution FLOPs are 3x a forward's as torch's FLOP counter counts them (on the CPU it does not
    count attention), the same in every mode; attention is 14·D per pair: every pair in dense layers, the window's
    boxes, the sparse DSV layers' budgets. The counting forward leaves the DSV state under test as it was."""
    from torch.utils.flop_counter import FlopCounterMode

    from dsv.bench.train import step_flops
    from dsv.ops.measure import window_index

    cfg = apply_overrides(get_recipe("debug_cpu"), ["model.depth=5", "model.hidden=32", "model.heads=2",
                                                    "attention.cube=2,2,2"])
    tokens, heads, head_dim, depth = 128, 2, 16, 5
    dense_pairs = heads * tokens * tokens
    counts = {}
    for mode in ("dense", "window", "dsv"):
        run = _Run(cfg, mode, square_grid(tokens, 8), torch.device("cpu"))
        if mode == "dsv":
            run.step()
            run.enter_stage2(paper_profile(depth, heads))
        state = run.dsv_state()
        counts[mode] = step_flops(run)
        for layer, (saved, _) in zip(run.model.controller.layers, state):
            for name, value in saved.items():  # the EMAs start as NaN (not measured yet)
                torch.testing.assert_close(getattr(layer, name), value, rtol=0, atol=0, equal_nan=True)
        if mode == "dense":
            counter = FlopCounterMode(display=False)
            with torch.no_grad(), counter:
                run.loss()
            assert counts[mode][0] == 3 * counter.get_total_flops() > 0
            assert counts[mode][1] == depth * 14 * head_dim * dense_pairs
        elif mode == "window":
            grid, layer = (2, 8, 8), run.model.controller.layers[0]
            boxes = window_index(grid, cfg.attention.cube, cfg.attention.key_block, 1, heads, cfg.attention.window_frac)
            window_pairs = int((boxes.counts * cfg.attention.key_block).sum()) * cfg.attention.group_size
            assert 0 < window_pairs < dense_pairs
            assert counts[mode][1] == depth * 14 * head_dim * window_pairs
        else:
            layers = run.model.controller.layers
            blocks = tokens // cfg.attention.key_block
            expected = sum(14 * head_dim * (int(layer._keep_blocks(blocks).sum()) * cfg.attention.key_block * tokens
                                            if layer.runs_sparse() else dense_pairs) for layer in layers)
            assert any(layer.runs_sparse() for layer in layers)
            assert counts[mode][1] == expected < depth * 14 * head_dim * dense_pairs
    assert counts["dense"][0] == counts["window"][0] == counts["dsv"][0]


TINY = ["--recipe", "debug_cpu", "--device", "cpu", "--tokens", "128", "--spatial", "8", "--set", "model.depth=5",
        "--set", "model.hidden=32", "--set", "model.heads=2", "--set", "attention.cube=2,2,2"]


@pytest.mark.parametrize("modes", [["dense", "dsv"], ["dsv", "dense"]])
@pytest.mark.parametrize("learn_every", [1, 3])
def test_dsv_step_time_carries_the_periodic_predictor_update(tmp_path, capsys, monkeypatch, learn_every, modes):
    """With a predictor update every k steps, DSV's ms/step is the mean over whole update periods: it carries
    the update's cost / k, and so does the "predictor update" note (a median of single steps left the update
    step out). A fake clock makes it exact: 10 ms a step, 100 ms more for a step that updates a predictor.
    With k = 1 every step updates, and the numbers are medians of single steps as before. The speedup over
    dense is the same in either order of --modes (it is computed once every mode of a token count ran)."""
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
                 "--modes", *modes, "--warmup", "0", "--steps", "2", "--out", str(out)])
    assert code == 0
    rows = {row.split("|")[2].strip(): row.split("|") for row in out.read_text().splitlines()
            if row.startswith("| 128 |")}
    expected = 10.0 + 100.0 / learn_every
    assert float(rows["dense"][3]) == 10.0
    assert float(rows["dsv"][3]) == pytest.approx(expected, abs=0.05)  # the report rounds to 0.1 ms
    assert float(rows["dsv"][4]) == pytest.approx(10.0 / expected, abs=0.005)
    speedups = re.search(r"128 against dense: (.*)", capsys.readouterr().out).group(1)
    assert speedups == ", ".join(f"{mode} {1.0 if mode == 'dense' else 10.0 / expected:.2f}x" for mode in modes)
    update_ms = float(re.search(r"predictor update ([0-9.-]+) ms/step", rows["dsv"][10]).group(1))
    assert update_ms == pytest.approx(100.0 / learn_every, abs=0.5)
    assert ("one update every 3 steps" in rows["dsv"][10]) == (learn_every == 3)


@pytest.mark.parametrize("override, why", [
    ("train.batch_size=8", "model.* and attention.* overrides only"),
    ("optim.lr=5", "model.* and attention.* overrides only"),
    ("train.bf16=false", "model.* and attention.* overrides only"),
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
    run = _Run(cfg, "dsv", square_grid(512, 8), torch.device("cuda"))
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_history_holds_each_runs_allocations_with_their_python_stacks_on_gpu(tmp_path):
    """`--memory-history` dumps one allocator snapshot per run that torch's memory viewer reads: allocations
    recorded with the Python frames that made them (DSV's code among them), after the timed steps."""
    folder = tmp_path / "mem"
    tiny_gpu = [arg if arg != "cpu" else "cuda" for arg in TINY]
    tiny_gpu[tiny_gpu.index("128")] = "512"  # 8×8×8 tokens: whole 4×4×4 cubes, 64-token groups as in training
    tiny_gpu[tiny_gpu.index("attention.cube=2,2,2")] = "attention.cube=4,4,4"
    tiny_gpu[tiny_gpu.index("model.hidden=32")] = "model.hidden=64"  # head dim 32, as the other GPU bench test
    code = main(["bench", "train", *tiny_gpu, "--modes", "dense", "dsv", "--warmup", "0", "--steps", "1",
                 "--memory-history", str(folder)])
    assert code == 0
    assert sorted(p.name for p in folder.iterdir()) == ["512-dense.pickle", "512-dsv.pickle"]
    for name in ("dense", "dsv"):
        with open(folder / f"512-{name}.pickle", "rb") as f:
            snapshot = pickle.load(f)
        allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
        assert allocs, f"{name}: no allocation recorded"
        files = {frame["filename"] for e in allocs for frame in e.get("frames", [])}
        assert any("/dsv/" in f.replace("\\", "/") and f.endswith(".py") for f in files), \
            f"{name}: no Python frame of DSV's code among {sorted(files)[:5]}"


def test_gate_tolerance_is_two_units_of_the_dtypes_eps():
    assert gate_tolerance(torch.bfloat16) == 2 * 2**-7
    assert gate_tolerance(torch.float16) == 2 * 2**-10
    assert gate_tolerance(torch.float32) == 1e-5  # floor: an fp32 kernel sums long rows in another order


@pytest.mark.parametrize("wrong", ["scaled", "nan"])
def test_bench_train_fails_before_timing_when_the_sparse_path_is_wrong(tmp_path, capsys, monkeypatch, wrong):
    """The sparse attention that the gate checks (the path under test, not its reference) made 0.1% too large,
    or NaN: the window run fails its gate before any of its steps is timed, the command exits 1 and writes no
    report. Dense, which runs no sparse layer, passed and was timed first."""
    sparse_attention = bench_train.sparse_attention

    def broken(q, k, v, index, **kwargs):
        out = sparse_attention(q, k, v, index, **kwargs)
        return out * 1.001 if wrong == "scaled" else torch.full_like(out, float("nan"))

    timed = []
    timed_steps = bench_train._timed_steps

    def recorded(run, args, name, device, period=1):
        timed.append(name)
        return timed_steps(run, args, name, device, period)

    monkeypatch.setattr(bench_train, "sparse_attention", broken)
    monkeypatch.setattr(bench_train, "_timed_steps", recorded)
    out = tmp_path / "report.md"
    code = main(["bench", "train", *TINY, "--modes", "dense", "window", "--warmup", "0", "--steps", "1",
                 "--out", str(out)])
    assert code == 1
    assert timed == ["128-dense"]
    error = capsys.readouterr().err
    assert "correctness gate FAILED for window at 128 tokens: layer 0's sparse attention" in error
    measured = re.search(r"relative L2 error (\S+) > 1\.00e-05", error).group(1)
    assert measured == "nan" if wrong == "nan" else float(measured) == pytest.approx(1e-3, rel=0.01)
    assert not out.exists()


class _ScaledBackward(torch.autograd.Function):
    """The identity forward, a backward 0.1% too large: a wrong backward behind a right output."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.001


def test_bench_train_gate_checks_the_backward_too(tmp_path, capsys, monkeypatch):
    """A sparse path whose output is right and whose gradients are 0.1% off fails the gate (before any timing),
    naming the gradients' errors: the timed steps run the backward kernels, which are separate code."""
    sparse_attention = bench_train.sparse_attention

    def wrong_backward(q, k, v, index, **kwargs):
        return _ScaledBackward.apply(sparse_attention(q, k, v, index, **kwargs))

    monkeypatch.setattr(bench_train, "sparse_attention", wrong_backward)
    out = tmp_path / "report.md"
    code = main(["bench", "train", *TINY, "--modes", "window", "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert code == 1 and not out.exists()
    error = capsys.readouterr().err
    detail = re.search(r"relative L2 error (\S+) > 1\.00e-05 \(out (\S+), dq (\S+), dk (\S+), dv (\S+)\)", error)
    assert detail, error
    assert float(detail.group(2)) < 1e-5  # the output itself is right
    for group in (1, 3, 4, 5):
        assert float(detail.group(group)) == pytest.approx(1e-3, rel=0.01)


def test_bench_train_fails_before_timing_on_a_nan_loss(tmp_path, capsys, monkeypatch):
    """Window: its sparse layers run from the first step (DSV's stage-1 step before the gate would stop on the
    NaN weights that its optimizer step leaves, in the key selection)."""
    loss = bench_train.flow_matching_loss
    monkeypatch.setattr(bench_train, "flow_matching_loss", lambda *args: loss(*args) * float("nan"))
    monkeypatch.setattr(bench_train, "_timed_steps", lambda *args, **kwargs: pytest.fail("timed after a NaN loss"))
    out = tmp_path / "report.md"
    code = main(["bench", "train", *TINY, "--modes", "window", "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert code == 1
    error = capsys.readouterr().err
    assert "correctness gate FAILED for window at 128 tokens: one step's loss is nan; non-finite gradients in" in error
    assert not out.exists()


def test_finite_gate_names_a_non_finite_or_missing_gradient():
    """A finite loss is not enough: one parameter's NaN gradient fails the gate, named, and so does a parameter
    of the optimizer that the backward never reached. The DSV predictors, which step themselves, have no
    gradient after the backward and are not asked for one."""
    cfg = apply_overrides(get_recipe("debug_cpu"), ["model.depth=2", "model.hidden=32", "model.heads=2",
                                                    "attention.cube=2,2,2"])

    def dsv_run():
        return _Run(cfg, "dsv", square_grid(128, 8), torch.device("cpu"))

    run = dsv_run()
    stepped = len(bench_train.model_parameters(run.model))
    assert stepped < len(list(run.model.parameters()))  # the predictors' are left out
    assert _finite_gate(run).endswith(f"the gradients of all {stepped} parameters finite")
    run = dsv_run()
    run.model.final_linear.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    with pytest.raises(GateFailure, match=rf"one step's loss is [0-9.]+; non-finite gradients in 1 of {stepped} "
                                          r"parameters: final_linear\.weight$"):
        _finite_gate(run)
    run = dsv_run()
    run.model.final_table.requires_grad_(False)  # still stepped by the optimizer, but no longer reached
    with pytest.raises(GateFailure, match=rf"; no gradient in 1 of {stepped} parameters: final_table$"):
        _finite_gate(run)


@pytest.mark.parametrize("flag, value, expected", [
    ("--steps", "0", "expected an integer >= 1, got 0"),
    ("--steps", "two", "expected an integer >= 1, got 'two'"),
    ("--tokens", "0", "expected an integer >= 1, got 0"),
    ("--tokens", "-128", "expected an integer >= 1, got -128"),
    ("--spatial", "0", "expected an integer >= 1, got 0"),
    ("--warmup", "-1", "expected an integer >= 0, got -1"),
    ("--device", "cpux", "must be auto, cpu, cuda or cuda:N, got 'cpux'"),  # a torch traceback before
    ("--grids", "21x30", "expected a token grid TxHxW of three positive ints (e.g. 21x30x52), got '21x30'"),
    ("--grids", "0x4x4", "expected a token grid TxHxW of three positive ints (e.g. 21x30x52), got '0x4x4'"),
])
def test_bench_train_rejects_bad_counts_when_parsing(capsys, flag, value, expected):
    """Checked before any model is built (--steps 0 used to fail after the warm-up: no median of no steps)."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "train", *TINY, flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {expected}" in capsys.readouterr().err


def test_bench_train_refuses_a_mode_listed_twice(tmp_path, capsys):
    out = tmp_path / "report.md"
    code = main(["bench", "train", *TINY, "--modes", "dsv", "dense", "dsv", "--out", str(out)])
    assert code == 2
    error = capsys.readouterr().err
    assert "--modes dsv dense dsv: expected each mode at most once, dsv listed more than once" in error
    assert not out.exists()
    # A report path that cannot be written: refused before the runs (after them, before).
    (tmp_path / "file").write_text("")
    assert main(["bench", "train", *TINY, "--modes", "dense", "--out", str(tmp_path / "file" / "r.md")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_bench_train_checks_every_token_count_and_the_profile_before_running(tmp_path, capsys, monkeypatch):
    """A token count that the grid cannot hold, or a profile that cannot be read, is refused before the first
    run: found at the second token count, it would have cost the first one's runs and left no report."""
    import dsv.bench.train as bench_train

    built = []
    monkeypatch.setattr(bench_train._Run, "__init__", lambda self, *args: built.append(args) or 1 / 0)
    at = TINY.index("--tokens") + 1
    code = main(["bench", "train", *TINY[:at], "128", "100", *TINY[at + 1:]])
    assert code == 2 and not built
    assert "--tokens 128 100: each must be a multiple of --spatial² = 64" in capsys.readouterr().err
    code = main(["bench", "train", *TINY, "--modes", "dense", "dsv", "--profile", str(tmp_path / "missing.json")])
    assert code != 0 and not built
    # A readable profile of another model's shape: found only after dense and window had run.
    (tmp_path / "other.json").write_text(json.dumps(paper_profile(32, 16)))
    code = main(["bench", "train", *TINY, "--modes", "dense", "dsv", "--profile", str(tmp_path / "other.json")])
    assert code == 2 and not built
    assert "32 layers × [16] heads, the model has 5 layers × 2 heads" in capsys.readouterr().err
    # 320 tokens of 8×8: T=5, which the window's 2×2×2 cubes do not tile (found after dense had been timed).
    code = main(["bench", "train", *TINY[:at], "320", *TINY[at + 1:], "--modes", "dense", "window"])
    assert code == 2 and not built
    assert "--modes window at the grid 5x8x8 needs whole cubes: grid T=5 is not divisible" in capsys.readouterr().err
    # Two grids of one token count: their rows and speedups could not be told apart.
    no_tokens = [arg for i, arg in enumerate(TINY) if arg not in ("--tokens", "--spatial")
                 and TINY[i - 1] not in ("--tokens", "--spatial")]
    code = main(["bench", "train", *no_tokens, "--grids", "2x8x8", "8x4x4", "--modes", "dense"])
    assert code == 2 and not built
    assert "--grids 2x8x8 8x4x4: expected one grid per token count, two have the same" in capsys.readouterr().err
    code = main(["bench", "train", *TINY, "--grids", "2x8x8", "--modes", "dense"])  # TINY gives --tokens too
    assert code == 2 and not built
    assert "--grids gives the token grids: leave out --tokens and --spatial" in capsys.readouterr().err


def test_bench_train_times_a_diffusers_wan_at_a_grid_the_cube_does_not_tile(tmp_path, capsys):
    """`--recipe` of `model.arch=wan` times the trainer's diffusers Wan with DSV installed, and `--grids` takes a
    grid that is not square and that the query cube does not tile (edge tokens in partial groups), as Wan's
    480×832, 81-frame grid (21×30×52) is not; the gates hold and its sparse layers run."""
    out = tmp_path / "report.md"
    code = main(["bench", "train", "--recipe", "wan_debug_cpu", "--device", "cpu", "--grids", "3x6x10",
                 "--set", "model.depth=5", "--set", "model.hidden=32", "--set", "model.heads=2",
                 "--set", "attention.cube=2,2,2", "--modes", "dense", "dsv", "--warmup", "0", "--steps", "1",
                 "--out", str(out)])
    assert code == 0
    report = out.read_text()
    assert ("a diffusers WanTransformer3DModel with DSV installed (5 blocks, 2 heads × 16, hidden 32, FFN 128; its "
            "cross-attention reads 4 null-text tokens of width 64); token grids (T×H×W) 3×6×10;") in report
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| 180 |")]
    assert [row[2].strip() for row in rows] == ["dense", "dsv"]
    assert int(rows[1][9]) >= 1  # the paper profile's sparse blocks run sparse
    sparse = re.search(r"- dsv at 180 tokens: layer (\d+)'s sparse attention \(reference, float32, 2 of 2 heads, its "
                       r"own index\) against the float32 reference: relative L2 error (\S+) <= (\S+)", report)
    assert sparse and float(sparse.group(2)) <= float(sparse.group(3))
    assert "180    dsv gate: one step's loss" in capsys.readouterr().out


def test_the_stage1_peak_is_of_a_step_with_the_optimizer_state(monkeypatch, capsys):
    """AdamW creates its state (twice the parameters' bytes) in the first step's optimizer.step: a peak over the
    run's first step left it out, and stage 1 read 6-12 GiB cheaper than dense at the 2.7B shape."""
    runs, state_at_reset = [], []
    original_init, original_reset = bench_train._Run.__init__, bench_train._reset_peak

    def init(self, *args):
        original_init(self, *args)
        runs.append(self)

    def reset(device):
        state_at_reset.append(len(runs[-1].optimizer.state) if runs else None)
        original_reset(device)

    monkeypatch.setattr(bench_train._Run, "__init__", init)
    monkeypatch.setattr(bench_train, "_reset_peak", reset)
    assert main(["bench", "train", *TINY, "--modes", "dsv"]) == 0
    assert state_at_reset and all(count for count in state_at_reset), state_at_reset
