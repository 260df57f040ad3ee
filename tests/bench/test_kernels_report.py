"""`dsv bench kernels`' report on rows of the runner's form (the runner itself needs a GPU)."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv.bench.kernels import _dsv_kernels, _report, speed_model_fit
from dsv.modules.dispatch import speed_model


def test_report_rows_have_every_column_and_the_gpu_time_ratio():
    args = argparse.Namespace(batch=1, heads=24, head_dim=128, dtype="bf16", group_size=128, kv_block=128, rank=16)
    rows = [
        dict(S=32768, method="cuDNN dense", kept=1.0, fwd_ms=21.0, ms=80.0, tflops=560.0, mem=1.9, gpu_ms=79.0),
        dict(S=32768, method="FlexAttention", kept=0.1, fwd_ms=3.2, ms=12.0, tflops=390.0, mem=1.6, agree=1e-4,
             dense_ms=80.0, gpu_ms=11.5),
        dict(S=32768, method="DSV", kept=0.1, sparsity=0.9, fwd_ms=2.6, ms=10.0, tflops=430.0, mem=1.6, est_ms=0.2,
             est_gpu_ms=0.1, est_ref_ms=0.9, dense_ms=80.0, flex_ms=12.0, gpu_ms=9.2, flex_gpu_ms=11.5,
             forward="Hopper", backward="fused Hopper", key_major_ms=0.3, group_size=128, kv_block=128),
    ]
    table = [line for line in _report(rows, args, "a GPU", "a kernel", "a backward").splitlines()
             if line.startswith("|")]
    widths = {line.count("|") for line in table}
    assert len(widths) == 1, widths  # header, rule and rows: one column count
    dsv = table[-1].split("|")
    assert dsv[9].strip() == "9.20 (1.25×)"  # 11.5 / 9.2 GPU ms
    assert dsv[7].strip() == "8.0" and dsv[8].strip() == "1.20"  # × dense, × Flex by wall time
    assert "Hopper forward, fused Hopper backward; target ≥8×: met (8.00×)" in table[-1]
    assert table[2].split("|")[9].strip() == "79.00"  # dense: GPU ms without a ratio
    rows[-1]["ms"] = 10.02  # 7.98×: the one-place column reads 8.0, the note says why it is missed
    dsv = [line for line in _report(rows, args, "a GPU", "a kernel", "a backward").splitlines()][-1]
    assert dsv.split("|")[7].strip() == "8.0" and "target ≥8×: missed (7.98×)" in dsv


def test_speed_model_fit_recovers_known_costs_and_scores_the_dispatch_model():
    """Rows made from a known fixed cost and relative cost give those back, and the dispatch model's error per row
    is its prediction against the measured time; one DSV row (or none) gives no fit."""
    fixed, relative, dense = 0.9, 1.4, {16384: 13.5, 32768: 54.0}
    rows = [dict(S=S, method="cuDNN dense", kept=1.0, ms=ms, tflops=570.0) for S, ms in dense.items()]
    for S, kept in [(16384, 0.5), (16384, 0.1), (32768, 0.25), (32768, 0.05)]:
        total = fixed + relative * kept * dense[S]
        rows.append(dict(S=S, method="DSV", kept=kept, ms=total - 0.4, est_ms=0.3, key_major_ms=0.1, dense_ms=dense[S],
                         group_size=64, kv_block=64))
    lines = speed_model_fit(rows)
    assert "fixed 0.90 ms, relative cost 1.40, largest error of the fit 0.0%" in lines[1]
    model, _ = speed_model("triton", 64, 64)
    first = (model.fixed_ms + model.relative_cost * 0.5 * 13.5) / (fixed + relative * 0.5 * 13.5) - 1
    assert f"in table order (positive: it predicts sparse slower than measured, so near break-even it keeps a " \
           f"block dense): {first:+.0%}," in lines[2]
    assert speed_model_fit(rows[:3]) == [] and speed_model_fit(rows[:2]) == []


def test_kernels_cli_refuses_sizes_and_sparsities_out_of_range(capsys):
    """A sparsity of -0.2 kept more blocks than exist and ran dense under its label; 1.5 kept one block; zero
    or negative sizes failed only after the gate or the dense timing."""
    from dsv.bench.kernels import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for option, value in (("--sparsities", "-0.2"), ("--sparsities", "1.0"), ("--batch", "0"), ("--heads", "-1"),
                          ("--seq-lens", "0"), ("--rep-ms", "-3")):
        with pytest.raises(SystemExit):
            parser.parse_args([option, value])
        assert f"argument {option}: expected" in capsys.readouterr().err
    assert parser.parse_args(["--sparsities", "0", "0.95"]).sparsities == [0.0, 0.95]


def test_flex_autotunes_where_its_default_backward_tiles_do_not_divide_the_blocks():
    """Where 128 does not divide the blocks, FlexAttention's default Hopper backward tile (64×128) leaves it
    no choice at all, so it is compiled with autotuning, and the report says so; at multiples of 128 it keeps
    its defaults."""
    from dsv.bench.kernels import _flex_compile_mode

    assert _flex_compile_mode(128, 128) is None and _flex_compile_mode(256, 128) is None
    for group, block in ((64, 64), (64, 128), (128, 192)):
        assert _flex_compile_mode(group, block) == "max-autotune-no-cudagraphs", (group, block)
    for block, noted in ((128, False), (64, True)):
        args = argparse.Namespace(batch=1, heads=24, head_dim=128, dtype="bf16", group_size=block, kv_block=block,
                                  rank=16)
        assert ("max-autotune-no-cudagraphs" in _report([], args, "a GPU", "a kernel", "a backward")) == noted


def test_kernel_lines_name_the_kernels_or_why_not(monkeypatch):
    from dsv.bench import kernels

    args = argparse.Namespace(group_size=128, kv_block=128, head_dim=128)
    forward, backward = _dsv_kernels(args, torch.bfloat16, device="cpu")
    assert forward == "the Triton kernel (needs an NVIDIA Hopper GPU (compute capability 9.x))"
    assert backward == "the split Triton dq and dk/dv passes (needs an NVIDIA Hopper GPU (compute capability 9.x))"
    monkeypatch.setattr(kernels, "hopper_forward_unsupported", lambda *a: None)
    monkeypatch.setattr(kernels, "hopper_backward_unsupported", lambda *a: None)
    forward, backward = _dsv_kernels(args, torch.bfloat16, device="cpu")
    assert forward.startswith("the warp-specialized Hopper kernel") and "note column" in forward
    assert backward.startswith("the fused Hopper kernel") and backward.endswith("(the note column says which ran)")


def test_one_sequence_length_runs_every_method_and_checks_flex_against_dsv(monkeypatch):
    """The runner's loop on the CPU, with its GPU-only pieces replaced (timing, memory, profiler, the Triton
    launchers by their references, FlexAttention by masked SDPA over the BlockMask): every row is produced,
    and a FlexAttention that ignores its mask stops the run before it is timed."""
    import importlib

    import pytest
    import torch
    import torch.nn.functional as F

    from dsv.bench import kernels
    from dsv.ops import SparseIndex, estimate_index, sparse_attention_reference

    # `dsv.ops.sparse_attention` is also a function of `dsv.ops`: the modules are looked up by name.
    estimate_kernels = importlib.import_module("dsv.ops.estimate.triton_kernels")
    attention_kernels = importlib.import_module("dsv.ops.sparse_attention.triton_kernels")
    monkeypatch.setattr(kernels, "_bench_ms", lambda fn, rep_ms: (fn(), 1.0)[1])
    monkeypatch.setattr(kernels, "_peak_gib", lambda fn, inputs: (fn(), 0.5)[1])
    monkeypatch.setattr(kernels, "_gpu_kernel_ms", lambda fn, reps=10: (fn(), 0.9)[1])
    monkeypatch.setattr(kernels, "_cudnn_attention", F.scaled_dot_product_attention)
    monkeypatch.setattr(estimate_kernels, "estimate_index_triton", estimate_index)
    monkeypatch.setattr(attention_kernels, "sparse_attention_triton",
                        lambda q, k, v, index: sparse_attention_reference(q, k, v, index))
    S = 256

    def flex(q, k, v, block_mask, kernel_options=None, honour_mask=True):
        """The BlockMask's blocks read back into an index (so the runner's mask encoding is checked too);
        ignoring the mask is dense attention, as eager FlexAttention without a mask_mod does."""
        if not honour_mask:
            return F.scaled_dot_product_attention(q, k, v)
        counts = block_mask.full_kv_num_blocks.to(torch.int32)
        width = int(counts.max())
        ids = block_mask.full_kv_indices[..., :width]
        ids = torch.where(torch.arange(width) < counts[..., None], ids, -1).to(torch.int32)
        return sparse_attention_reference(q, k, v, SparseIndex(ids, counts, *block_mask.BLOCK_SIZE, S))

    args = argparse.Namespace(batch=1, heads=2, head_dim=16, group_size=32, kv_block=32, rank=4, rep_ms=1,
                              sparsities=[0.75, 0.5], skip_dense=False, skip_flex=False)
    rows = kernels._bench_seq_len(S, args, torch.float64, flex, device="cpu")
    assert [r["method"] for r in rows] == ["cuDNN dense"] + ["FlexAttention", "DSV"] * 2
    dsv = rows[-1]
    assert dsv["kept"] == 0.5 and dsv["key_major_ms"] == 1.0 and dsv["flex_ms"] == 1.0
    assert dsv["forward"] == "Triton"  # a CPU has no Hopper forward
    assert rows[1]["agree"] == 0.0 and rows[1]["fwd_ms"] == 1.0
    with pytest.raises(RuntimeError, match="FlexAttention differs from DSV"):
        kernels._bench_seq_len(S, args, torch.float64, lambda *a, **kw: flex(*a, **kw, honour_mask=False),
                               device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA GPU the runner would start")
def test_cli_builds_the_kernels_parser_without_triton():
    """The kernel modules are imported inside `run`: without triton the CLI still parses `bench kernels` and
    says what the runner needs."""
    code = ("import sys; sys.modules['triton'] = None  # import triton now fails: as if not installed\n"
            "from dsv.cli import main; sys.exit(main(['bench', 'kernels']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith("dsv bench kernels needs a CUDA GPU")
