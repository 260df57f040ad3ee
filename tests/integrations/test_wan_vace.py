"""DSV installed in diffusers' Wan VACE transformer (Wan's blocks and its control blocks), against the unpatched
model (same weights)."""

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers integration needs `pip install 'dsv[integrations]'`")

from diffusers import WanVACETransformer3DModel  # noqa: E402

from dsv.integrations.diffusers import WanDSVProcessor  # noqa: E402
from tests.integrations.test_diffusers import (  # noqa: E402
    TOL64,
    _as,
    assert_all_keys_sparse_matches,
    assert_dense_mode_matches,
    assert_dsv_state_round_trips,
    assert_same_grads,
    bf16_model_errors,
    sparse_grads,
)


def tiny_wan_vace(head_dim: int = 16) -> WanVACETransformer3DModel:
    """One Wan block and one control block (VACE needs its layer 0), so two DSV layers; float64."""
    return WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=3, out_channels=3,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=32, vace_layers=[0], vace_in_channels=5,
    ).double()


def vace_inputs(frames: int = 4, size: int = 8, control_frames: int | None = None):
    """Latent [2, 3, F, size, size] → token grid (F, size/2, size/2); 5 text tokens; a control latent of 5 channels
    over `control_frames` (default F) frames, which the model pads with zero tokens to the video's."""
    control_frames = frames if control_frames is None else control_frames
    return (torch.randn(2, 3, frames, size, size, dtype=torch.float64), torch.tensor([100.0, 700.0]),
            torch.randn(2, 5, 32, dtype=torch.float64),
            torch.randn(2, 5, control_frames, size, size, dtype=torch.float64))


def vace_forward(model, inputs):
    x, t, text, control = inputs
    return model(hidden_states=x, timestep=t, encoder_hidden_states=text, control_hidden_states=control,
                 return_dict=False)[0]


def test_wan_vace_dense_mode_equals_unpatched_forward_and_backward():
    patched = assert_dense_mode_matches(tiny_wan_vace(), vace_forward, vace_inputs(), TOL64)
    names = [name for name, module in patched.named_modules() if isinstance(module, WanDSVProcessor)]
    assert names == ["blocks.0.attn1.processor", "vace_blocks.0.attn1.processor"]
    assert patched.dsv_controller.cfg.predictor_rotary == 6  # Wan's rotary embedding positions q and k


@pytest.mark.parametrize("frames, size, control_frames", [(4, 8, None), (3, 6, None), (4, 8, 2)],
                         ids=["whole-cubes", "partial-cubes", "short-control"])
def test_wan_vace_oracle_with_all_keys_equals_dense_forward_and_backward(frames, size, control_frames):
    """Keeping every key, the sparse path of both stacks is the stock attention, also on a grid the cube does not
    tile and with a control latent shorter than the video (zero tokens at the end of the control stream)."""
    assert_all_keys_sparse_matches(tiny_wan_vace(), vace_forward, vace_inputs(frames, size, control_frames), TOL64)


def test_wan_vace_trains_sparse_with_gradient_checkpointing_as_without():
    """diffusers checkpoints the control blocks and the Wan blocks apart: each recomputed with its forward's grid."""
    base, inputs = tiny_wan_vace(), vace_inputs()
    assert_same_grads(sparse_grads(base, vace_forward, inputs, True),
                      sparse_grads(base, vace_forward, inputs, False), TOL64)


def test_wan_vace_dsv_state_round_trips_through_save_pretrained(tmp_path):
    # In float32: loading in float64 would keep the modules Wan marks `_keep_in_fp32_modules` in float32.
    assert_dsv_state_round_trips(tiny_wan_vace().float(), vace_forward, _as(torch.float32, vace_inputs()), tmp_path,
                          "vace_blocks.0.attn1.processor.predictor.")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wan_vace_runs_its_sparse_attention_on_the_triton_kernels():
    """Both stacks' self-attention through the Triton kernels, keeping every key: the bf16 model is as close to
    float32 as the stock bf16 model."""
    torch.manual_seed(0)
    reference = tiny_wan_vace(head_dim=64).float().cuda()
    inputs = tuple(t.cuda() for t in _as(torch.float32, vace_inputs(size=16)))
    patched, (dsv_error, stock_error) = bf16_model_errors(reference, vace_forward, inputs)
    assert [layer.last_path for layer in patched.dsv_controller.layers] == ["sparse:triton"] * 2
    # Both run in bf16 against float32; DSV sums in another order with its own kernels: within twice the stock
    # error, plus one bf16 eps (2^-8) for a stock error near zero.
    assert dsv_error <= 2 * stock_error + 2**-8, (dsv_error, stock_error)
