"""`attention.host_offload`: DSV's per-layer training state waits in pinned host memory between its uses, and
training is bit-for-bit what it is without it."""

import dataclasses

import pytest
import torch

from dsv.bench.train import _Run
from dsv.modules.attention import RepeatableSelection
from dsv.modules.predictor import LowRankPredictor
from dsv.ops import estimate_index_from_means
from dsv.train.config import apply_overrides
from dsv.train.recipes import get_recipe

HAS_CUDA = torch.cuda.is_available()
SHAPE = ["model.depth=3", "model.hidden=64", "model.heads=2", "attention.cube=4,4,4", "attention.speed_dispatch=false",
         "attention.predictor_keys=256", "attention.keep_floor_blocks=2"]


def _runs(device: str, *extra: str) -> tuple[_Run, _Run]:
    """The same model, data and schedule with the offload off and on."""
    cfg = apply_overrides(get_recipe("debug_cpu"), SHAPE + list(extra))
    plain = _Run(cfg, "dsv", 512, 8, torch.device(device))
    offloaded = _Run(dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, host_offload=True)),
                     "dsv", 512, 8, torch.device(device))
    return plain, offloaded


def _train_alike(plain: _Run, offloaded: _Run, after_each=lambda: None) -> None:
    """Stage 1, then stage 2 with sparse blocks and a profiling step; after every step the two runs hold the
    same weights (model and predictors) and AdamW moments, bit for bit."""
    for run in (plain, offloaded):
        run.set_attention(profile_every_stage2=2)
    sparse_steps = 0
    for step in range(4):
        if step == 1:
            for run in (plain, offloaded):
                run.enter_stage2([[0.9, 0.9]] * 3)
        plain.step()
        offloaded.step()
        after_each()
        sparse_steps += any(layer.last_path.startswith("sparse") for layer in offloaded.model.controller.layers)
        want, got = plain.model.state_dict(), offloaded.model.state_dict()  # unparks
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
        for a, b in zip(plain.model.controller.layers, offloaded.model.controller.layers):
            moments_a = [v for s in a.predictor.optimizer.state_dict()["state"].values() for v in s.values()]
            moments_b = [v for s in b.predictor.optimizer.state_dict()["state"].values() for v in s.values()]
            assert len(moments_a) == len(moments_b) > 0
            assert all(torch.equal(x, y) for x, y in zip(moments_a, moments_b)), step
    assert sparse_steps >= 2  # the recompute re-selected from offloaded rows


def test_host_offload_is_a_no_op_off_cuda():
    """On the CPU there is no host memory to move to: nothing parks, and training is unchanged."""
    plain, offloaded = _runs("cpu")

    def nothing_parked():
        assert not any(layer.predictor.parked for layer in offloaded.model.controller.layers)

    _train_alike(plain, offloaded, nothing_parked)


def test_repeatable_selection_gives_the_same_index_again():
    rows = (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4))
    keep = torch.tensor([3, 2], dtype=torch.int32)

    def select(proxies, block_keys):
        return estimate_index_from_means(proxies, block_keys, keep, 16, 16, 128)

    again = RepeatableSelection(select, rows, offload=True)
    first, second = again(), again()
    assert torch.equal(first.indices, second.indices) and torch.equal(first.counts, second.counts)
    assert again.rows[0] is rows[0]  # nothing to offload to on the CPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_host_offload_parks_between_steps_and_trains_identically_on_gpu():
    """After each step every predictor's weights and AdamW moments sit in pinned host memory, the rows kept
    for the recompute too; reading the state (state_dict) brings it back; the runs stay bit-identical."""
    plain, offloaded = _runs("cuda")

    def parked_on_host():
        for layer in offloaded.model.controller.layers:
            predictor = layer.predictor
            assert predictor.parked
            tensors = predictor._state_tensors()
            assert len(tensors) == 6  # two weights, each with two AdamW moments
            assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
            kept = [entry[1] for entries in layer._selection_cache.values() for entry in entries]
            if layer.runs_sparse():
                assert kept and all(row.device.type == "cpu" and row.is_pinned()
                                    for selection in kept for row in selection.rows)
        for layer in plain.model.controller.layers:
            assert not layer.predictor.parked
            assert all(t.is_cuda for t in layer.predictor._state_tensors())

    _train_alike(plain, offloaded, parked_on_host)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_parked_predictor_reads_writes_and_moves_its_state_on_gpu():
    torch.manual_seed(0)
    predictor = LowRankPredictor(32, 2, rank=4).cuda()
    hidden, q, k = torch.randn(1, 64, 32, device="cuda"), torch.randn(1, 2, 64, 8, device="cuda"), None
    k = torch.randn(1, 2, 64, 8, device="cuda")
    predictor.update(hidden, q, k, torch.arange(0, 64, 8, device="cuda"), 8**-0.5)
    weights = {name: t.clone() for name, t in predictor.state_dict().items()}
    moments = [v.clone() for s in predictor.optimizer.state_dict()["state"].values() for v in s.values()]

    predictor.park()
    assert predictor.parked and predictor.q_proj.weight.device.type == "cpu"
    saved = predictor.state_dict()
    assert not predictor.parked
    assert all(saved[name].is_cuda and torch.equal(saved[name], weights[name]) for name in weights)

    predictor.park()
    state = predictor.optimizer.state_dict()
    assert not predictor.parked
    assert all(torch.equal(a, b) for a, b in zip(moments, [v for s in state["state"].values() for v in s.values()]))

    predictor.park()
    predictor.load_state_dict({name: torch.zeros_like(t) for name, t in weights.items()})
    assert not predictor.parked and predictor.q_proj.weight.is_cuda and not predictor.q_proj.weight.any()

    predictor.park()
    predictor.optimizer.load_state_dict(state)
    assert not predictor.parked
    assert all(v.is_cuda for s in predictor.optimizer.state.values() for v in s.values() if v.dim() > 0)

    predictor.park()
    predictor.prefetch()
    proxies, _ = predictor.pooled_project(hidden, 16, 16)  # a use brings it back, here from the prefetch
    assert not predictor.parked and proxies.is_cuda and not proxies.any()  # the zero weights loaded above

    predictor.park()
    predictor.to(torch.float64)
    assert not predictor.parked and predictor.k_proj.weight.dtype == torch.float64 and predictor.k_proj.weight.is_cuda
