"""Helpers shared by the test packages."""

import torch


def assert_opcheck_passes(op, args) -> None:
    """`torch.library.opcheck` raises on a failed check; its report must also say every check passed."""
    report = torch.library.opcheck(op, args)
    assert all(result == "SUCCESS" for result in report.values()), report
