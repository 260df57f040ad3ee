"""Every diffusers model DSV supports, with float32 weights under bf16 autocast (how one-GPU training runs): the
sparse path takes q, k and v in one dtype, whatever the model's own q/k norms return (diffusers' RMSNorm times a
float32 weight gives float32; so does CUDA autocast's `rms_norm` and `layer_norm`), and the model is as close to
float32 as the stock one under the same autocast."""

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers integration needs `pip install 'dsv[integrations]'`")

from tests.integrations import test_cosmos as cosmos  # noqa: E402
from tests.integrations import test_diffusers as base  # noqa: E402
from tests.integrations import test_hunyuan_video15 as hv15  # noqa: E402
from tests.integrations import test_mochi as mochi  # noqa: E402
from tests.integrations import test_wan_vace as vace  # noqa: E402

# name: (tiny model, its inputs, its forward); the models are made float32 below.
MODELS = {
    "wan": (base.tiny_wan, base.wan_inputs, base.wan_forward),
    "wan-vace": (vace.tiny_wan_vace, vace.vace_inputs, vace.vace_forward),
    "cogvideox": (base.tiny_cogvideox, base.cog_inputs, base.cog_forward),
    "hunyuan": (base.tiny_hunyuan, base.hunyuan_inputs, base.hunyuan_forward),
    "hunyuan-1.5": (hv15.tiny_hunyuan_video15, hv15.hv15_inputs, hv15.hv15_forward),
    "ltx": (base.tiny_ltx, base.ltx_inputs, base.ltx_forward),
    "mochi": (mochi.tiny_mochi, mochi.mochi_inputs, mochi.mochi_forward),
    "cosmos": (cosmos.tiny_cosmos, cosmos.cosmos_inputs, cosmos.cosmos_forward),
}


def _on(device: str, inputs):
    """`inputs` (tensors, or tuples of them) on `device`."""
    return tuple(_on(device, x) if isinstance(x, tuple) else x.to(device) if torch.is_tensor(x) else x for x in inputs)


def autocast_errors(name: str, device: str) -> tuple[float, float, list[str]]:
    """`bf16_model_errors` under autocast of the model `name` on `device`, and its DSV layers' attention paths."""
    make, inputs, forward = MODELS[name]
    torch.manual_seed(0)
    reference = make().float().to(device)
    patched, (dsv_error, stock_error) = base.bf16_model_errors(
        reference, forward, _on(device, base._as(torch.float32, inputs())), autocast=True)
    return dsv_error, stock_error, [layer.last_path for layer in patched.dsv_controller.layers]


def assert_as_close_as_stock(dsv_error: float, stock_error: float) -> None:
    # Both compute attention in bf16 against float32; DSV sums in another order: within twice the stock error, plus
    # one bf16 eps (2^-8) for a stock error near zero.
    assert dsv_error <= 2 * stock_error + 2**-8, (dsv_error, stock_error)


@pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning")
@pytest.mark.parametrize("name", list(MODELS))
def test_the_sparse_path_runs_under_autocast_with_float32_weights(name):
    dsv_error, stock_error, paths = autocast_errors(name, "cpu")
    assert paths == ["sparse:reference"] * len(paths)
    assert_as_close_as_stock(dsv_error, stock_error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(MODELS))
def test_the_triton_kernels_run_under_autocast_with_float32_weights(name):
    """On CUDA, autocast itself runs `layer_norm` (CogVideoX's q/k norms) and, from torch 2.12, `rms_norm` (Wan's,
    LTX-Video's) in float32."""
    dsv_error, stock_error, paths = autocast_errors(name, "cuda")
    assert paths == ["sparse:triton"] * len(paths)
    assert_as_close_as_stock(dsv_error, stock_error)
