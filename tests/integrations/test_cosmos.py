"""DSV installed in diffusers' Cosmos transformer (the `attn1` of its blocks), against the unpatched model (same
weights)."""

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers integration needs `pip install 'dsv[integrations]'`")

from diffusers import CosmosTransformer3DModel  # noqa: E402
from diffusers.models.attention_processor import AttnProcessor2_0  # noqa: E402
from diffusers.models.transformers.transformer_cosmos import (  # noqa: E402
    CosmosAttnProcessor2_0,
    CosmosAttnProcessor2_5,
)

from dsv.integrations.diffusers import CosmosDSVProcessor, install_dsv  # noqa: E402
from tests.integrations.test_diffusers import (  # noqa: E402
    TOL64,
    _as,
    _sparse_quarter,
    assert_all_keys_sparse_matches,
    assert_dense_mode_matches,
    assert_dsv_state_round_trips,
    assert_same_grads,
    bf16_model_errors,
    cfg,
    processor_errors,
    sparse_grads,
)

# TOL64 (float64; DSV only sums the keys in another order) holds for Cosmos too: its float32 RMS norms, rotary
# embedding and positional-embedding norm round the same values in the patched and the stock model.


def tiny_cosmos(head_dim: int = 16, patch_size=(1, 2, 2), image_context: bool = False) -> CosmosTransformer3DModel:
    """Two blocks of 2 heads x `head_dim` in float64, whose input is a 3-channel latent and its condition-mask
    channel (no padding-mask channel: that one needs torchvision). With a random learnable positional embedding (zero
    in a fresh model), kept in float32 as diffusers loads it (`_keep_in_fp32_modules`; its forward takes a float32
    norm that a float64 input refuses); or, with `image_context`, a cross-attention to text and image tokens (Cosmos
    2.5's `CosmosAttnProcessor2_5`) and no learnable positional embedding."""
    image = dict(img_context_dim_in=24, img_context_num_tokens=3, img_context_dim_out=2 * head_dim) \
        if image_context else {}
    model = CosmosTransformer3DModel(
        in_channels=4, out_channels=3, num_attention_heads=2, attention_head_dim=head_dim, num_layers=2,
        mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=16, max_size=(8, 16, 16), patch_size=patch_size,
        concat_padding_mask=False, extra_pos_embed_type=None if image_context else "learnable", **image,
    ).double()
    if not image_context:
        model.learnable_pos_embed.float()
        with torch.no_grad():
            for table in model.learnable_pos_embed.parameters():
                table.normal_()
    return model


def cosmos_inputs(frames: int = 4, size: int = 8, image_context: bool = False):
    """Latent [2, 3, F, size, size] → token grid (F, size / 2, size / 2) under patch (1, 2, 2); its condition mask
    [2, 1, F, size, size] of zeros and ones; 5 text tokens, the second sample's last 2 masked for the
    cross-attention. With `image_context`: (text, 3 image tokens) and no mask (Cosmos 2.5's cross-attention takes a
    pair of masks)."""
    text = torch.randn(2, 5, 32, dtype=torch.float64)
    context, mask = ((text, torch.randn(2, 3, 24, dtype=torch.float64)), None) if image_context else \
        (text, torch.tensor([[True] * 5, [True] * 3 + [False] * 2]))
    condition = torch.randint(0, 2, (2, 1, frames, size, size)).to(torch.float64)
    return (torch.randn(2, 3, frames, size, size, dtype=torch.float64),
            torch.tensor([10.0, 600.0], dtype=torch.float64), context, mask, condition)


def cosmos_forward(model, inputs):
    x, t, context, mask, condition = inputs
    return model(hidden_states=x, timestep=t, encoder_hidden_states=context, attention_mask=mask, fps=24,
                 condition_mask=condition, return_dict=False)[0]


@pytest.mark.parametrize("patch_size, frames", [((1, 2, 2), 4), ((2, 2, 2), 8)], ids=["patch-1x2x2", "patch-2x2x2"])
def test_cosmos_dense_mode_equals_unpatched_forward_and_backward(patch_size, frames):
    model = tiny_cosmos(patch_size=patch_size)
    patched = assert_dense_mode_matches(model, cosmos_forward, cosmos_inputs(frames), TOL64)
    names = [name for name, module in patched.named_modules() if isinstance(module, CosmosDSVProcessor)]
    assert names == ["transformer_blocks.0.attn1.processor", "transformer_blocks.1.attn1.processor"]
    assert all(type(block.attn2.processor) is CosmosAttnProcessor2_0 for block in patched.transformer_blocks)
    assert patched.dsv_controller.cfg.predictor_rotary == 6  # Cosmos's rotary embedding positions q and k


def test_cosmos_with_image_context_keeps_its_cross_attention_processor():
    """Cosmos 2.5's blocks cross-attend to text and image tokens through another processor: it is left as it is."""
    model = tiny_cosmos(image_context=True)
    patched = assert_dense_mode_matches(model, cosmos_forward, cosmos_inputs(image_context=True), TOL64)
    assert all(type(block.attn2.processor) is CosmosAttnProcessor2_5 for block in patched.transformer_blocks)
    assert all(isinstance(block.attn1.processor, CosmosDSVProcessor) for block in patched.transformer_blocks)


@pytest.mark.parametrize("frames, size", [(4, 8), (3, 6)], ids=["whole-cubes", "partial-cubes"])
def test_cosmos_oracle_with_all_keys_equals_dense_forward_and_backward(frames, size):
    assert_all_keys_sparse_matches(tiny_cosmos(), cosmos_forward, cosmos_inputs(frames, size), TOL64)


def test_cosmos_tokens_are_the_raster_order_of_the_grid_dsv_reads():
    """DSV groups token r of a layer as the patch at raster position r of the grid (T, H, W) it reads from the
    latent's shape: a patch embedding that copies each patch's first latent position (t, h, w) into the first three
    hidden channels shows where every token the blocks get comes from. Three unequal grid extents and an unequal
    patch: a swapped axis or patch extent would show."""
    patch, latent = (2, 1, 4), (4, 3, 16)
    model = tiny_cosmos(patch_size=patch)
    install_dsv(model, cfg("dense"))
    voxels = patch[0] * patch[1] * patch[2]  # the patch embedding's input is (channel, t, h, w) per token
    with torch.no_grad():
        model.patch_embed.proj.weight.zero_()
        for axis in range(3):  # latent channel `axis` holds the position along that axis
            model.patch_embed.proj.weight[axis, axis * voxels] = 1.0
    grids, tokens = [], {}
    for block in model.transformer_blocks:
        block.attn1.processor.observer = lambda layer, hidden, q, k, grid: grids.append(grid)
    model.transformer_blocks[0].register_forward_pre_hook(lambda module, args: tokens.update(block_input=args[0]))
    positions = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in latent), indexing="ij"))
    inputs = list(cosmos_inputs())
    inputs[0], inputs[-1] = positions.expand(2, 3, *latent), torch.zeros(2, 1, *latent, dtype=torch.float64)
    with torch.no_grad():
        cosmos_forward(model, inputs)
    grid = tuple(n // p for n, p in zip(latent, patch))
    assert grids == [grid, grid]
    raster = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).flatten(0, 2)
    expected = (raster * torch.tensor(patch)).to(torch.float64)  # each token's first latent position, raster order
    assert torch.equal(tokens["block_input"][0, :, :3], expected)


def test_cosmos_trains_sparse_with_gradient_checkpointing_as_without():
    """diffusers checkpoints each Cosmos block: each recomputed with its forward's grid."""
    base, inputs = tiny_cosmos(), cosmos_inputs()
    assert_same_grads(sparse_grads(base, cosmos_forward, inputs, True),
                      sparse_grads(base, cosmos_forward, inputs, False), TOL64)


def test_cosmos_dsv_state_round_trips_through_save_pretrained(tmp_path):
    # In float32: loading in float64 would keep the learnable positional embedding (`_keep_in_fp32_modules`) in
    # float32, so the loaded model's state would not be the saved one's bit for bit.
    assert_dsv_state_round_trips(tiny_cosmos().float(), cosmos_forward, _as(torch.float32, cosmos_inputs()), tmp_path,
                          "transformer_blocks.1.attn1.processor.predictor.")


def _hidden_states_by_keyword(attn) -> None:
    """Cosmos's blocks call `attn1(hidden_states, image_rotary_emb=...)`: pass hidden_states by keyword, so that a
    forward hook on the module sees every argument the processor gets in its keyword arguments."""
    attn.register_forward_pre_hook(lambda module, args, kwargs: ((), dict(kwargs, hidden_states=args[0]))
                                   if args else None, with_kwargs=True)


def test_cosmos_bad_inputs_raise_clear_errors():
    model = tiny_cosmos()
    with pytest.raises(TypeError, match="CogVideoXTransformer3DModel, CosmosTransformer3DModel, .* got Linear"):
        install_dsv(torch.nn.Linear(2, 2), cfg("dsv"))
    attn = model.transformer_blocks[1].attn1
    stock = attn.processor
    attn.set_processor(AttnProcessor2_0())
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.attn1 runs AttnProcessor2_0, expected diffusers' "
                                         "CosmosAttnProcessor2_0"):
        install_dsv(model, cfg("dsv"))
    assert not hasattr(model, "dsv_controller")  # a refused install changes nothing
    attn.set_processor(stock)
    # Fewer key/value heads than query heads (grouped-query attention, which the stock processor would repeat): DSV
    # attends key blocks per query head.
    narrow, attn.to_k = attn.to_k, torch.nn.Linear(32, 16, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"to_k and to_v must be as wide as to_q .* \{'to_q': 32, 'to_k': 16, "
                                         r"'to_v': 32\}"):
        install_dsv(model, cfg("dsv"))
    assert not hasattr(model, "dsv_controller")
    attn.to_k = narrow

    install_dsv(model, cfg("oracle"))
    _sparse_quarter(model)
    x, t, text, mask, condition = cosmos_inputs()
    with pytest.raises(ValueError, match="height=7 is not divisible by the model's patch extent 2"):
        cosmos_forward(model, (x[..., :7, :], t, text, mask, condition[..., :7, :]))

    _hidden_states_by_keyword(attn)

    def bad(kwargs):
        seq_len = kwargs["hidden_states"].shape[1]
        cos, sin = kwargs["image_rotary_emb"]
        return {"rotary of another grid": dict(image_rotary_emb=(cos[:-1], sin[:-1])),
                "mask": dict(attention_mask=torch.ones(2, 1, 1, seq_len, dtype=torch.bool)),
                "text": dict(encoder_hidden_states=text)}

    errors = processor_errors(model, cosmos_forward, attn, cosmos_inputs(), bad)
    assert attn.processor.last_path == "sparse:reference"  # the calls ran on the sparse path
    assert errors["rotary of another grid"] == (
        "CosmosDSVProcessor: image_rotary_emb must be (cos, sin), each of shape [64, 16] for this latent's 64 video "
        "tokens; got [(63, 16), (63, 16)]")
    self_attention = ("CosmosDSVProcessor is self-attention: encoder_hidden_states and attention_mask must be None (it "
                      "is installed on attn1 only)")
    assert errors["mask"] == errors["text"] == self_attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cosmos_runs_its_sparse_attention_on_the_triton_kernels():
    """Cosmos's self-attention through the Triton kernels, keeping every key: the bf16 model is as close to float32
    as the stock bf16 model."""
    torch.manual_seed(0)
    reference = tiny_cosmos(head_dim=64).float().cuda()
    inputs = tuple(t.cuda() for t in _as(torch.float32, cosmos_inputs(size=16)))
    patched, (dsv_error, stock_error) = bf16_model_errors(reference, cosmos_forward, inputs)
    assert [layer.last_path for layer in patched.dsv_controller.layers] == ["sparse:triton"] * 2
    # Both run in bf16 against float32; DSV sums in another order with its own kernels: within twice the stock
    # error, plus one bf16 eps (2^-8) for a stock error near zero.
    assert dsv_error <= 2 * stock_error + 2**-8, (dsv_error, stock_error)
