"""A benchmark's report file: checked before the timing, written whole after it."""

from __future__ import annotations

from pathlib import Path

from dsv.train.checkpoint import write_text_atomic
from dsv.train.durable import check_folder_possible


def check_report_path(out: Path | None) -> None:
    """ValueError naming --out unless the report can be written there: checked before minutes of GPU work, not
    after them."""
    if out is None:
        return
    if out.is_dir():
        raise ValueError(f"--out {out}: a folder; name the report's file")
    check_folder_possible(out.parent, "--out")


def write_report(out: Path | None, report: str) -> None:
    """Write the report to `out` atomically (its folder created), if one was asked for."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, report)
