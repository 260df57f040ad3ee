"""`dsv bench cp` on 2 gloo ranks (CPU, float32): the gate passes and every layout gets a row."""

import argparse

from tests.parallel import run_distributed


def _bench(rank, world, out):
    from dsv.bench.cp import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--tokens", "512", "--heads", "4", "--head-dim", "16",
                              "--block", "16", "--steps", "1", "--out", str(out),
                              "--op-profile", str(out.parent / "ops")])
    return run(args)


def test_cp_bench_runs_every_layout_after_its_gate(tmp_path):
    codes = run_distributed(_bench, 2, tmp_path / "report.md", out_dir=tmp_path, timeout_s=120)
    assert codes == [0, 0]
    report = (tmp_path / "report.md").read_text()
    for mode in ("naive_hcp", "| hcp", "| scp", "hybrid"):
        assert mode in report
    assert "FAILED" not in report
    table = [line for line in report.splitlines() if line.startswith("| 512")]
    assert len(table) == 8  # 2 profiles x 4 layouts
    # Rank 0's operator table of each layout (the all-to-alls of the CP exchange among them).
    tables = sorted(path.name for path in (tmp_path / "ops").iterdir())
    assert len(tables) == 8 and "512-skewed-scp.txt" in tables
    assert "all_to_all" in (tmp_path / "ops" / "512-skewed-scp.txt").read_text()
    print(report)
