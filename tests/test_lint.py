"""The repository lints clean under the ruff configuration of pyproject.toml."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff not installed: pip install -e '.[dev]'")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", str(REPO_ROOT)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}\n{result.stderr}"
