"""`attention.host_offload`: DSV's per-layer training state waits in pinned host memory between its uses, and
training is bit-for-bit what it is without it."""

import copy
import dataclasses
import io
import weakref

import pytest
import torch

from dsv.bench.train import _Run, square_grid
from dsv.modules.attention import RepeatableSelection
from dsv.modules.dit import flow_matching_loss
from dsv.modules.predictor import _HELD, LowRankPredictor, _copy_stream, _hold_until, release_parked
from dsv.ops import estimate_index_from_means
from dsv.train.config import apply_overrides
from dsv.train.recipes import get_recipe

HAS_CUDA = torch.cuda.is_available()
SHAPE = ["model.depth=3", "model.hidden=64", "model.heads=2", "attention.cube=4,4,4", "attention.speed_dispatch=false",
         "attention.predictor_keys=256", "attention.keep_floor_blocks=2"]
# GPU cycles a stall holds a stream (~0.5 ms at 2 GHz): far longer than this model's copies and kernels, so a
# copy or a use that does not wait for its stream's work reads unfinished data.
STALL_CYCLES = 1_000_000


def _runs(device: str, *extra: str) -> tuple[_Run, _Run]:
    """The same model, data and schedule with the offload off and on."""
    cfg = apply_overrides(get_recipe("debug_cpu"), SHAPE + list(extra))
    plain = _Run(cfg, "dsv", square_grid(512, 8), torch.device(device))
    offloaded = _Run(dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, host_offload=True)),
                     "dsv", square_grid(512, 8), torch.device(device))
    for run in (plain, offloaded):
        run.set_attention(profile_every_stage2=2)
    return plain, offloaded


def _accumulating_step(run: _Run, micro_batches: int) -> None:
    """`_Run.step` with the loss over `micro_batches` forward-backward passes (gradient accumulation)."""
    controller = run.model.controller
    controller.begin_step(run.step_index)
    for _ in range(micro_batches):
        with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.device.type == "cuda"):
            loss = flow_matching_loss(run.model, run.x0, run.t, run.noise) / micro_batches
        loss.backward()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    controller.end_step()
    run.step_index += 1


def _train_alike(plain: _Run, offloaded: _Run, after_each=lambda: None, micro_batches: int = 1,
                 between=lambda run: None) -> int:
    """Stage 1, then stage 2 with sparse blocks and a profiling step; `between(run)` after each step of
    both. Then the two runs hold the same weights (model and predictors) and AdamW moments, bit for bit.
    Returns how many steps ran sparse blocks."""
    sparse_steps = 0
    for step in range(4):
        if step == 1:
            for run in (plain, offloaded):
                run.enter_stage2([[0.9, 0.9]] * 3)
        for run in (plain, offloaded):
            _accumulating_step(run, micro_batches)
        after_each()
        sparse_steps += any(layer.last_path.startswith("sparse") for layer in offloaded.model.controller.layers)
        for run in (plain, offloaded):
            between(run)
    _assert_same_state(plain.model, offloaded.model)
    return sparse_steps


def _assert_same_state(want_model, got_model) -> None:
    want, got = want_model.state_dict(), got_model.state_dict()  # unparks
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    for a, b in zip(want_model.controller.layers, got_model.controller.layers):
        moments_a = [v for s in a.predictor.optimizer.state_dict()["state"].values() for v in s.values()]
        moments_b = [v for s in b.predictor.optimizer.state_dict()["state"].values() for v in s.values()]
        assert len(moments_a) == len(moments_b) > 0
        assert all(torch.equal(x, y) for x, y in zip(moments_a, moments_b))


def test_host_offload_is_a_no_op_off_cuda():
    """On the CPU there is no host memory to move to: nothing parks, and training is unchanged."""
    plain, offloaded = _runs("cpu")

    def nothing_parked():
        assert not any(layer.predictor.parked for layer in offloaded.model.controller.layers)

    assert _train_alike(plain, offloaded, nothing_parked) >= 2


def test_release_makes_each_allocating_stream_wait_for_its_copy_then_drops_the_memory():
    """The registry behind `release_parked` (streams and events stand in for CUDA ones): each held entry's
    stream waits for its event once, per device or for every device, and its tensors are let go."""
    class Stream:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(event)

    first, second = Stream(), Stream()
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    memory = torch.empty(4)
    held = weakref.ref(memory)
    _hold_until(gpu0, first, "copy to host", [memory])
    del memory  # the registry keeps it
    assert held() is not None
    _hold_until(gpu0, second, "copy to device", [torch.empty(4)])
    _hold_until(gpu1, first, "other device", [torch.empty(4)])
    release_parked(gpu0)
    assert first.waited == ["copy to host"] and second.waited == ["copy to device"]
    assert gpu0 not in _HELD and gpu1 in _HELD and held() is None
    release_parked(gpu0)  # nothing left there: no second wait
    assert first.waited == ["copy to host"]
    release_parked()
    assert first.waited == ["copy to host", "other device"] and not _HELD


def test_repeatable_selection_gives_the_same_index_again():
    rows = (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4))
    keep = torch.tensor([3, 2], dtype=torch.int32)

    def select(proxies, block_keys):
        return estimate_index_from_means(proxies, block_keys, keep, 16, 16, 128)

    again = RepeatableSelection(select, rows, offload=True)
    first, second = again(), again()
    assert torch.equal(first.indices, second.indices) and torch.equal(first.counts, second.counts)
    assert again.rows[0] is rows[0]  # nothing to offload to on the CPU


def test_a_layer_knows_whether_its_next_forward_uses_the_predictor():
    """What the offload prefetches by: every layer in a step's first forward while it learns every step; after
    that forward only the sparse blocks (they select in every forward); none of the dense ones on a stage-2
    step that neither learns nor profiles."""
    cfg = apply_overrides(get_recipe("debug_cpu"), SHAPE + ["attention.learn_every_stage2=2"])
    run = _Run(cfg, "dsv", square_grid(512, 8), torch.device("cpu"))
    layers = run.model.controller.layers
    run.model.controller.begin_step(0)
    assert all(layer.will_use_predictor() for layer in layers)  # stage 1 learns every step
    run.step_index = 0
    run.step()  # begins step 0 again (the same forward id rule) and runs its forward
    assert not any(layer.will_use_predictor() for layer in layers)  # learned in this step already
    run.enter_stage2([[0.9, 0.9], [0.1, 0.1], [0.9, 0.9]])  # blocks 0 and 2 sparse, block 1 dense
    assert [layer.runs_sparse() for layer in layers] == [True, False, True]
    assert [layer.will_use_predictor() for layer in layers] == [True, False, True]
    run.model.controller.begin_step(1)  # odd: no predictor step (every 2nd in stage 2), no profiling
    assert not run.model.controller.profile_due()
    assert [layer.will_use_predictor() for layer in layers] == [True, False, True]
    run.model.controller.begin_step(2)  # even: every layer learns
    assert all(layer.will_use_predictor() for layer in layers)


def test_copies_of_a_predictor_bring_their_own_state_back_before_it_is_read(monkeypatch):
    """A deepcopy or an unpickled predictor's state_dict hooks (module and optimizer) unpark the copy itself:
    torch's optimizer drops its hooks when copied, and a copy reading parked host tensors could see
    unfinished copies."""
    unparked = []
    monkeypatch.setattr(LowRankPredictor, "unpark", lambda self: unparked.append(self))
    original = LowRankPredictor(16, 2, rank=4)
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(original), torch.load(buffer, weights_only=False)):
        state, weights = twin.optimizer.state_dict(), twin.state_dict()
        for read_or_write, args in ((twin.optimizer.state_dict, ()), (twin.optimizer.load_state_dict, (state,)),
                                    (twin.state_dict, ()), (twin.load_state_dict, (weights,))):
            unparked.clear()
            read_or_write(*args)
            assert unparked and all(who is twin for who in unparked), read_or_write


def test_a_copy_of_a_layer_leaves_the_pending_recompute_behind():
    """What a training forward keeps for its checkpointing recompute belongs to that forward's backward: a
    copy made in between starts without it."""
    run = _Run(apply_overrides(get_recipe("debug_cpu"), SHAPE), "dsv", square_grid(512, 8), torch.device("cpu"))
    run.step()
    run.enter_stage2([[0.9, 0.9]] * 3)
    run.model.controller.begin_step(1)
    flow_matching_loss(run.model, run.x0, run.t, run.noise)  # forward only: the recompute is pending
    layers = run.model.controller.layers
    assert all(layer._selection_cache for layer in layers)
    assert not any(layer._selection_cache for layer in copy.deepcopy(run.model).controller.layers)
    assert all(layer._selection_cache for layer in layers)


@pytest.fixture
def stalled_streams(monkeypatch):
    """Stall the compute stream before each predictor update and the copy stream before each prefetch: a
    park that did not wait for the update, or a use that did not wait for its prefetch, then moves or reads
    unfinished data."""
    step, prefetch = LowRankPredictor.step, LowRankPredictor.prefetch

    def slow_step(self, compute_loss, device_type):
        torch.cuda._sleep(STALL_CYCLES)
        return step(self, compute_loss, device_type)

    def slow_prefetch(self):
        if self.parked and self._incoming is None:
            with torch.cuda.stream(_copy_stream(self._parked_from)):
                torch.cuda._sleep(STALL_CYCLES)
        prefetch(self)

    monkeypatch.setattr(LowRankPredictor, "step", slow_step)
    monkeypatch.setattr(LowRankPredictor, "prefetch", slow_prefetch)


def _parked_checks(offloaded: _Run, plain: _Run):
    def check():
        for layer in offloaded.model.controller.layers:
            predictor = layer.predictor
            assert predictor.parked and predictor._incoming is None  # nothing brought back and left unused
            tensors = predictor._state_tensors()
            # Two weights (four with rotary dims' offsets), each with two AdamW moments.
            assert len(tensors) == (12 if predictor.rotary_dims else 6)
            assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
            kept = [entry[1] for entries in layer._selection_cache.values() for entry in entries]
            if layer.runs_sparse():
                assert kept and all(row.device.type == "cpu" and row.is_pinned()
                                    for selection in kept for row in selection.rows)
        for layer in plain.model.controller.layers:
            assert not layer.predictor.parked
            assert all(t.is_cuda for t in layer.predictor._state_tensors())

    return check


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("rotary", [[], ["attention.predictor_rotary=6"]], ids=["plain", "rotary"])
def test_host_offload_parks_between_steps_and_trains_identically_on_gpu(stalled_streams, micro_batches, rotary):
    """After each step every predictor's weights and AdamW moments sit in pinned host memory, the rows kept
    for the recompute too, with no prefetched copy left on the GPU (also with two micro-batches per step,
    whose second forward uses only the sparse blocks' predictors; and with rotary dims, whose offsets park
    with the weights); both runs end bit-identical."""
    plain, offloaded = _runs("cuda", *rotary)
    # Steps with sparse blocks: their recompute re-selected from offloaded rows.
    assert _train_alike(plain, offloaded, _parked_checks(offloaded, plain), micro_batches=micro_batches) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_offloaded_model_samples_under_inference_mode_copies_and_trains_on_gpu():
    """An evaluation forward under torch.inference_mode between steps brings parked predictors back; the
    training after it and a deepcopy of the model work and agree with the run without offload."""
    plain, offloaded = _runs("cuda")

    def evaluate(run: _Run) -> None:
        run.model.eval()
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            flow_matching_loss(run.model, run.x0, run.t, run.noise)
        run.model.train()

    assert _train_alike(plain, offloaded, between=evaluate) >= 2
    _accumulating_step(offloaded, 1)  # parks again
    _accumulating_step(plain, 1)
    twin = copy.deepcopy(offloaded.model)
    assert not any(layer.predictor.parked for layer in twin.controller.layers)
    _assert_same_state(plain.model, twin)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_parked_predictor_reads_writes_and_moves_its_state_on_gpu():
    torch.manual_seed(0)
    predictor = LowRankPredictor(32, 2, rank=4).cuda()
    hidden, q, k = (torch.randn(1, 64, 32, device="cuda"), torch.randn(1, 2, 64, 8, device="cuda"),
                    torch.randn(1, 2, 64, 8, device="cuda"))
    predictor.update(hidden, q, k, torch.arange(0, 64, 8, device="cuda"), 8**-0.5)
    weights = {name: t.clone() for name, t in predictor.state_dict().items()}
    state = copy.deepcopy(predictor.optimizer.state_dict())
    moments = [v for s in state["state"].values() for v in s.values() if v.dim() > 0]

    predictor.park()
    assert predictor.parked and predictor.q_proj.weight.device.type == "cpu"
    saved = predictor.state_dict()
    assert not predictor.parked
    assert all(saved[name].is_cuda and torch.equal(saved[name], weights[name]) for name in weights)

    predictor.park()
    live = predictor.optimizer.state_dict()
    assert not predictor.parked
    assert all(torch.equal(a, b) for a, b in zip(moments, [v for s in live["state"].values() for v in s.values()
                                                            if v.dim() > 0]))

    predictor.park()
    predictor.load_state_dict({name: torch.zeros_like(t) for name, t in weights.items()})
    assert not predictor.parked and predictor.q_proj.weight.is_cuda and not predictor.q_proj.weight.any()

    predictor.park()
    doubled = copy.deepcopy(state)
    for s in doubled["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            s[name] = s[name] * 2
    predictor.optimizer.load_state_dict(doubled)
    assert not predictor.parked
    loaded = [v for s in predictor.optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert all(v.is_cuda and torch.equal(v, 2 * m) for v, m in zip(loaded, moments))

    predictor.park()
    predictor.prefetch()
    proxies, _ = predictor.pooled_project(hidden, 16, 16)  # a use brings it back, here from the prefetch
    assert not predictor.parked and proxies.is_cuda and not proxies.any()  # the zero weights loaded above

    predictor.park()
    predictor.to(torch.float64)
    assert not predictor.parked and predictor.k_proj.weight.dtype == torch.float64 and predictor.k_proj.weight.is_cuda


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_parked_memory_returns_to_the_allocator_while_the_gpu_lags_on_gpu():
    """With the GPU far behind the host, a park's device memory goes back to the allocator at the next
    `release_parked`, in stream order: the active bytes fall at once by the state's size (under
    `record_stream` they would stay until the host saw the copy finish). Blocks reused at once on the compute
    stream and poisoned with NaN must not reach the host copy, which the copy stream holds back longer than
    the compute stream: the state comes back intact."""
    torch.manual_seed(0)
    predictor = LowRankPredictor(256, 4, rank=16).cuda()
    hidden, q, k = (torch.randn(1, 512, 256, device="cuda"), torch.randn(1, 4, 512, 64, device="cuda"),
                    torch.randn(1, 4, 512, 64, device="cuda"))
    predictor.update(hidden, q, k, torch.arange(0, 512, 16, device="cuda"), 64**-0.5)
    predictor.park()
    predictor.unpark()  # from here on the device state comes from a prefetch, on a known stream
    want = [t.clone() for t in predictor._state_tensors()]
    state_bytes = sum(t.numel() * t.element_size() for t in want)
    torch.cuda.synchronize()
    release_parked()
    active = torch.cuda.memory_stats()["active_bytes.all.current"]
    torch.cuda._sleep(100 * STALL_CYCLES)  # ~50 ms queued on the compute stream
    with torch.cuda.stream(_copy_stream(torch.device("cuda", torch.cuda.current_device()))):
        torch.cuda._sleep(200 * STALL_CYCLES)  # the park's copies start only after ~100 ms
    predictor.park()
    release_parked(predictor._parked_from)
    assert torch.cuda.memory_stats()["active_bytes.all.current"] <= active - state_bytes
    poison = [torch.full_like(t, float("nan")) for t in want for _ in range(4)]  # likely in the freed blocks
    predictor.unpark()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(predictor._state_tensors(), want))
    del poison
