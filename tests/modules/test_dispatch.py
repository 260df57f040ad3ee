"""The kernel-speed dispatch model: sparse runs only where the measured kernels beat dense."""

import torch

from dsv.modules.attention import DSVAttention
from dsv.modules.config import AttentionConfig
from dsv.modules.dispatch import H200_TRITON


def test_speed_model_matches_the_measured_points_it_was_fitted_to():
    # benchmarks/results/2026-11-29-h200-kernels.md, S=32k, 24 heads, D=128: dense 81.64 ms,
    # DSV 10.86 ms at 10.2% kept and 2.70 ms at 2.0% kept; S=64k: dense 327.71, DSV 42.27 and 9.61 ms.
    # The model must land within 10% of each.
    for seq, dense, points in ((32768, 81.64, ((0.102, 10.86), (0.020, 2.70))),
                               (65536, 327.71, ((0.100, 42.27), (0.020, 9.61)))):
        assert abs(H200_TRITON.dense_ms(1, 24, seq, 128) - dense) / dense < 0.10
        for keep, measured in points:
            assert abs(H200_TRITON.sparse_ms(keep, 1, 24, seq, 128) - measured) / measured < 0.10


def test_sparse_pays_only_for_long_sequences_and_small_kept_fractions():
    assert H200_TRITON.pays(0.10, 1, 24, 32768, 128)
    assert not H200_TRITON.pays(0.90, 1, 24, 32768, 128)  # 1.25 x 0.9 of dense: slower than dense
    assert not H200_TRITON.pays(0.10, 1, 4, 512, 32)  # tiny shapes: the fixed cost dominates


def test_layer_dispatch_consults_the_speed_model_for_the_triton_backend():
    layer = DSVAttention(64, 4, cfg=AttentionConfig(sparse_threshold=0.5))
    layer.sparsity_ema.copy_(torch.tensor([0.9, 0.95, 0.9, 0.92]))
    layer._last_shape = (1, 512)
    layer.dispatch()  # reference backend: the sparsity threshold alone decides
    assert layer.use_sparse and "speed model" not in layer.dispatch_reason
    layer._last_backend = "triton"
    layer.dispatch()  # 512 tokens: the kernels' fixed cost exceeds dense attention's time
    assert not layer.use_sparse and "triton speed model" in layer.dispatch_reason
    layer._last_shape = (1, 32768)
    layer.dispatch()
    assert layer.use_sparse


def test_speed_dispatch_off_dispatches_on_sparsity_alone():
    layer = DSVAttention(64, 4, cfg=AttentionConfig(sparse_threshold=0.5, speed_dispatch=False))
    layer.sparsity_ema.copy_(torch.tensor([0.9, 0.95, 0.9, 0.92]))
    layer._last_shape, layer._last_backend = (1, 512), "triton"
    layer.dispatch()  # the speed model would keep this short sequence dense
    assert layer.use_sparse and "speed model" not in layer.dispatch_reason


def test_the_model_follows_the_block_size_of_the_layer():
    """32-token blocks (the default 2x4x4 cube) ran at 3.95x dense's cost per unit kept on one H200, 64- and
    128-token blocks at 1.30x and 1.25x (benchmarks/NOTES.md): at 32k tokens and 16 heads, 40% kept pays
    with 128-token blocks and not with 32-token ones; 10% kept pays with both."""
    from dsv.modules.dispatch import H200_TRITON_32, H200_TRITON_64, speed_model

    assert speed_model("triton", 128, 128)[0] is H200_TRITON and speed_model("triton", 256, 128)[0] is H200_TRITON
    assert speed_model("triton", 64, 128)[0] is H200_TRITON_64
    assert speed_model("triton", 32, 32) == (H200_TRITON_32, "32-token blocks, H200 times, alike on an H100")
    model, words = speed_model("triton", 16, 16)
    assert model is H200_TRITON_32 and "not measured" in words
    assert speed_model("reference", 128, 128) == (None, "")
    shape = (1, 16, 32768, 128)
    assert H200_TRITON.pays(0.40, *shape) and not H200_TRITON_32.pays(0.40, *shape)
    assert H200_TRITON_32.pays(0.10, *shape)
    # The measured 32-token points (32k, 16 heads): 11.93 ms at 5.1% kept, 55.04 ms at 25%, dense 54.53 ms.
    for keep, measured in ((0.0508, 11.93), (0.25, 55.04)):
        assert abs(H200_TRITON_32.sparse_ms(keep, *shape) - measured) / measured < 0.10


def test_a_layer_with_small_cubes_stays_dense_where_their_kernels_lose():
    layer = DSVAttention(64, 4, cfg=AttentionConfig(cube=(2, 4, 4), sparse_threshold=0.5))  # 32-token groups
    layer.sparsity_ema.copy_(torch.tensor([0.62, 0.6, 0.58, 0.6]))  # 40% kept
    layer._last_backend, layer._last_shape = "triton", (1, 32768)
    layer.dispatch()
    assert not layer.use_sparse
    assert "speed model (32-token blocks, H200 times, alike on an H100)" in layer.dispatch_reason
    layer.sparsity_ema.copy_(torch.tensor([0.92, 0.9, 0.9, 0.88]))  # 10% kept
    layer.dispatch()
    assert layer.use_sparse


def test_the_speed_model_is_given_the_kept_fraction_the_kernels_run():
    """Budgets run as whole key blocks and at least `keep_floor_blocks` of them: the dispatch prices that, not
    the fraction asked for. Three quarters of 128 blocks as the floor: 5% asked runs 75%, slower than dense."""
    from dsv.modules.dispatch import H200_TRITON_64

    shape = (8, 6, 8192, 64)
    assert H200_TRITON_64.pays(0.05, *shape) and not H200_TRITON_64.pays(0.75, *shape)
    layer = DSVAttention(384, 6, cfg=AttentionConfig(cube=(4, 4, 4), sparse_threshold=0.5, keep_floor_blocks=96))
    layer._last_backend, layer._last_shape = "triton", (8, 8192)
    layer.sparsity_ema.fill_(0.95)
    layer.dispatch()
    assert not layer.use_sparse and "at 0.750 kept in whole key blocks" in layer.dispatch_reason
    layer.cfg = AttentionConfig(cube=(4, 4, 4), sparse_threshold=0.5, keep_floor_blocks=2)
    layer.dispatch()
    assert layer.use_sparse and "at 0.055 kept in whole key blocks" in layer.dispatch_reason  # ceil(6.4) of 128


def test_blocks_near_the_break_even_keep_their_path():
    """attention.dispatch_margin: a dense block goes sparse only for a predicted saving of at least the margin,
    a sparse one goes back to dense only where sparse is predicted slower: the band keeps blocks near the
    break-even from switching every profile, as 64-token blocks at 8192 tokens and ~0.6 sparsity did."""
    from dsv.modules.dispatch import H200_TRITON_64

    # The quality_gpu DiT's layers (6 heads x 64) at 8192 tokens, batch 8; a low threshold, so that the speed
    # model decides (with the recall floor's boost, blocks at sparsity ~0.6 kept 0.6-0.7 of their keys).
    layer = DSVAttention(384, 6, cfg=AttentionConfig(cube=(4, 4, 4), sparse_threshold=0.2))
    layer._last_backend, layer._last_shape = "triton", (8, 8192)
    shape = (8, 6, 8192, 64)

    def dispatch_at(keep: float) -> float:
        layer.sparsity_ema.fill_(1 - keep)
        layer.dispatch()
        return H200_TRITON_64.sparse_ms(keep, *shape) / H200_TRITON_64.dense_ms(*shape)

    assert 0.9 < dispatch_at(0.62) < 1.0  # sparse predicted 0-10% faster: a dense block stays dense
    assert not layer.use_sparse and "to go sparse: <" in layer.dispatch_reason
    assert dispatch_at(0.45) < 0.9  # a saving beyond the margin
    assert layer.use_sparse
    assert 0.9 < dispatch_at(0.62) < 1.0  # back in the band: a sparse block stays sparse
    assert layer.use_sparse and "to go sparse" not in layer.dispatch_reason
    assert dispatch_at(0.75) > 1.0  # slower than dense: back to dense
    assert not layer.use_sparse
    no_band = DSVAttention(384, 6, cfg=AttentionConfig(cube=(4, 4, 4), sparse_threshold=0.2, dispatch_margin=0.0))
    no_band._last_backend, no_band._last_shape = "triton", (8, 8192)
    no_band.sparsity_ema.fill_(1 - 0.62)
    no_band.dispatch()
    assert no_band.use_sparse


def test_window_and_dense_layers_keep_their_mode_under_a_dispatching_controller():
    """One controller may serve layers of several modes (a model built with per-layer configs): the stage-2
    dispatch leaves a window or dense layer's path and its stated reason as its mode fixes them."""
    for mode, runs_sparse in (("window", True), ("dense", False)):
        layer = DSVAttention(64, 4, cfg=AttentionConfig(mode=mode, sparse_threshold=0.5))
        reason, use_sparse = layer.dispatch_reason, bool(layer.use_sparse)
        layer.sparsity_ema.fill_(0.95 if mode == "dense" else 0.1)
        layer.dispatch()
        assert layer.dispatch_reason == reason and reason.startswith(f"attention.mode={mode}")
        assert layer.runs_sparse() is runs_sparse and bool(layer.use_sparse) is use_sparse


def test_the_dispatch_times_the_training_forwards_not_an_evaluation_between_them(monkeypatch):
    """A custom loop that evaluates (another batch size) between a step's training forward and its end_step: the
    dispatch timed the kernels at the evaluation's batch, the last forward's, and could send a block sparse or
    dense for a batch that training never runs."""
    import dsv.modules.attention as attention
    from dsv.modules.dit import ModelConfig, VideoDiT

    timed = []

    class Recording:
        """A speed model that records the shapes it is asked about."""

        def dense_ms(self, *shape):
            timed.append(shape)
            return 1.0

        def sparse_ms(self, keep, *shape):
            return 0.5

        def pays(self, keep, *shape, margin=0.0):
            return True

    # The Triton backend on a CPU: stage 1 runs dense attention, which no backend touches.
    monkeypatch.setattr(attention, "resolve_backend", lambda *args: ("triton", None))
    monkeypatch.setattr(attention, "speed_model", lambda backend, *blocks: (Recording(), "recorded"))
    torch.manual_seed(0)
    model = VideoDiT(ModelConfig(hidden=32, depth=2, heads=2), AttentionConfig(cube=(2, 2, 2)))
    layer = model.controller.layers[0]
    model.controller.begin_step(0)
    model(torch.randn(2, 3, 2, 8, 8), torch.rand(2)).pow(2).mean().backward()
    model.eval()
    with torch.no_grad():
        model(torch.randn(5, 3, 2, 8, 8), torch.rand(5))
    tokens = layer._last_shape[1]
    assert layer._last_shape == (5, tokens)
    assert layer.dispatch_basis() == ((2, tokens), "triton")
    layer.sparse_pays(torch.full((2,), 0.2))
    assert timed == [(2, 2, tokens, 16)]
