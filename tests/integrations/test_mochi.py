"""DSV installed in diffusers' Mochi transformer, against the unpatched model (same weights)."""


import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers integration needs `pip install 'dsv[integrations]'`")

from diffusers import MochiTransformer3DModel  # noqa: E402
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, MochiAttnProcessor2_0  # noqa: E402

from dsv.integrations.diffusers import MochiDSVProcessor, install_dsv  # noqa: E402
from tests.integrations.test_diffusers import (  # noqa: E402
    TOL64,
    _as,
    _scale_second_sample_padding,
    _sparse_quarter,
    assert_all_keys_sparse_matches,
    assert_as_close_as_stock_bf16,
    assert_dense_mode_matches,
    assert_dsv_state_round_trips,
    assert_same_grads,
    attend_calls,
    bf16_joint_errors,
    calls_inside_the_forward,
    cfg,
    grads,
    processor_errors,
    sparse_grads,
)

# TOL64 (float64; DSV only sums the keys in another order) holds for Mochi too: its float32 norms and rotary round
# the same values in the patched and the stock model (gradients agree to ~1e-11 relative).

# diffusers' MochiRoPE builds its tables under `torch.autocast(device, float32)`, which CPU autocast does not
# support: it warns at every forward and runs them in float32 anyway.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning")

# Prompt masks of the two samples over 7 text tokens (a partial key block of 8): the second sample's last 3
# padded (as a tokenizer pads), tokens missing here and there (the stock processor attends the valid ones
# wherever they are), none padded, and a sample with no valid token at all.
MASKS = {
    "padded": ((1, 1, 1, 1, 1, 1, 1), (1, 1, 1, 1, 0, 0, 0)),
    "holes": ((1, 0, 1, 1, 0, 1, 0), (0, 1, 1, 0, 0, 0, 1)),
    "unpadded": ((1, 1, 1, 1, 1, 1, 1), (1, 1, 1, 1, 1, 1, 1)),
    "empty-prompt": ((0, 0, 0, 0, 0, 0, 0), (1, 1, 0, 0, 0, 0, 0)),
}


def tiny_mochi() -> MochiTransformer3DModel:
    """Two blocks (the last one `context_pre_only`: no text output projection), text of its own width (24, video
    32), in float64. The rotary frequencies (zero, so no rotation, in a fresh model) are drawn at random and frozen:
    Mochi builds its rotary tables in float32 whatever the model dtype, so their gradient is compared on its own
    (`test_mochi_dense_mode_equals_unpatched_forward_and_backward`)."""
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2, pooled_projection_dim=24,
        in_channels=4, text_embed_dim=32, time_embed_dim=16, max_sequence_length=7,
    ).double()
    with torch.no_grad():
        model.pos_frequencies.normal_()
    model.pos_frequencies.requires_grad_(False)
    return model


def mochi_inputs(size: int = 8, masks: str = "padded"):
    """Latent [2, 4, F=4, size, size] → token grid (4, size / 2, size / 2); 7 text tokens under the prompt masks
    `MASKS[masks]`."""
    return (torch.randn(2, 4, 4, size, size, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64),
            torch.tensor(MASKS[masks], dtype=torch.bool))


def mochi_forward(model, inputs):
    x, text, mask = inputs
    return model(x, text, torch.tensor([10, 600], device=x.device), mask, return_dict=False)[0]


def test_mochi_dense_mode_equals_unpatched_forward_and_backward():
    reference, inputs = tiny_mochi(), mochi_inputs()
    patched = assert_dense_mode_matches(reference, mochi_forward, inputs, TOL64)
    assert all(isinstance(block.attn1.processor, MochiDSVProcessor) for block in patched.transformer_blocks)
    assert patched.transformer_blocks[-1].attn1.context_pre_only  # the last block's text output is not projected
    assert patched.dsv_controller.cfg.predictor_rotary == 6  # rotary embeddings position q and k
    # The rotary frequencies' gradient flows through the tables that the processors reorder into cube order.
    for model in (patched, reference):
        model.pos_frequencies.requires_grad_(True)
    got, want = (grads(model, mochi_forward, inputs)[2]["pos_frequencies"] for model in (patched, reference))
    # Mochi's rotary tables and their gradient are float32 sums, whatever the model dtype; DSV sums the two layers'
    # and q's and k's contributions in another order: within a few float32 ulps of the gradient's largest entry.
    torch.testing.assert_close(got, want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * want.abs().max().item())


@pytest.mark.parametrize("masks", ["padded", "holes"])
def test_mochi_dense_layers_equal_the_stock_processor_in_float64(masks):
    """Before Mochi's float32 norms round them: the video and text outputs of each layer are the stock processor's,
    the padded text positions included (zeros before `to_add_out`, so its bias; zeros in the last block)."""
    model = tiny_mochi()
    install_dsv(model, cfg("dense"))
    inputs = mochi_inputs(masks=masks)
    valid_counts = inputs[2].sum(1).tolist()
    for block in model.transformer_blocks:
        attn = block.attn1
        found = calls_inside_the_forward(model, mochi_forward, attn, inputs, lambda kwargs, out, attn=attn: {
            "out": out, "stock": MochiAttnProcessor2_0()(attn, **kwargs)})
        assert attn.processor.last_path == "dense:sdpa"
        for got, want in zip(found["out"], found["stock"]):
            torch.testing.assert_close(got, want, **TOL64)
        text = found["out"][1]
        padded_output = attn.to_add_out.bias if hasattr(attn, "to_add_out") else text.new_zeros(text.shape[-1])
        for sample, count in enumerate(valid_counts):
            assert torch.equal(text[sample, count:], padded_output.expand(7 - count, -1))
            assert (text[sample, :count] != padded_output).any(-1).all()


@pytest.mark.parametrize("masks, unmasked_calls", [("padded", 2), ("unpadded", 1)])
def test_mochi_dense_layers_attend_without_a_mask(monkeypatch, masks, unmasked_calls):
    """Dense layers run each sample over its own unpadded sequence with no mask, as the stock processor does (SDPA's
    fast GPU kernels take none): one call for the batch where no prompt is padded, one a sample where they differ."""
    model = tiny_mochi()
    install_dsv(model, cfg("dense"))
    inputs = mochi_inputs(masks=masks)
    calls = attend_calls(model, mochi_forward, model.transformer_blocks[0].attn1, inputs, monkeypatch)
    video_tokens = 4 * 4 * 4
    lengths = inputs[2].sum(1).tolist()
    expected = [(2, video_tokens + 7)] if unmasked_calls == 1 else [(1, video_tokens + n) for n in lengths]
    assert [(batch, seq) for batch, seq, _ in calls] == expected
    assert all(key_mask is None for *_, key_mask in calls)


@pytest.mark.parametrize("size, masks", [(8, "padded"), (6, "padded"), (8, "unpadded"), (8, "holes"),
                                         (8, "empty-prompt")],
                         ids=["padded", "odd-H-W-padded", "unpadded", "holes", "empty-prompt"])
def test_mochi_oracle_with_all_keys_equals_dense_forward_and_backward(size, masks):
    """With every video key kept, DSV's joint attention is the stock processor's: each sample's valid text keys
    attended, its padded ones not (one sample at a time where they differ), its text outputs in the stock order."""
    assert_all_keys_sparse_matches(tiny_mochi(), mochi_forward, mochi_inputs(size, masks), TOL64)


@pytest.mark.parametrize("masks", ["padded", "holes"])
def test_mochi_padded_text_keys_never_count_and_text_queries_stay_as_stock(masks):
    """Under a partial budget: the text outputs are the stock processor's, the video outputs skip keys, and the
    padded text tokens' contents change no output at all (the stock processor drops them)."""
    model = tiny_mochi()
    install_dsv(model, cfg("oracle"))
    _sparse_quarter(model)
    attn = model.transformer_blocks[0].attn1

    def calls(kwargs, out):
        changed = dict(kwargs, encoder_hidden_states=kwargs["encoder_hidden_states"].clone())
        changed["encoder_hidden_states"][~kwargs["attention_mask"]] = 100.0
        return {"out": out, "stock": MochiAttnProcessor2_0()(attn, **kwargs),
                "changed": attn.processor(attn, **changed)}

    results = calls_inside_the_forward(model, mochi_forward, attn, mochi_inputs(masks=masks), calls)
    (video, text), (stock_video, stock_text) = results["out"], results["stock"]
    assert attn.processor.last_path == "sparse:reference"
    torch.testing.assert_close(text, stock_text, **TOL64)
    assert (video - stock_video).abs().max() > 1e-3  # the video queries did skip keys
    for changed, unchanged in zip(results["changed"], results["out"]):
        torch.testing.assert_close(changed, unchanged, **TOL64)


def test_mochi_trains_sparse_with_gradient_checkpointing_as_without():
    """The DSV schedule on Mochi with padded prompts: stage 2 with every layer sparse, the same gradients with
    diffusers' gradient checkpointing (each block recomputed with its forward's grid and mask) as without."""
    base, inputs = tiny_mochi(), mochi_inputs()
    assert_same_grads(sparse_grads(base, mochi_forward, inputs, True),
                      sparse_grads(base, mochi_forward, inputs, False), TOL64)


def test_mochi_bad_inputs_raise_clear_errors():
    model = tiny_mochi()
    attn = model.transformer_blocks[0].attn1
    with pytest.raises(TypeError, match="LTXVideoTransformer3DModel and MochiTransformer3DModel, got Linear"):
        install_dsv(torch.nn.Linear(2, 2), cfg("dsv"))
    stock, attn.processor = attn.processor, CogVideoXAttnProcessor2_0()
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn1 runs CogVideoXAttnProcessor2_0, expected "
                                         "diffusers' MochiAttnProcessor2_0"):
        install_dsv(model, cfg("dsv"))
    assert not hasattr(model, "dsv_controller")  # a refused install changes nothing
    attn.processor = stock
    install_dsv(model, cfg("oracle"))
    _sparse_quarter(model)
    with pytest.raises(ValueError, match="height=7 is not divisible by the model's patch extent 2"):
        mochi_forward(model, (torch.randn(1, 4, 2, 7, 8, dtype=torch.float64),
                              torch.randn(1, 7, 32, dtype=torch.float64), torch.ones(1, 7, dtype=torch.bool)))

    def bad(kwargs):
        seq_len = kwargs["hidden_states"].shape[1]
        key_mask = torch.ones(2, 1, 1, seq_len + 7, dtype=torch.bool)  # HunyuanVideo's form, not Mochi's
        cos, sin = kwargs["image_rotary_emb"]
        return {"key mask": dict(attention_mask=key_mask), "no mask": dict(attention_mask=None),
                "rotary [S, D]": dict(image_rotary_emb=(cos.flatten(1), sin.flatten(1))),
                "no text": dict(encoder_hidden_states=None)}

    errors = processor_errors(model, mochi_forward, attn, mochi_inputs(), bad)
    prompt_mask = ("MochiDSVProcessor: attention_mask must be the prompt mask of encoder_hidden_states, shape "
                   "[B, L] = [2, 7]")
    assert errors["key mask"].startswith(prompt_mask) and errors["key mask"].endswith("got (2, 1, 1, 71)")
    assert errors["no mask"].startswith(prompt_mask) and errors["no mask"].endswith("got None")
    assert "image_rotary_emb must be (cos, sin), each of shape [64, 2, 8]" in errors["rotary [S, D]"]
    assert "encoder_hidden_states (the text tokens [B, L, C_text]) is required" in errors["no text"]


def test_mochi_dsv_state_round_trips_through_save_pretrained(tmp_path):
    assert_dsv_state_round_trips(tiny_mochi(), mochi_forward, mochi_inputs(), tmp_path,
                          "transformer_blocks.0.attn1.processor.predictor.")


def _mochi_bf16_errors(device: str) -> dict:
    """Relative errors against float32 of a bf16 Mochi with DSV keeping every key on its sparse path, and of the
    stock bf16 model (same weights): `model`, output and input gradient together; `layer`, the first joint
    attention's video and text outputs on the model's inputs with the second sample's padded text tokens scaled
    100x (attending them would show). Head dim 64, 2x4x4 cubes (32-token groups and key blocks), a 4x8x8 grid.
    Also `paths`, the DSV layers' attention paths."""
    torch.manual_seed(0)
    reference = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=64, num_layers=2, pooled_projection_dim=24,
        in_channels=4, text_embed_dim=32, time_embed_dim=16, max_sequence_length=7,
    )
    with torch.no_grad():
        # Frequencies that bf16 holds exactly: the bf16 copies build the float32 reference's rotary tables.
        reference.pos_frequencies.copy_(torch.randn_like(reference.pos_frequencies).bfloat16())
    reference.to(device)
    inputs = tuple(t.to(device) for t in _as(torch.float32, mochi_inputs(size=16)))
    return bf16_joint_errors(reference, mochi_forward, inputs, "transformer_blocks.0.attn1", MochiAttnProcessor2_0,
                             _scale_second_sample_padding)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mochi_runs_its_joint_sparse_attention_on_the_triton_kernels():
    """The valid text key blocks appended to each group's row, one sample at a time where the prompts are padded
    unequally, through the Triton kernels: keeping every key, the bf16 model and layer are as close to float32 as
    stock bf16 ones."""
    assert_as_close_as_stock_bf16(_mochi_bf16_errors("cuda"), layers=2)
