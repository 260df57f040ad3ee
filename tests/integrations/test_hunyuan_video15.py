"""DSV installed in diffusers' HunyuanVideo 1.5 transformer, against the unpatched model (same weights)."""

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers integration needs `pip install 'dsv[integrations]'`")

from diffusers import HunyuanVideo15Transformer3DModel  # noqa: E402
from diffusers.models.attention_processor import MochiAttnProcessor2_0  # noqa: E402
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0  # noqa: E402

from dsv.integrations.diffusers import HunyuanVideo15DSVProcessor, install_dsv  # noqa: E402
from tests.integrations.test_diffusers import (  # noqa: E402
    TOL64,
    _as,
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
    processor_errors,
    sparse_grads,
)

# TOL64 (float64; DSV only sums the keys in another order) holds for HunyuanVideo 1.5 too: its float32 RMS norms and
# rotary tables round the same values in the patched and the stock model.

# Masks of the two samples' prompt tokens (4) and ByT5 tokens (2): the second sample padded in both (as tokenizers
# pad), or no token padded. With the one image token (invalid for text-to-video, whose image_embeds are zero), the
# model's text stream is 7 tokens (a partial key block of 8), each sample's valid ones first.
MASKS = {
    "padded": (((1, 1, 1, 1), (1, 1, 0, 0)), ((1, 1), (1, 0))),
    "unpadded": (((1, 1, 1, 1), (1, 1, 1, 1)), ((1, 1), (1, 1))),
}
TEXT_TOKENS = 7


def tiny_hunyuan_video15(patch_size_t: int = 1) -> HunyuanVideo15Transformer3DModel:
    """Two dual-stream blocks of 2 heads × 16 (rotary axes 4 + 6 + 6), one refiner block, spatial patch 2, in
    float64."""
    return HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
        mlp_ratio=2.0, patch_size=2, patch_size_t=patch_size_t, text_embed_dim=32, text_embed_2_dim=16,
        image_embed_dim=16, rope_axes_dim=(4, 6, 6),
    ).double()


def hv15_inputs(size: int = 8, masks: str = "padded", image: bool = False):
    """Latent [2, 4, F=4, size, size] → token grid (4, size / 2, size / 2); 4 prompt and 2 ByT5 tokens under
    `MASKS[masks]`; one image token, zero (text-to-video: the model masks it) unless `image`."""
    prompt_mask, byt5_mask = (torch.tensor(mask, dtype=torch.bool) for mask in MASKS[masks])
    image_embeds = torch.randn(2, 1, 16, dtype=torch.float64) if image else torch.zeros(2, 1, 16, dtype=torch.float64)
    return (torch.randn(2, 4, 4, size, size, dtype=torch.float64), torch.randn(2, 4, 32, dtype=torch.float64),
            prompt_mask, torch.randn(2, 2, 16, dtype=torch.float64), byt5_mask, image_embeds)


def hv15_forward(model, inputs):
    x, prompt, prompt_mask, byt5, byt5_mask, image_embeds = inputs
    # The timestep in the latent's dtype and on its device, as HunyuanVideo 1.5's pipelines pass it.
    timestep = torch.tensor([10.0, 600.0], dtype=x.dtype, device=x.device)
    return model(hidden_states=x, timestep=timestep, encoder_hidden_states=prompt, encoder_attention_mask=prompt_mask,
                 encoder_hidden_states_2=byt5, encoder_attention_mask_2=byt5_mask, image_embeds=image_embeds,
                 return_dict=False)[0]



# Text masks [2, 7] that the model's forward never builds (a caller of the attention module may): valid tokens that
# are not a leading run, and a sample with none at all.
LAYER_MASKS = {
    "holes": ((0, 1, 1, 0, 1, 0, 1), (1, 0, 0, 1, 0, 0, 1)),
    "no-valid-token": ((1, 0, 1, 1, 0, 0, 1), (0, 0, 0, 0, 0, 0, 0)),
}


def layer_mask(kwargs: dict, masks: str) -> dict:
    """The attention module's keyword arguments with the text mask `LAYER_MASKS[masks]` ("model": as they are)."""
    if masks == "model":
        return kwargs
    mask = kwargs["attention_mask"]
    return dict(kwargs, attention_mask=torch.tensor(LAYER_MASKS[masks], dtype=mask.dtype, device=mask.device))


@pytest.mark.parametrize("image", [False, True], ids=["text-to-video", "image-to-video"])
def test_hunyuan_video15_dense_mode_equals_unpatched_forward_and_backward(image):
    patched = assert_dense_mode_matches(tiny_hunyuan_video15(), hv15_forward, hv15_inputs(image=image), TOL64)
    assert all(isinstance(block.attn.processor, HunyuanVideo15DSVProcessor) for block in patched.transformer_blocks)
    # The text refiner's self-attention over the prompt tokens is not DSV's.
    assert not any(isinstance(module.processor, HunyuanVideo15DSVProcessor)
                   for name, module in patched.named_modules()
                   if name.startswith("context_embedder") and hasattr(module, "processor"))
    assert patched.dsv_controller.cfg.predictor_rotary == 6  # rotary embeddings position q and k


@pytest.mark.parametrize("patch_size_t", [1, 2])
def test_hunyuan_video15_token_grid_is_the_latent_under_its_patch(patch_size_t):
    """The latent [B, C, F, H, W] = [2, 4, 4, 8, 6] under the patch (patch_size_t, 2, 2): each layer runs on the grid
    (4 / patch_size_t, 4, 3), as the model's rotary tables lay the tokens out, and dense mode stays the stock model."""
    reference = tiny_hunyuan_video15(patch_size_t)
    model = copy.deepcopy(reference)
    install_dsv(model, cfg("dense"))
    inputs = (torch.randn(2, 4, 4, 8, 6, dtype=torch.float64), *hv15_inputs()[1:])
    grids = [calls_inside_the_forward(model, hv15_forward, block.attn, inputs, lambda kwargs, out, attn=block.attn: {
        "grid": attn.processor._grid.grid})["grid"] for block in model.transformer_blocks]
    assert grids == [(4 // patch_size_t, 4, 3)] * 2
    with torch.no_grad():
        torch.testing.assert_close(hv15_forward(model, inputs), hv15_forward(reference, inputs), **TOL64)


@pytest.mark.parametrize("masks", ["model", *LAYER_MASKS])
def test_hunyuan_video15_dense_layers_equal_the_stock_processor_in_float64(masks):
    """Each layer's video and text outputs are the stock processor's, the padded text positions included: their
    query attends to no key under the stock pairwise mask, which SDPA answers with zeros, so `to_add_out`'s bias."""
    model = tiny_hunyuan_video15()
    install_dsv(model, cfg("dense"))
    for block in model.transformer_blocks:
        attn = block.attn

        def calls(kwargs, out, attn=attn):
            kwargs = layer_mask(kwargs, masks)
            return {"out": attn.processor(attn, **kwargs), "stock": HunyuanVideo15AttnProcessor2_0()(attn, **kwargs),
                    "mask": kwargs["attention_mask"]}

        found = calls_inside_the_forward(model, hv15_forward, attn, hv15_inputs(), calls)
        assert attn.processor.last_path == "dense:sdpa"
        for got, want in zip(found["out"], found["stock"]):
            torch.testing.assert_close(got, want, **TOL64)
        padded = ~found["mask"]
        assert padded.any(1).all() and (~padded).any()  # every sample has padded text tokens, some have valid ones
        for text in (found["out"][1], found["stock"][1]):
            assert torch.equal(text[padded], attn.to_add_out.bias.expand(int(padded.sum()), -1))
            assert (text[~padded] != attn.to_add_out.bias).any(-1).all()


@pytest.mark.parametrize("masks, unmasked_calls", [("padded", 2), ("unpadded", 1)])
def test_hunyuan_video15_dense_layers_attend_without_a_mask(monkeypatch, masks, unmasked_calls):
    """Dense layers run each sample over its own valid text with no mask (SDPA's fast kernels take none; the stock
    pairwise mask is `[B, 1, S + L, S + L]`): one call for the batch where the samples' valid counts agree, one a
    sample where they differ."""
    model = tiny_hunyuan_video15()
    install_dsv(model, cfg("dense"))
    inputs = hv15_inputs(masks=masks, image=True)
    calls = attend_calls(model, hv15_forward, model.transformer_blocks[0].attn, inputs, monkeypatch)
    video_tokens = 4 * 4 * 4
    valid_counts = (1 + inputs[2].sum(1) + inputs[4].sum(1)).tolist()  # the image token, prompt and ByT5 tokens
    expected = ([(2, video_tokens + TEXT_TOKENS)] if unmasked_calls == 1 else
                [(1, video_tokens + n) for n in valid_counts])
    assert [(batch, seq) for batch, seq, _ in calls] == expected
    assert all(key_mask is None for *_, key_mask in calls)


@pytest.mark.parametrize("size, masks, image", [(8, "padded", False), (6, "padded", False), (8, "padded", True),
                                                (8, "unpadded", True), (8, "unpadded", False)],
                         ids=["padded", "odd-H-W-padded", "image-padded", "unpadded", "padded-alike"])
def test_hunyuan_video15_oracle_with_all_keys_equals_dense_forward_and_backward(size, masks, image):
    """With every video key kept, DSV's joint attention is the stock processor's: each sample's valid text keys
    attended, its padded ones not (one sample at a time where the counts differ; the masked image token of
    text-to-video pads both samples alike where nothing else does)."""
    assert_all_keys_sparse_matches(tiny_hunyuan_video15(), hv15_forward, hv15_inputs(size, masks, image), TOL64)


@pytest.mark.parametrize("masks", ["model", *LAYER_MASKS])
def test_hunyuan_video15_padded_text_keys_never_count_and_text_queries_stay_as_stock(masks):
    """Under a partial budget: the text outputs are the stock processor's (the padded positions' included), the video
    outputs skip keys, and the padded text tokens' contents change no output at all (the stock pairwise mask hides
    them as keys and as queries)."""
    model = tiny_hunyuan_video15()
    install_dsv(model, cfg("oracle"))
    _sparse_quarter(model)
    attn = model.transformer_blocks[0].attn

    def calls(kwargs, out):
        kwargs = layer_mask(kwargs, masks)
        changed = dict(kwargs, encoder_hidden_states=kwargs["encoder_hidden_states"].clone())
        changed["encoder_hidden_states"][~kwargs["attention_mask"]] = 100.0
        return {"out": attn.processor(attn, **kwargs), "stock": HunyuanVideo15AttnProcessor2_0()(attn, **kwargs),
                "changed": attn.processor(attn, **changed)}

    found = calls_inside_the_forward(model, hv15_forward, attn, hv15_inputs(), calls)
    (video, text), (stock_video, stock_text) = found["out"], found["stock"]
    assert attn.processor.last_path == "sparse:reference"
    torch.testing.assert_close(text, stock_text, **TOL64)
    assert (video - stock_video).abs().max() > 1e-3  # the video queries did skip keys
    for changed, unchanged in zip(found["changed"], found["out"]):
        torch.testing.assert_close(changed, unchanged, **TOL64)


def test_hunyuan_video15_trains_sparse_with_gradient_checkpointing_as_without():
    """The DSV schedule on HunyuanVideo 1.5 with padded prompts: stage 2 with every layer sparse, the same gradients
    with diffusers' gradient checkpointing (each block recomputed with its forward's grid and mask) as without."""
    base, inputs = tiny_hunyuan_video15(), hv15_inputs()
    assert_same_grads(sparse_grads(base, hv15_forward, inputs, True),
                      sparse_grads(base, hv15_forward, inputs, False), TOL64)


def test_hunyuan_video15_bad_inputs_raise_clear_errors():
    model = tiny_hunyuan_video15()
    attn = model.transformer_blocks[0].attn
    with pytest.raises(TypeError, match="HunyuanVideo15Transformer3DModel, LTXVideoTransformer3DModel and "
                                        "MochiTransformer3DModel, got Linear"):
        install_dsv(torch.nn.Linear(2, 2), cfg("dsv"))
    stock, attn.processor = attn.processor, MochiAttnProcessor2_0()
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn runs MochiAttnProcessor2_0, expected "
                                         "diffusers' HunyuanVideo15AttnProcessor2_0"):
        install_dsv(model, cfg("dsv"))
    assert not hasattr(model, "dsv_controller")  # a refused install changes nothing
    attn.processor = stock
    install_dsv(model, cfg("oracle"))
    _sparse_quarter(model)
    inputs = hv15_inputs()
    with pytest.raises(ValueError, match="width=7 is not divisible by the model's patch extent 2"):
        hv15_forward(model, (torch.randn(2, 4, 2, 8, 7, dtype=torch.float64), *inputs[1:]))

    def bad(kwargs):
        seq_len = kwargs["hidden_states"].shape[1]
        key_mask = torch.ones(2, 1, 1, seq_len + TEXT_TOKENS, dtype=torch.bool)  # HunyuanVideo's form, not 1.5's
        cos, sin = kwargs["image_rotary_emb"]
        return {"key mask": dict(attention_mask=key_mask), "no mask": dict(attention_mask=None),
                "rotary of another grid": dict(image_rotary_emb=(cos[:-16], sin[:-16])),
                "no text": dict(encoder_hidden_states=None)}

    errors = processor_errors(model, hv15_forward, attn, inputs, bad)
    text_mask = ("HunyuanVideo15DSVProcessor: attention_mask must be the prompt mask of encoder_hidden_states, shape "
                 "[B, L] = [2, 7], nonzero where a text token is valid (as HunyuanVideo15Transformer3DModel passes")
    assert errors["key mask"].startswith(text_mask) and errors["key mask"].endswith("got (2, 1, 1, 71)")
    assert errors["no mask"].startswith(text_mask) and errors["no mask"].endswith("got None")
    assert "image_rotary_emb must be (cos, sin), each of shape [64, 16]" in errors["rotary of another grid"]
    assert errors["no text"] == ("HunyuanVideo15DSVProcessor: encoder_hidden_states (the text tokens [B, L, C_text]) "
                                 "is required")


def test_hunyuan_video15_dsv_state_round_trips_through_save_pretrained(tmp_path):
    assert_dsv_state_round_trips(tiny_hunyuan_video15(), hv15_forward, hv15_inputs(), tmp_path,
                          "transformer_blocks.1.attn.processor.predictor.")


def _hunyuan_video15_bf16_errors(device: str) -> dict:
    """Relative errors against float32 of a bf16 HunyuanVideo 1.5 with DSV keeping every key on its sparse path, and
    of the stock bf16 model (same weights): `model`, output and input gradient together; `layer`, the first joint
    attention's video and text outputs on the model's inputs with the padded text tokens scaled 100x (attending
    them would show). Head dim 64, 2x4x4 cubes (32-token groups and key blocks), a 4x8x8 grid. Also `paths`, the
    DSV layers' attention paths."""
    torch.manual_seed(0)
    reference = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=2, num_refiner_layers=1,
        mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16,
        rope_axes_dim=(16, 24, 24),
    ).to(device)
    inputs = tuple(t.to(device) for t in _as(torch.float32, hv15_inputs(size=16)))
    return bf16_joint_errors(reference, hv15_forward, inputs, "transformer_blocks.0.attn",
                             HunyuanVideo15AttnProcessor2_0, _scale_padded_text)


def _scale_padded_text(kwargs) -> None:
    kwargs["encoder_hidden_states"][~kwargs["attention_mask"]] *= 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hunyuan_video15_runs_its_joint_sparse_attention_on_the_triton_kernels():
    """The valid text key blocks appended to each group's row, one sample at a time where the prompts are padded
    unequally, through the Triton kernels: keeping every key, the bf16 model and layer are as close to float32 as
    stock bf16 ones."""
    assert_as_close_as_stock_bf16(_hunyuan_video15_bf16_errors("cuda"), layers=2)
