"""Does sparse attention pay for a block? A kernel-speed model fitted to measured times.

Forward+backward time of sparse attention is modelled as `fixed_ms + relative_cost · keep · dense_ms`,
where `dense_ms` is cuDNN's time for the same shape, `keep` the kept fraction of keys, `relative_cost` the
sparse kernels' time per unit of kept work relative to dense, and `fixed_ms` the per-call overhead
(estimation, index transpose, launches). Sparse pays when that is below `dense_ms`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SparseSpeedModel:
    dense_tflops: float  # measured dense (cuDNN) fwd+bwd rate, counted as 14·S²·D FLOPs per head
    relative_cost: float
    fixed_ms: float
    source: str

    def dense_ms(self, batch: int, heads: int, seq_len: int, head_dim: int) -> float:
        flops = 14.0 * batch * heads * seq_len * seq_len * head_dim
        return flops / (self.dense_tflops * 1e12) * 1e3

    def sparse_ms(self, keep: float, batch: int, heads: int, seq_len: int, head_dim: int) -> float:
        return self.fixed_ms + self.relative_cost * keep * self.dense_ms(batch, heads, seq_len, head_dim)

    def pays(self, keep: float, batch: int, heads: int, seq_len: int, head_dim: int) -> bool:
        dense = self.dense_ms(batch, heads, seq_len, head_dim)
        return self.sparse_ms(keep, batch, heads, seq_len, head_dim) < dense


# Fitted to benchmarks/results/2026-11-29-h200-kernels.md (one H200, bf16, D=128, 128-token blocks):
# cuDNN ran at 563-566 TFLOP/s; between 2% and 10% kept, DSV's fwd+bwd time grew by 1.22x (32k) and
# 1.25x (64k) of dense per unit kept, on top of ~0.7-1.4 ms per call. The fit is within 6% at 32k and
# 64k; at 16k and 2% kept it is 20% optimistic (host-bound there).
H200_TRITON = SparseSpeedModel(dense_tflops=565.0, relative_cost=1.25, fixed_ms=0.8,
                               source="benchmarks/results/2026-11-29-h200-kernels.md")

SPEED_MODELS = {"triton": H200_TRITON}
