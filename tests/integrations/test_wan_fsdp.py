"""The Wan model under FSDP bf16 mixed precision (`shard_model(..., mixed_precision=True)`) on 2 gloo ranks.

`shard_model` does not cast the root's inputs (the timesteps must stay fp32), so `WanVideoModel` has to cast
the video to its bf16 weights itself, as `VideoDiT` does; without that the patch embedding raises
"Input type (float) and bias type (c10::BFloat16) should be the same".
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("diffusers", reason="the diffusers integration needs `pip install 'dsv[integrations]'`")

from dsv.integrations.diffusers import WanVideoModel, build_wan_for_training  # noqa: E402
from dsv.modules.config import AttentionConfig  # noqa: E402
from tests.parallel import run_distributed  # noqa: E402

WORLD, BATCH = 2, 2
VIDEO = (3, 2, 8, 8)  # C, T, H, W: with 1×2×2 patches a 2×4×4 grid of 32 tokens
# The loss is an fp32 mean of outputs computed in bf16, so one bf16 rounding (2^-8 relative) bounds its gap
# to the fp32 run, as in tests/parallel/test_fsdp.py; we measure 7e-5 relative.
BF16_LOSS_TOL = {"rtol": 2**-8, "atol": 0.0}
# The output itself goes through a few bf16 roundings (input, weights, activations, the bf16 output), each
# 2^-8 relative, so bound its relative (Frobenius) error to the fp32 run by 4 of them; we measure 5.8e-3.
BF16_OUTPUT_REL_TOL = 4 * 2**-8


def build_model() -> WanVideoModel:
    torch.manual_seed(0)  # every rank and the reference start from the same weights
    return build_wan_for_training(AttentionConfig(mode="dense", cube=(1, 2, 2)), num_layers=2, num_heads=2,
                                  head_dim=16, ffn_dim=64)


def make_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, *VIDEO, generator=gen), torch.rand(BATCH, generator=gen),
            torch.randn(BATCH, *VIDEO, generator=gen))


def forward_backward(model: WanVideoModel) -> dict:
    """One flow-matching forward and backward on fp32 inputs, as the trainer feeds them."""
    model.train()
    model.controller.begin_step(0)
    x0, t, noise = make_batch()
    tb = t.view(-1, 1, 1, 1, 1)
    pred = model((1 - tb) * x0 + tb * noise, t)
    loss = F.mse_loss(pred.float(), noise - x0)
    loss.backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return {"pred": pred.detach().float(), "pred_dtype": pred.dtype, "loss": loss.detach(),
            "grads_finite": all(g is not None and bool(torch.isfinite(g).all()) for g in grads)}


def mixed_precision_worker(rank, world):
    from dsv.parallel.fsdp import shard_model

    return forward_backward(shard_model(build_model(), mixed_precision=True))


def test_wan_sharded_bf16_mixed_precision_matches_fp32(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank (run_distributed sets that): the ranks share the cores
    try:
        reference = forward_backward(build_model())
    finally:
        torch.set_num_threads(threads)
    per_rank = run_distributed(mixed_precision_worker, WORLD, out_dir=tmp_path, timeout_s=120)

    assert reference["pred_dtype"] == torch.float32
    for result in per_rank:
        # The computation ran in bf16 (the fp32 video was cast to the gathered bf16 weights) ...
        assert result["pred_dtype"] == torch.bfloat16
        assert torch.isfinite(result["pred"]).all() and torch.isfinite(result["loss"])
        assert result["grads_finite"]
        # ... and stays within bf16 rounding of the fp32 model on the same weights and data.
        torch.testing.assert_close(result["loss"], reference["loss"], **BF16_LOSS_TOL)
        error = (result["pred"] - reference["pred"]).norm() / reference["pred"].norm()
        assert error <= BF16_OUTPUT_REL_TOL, f"relative output error {error:.3g} > {BF16_OUTPUT_REL_TOL:.3g}"
