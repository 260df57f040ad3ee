"""torch.compile(fullgraph=True) of DSV models in training: same results as eager, no per-step recompiles.

A compiled block and its eager twin (same weights) train side by side through the stage switch; every step
compares outputs, gradients and the DSV state. `unique_graphs` counts what dynamo compiled: one graph per
dispatch (dense, sparse), never one per step. On the CPU the blocks compile with the "aot_eager" backend:
dynamo captures the graph and AOTAutograd traces forward and backward, which is where a graph break, a
data-dependent shape or a per-step guard shows. Inductor compiles only the attention layer of one mode
here: its C++ kernels take ~12 s on a two-core CI machine for the layer and ~18 s for a whole block, per
graph. The GPU test compiles whole blocks with Inductor.
"""

import copy
import types
import warnings
from typing import NamedTuple

import pytest
import torch

from dsv.modules.config import AttentionConfig
from dsv.modules.controller import DSVController
from dsv.modules.dit import DiTBlock, ModelConfig, VideoDiT, flow_matching_loss
from tests import assert_opcheck_passes

HAS_CUDA = torch.cuda.is_available()
GRID = (4, 4, 4)
STEPS = 5
# Graphs per mode over STEPS: dsv and oracle compile a dense graph in stage 1 and a sparse one after the
# switch; window runs sparse from the start, dense never does. Re-dispatches in stage 2 change the per-head
# budgets (host state read inside the runtime ops), which must not recompile.
GRAPHS = {"dsv": 2, "oracle": 2, "window": 1, "dense": 1}


def attention_config(mode: str, **overrides) -> AttentionConfig:
    # dsv switches after step 1 (max_stage1_steps), oracle after its first profiling step (step 0); every
    # block goes sparse, and stage 2 profiles and re-dispatches every other step. The recall target moves
    # the budget at every profiling step (a buffer the compiled update op mutates).
    return AttentionConfig(**{"mode": mode, "cube": (2, 2, 2), "sample_stride": 4, "max_stage1_steps": 2,
                              "profile_every_stage1": 1, "profile_every_stage2": 2, "sparse_threshold": 0.0,
                              "recall_target": 0.95, **overrides})


class Block(torch.nn.Module):
    """A DiT block with its controller, as a model holds them."""

    def __init__(self, cfg: AttentionConfig, hidden: int = 32, heads: int = 2):
        super().__init__()
        self.block = DiTBlock(ModelConfig(hidden=hidden, heads=heads), cfg)
        self.controller = DSVController(cfg).attach(self)
        # DiT zero-inits the output paths (every block starts as the identity); gradients would be zero.
        torch.nn.init.normal_(self.block.attn.to_out.weight, std=0.1)
        torch.nn.init.normal_(self.block.mlp[-1].weight, std=0.1)


def dsv_state(layer) -> dict[str, torch.Tensor]:
    state = {name: getattr(layer, name).clone() for name in ("loss_ema", "sparsity_ema", "recall_ema", "keep_boost")}
    if layer.predictor is not None:
        state |= {f"predictor.{n}": p.detach().clone() for n, p in layer.predictor.named_parameters()}
    return state


def train_step(model: Block, forward, x: torch.Tensor, t_mod: torch.Tensor, grid, step: int) -> dict:
    """One controller step: forward, backward of a fixed weighting of the output, end of step."""
    model.controller.begin_step(step)
    x = x.clone().requires_grad_(True)
    out = forward(x, t_mod, grid)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    record = {"out": out.detach(), "dx": x.grad} | {f"grad.{n}": p.grad.clone()
                                                     for n, p in model.named_parameters() if p.grad is not None}
    record |= dsv_state(model.block.attn)
    model.zero_grad(set_to_none=True)
    model.controller.end_step()
    return record


def assert_fp64_close(actual: dict, expected: dict, step: int) -> None:
    # float64 end to end: a compiled graph only reorders sums (errors ~1e-15 relative); 1e-9 of each
    # tensor's scale leaves six orders of headroom, while another selection or a missed predictor step
    # changes values by orders of magnitude more. NaN marks EMAs never measured, on both sides alike.
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        scale = want.nan_to_num().abs().max().item()
        torch.testing.assert_close(actual[name], want, rtol=1e-9, atol=1e-9 * scale, equal_nan=True,
                                   msg=lambda m, name=name: f"step {step}, {name}: {m}")


class Run(NamedTuple):
    records: list[tuple[dict, dict]]  # (eager, compiled) per compared step
    graphs: int  # compiled by dynamo
    budgets: set[tuple[float, ...]]  # per-head kept fractions seen while sparse
    eager: Block
    compiled: Block
    forward: object  # the compiled model's forward


def compile_and_train(mode: str, backend: str, eager_steps: int = 0, attention_only: bool = False,
                      path: str = "sparse:reference", **cfg_overrides) -> Run:
    """Train an eager block for `eager_steps`, then it and a copy with the block (or only its attention)
    compiled side by side up to `STEPS`, ending on attention `path`."""
    eager = Block(attention_config(mode, **cfg_overrides)).double()
    for step in range(eager_steps):
        train_step(eager, eager.block, torch.randn(2, 64, 32).double(), torch.randn(2, 6, 32).double(), GRID, step)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if attention_only:
        compiled.block.attn.compile(backend=backend, fullgraph=True)
        forward = compiled.block
    else:
        forward = torch.compile(compiled.block, backend=backend, fullgraph=True)
    records, budgets = [], set()
    for step in range(eager_steps, STEPS):
        x, t_mod = torch.randn(2, 64, 32).double(), torch.randn(2, 6, 32).double()
        records.append((train_step(eager, eager.block, x, t_mod, GRID, step),
                        train_step(compiled, forward, x, t_mod, GRID, step)))
        assert compiled.controller.current_stage == eager.controller.current_stage
        if compiled.block.attn.runs_sparse():
            budgets.add(tuple(compiled.block.attn._keep_fraction_host))
    assert compiled.block.attn.last_path == eager.block.attn.last_path == path
    return Run(records, torch._dynamo.utils.counters["stats"]["unique_graphs"], budgets, eager, compiled, forward)


@pytest.mark.parametrize("mode", ["dsv", "window", "oracle", "dense"])
def test_block_compiles_fullgraph_and_matches_eager(mode):
    path = "dense:sdpa" if mode == "dense" else "sparse:reference"
    run = compile_and_train(mode, "aot_eager", path=path)
    for step, (eager, compiled) in enumerate(run.records):
        assert_fp64_close(compiled, eager, step)
    assert run.graphs == GRAPHS[mode]
    if mode in ("dsv", "oracle"):  # the re-dispatches changed the budgets, without a recompile
        assert len(run.budgets) > 1
    if mode == "dsv":  # the compiled update op moved the recall boost (compared with eager above)
        assert run.compiled.block.attn.keep_boost.abs().sum() > 0
    # Inference compiles too (selection only, no learning): one more graph, since dynamo guards on grad mode
    # and on `training`.
    for model in (run.eager, run.compiled):
        model.eval()
    x, t_mod = torch.randn(2, 64, 32).double(), torch.randn(2, 6, 32).double()
    with torch.no_grad():
        assert_fp64_close({"out": run.forward(x, t_mod, GRID)}, {"out": run.eager.block(x, t_mod, GRID)}, STEPS)
    assert run.compiled.block.attn.last_path == path


def test_block_that_stays_dense_keeps_its_graph_across_the_switch():
    run = compile_and_train("dsv", "aot_eager", path="dense:sdpa", sparse_threshold=1.0)
    for step, (eager, compiled) in enumerate(run.records):
        assert_fp64_close(compiled, eager, step)
    assert run.graphs == 1


def test_attention_compiles_with_inductor():
    # Compiled from stage 2 on (the switch is after step 1): one graph, the sparse one, holding both runtime
    # ops and the sparse attention; its re-dispatches at steps 2 and 4 change the budgets, not the graph.
    run = compile_and_train("dsv", "inductor", eager_steps=2, attention_only=True)
    for step, (eager, compiled) in enumerate(run.records, start=2):
        assert_fp64_close(compiled, eager, step)
    assert run.graphs == 1 and len(run.budgets) > 1


@pytest.mark.parametrize("how", ["whole model", "each block, activation checkpointing"])
def test_video_dit_compiles_and_matches_eager(how):
    """The whole VideoDiT in one graph, or each block on its own (the blocks then share their graphs:
    the runtime ops take the layer as a tensor, not as a constant of the graph). The eager reference runs
    without activation checkpointing, so that a recompute selecting other keys cannot cancel out."""
    cfg = attention_config("dsv")
    model_cfg = ModelConfig(hidden=32, heads=2, depth=3, patch=(1, 2, 2))
    eager = VideoDiT(model_cfg, cfg).double()
    for block in eager.blocks:  # as in Block: non-zero output paths
        torch.nn.init.normal_(block.attn.to_out.weight, std=0.1)
        torch.nn.init.normal_(block.mlp[-1].weight, std=0.1)
    torch.nn.init.normal_(eager.final_linear.weight, std=0.1)
    compiled = copy.deepcopy(eager)
    compiled.cfg.activation_checkpointing = how.endswith("checkpointing")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if how == "whole model":
        forward = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    else:
        for block in compiled.blocks:
            block.compile(backend="aot_eager", fullgraph=True)
        forward = compiled
    for step in range(STEPS):
        x0 = torch.randn(2, 3, 4, 8, 8, dtype=torch.float64)
        noise, t = torch.randn_like(x0), torch.rand(2, dtype=torch.float64)
        records = []
        for model, fn in ((eager, eager), (compiled, forward)):
            model.controller.begin_step(step)
            loss = flow_matching_loss(fn, x0, t, noise)
            loss.backward()
            records.append({"loss": loss.detach()} | {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()
                                                      if p.grad is not None}
                           | {f"{i}.{k}": v for i, layer in enumerate(model.controller.layers)
                              for k, v in dsv_state(layer).items()})
            model.zero_grad(set_to_none=True)
            model.controller.end_step()
        assert_fp64_close(records[1], records[0], step)
    assert [layer.last_path for layer in compiled.controller.layers] == ["sparse:reference"] * 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == GRAPHS["dsv"]


@pytest.mark.parametrize("mode", ["dsv", "window"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no grad"])
def test_compiled_block_rejects_non_finite_input(mode, grad):
    """A graph cannot branch on values, so the finite check runs inside the runtime ops: the selection's
    (window: sparse from the start) or the update's (dsv in stage 1: dense)."""
    model = Block(attention_config(mode))
    forward = torch.compile(model.block, backend="aot_eager", fullgraph=True)
    x, t_mod = torch.randn(1, 64, 32), torch.randn(1, 6, 32)
    x[0, 5, 3] = float("inf")
    model.controller.begin_step(0)
    with torch.set_grad_enabled(grad), pytest.raises(FloatingPointError, match="NaN or Inf"):
        forward(x, t_mod, GRID)


def test_compiled_block_runs_a_simple_observer():
    """A measurement hook that only records what it sees traces into a fullgraph-compiled block (the eager
    layer's recompute check, a graph task id, is not asked there)."""
    model = Block(attention_config("dsv"))
    seen = []
    model.block.attn.observer = lambda layer, hidden, q, k, grid: seen.append(tuple(q.shape))
    forward = torch.compile(model.block, backend="eager", fullgraph=True)
    model.controller.begin_step(0)
    with torch.no_grad():
        forward(torch.randn(1, 64, 32), torch.randn(1, 6, 32), GRID)
    assert seen and seen[0][2] == 64


def test_runtime_ops_pass_opcheck():
    """Schema, fake (meta) implementation and autograd registration of `dsv::layer_select/layer_update`."""
    model = Block(attention_config("dsv", max_stage1_steps=1))
    layer = model.block.attn
    model.controller.begin_step(0)
    model.block(torch.randn(2, 64, 32), torch.randn(2, 6, 32), GRID).sum().backward()
    model.controller.end_step()  # stage 2, sparse
    model.controller.begin_step(1)
    hidden = torch.randn(2, 64, 32)
    q, k = (torch.randn(2, 2, 64, 16, requires_grad=True) for _ in range(2))
    # Not training: the selection is then free of side effects, which opcheck's repeated calls need.
    select_args = (layer._runtime_id, hidden, q, k, list(GRID), layer.cfg.group_size, False, False, True, None)
    assert_opcheck_passes(torch.ops.dsv.layer_select.default, select_args)
    indices, _ = torch.ops.dsv.layer_select(*select_args)
    assert_opcheck_passes(torch.ops.dsv.layer_update.default,
                          (layer._runtime_id, hidden, q, k, indices, list(GRID), True, True, None, layer.loss_ema,
                           layer.sparsity_ema, layer.recall_ema, layer.keep_boost))


# ----------------------------------------------------------------------------------------------------------
# GPU: Inductor, bf16 autocast, the Triton kernels
# ----------------------------------------------------------------------------------------------------------

# Both sides round every matmul output to bf16 (eps 2^-8); the compiled graph fuses the pointwise ops in
# between and so rounds in other places: a few eps of relative L2 error, here 4.
BF16_REL_TOL = 4 * 2**-8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["dsv", "window"])
def test_block_compiles_on_gpu_with_triton_kernels(mode):
    # Cubes of 32 tokens (the Triton kernels take powers of two >= 16). dsv keeps every key block: bf16
    # rounding differences between the two sides could otherwise flip a near-tied selection, which is not
    # what this test is about; window mode covers a selection that drops keys. Without the speed model the
    # dispatch sends the block sparse: at 256 tokens the model would keep it dense (sparse pays at long
    # sequences only), and this test is about the compiled sparse path.
    grid = (4, 8, 8)
    cfg = attention_config(mode, cube=(2, 4, 4), keep_floor_blocks=8, speed_dispatch=False)
    eager = Block(cfg, hidden=128, heads=2).cuda()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    forward = torch.compile(compiled.block, fullgraph=True)
    for step in range(STEPS):
        x, t_mod = torch.randn(2, 256, 128, device="cuda"), torch.randn(2, 6, 128, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = train_step(eager, eager.block, x, t_mod, grid, step)
            got = train_step(compiled, forward, x, t_mod, grid, step)
        for name in ("out", "dx", "grad.block.attn.to_qkv.weight", "grad.block.mlp.0.weight"):
            assert rel_err(got[name], want[name]) < BF16_REL_TOL, (step, name, rel_err(got[name], want[name]))
    assert compiled.block.attn.last_path == eager.block.attn.last_path == "sparse:triton"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == GRAPHS[mode]


def test_compiled_forward_does_not_warn_about_the_slow_path(monkeypatch):
    """`warnings.warn` cannot be traced in a fullgraph block: while compiling, the slow-path warning stays
    silent (and its once-flag unread); an eager forward still warns."""
    layer = Block(attention_config("window"), hidden=32, heads=2).block.attn
    layer._last_backend, layer.backend_reason = "reference", "head dim 8: the kernels take 16 or more"
    fake_cuda_q = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # all the check reads
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer._warn_if_slow(fake_cuda_q)
    assert not layer._warned_backend
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with pytest.warns(UserWarning, match="slow PyTorch reference"):
        layer._warn_if_slow(fake_cuda_q)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fullgraph_block_on_the_reference_path_compiles_on_gpu():
    # 8-token cubes take the PyTorch reference on a GPU (the kernels need 16 or more): compiled from the first
    # forward, the layer's slow-path warning must not break the fullgraph compile (it did: warnings.warn is
    # not traceable).
    grid = (4, 8, 8)
    block = Block(attention_config("window", cube=(2, 2, 2), speed_dispatch=False), hidden=64, heads=2).cuda()
    torch._dynamo.reset()
    forward = torch.compile(block.block, fullgraph=True)
    x, t_mod = torch.randn(2, 256, 64, device="cuda"), torch.randn(2, 6, 64, device="cuda")
    got = train_step(block, forward, x, t_mod, grid, 0)
    assert all(torch.isfinite(got[name]).all() for name in got if name in ("out", "dx") or name.startswith("grad."))
    assert block.block.attn.last_path == "sparse:reference"
    assert block.block.attn.state_summary()["backend_reason"]  # why not the kernels, for the trainer's log
