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
