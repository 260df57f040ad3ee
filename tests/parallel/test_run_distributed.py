"""The rank processes of the distributed tests: forked from a preloaded server, yet each with the caller's
environment and a random stream of its own, as spawned processes had."""

import os

import pytest
import torch

from tests.parallel import run_distributed


def _environment_and_seed(rank, world_size):
    return os.environ.get("DSV_RANK_ENV_PROBE"), torch.initial_seed()


def test_ranks_see_the_callers_environment_and_draw_their_own_random_streams(tmp_path, monkeypatch):
    monkeypatch.delenv("DSV_RANK_ENV_PROBE", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = run_distributed(_environment_and_seed, 2, out_dir=tmp_path / "a")
    assert [probe for probe, _ in first] == [None, None]
    assert first[0][1] != first[1][1]  # 64-bit random seeds: equal by chance with probability ~2^-64
    # Set after the server started: these ranks must still see it (they start fresh).
    monkeypatch.setenv("DSV_RANK_ENV_PROBE", "set")
    with pytest.warns(UserWarning, match=r"environment changed since the forkserver started \(DSV_RANK_ENV_PROBE\)"):
        second = run_distributed(_environment_and_seed, 2, out_dir=tmp_path / "b")
    assert [probe for probe, _ in second] == ["set"] * 2
