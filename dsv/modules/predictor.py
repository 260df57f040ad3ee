"""Low-rank sparsity predictor: learns Q_lr·K_lrᵀ ≈ QKᵀ·scale for one attention layer.

The predictor is detached from the model graph: its loss is computed and its own optimizer steps inside
the layer's forward pass, so no S×S intermediate is kept alive for the model's backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def predictor_loss(
    pred_scores: torch.Tensor, true_scores: torch.Tensor, cosine_weight: float, mse_weight: float
) -> torch.Tensor:
    """Weighted row-cosine + MSE of row-standardised scores, both `[..., R, S]`.

    The cosine term matches the rows' direction; the MSE term compares rows after removing each row's
    mean and scale, because softmax ignores a per-row shift and only the ranking decides the selection.
    """
    cosine = F.cosine_similarity(pred_scores, true_scores, dim=-1, eps=1e-6)

    def standardise(rows: torch.Tensor) -> torch.Tensor:
        centred = rows - rows.mean(dim=-1, keepdim=True)
        return centred / centred.pow(2).mean(dim=-1, keepdim=True).add(1e-6).sqrt()

    mse = (standardise(pred_scores) - standardise(true_scores)).pow(2).mean(dim=-1)
    return cosine_weight * (1.0 - cosine).mean() + mse_weight * mse.mean()


class LowRankPredictor(nn.Module):
    """Two low-rank projections per layer: hidden `[B, S, C]` → `q_lr, k_lr` of `[B, H, S, rank]`."""

    def __init__(
        self,
        dim: int,
        heads: int,
        rank: int = 16,
        lr: float = 1e-3,
        cosine_weight: float = 0.9,
        mse_weight: float = 0.1,
    ):
        super().__init__()
        if rank < 1:
            raise ValueError(f"predictor rank must be >= 1, got {rank}")
        self.heads, self.rank = heads, rank
        self.cosine_weight, self.mse_weight = cosine_weight, mse_weight
        self.q_proj = nn.Linear(dim, heads * rank, bias=False)
        self.k_proj = nn.Linear(dim, heads * rank, bias=False)
        # The optimizer lives with the predictor: it is not part of the model's optimizer, and the
        # trainer saves its state through `optimizer_state_dict`.
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden [B, S, C]` → `(q_lr, k_lr)`, each `[B, H, S, rank]`."""
        b, s, _ = hidden.shape
        q_lr = self.q_proj(hidden).view(b, s, self.heads, self.rank).transpose(1, 2)
        k_lr = self.k_proj(hidden).view(b, s, self.heads, self.rank).transpose(1, 2)
        return q_lr, k_lr

    def loss(
        self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Loss on sampled query rows: `hidden [B,S,C]`, `q, k [B,H,S,D]`, `rows` LongTensor `[R]`."""
        dtype = self.q_proj.weight.dtype  # the predictor keeps its own (fp32) precision under autocast
        hidden = hidden.to(dtype)
        b, s, _ = hidden.shape
        # Only the sampled rows need low-rank queries; every key needs its low-rank key.
        q_lr = self.q_proj(hidden[:, rows]).view(b, len(rows), self.heads, self.rank).transpose(1, 2)
        k_lr = self.k_proj(hidden).view(b, s, self.heads, self.rank).transpose(1, 2)
        pred = q_lr @ k_lr.transpose(-1, -2)  # [B, H, R, S]
        with torch.no_grad():
            # In q/k's own precision (bf16 under autocast: tensor cores, fp32 accumulation), so that k is
            # not copied to fp32 each step; the target's rounding is far below what the loss resolves.
            true = (q[:, :, rows] @ k.transpose(-1, -2)).to(dtype) * scale
        return self.scores_loss(pred, true)

    def update(
        self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One optimizer step on detached inputs; returns the loss before the step (a 0-d tensor, so
        no device synchronisation is forced)."""
        return self.step(lambda: self.loss(hidden.detach(), q.detach(), k.detach(), rows, scale),
                         hidden.device.type)

    def scores_loss(self, pred_scores: torch.Tensor, true_scores: torch.Tensor) -> torch.Tensor:
        """`predictor_loss` with this predictor's weights (callers that build the scores themselves)."""
        return predictor_loss(pred_scores, true_scores, self.cosine_weight, self.mse_weight)

    def step(self, compute_loss, device_type: str) -> torch.Tensor:
        """One optimizer step on the 0-d loss that `compute_loss()` builds from this predictor's
        parameters (fp32: autocast is off inside); returns the loss, detached."""
        with torch.enable_grad(), torch.autocast(device_type, enabled=False):
            loss = compute_loss()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Predictors are replicated on every rank and must stay identical: average their gradients
            # separately from the model's.
            for p in self.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        self.optimizer.step()
        return loss.detach()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
