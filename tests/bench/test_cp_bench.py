"""`dsv bench cp` on 2 gloo ranks (CPU, float32): the gate passes and every layout gets a row."""

import argparse

import pytest

from tests.parallel import run_distributed


def _bench(rank, world, out, tokens=("512",)):
    from dsv.bench.cp import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--tokens", *tokens, "--heads", "4", "--head-dim", "16",
                              "--block", "16", "--steps", "1", "--out", str(out),
                              "--op-profile", str(out.parent / "ops")])
    return run(args)


def test_cp_bench_runs_every_layout_after_its_gate(tmp_path):
    codes = run_distributed(_bench, 2, tmp_path / "report.md", out_dir=tmp_path, timeout_s=120)
    assert codes == [0, 0]
    report = (tmp_path / "report.md").read_text()
    for mode in ("| dense", "naive_hcp", "| hcp", "| scp", "hybrid"):
        assert mode in report
    assert "FAILED" not in report
    table = [line.split("|") for line in report.splitlines() if line.startswith("| 512")]
    assert len(table) == 9  # the dense baseline, then 2 profiles x 4 layouts
    assert table[0][4].strip() == "dense" and float(table[0][6]) == 1.0  # × dense of the baseline itself
    dense_ms = float(table[0][5])
    for row in table:
        assert float(row[6]) == pytest.approx(dense_ms / float(row[5]), abs=0.006)  # the report rounds to 2 places
        assert float(row[8]) > 0 and row[9].strip() == "nan"  # TFLOP/s per GPU; peak memory: CUDA only
    # Per GPU: 14·D FLOPs per pair; the dense baseline computes every pair of 4 heads of 512 tokens, over 2 GPUs.
    dense_flops = 14 * 16 * 4 * 512**2
    assert float(table[0][8]) == pytest.approx(dense_flops / 2 / dense_ms / 1e9, rel=0.01)
    # The layouts of one profile compute the pairs of one index: equal FLOPs (TFLOP/s × ms), fewer than dense's.
    for profile in ("skewed", "paper block 4"):
        flops = [float(row[8]) * float(row[5]) * 2 * 1e9 for row in table if row[2].strip() == profile]
        assert len(flops) == 4 and max(flops) == pytest.approx(min(flops), rel=0.01) and max(flops) < 0.6 * dense_flops
    # Rank 0's operator table of each layout (the all-to-alls of the CP exchange among them).
    tables = sorted(path.name for path in (tmp_path / "ops").iterdir())
    assert len(tables) == 9 and "512-skewed-scp.txt" in tables and "512-dense.txt" in tables
    assert "all_to_all" in (tmp_path / "ops" / "512-skewed-scp.txt").read_text()
    print(report)


class _ScaleGrad(__import__("torch").autograd.Function):
    """Identity forward, doubled gradient: a CP backward that is wrong while its forward is right."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _bench_broken(rank, world, out, broken):
    import torch

    from dsv.parallel import context

    attend = context.ContextParallel.attend

    def broken_attend(self, q, k, v, index, layout, *args, **kwargs):
        result = attend(self, q, k, v, index, layout, *args, **kwargs)
        if broken == "dense" and index is None and rank == 1:  # the dense baseline's backward, one rank
            result = _ScaleGrad.apply(result)
        elif layout.scp > 1 and rank == 1:  # one layout, one rank
            if broken == "nan":
                result = result * float("nan")
            elif broken == "slight":  # 0.1%: far above float32's rounding, inside the fixed 1% bound of before
                result = result * 1.001
            else:
                result = _ScaleGrad.apply(result)
        return result

    context.ContextParallel.attend = broken_attend
    torch.manual_seed(0)
    return _bench(rank, world, out)


def test_cp_bench_gate_fails_on_a_nan_or_a_wrong_gradient_on_one_rank(tmp_path):
    """The gate compares the output and dq/dk/dv with an fp32 reference on every rank: NaN on one rank fails it
    (NaN compares False with the bound), and so does a backward that is wrong where the forward is right, and an
    error of 0.1% in float32 (the bound is the dtype's, not a fixed 1%); the dense baseline is gated alike."""
    for broken in ("nan", "grad", "slight", "dense"):
        report_path = tmp_path / f"{broken}.md"
        codes = run_distributed(_bench_broken, 2, report_path, broken, out_dir=tmp_path, timeout_s=120)
        assert codes == [1, 1], broken
        report = report_path.read_text()
        assert "FAILED" in report and "relative error of out, dq, dk, dv" in report, broken
        assert ("dense at S=512: relative error" in report) == (broken == "dense"), broken


def _bench_lengths(rank, world, out):
    try:
        return _bench(rank, world, out, ("512", "520"))
    except ValueError as err:
        return str(err)


def test_cp_bench_checks_every_length_before_timing_any(tmp_path):
    """520 tokens do not split into whole 16-token blocks on 2 ranks: found after 512 had been timed, the error
    lost that length's measurements and the report."""
    errors = run_distributed(_bench_lengths, 2, tmp_path / "report.md", out_dir=tmp_path, timeout_s=120)
    assert all("--tokens 520 on 2 ranks with --block 16: each rank's S/N=260 tokens" in e for e in errors), errors
    assert not (tmp_path / "ops").exists() and not (tmp_path / "report.md").exists()


def test_cp_bench_refuses_zero_steps_before_anything_runs(capsys):
    """--steps 0 failed after every gate and the calibration, in statistics.median of no times."""
    from dsv.bench.cp import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "0"])
    assert "argument --steps: expected an integer >= 1" in capsys.readouterr().err
