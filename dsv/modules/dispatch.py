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

    def pays(self, keep: float, batch: int, heads: int, seq_len: int, head_dim: int, margin: float = 0.0) -> bool:
        """Whether sparse attention at kept fraction `keep` saves more than `margin` of dense's time."""
        dense = self.dense_ms(batch, heads, seq_len, head_dim)
        return self.sparse_ms(keep, batch, heads, seq_len, head_dim) < (1.0 - margin) * dense


# Fitted to benchmarks/results/2026-11-29-h200-kernels.md (one H200, bf16, D=128, 128-token blocks):
# cuDNN ran at 563-566 TFLOP/s; between 2% and 10% kept, DSV's fwd+bwd time grew by 1.22x (32k) and
# 1.25x (64k) of dense per unit kept, on top of ~0.7-1.4 ms per call. The fit is within 6% at 32k and
# 64k; at 16k and 2% kept it is 20% optimistic (host-bound there).
H200_TRITON = SparseSpeedModel(dense_tflops=565.0, relative_cost=1.25, fixed_ms=0.8,
                               source="benchmarks/results/2026-11-29-h200-kernels.md")
# Smaller blocks run smaller tiles. Measured on one H200 (benchmarks/NOTES.md, "Dispatch speed model by
# block size": 16 heads × 128, bf16, estimation and key-major build included, 5-50% kept at 16k and 32k):
# 64-token blocks cost 1.30x dense per unit kept, as 128-token ones (1.25x); 32-token blocks 3.95x (their
# 32x32 tiles), so they pay only below ~25% kept. Least-squares fixed costs were 0.5-0.7 ms; 0.8 is kept.
H200_TRITON_64 = SparseSpeedModel(dense_tflops=565.0, relative_cost=1.30, fixed_ms=0.8,
                                  source="benchmarks/NOTES.md (64-token blocks)")
H200_TRITON_32 = SparseSpeedModel(dense_tflops=565.0, relative_cost=3.95, fixed_ms=0.8,
                                  source="benchmarks/NOTES.md (32-token blocks)")

# Checked on one H100 (2026-12-07, `dsv bench kernels`' speed-model check; benchmarks/NOTES.md, "The dispatch
# speed model on an H100"): cuDNN ran at 557-577 TFLOP/s at head dim 128, as on the H200, and the models above,
# on its dense times, were within -5%..+5% (64-token blocks) and -2%..+0.4% (32-token) of the sparse time; the
# 128-token model -7%..+19%, high at 25-50% kept at 16k (the fused Hopper backward has since made those cheaper),
# where its error keeps a layer near break-even dense.

SPEED_MODELS = {"triton": H200_TRITON}
"""The 128-token-block model per backend, the base that `speed_model` picks by block size."""


def speed_model(backend: str, group_size: int, kv_block: int) -> tuple[SparseSpeedModel | None, str]:
    """`(model, description)` for a layer's sparse backend and blocks, by the smaller of its query group and
    key block: the 128-, 64- or 32-token model. Blocks under 32 tokens (not measured) take the 32-token
    model and the description says so; a backend without a model (the reference) gives None. The description
    names the GPU the times come from: on another GPU the model's absolute times are not that GPU's (only
    their ratio to dense carries over), which a user reading a dispatch decision should know."""
    if backend not in SPEED_MODELS:
        return None, ""
    block = min(group_size, kv_block)
    if block >= 128:
        model, words = H200_TRITON, "128-token blocks"
    elif block >= 64:
        model, words = H200_TRITON_64, "64-token blocks"
    elif block >= 32:
        model, words = H200_TRITON_32, "32-token blocks"
    else:
        model, words = H200_TRITON_32, f"{block}-token blocks, not measured: the 32-token model"
    return model, f"{words}, H200 times, alike on an H100"
