"""`dsv bench kernels`' report on rows of the runner's form (the runner itself needs a GPU)."""

import argparse

from dsv.bench.kernels import _report


def test_report_rows_have_every_column_and_the_gpu_time_ratio():
    args = argparse.Namespace(batch=1, heads=24, head_dim=128, dtype="bf16", group_size=128, kv_block=128, rank=16)
    rows = [
        dict(S=32768, method="cuDNN dense", kept=1.0, fwd_ms=21.0, ms=80.0, tflops=560.0, mem=1.9, gpu_ms=79.0),
        dict(S=32768, method="FlexAttention", kept=0.1, fwd_ms=3.2, ms=12.0, tflops=390.0, mem=1.6, agree=1e-4,
             dense_ms=80.0, gpu_ms=11.5),
        dict(S=32768, method="DSV", kept=0.1, sparsity=0.9, fwd_ms=2.6, ms=10.0, tflops=430.0, mem=1.6, est_ms=0.2,
             est_gpu_ms=0.1, est_ref_ms=0.9, dense_ms=80.0, flex_ms=12.0, gpu_ms=9.2, flex_gpu_ms=11.5),
    ]
    table = [line for line in _report(rows, args, "a GPU").splitlines() if line.startswith("|")]
    widths = {line.count("|") for line in table}
    assert len(widths) == 1, widths  # header, rule and rows: one column count
    dsv = table[-1].split("|")
    assert dsv[9].strip() == "9.20 (1.25×)"  # 11.5 / 9.2 GPU ms
    assert dsv[7].strip() == "8.0" and dsv[8].strip() == "1.20"  # × dense, × Flex by wall time
    assert "target ≥8×: met" in table[-1]
    assert table[2].split("|")[9].strip() == "79.00"  # dense: GPU ms without a ratio
