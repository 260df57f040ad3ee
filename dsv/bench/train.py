"""``dsv bench train``: training-step time of one model with dense, window (WA-L) and DSV stage-2 attention.

One process, one device. For each token grid and mode the same model (a recipe's: its `model.arch`, DSV's DiT or
a diffusers Wan transformer with DSV installed, and its shape, default the paper's 2.7B DiT: 32 blocks, 16 heads
× 128) is built on the device, and full training steps (bf16 autocast, activation checkpointing, AdamW) are timed
on random latents: throughput only, no quality. DSV runs in
stage 2 with a per-layer/per-head sparsity profile (the paper's measured 2.7B profile by default, or a
`dsv profile` JSON), dispatched by the same controller code as training. With a predictor update every
`learn_every_stage2` = k > 1 steps, DSV is timed over whole update periods (k steps from an update step, their
mean per step), so its ms/step carries the update's cost / k. DSV's overheads are timed apart: the predictor
update (steps with and without it), a profiling step (amortised over `profile_every_stage2`), and the
critical-KV estimation. `--set` takes the model and attention fields that the bench applies, and refuses
the others (the bench fixes the rest of the run: see `bench_config`).

The timed steps run without `attention.check_finite` (a device sync per step), so before any timing of each
mode at each token count a correctness gate must hold, or the command fails without a report: one untimed
step's loss and every parameter gradient are finite (`_finite_gate`), and where layers run sparse (window; DSV
in stage 2), the first sparse layer's sparse attention on its real inputs at the benchmark shape, with the
index that the layer builds, matches the float32 PyTorch reference forward and backward (`_sparse_gate`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dsv.bench.kernels import attention_flops, kept_pairs
from dsv.bench.profiling import write_op_profile
from dsv.bench.report_file import check_report_path, write_report
from dsv.cli import device_name, non_negative_int, positive_int
from dsv.modules.attention import model_parameters
from dsv.modules.dit import flow_matching_loss
from dsv.modules.predictor import LowRankPredictor
from dsv.ops import sparse_attention, sparse_attention_reference
from dsv.ops.grouping import check_cube_tiles
from dsv.parallel.planner import load_profile, paper_profile
from dsv.train.config import apply_overrides
from dsv.train.recipes import get_recipe
from dsv.train.trainer import build_model

MODES = ("dense", "window", "dsv")
DEFAULT_TOKENS = (32768, 65536)
DEFAULT_SPATIAL = 64
# Heads of the first sparse layer that the correctness gate compares with the float32 reference: the kernels
# treat every head alike, and the reference's cost grows with the heads compared.
GATE_HEADS = 2

# `--set` fields that the bench fixes itself, with the one value it runs: any other value is refused.
_FIXED = {
    "model.activation_checkpointing": (True, "the bench always checkpoints the blocks"),
    "attention.check_finite": (False, "the bench turns the per-step finite check (a device sync) off; its "
                               "correctness gate checks one untimed step instead"),
}
# Attention fields that the bench never lets act on what it times.
_NOT_APPLIED = {
    "attention.mode": "the bench runs every mode of --modes: pick them there",
    **{f"attention.{name}": "it schedules stage 1 only; the bench enters stage 2 itself after one stage-1 step"
       for name in ("min_stage1_steps", "max_stage1_steps", "switch_loss_threshold", "profile_every_stage1")},
}


def bench_config(recipe, overrides: list[str]):
    """The recipe's config with the `--set` overrides applied, refusing those that the bench would not apply:
    sections other than model and attention (batch 1, AdamW at a fixed learning rate and bf16 autocast on CUDA
    are the bench's own), attention fields that never act on the timed steps, and a field that the bench fixes
    set to another value than the one it runs (the last override of a field holds)."""
    for item in overrides:
        key = item.split("=", 1)[0]
        if "." not in key:
            continue  # malformed: apply_overrides says how
        section = key.split(".", 1)[0]
        if section not in ("model", "attention"):
            raise ValueError(f"--set {key}: dsv bench train applies model.* and attention.* overrides only; it runs "
                             "batch 1, AdamW and bf16 autocast on CUDA (fp32 on the CPU) whatever the recipe says")
        if key in _NOT_APPLIED:
            raise ValueError(f"--set {key}: not applied by dsv bench train: {_NOT_APPLIED[key]}")
    cfg = apply_overrides(recipe, overrides)
    for key in dict.fromkeys(item.split("=", 1)[0] for item in overrides):
        if key in _FIXED:
            value, why = _FIXED[key]
            section, name = key.split(".", 1)
            if getattr(getattr(cfg, section), name) != value:
                shown = str(value).lower() if isinstance(value, bool) else value
                raise ValueError(f"--set {key}: dsv bench train runs only {key}={shown}: {why}")
    return cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="dit_2p7b", help="model shape (its model/attention sections)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=None,
                        help=f"tokens per sample (default {' '.join(map(str, DEFAULT_TOKENS))})")
    parser.add_argument("--spatial", type=positive_int, default=None,
                        help=f"latent H = W in tokens; T = tokens / spatial² (default {DEFAULT_SPATIAL})")
    parser.add_argument("--grids", type=grid_spec, nargs="+", default=None, metavar="TxHxW",
                        help="token grids (frames x height x width, in tokens after the patch), e.g. 21x30x52 for "
                             "480x832 pixels and 81 frames through Wan's VAE and patch; instead of --tokens and "
                             "--spatial")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--profile", default="paper", help="'paper' or a JSON of per-layer per-head sparsity")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per mode (median reported)")
    parser.add_argument("--device", type=device_name, default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--op-profile", type=Path, default=None, metavar="FOLDER",
                        help="after timing, profile one more step of each run and write its top operators by "
                             "device time to FOLDER/<tokens>-<mode>.txt; on CUDA the report adds its GPU time by "
                             "kernel category")
    parser.add_argument("--memory-history", type=Path, default=None, metavar="FOLDER",
                        help="after timing, record the CUDA allocator's history over one more step of each "
                             "run (DSV: one update period; untimed, since recording every allocation's stack "
                             "slows it) and dump it to FOLDER/<tokens>-<mode>.pickle (pytorch.org/memory_viz)")


def grid_spec(text: str) -> tuple[int, int, int]:
    """`--grids` item: "TxHxW" of positive ints → (T, H, W)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected a token grid TxHxW of three positive ints (e.g. 21x30x52), "
                                         f"got {text!r}")
    return tuple(int(part) for part in parts)


def square_grid(tokens: int, spatial: int) -> tuple[int, int, int]:
    """The grid of `tokens` tokens with H = W = `spatial`: (tokens / spatial², spatial, spatial)."""
    if tokens % (spatial * spatial):
        raise ValueError(f"--tokens {tokens} is not a multiple of --spatial² = {spatial * spatial}")
    return tokens // (spatial * spatial), spatial, spatial


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _estimation_ms(run: _Run, device: torch.device) -> float:
    """Time of one step's key selection (low-rank projection and fused top-k) summed over the sparse
    layers: one step with an observer that times each sparse layer's `compute_index` on its own inputs,
    synchronised (the selection itself then runs as usual; a checkpointing recompute reuses it)."""
    times = []

    def observer(layer, hidden, q, k, grid):
        if layer.runs_sparse() and torch._C._current_graph_task_id() == -1:  # not in a recompute
            with torch.no_grad():
                times.append(_timed(lambda: layer.compute_index(hidden, q, k, grid), device))

    layers = run.model.controller.layers
    for layer in layers:
        layer.observer = observer
    try:
        run.step()
    finally:
        for layer in layers:
            layer.observer = None
    return sum(times)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    """Peak allocated GiB since the last reset (NaN off CUDA, where it is not tracked)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def _peak_requested_gib(device: torch.device) -> float:
    """Peak GiB that tensors requested since the last reset: the allocated peak without the allocator's
    rounding of each block (a block can exceed its request by up to 1 MiB, depending on what the cache
    held), which can differ between two runs that hold the same tensors. NaN off CUDA."""
    if device.type != "cuda":
        return float("nan")
    return torch.cuda.memory_stats(device).get("requested_bytes.all.peak", float("nan")) / 2**30


@contextlib.contextmanager
def _memory_history(folder: Path | None, name: str, device: torch.device):
    """Record the CUDA allocator's history (every allocation with its Python stack) while the body runs,
    then dump it to `folder/name.pickle`; a no-op without a folder or off CUDA."""
    if folder is None or device.type != "cuda":
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        yield
        torch.cuda.memory._dump_snapshot(str(folder / f"{name}.pickle"))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _timed_steps(run: _Run, args, name: str, device: torch.device, period: int = 1) -> tuple[float, float, float]:
    """Median ms per step of the timed steps (after warm-up; of whole periods of `period` steps, see
    `_Run.median_ms`) and their peak GiB, allocated and requested; then, if asked, the allocator history of
    one more period, untimed (recording every allocation's Python stack slows the steps it covers)."""
    run.warm_up(args.warmup)
    _reset_peak(device)  # after the warm-up, for every mode alike: the peaks of the timed steps
    ms = run.median_ms(0, args.steps, period=period)
    peaks = _peak_gib(device), _peak_requested_gib(device)
    if args.memory_history is not None:
        with _memory_history(args.memory_history, name, device):
            for _ in range(period):
                run.step()
    return ms, *peaks


class GateFailure(Exception):
    """A correctness gate did not hold: the steps that the bench would time compute NaN or wrong attention."""


class _Captured(Exception):
    """Raised by the sparse gate's observer with the first sparse layer's inputs: the rest of the forward is
    not needed."""


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `out` against `ref`, in float64; not finite when `out` is not."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gate_tolerance(dtype: torch.dtype) -> float:
    """Relative L2 error that the sparse attention of inputs in `dtype` may have against the float32 reference."""
    # Two units of eps: rounding the output to the dtype costs half an ulp, rounding P before P·V at most one more
    # (tests/ops/test_triton_kernels.py); at least 1e-5, as an fp32 kernel sums long rows in another order.
    return max(2 * torch.finfo(dtype).eps, 1e-5)


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _finite_gate(run: _Run) -> str:
    """One untimed step whose loss must be finite, and which must give every parameter that the optimizer steps
    (all but the predictors, which step themselves) a finite gradient, checked before the optimizer consumes
    them; returns the gate's line, raises `GateFailure` naming what is missing or not finite."""
    checked = {}
    stepped = {id(p) for p in model_parameters(run.model)}
    params = [(name, p) for name, p in run.model.named_parameters() if id(p) in stepped]

    def inspect(loss: torch.Tensor) -> None:
        missing = [name for name, p in params if p.grad is None]
        grads = [(name, p.grad) for name, p in params if p.grad is not None]
        # One host sync for all of them: the step is untimed, but the gate stays cheap at 2.7B parameters.
        finite = torch.stack([torch.isfinite(grad).all() for _, grad in grads]).tolist() if grads else []
        bad = [name for (name, _), ok in zip(grads, finite) if not ok]
        value = loss.item()
        if not math.isfinite(value) or bad or missing:
            problems = [f"one step's loss is {value}"]
            if bad:
                problems.append(f"non-finite gradients in {len(bad)} of {len(params)} parameters: {_names(bad)}")
            if missing:
                problems.append(f"no gradient in {len(missing)} of {len(params)} parameters: {_names(missing)}")
            raise GateFailure("; ".join(problems))
        checked.update(loss=value)

    run.step(inspect)
    return f"one step's loss {checked['loss']:.4f} and the gradients of all {len(params)} parameters finite"


def _sparse_gate(run: _Run) -> str:
    """The first sparse layer's sparse attention, forward and backward, against the float32 PyTorch reference, on
    that layer's inputs at the benchmark shape (one forward up to it, no gradients) with the index that the layer
    builds for them, on its first `GATE_HEADS` heads and random values and output gradients; returns the gate's
    line, raises `GateFailure` when the largest relative L2 error (of out, dq, dk, dv) exceeds `gate_tolerance`
    of the inputs' dtype or is not finite."""
    sparse = [layer for layer in run.model.controller.layers if layer.runs_sparse()]
    if not sparse:
        return "no layer runs sparse: no sparse-attention check"
    layer = sparse[0]
    heads = min(GATE_HEADS, layer.heads)

    def observer(_layer, hidden, q, k, grid):  # set on `layer` alone
        index = layer.compute_index(hidden, q, k, grid)
        index = dataclasses.replace(index, indices=index.indices[:, :heads].contiguous(),
                                    counts=index.counts[:, :heads].contiguous())
        raise _Captured(*(x[:, :heads].clone(memory_format=torch.contiguous_format) for x in (q, k)), index,
                        layer.sparse_backend)

    layer.observer = observer
    try:
        # No gradients: no predictor step and no selection kept for a recompute, so the state under test stays
        # as it is. Eager blocks: a compiled block cannot run the Python hook.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            run.loss()
    except _Captured as captured:
        q, k, index, backend = captured.args
    else:
        raise GateFailure(f"layer {layer.layer_index} runs sparse, but the forward never reached its key selection")
    finally:
        layer.observer = None
    generator = torch.Generator(q.device).manual_seed(2)
    v, grad_out = (torch.randn(q.shape, dtype=q.dtype, device=q.device, generator=generator) for _ in range(2))
    tolerance = gate_tolerance(q.dtype)
    what = (f"layer {layer.layer_index}'s sparse attention ({backend}, {str(q.dtype).removeprefix('torch.')}, "
            f"{heads} of {layer.heads} heads, its own index) against the float32 reference")
    # Forward first: an output that is already wrong (or not connected to the inputs) fails without a backward.
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    reference_inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = sparse_attention(*inputs, index, scale=layer.scale, backend=backend)
    ref = sparse_attention_reference(*reference_inputs, index, scale=layer.scale)
    errors = {"out": _relative_error(out.detach(), ref.detach())}
    if errors["out"] <= tolerance:  # a NaN error fails too
        # The backward too: the timed steps run it, and the kernels' dq and dk/dv passes are separate code.
        grads = torch.autograd.grad(out, inputs, grad_out)
        ref_grads = torch.autograd.grad(ref, reference_inputs, grad_out.float())
        errors |= {name: _relative_error(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)}
    worst = max(errors.values(), key=lambda e: math.inf if math.isnan(e) else e)
    detail = ", ".join(f"{name} {error:.2e}" for name, error in errors.items())
    if not worst <= tolerance:
        raise GateFailure(f"{what}: relative L2 error {worst:.2e} > {tolerance:.2e} ({detail})")
    return f"{what}: relative L2 error {worst:.2e} <= {tolerance:.2e} ({detail})"


def _tflops(row: dict) -> float:
    """A row's model TFLOP/s: its step's model FLOPs (`step_flops`) over its ms/step."""
    return (row["matmul_flops"] + row["attention_flops"]) / row["ms"] / 1e9


def _peaks_against_dense(rows: list[dict]) -> list[str]:
    """Each mode's peaks minus dense's at the same token count, in MiB: the table's GiB hide a few MiB."""
    dense = {r["tokens"]: r for r in rows if r["mode"] == "dense"}
    lines = []
    for r in rows:
        base = dense.get(r["tokens"])
        if base is None or r is base or math.isnan(r["peak_gib"]):
            continue
        allocated, requested = ((r[key] - base[key]) * 1024 for key in ("peak_gib", "peak_requested_gib"))
        lines.append(f"- {r['mode']} at {r['tokens']} tokens, peak against dense: {allocated:+.1f} MiB allocated, "
                     f"{requested:+.1f} MiB requested")
    return [""] + lines if lines else []


class _Run:
    """One model and optimizer at one token grid `(T, H, W)`, stepping on fixed random latents."""

    def __init__(self, cfg, mode: str, grid: tuple[int, int, int], device: torch.device):
        # No profiling while timing, in either stage (dense and window stay in stage 1).
        attention = dataclasses.replace(cfg.attention, mode=mode, check_finite=False, profile_every_stage1=10**9,
                                        profile_every_stage2=10**9, min_stage1_steps=0)
        model_cfg = dataclasses.replace(cfg.model, activation_checkpointing=True)
        shape = (1, model_cfg.in_channels, *(g * p for g, p in zip(grid, model_cfg.patch)))
        with torch.device(device):  # built on the device: a 2.7B model is not first made in host memory
            self.model = build_model(dataclasses.replace(cfg, model=model_cfg, attention=attention,
                                                         train=dataclasses.replace(cfg.train, seed=0)), device)
        self.optimizer = torch.optim.AdamW(model_parameters(self.model), lr=1e-4, fused=device.type == "cuda")
        gen = torch.Generator(device).manual_seed(1)
        self.x0 = torch.randn(shape, device=device, generator=gen)
        self.noise = torch.randn(shape, device=device, generator=gen)
        self.t = torch.rand(1, device=device, generator=gen)
        self.device = device
        self.step_index = 0

    def loss(self) -> torch.Tensor:
        """The flow-matching loss on the fixed latents, under the bench's autocast."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            return flow_matching_loss(self.model, self.x0, self.t, self.noise)

    def step(self, inspect: Callable[[torch.Tensor], None] | None = None) -> None:
        """One training step; `inspect(loss)` runs after the backward, while the gradients are still there."""
        controller = self.model.controller
        controller.begin_step(self.step_index)
        loss = self.loss()
        loss.backward()
        if inspect is not None:
            inspect(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # as the trainer: no old gradients during the next forward
        controller.end_step()
        self.step_index += 1

    def enter_stage2(self, profile: list[list[float]]) -> None:
        """Stage 2 with the given sparsity per layer and head, dispatched by the controller's rule."""
        layers = self.model.controller.layers
        if len(profile) != len(layers) or any(len(p) != layers[0].heads for p in profile):
            raise ValueError(f"the sparsity profile is {len(profile)}×{len(profile[0])}, the model has "
                             f"{len(layers)} layers × {layers[0].heads} heads")
        controller = self.model.controller
        controller.stage.fill_(2)
        controller._refresh_host_state()
        for layer, sparsity in zip(layers, profile):
            layer.sparsity_ema.copy_(torch.tensor(sparsity))
            layer.enter_stage2()
            layer.dispatch()

    def set_attention(self, **changes) -> None:
        """Change schedule fields of the attention config on the controller and every layer."""
        cfg = dataclasses.replace(self.model.controller.cfg, **changes)
        self.model.controller.cfg = cfg
        for layer in self.model.controller.layers:
            layer.cfg = cfg

    def dsv_state(self) -> list[tuple[dict[str, torch.Tensor], str]]:
        """A copy of what a profiling step changes in each layer: its DSV buffers (sparsity and recall EMAs,
        recall boost, budgets, dispatch) and its dispatch reason. The controller's stage and switch step and
        the predictor's learning rate do not change in stage 2."""
        return [({name: buffer.clone() for name, buffer in layer.named_buffers(recurse=False)},
                 layer.dispatch_reason) for layer in self.model.controller.layers]

    def restore_dsv_state(self, state: list[tuple[dict[str, torch.Tensor], str]]) -> None:
        """Put back a `dsv_state` copy, host mirrors included."""
        for layer, (buffers, reason) in zip(self.model.controller.layers, state):
            for name, value in buffers.items():
                getattr(layer, name).copy_(value)
            layer.dispatch_reason = reason
            layer._refresh_host_state()

    def median_ms(self, warmup: int, steps: int,
                  state: list[tuple[dict[str, torch.Tensor], str]] | None = None, period: int = 1) -> float:
        """Median ms per step of `steps` timed periods of `period` steps, each period counting its mean per
        step (with period 1: the median of single steps). A period > 1 is the predictor's update period in
        stage 2 (`learn_every_stage2`): untimed steps after the warm-up bring the step index to a multiple of
        it, so that each period holds exactly one update step, which a median of single steps would leave out.
        With `state`, the DSV state is put back after each step (untimed), so that steps which profile keep
        the sparsity profile under test instead of the random model's own."""
        def one() -> float:
            ms = _timed(self.step, self.device)
            if state is not None:
                self.restore_dsv_state(state)
            return ms

        self.warm_up(warmup, state)
        while self.step_index % period:
            one()
        return statistics.median(sum(one() for _ in range(period)) / period for _ in range(steps))

    def warm_up(self, steps: int, state: list[tuple[dict[str, torch.Tensor], str]] | None = None) -> None:
        """`steps` untimed steps (restoring `state` after each, as `median_ms`)."""
        for _ in range(steps):
            self.step()
            if state is not None:
                self.restore_dsv_state(state)


def step_flops(run_: _Run) -> tuple[float, float]:
    """Model FLOPs of one training step as `(matmul, attention)`, by the usual conventions: the linear layers and
    the patch convolution 3× their forward (the backward computes the input's and the weight's gradients), the
    attention 14·D per query-key pair that each layer computes (`attention_flops`: 4 forward, 2.5× that backward),
    every key for a dense layer, the pairs of its own index for a sparse one. Activation checkpointing's
    recomputed forward and the detached predictors (which step themselves, off the model's graph) are not
    counted. Measured on one forward without gradients, as the step would run it: hooks on the model's linear
    and convolution layers, and an observer on each attention layer that builds the index it would use."""
    model = run_.model
    predictors = {id(m) for p in model.modules() if isinstance(p, LowRankPredictor) for m in p.modules()}
    matmul, attention = [], []

    def count_matmul(module, inputs, output):
        if isinstance(module, nn.Linear):
            matmul.append(2.0 * inputs[0].numel() * module.out_features)
        else:  # a convolution: one multiply-add per output element and kernel tap of its input channels
            taps = module.in_channels // module.groups * math.prod(module.kernel_size)
            matmul.append(2.0 * output.numel() * taps)

    def observer(layer, hidden, q, k, grid):
        batch, heads, seq_len, head_dim = q.shape
        pairs = kept_pairs(layer.compute_index(hidden, q, k, grid)) if layer.runs_sparse() \
            else float(batch * heads) * seq_len * seq_len
        attention.append(attention_flops(pairs, head_dim, backward=True))

    hooks = [m.register_forward_hook(count_matmul) for m in model.modules()
             if isinstance(m, (nn.Linear, nn.Conv3d)) and id(m) not in predictors]
    layers = model.controller.layers
    for layer in layers:
        layer.observer = observer
    try:
        # No gradients: no predictor step and no selection kept for a recompute, so the state under test stays
        # as it is. Eager blocks: a compiled block cannot run the Python hooks.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            run_.loss()
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            layer.observer = None
    if len(attention) != len(layers):
        raise RuntimeError(f"FLOP count: {len(attention)} of {len(layers)} attention layers were seen in the forward")
    return 3.0 * sum(matmul), sum(attention)


def _sparse_kernels(run_: _Run) -> str:
    """Which attention kernels the sparse layers' last eager training forward ran, forward and backward, with
    how many layers took each (e.g. a layout that keeps the fused Hopper backward out says so here); compiled
    blocks record none."""
    paths = collections.Counter((layer.forward_path, layer.backward_path)
                                for layer in run_.model.controller.layers if layer.runs_sparse())
    return "; ".join(f"{count} × " + ("not recorded (compiled blocks)" if forward is None
                                      else f"forward {forward}, backward {backward}")
                     for (forward, backward), count in paths.most_common())


def category_table(rows: list[dict]) -> list[str]:
    """The report's table of GPU time by kernel category (ms), a column per run that has them (`--op-profile`
    on CUDA), categories in the order of their largest time; empty when no run has them."""
    profiled = [r for r in rows if r.get("categories")]
    if not profiled:
        return []
    ms = [{label: us / 1e3 for label, us, _ in r["categories"]} for r in profiled]
    labels = sorted({label for times in ms for label in times}, key=lambda label: -max(t.get(label, 0.0) for t in ms))
    lines = ["", "GPU time by kernel category in one more step of each run under the profiler (ms, kernel "
             "durations summed; `--op-profile` has each run's operators):", "",
             "| category | " + " | ".join(f"{r['tokens']} {r['mode']}" for r in profiled) + " |",
             "|---|" + "---|" * len(profiled)]
    lines += [f"| {label} | " + " | ".join(f"{times[label]:.1f}" if label in times else "—" for times in ms) + " |"
              for label in labels]
    lines.append("| **all** | " + " | ".join(f"**{sum(times.values()):.1f}**" for times in ms) + " |")
    return lines


def describe_model(model: nn.Module, cfg) -> str:
    """The report's words for the model that the bench built from `cfg`."""
    m = cfg.model
    shape = f"{m.depth} blocks, {m.heads} heads × {m.attention_head_dim}, hidden {m.hidden}"
    if m.arch == "wan":
        # The trainer's Wan has no text encoder: its cross-attention reads a few learned null-text tokens.
        text_tokens, text_dim = model.null_text.shape[1:]
        return (f"a diffusers WanTransformer3DModel with DSV installed ({shape}, FFN "
                f"{model.transformer.config.ffn_dim}; its cross-attention reads {text_tokens} null-text tokens of "
                f"width {text_dim})")
    return f"DSV's VideoDiT ({shape})"


def _gates(run_: _Run, tokens: int, mode: str) -> list[str]:
    """Both correctness gates of one run, in the state that the bench times next; prints and returns their
    lines (`GateFailure` when one does not hold)."""
    lines = []
    for gate in (_finite_gate, _sparse_gate):
        line = gate(run_)
        print(f"{tokens:>6} {mode:>6} gate: {line}", flush=True)
        lines.append(f"{mode} at {tokens} tokens: {line}")
    return lines


def run(args) -> int:
    check_report_path(args.out)
    repeated = sorted({mode for mode in args.modes if args.modes.count(mode) > 1})
    if repeated:
        raise ValueError(f"--modes {' '.join(args.modes)}: expected each mode at most once, "
                         f"{', '.join(repeated)} listed more than once")
    device = torch.device(args.device)
    cfg = bench_config(get_recipe(args.recipe), args.set)
    # Checked before anything runs: found at the second token count, a bad value would cost the first one's runs.
    if args.grids is None:
        token_counts, spatial = args.tokens or DEFAULT_TOKENS, args.spatial or DEFAULT_SPATIAL
        area = spatial * spatial
        if any(tokens % area for tokens in token_counts):
            raise ValueError(f"--tokens {' '.join(map(str, token_counts))}: each must be a multiple of --spatial² = "
                             f"{area}")
        grids = [square_grid(tokens, spatial) for tokens in token_counts]
    elif args.tokens is not None or args.spatial is not None:
        raise ValueError("--grids gives the token grids: leave out --tokens and --spatial")
    else:
        grids = args.grids
        counts = [math.prod(grid) for grid in grids]
        if len(set(counts)) < len(counts):  # the rows and their speedups are told apart by token count
            raise ValueError(f"--grids {' '.join('x'.join(map(str, g)) for g in grids)}: expected one grid per "
                             "token count, two have the same")
    if "window" in args.modes:  # the window's boxes need whole cubes
        for grid in grids:
            check_cube_tiles(grid, cfg.attention.cube, f"--modes window at the grid {'x'.join(map(str, grid))}")
    profile = None
    if "dsv" in args.modes:
        profile = paper_profile(cfg.model.depth, cfg.model.heads) if args.profile == "paper" \
            else load_profile(args.profile)
        if len(profile) != cfg.model.depth or any(len(row) != cfg.model.heads for row in profile):
            raise ValueError(f"--profile {args.profile}: {len(profile)} layers × {sorted({len(r) for r in profile})} "
                             f"heads, the model has {cfg.model.depth} layers × {cfg.model.heads} heads")
    learn_every = cfg.attention.learn_every_stage2
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows, gates, described = [], [], ""
    for grid in grids:
        tokens = math.prod(grid)
        measured = []  # this token count's rows: their speedups need dense's time, whatever the order of --modes
        for mode in args.modes:
            if cfg.model.compile:
                torch._dynamo.reset()  # each run is a new model: no guards or graphs carried over from the last
            run_ = _Run(cfg, mode, grid, device)
            described = described or describe_model(run_.model, cfg)
            row = {"tokens": tokens, "mode": mode, "notes": ""}
            if mode == "dsv":
                # Stage-1 steps: the layers see their shapes and backends before dispatch. The peak is the
                # second's: the first runs before AdamW has created its state (twice the parameters' bytes).
                run_.step()
                _reset_peak(device)
                run_.step()
                stage1_peak = _peak_gib(device)
                run_.enter_stage2(profile)
            # Before the gates: its forward brings every layer's parked predictor state back to the device
            # (`attention.host_offload`), and the gates' training step parks it again, as the timed steps find it.
            row["matmul_flops"], row["attention_flops"] = step_flops(run_)
            try:
                gates += _gates(run_, tokens, mode)
            except GateFailure as err:
                print(f"dsv bench train: correctness gate FAILED for {mode} at {tokens} tokens: {err}. Its steps "
                      "would compute NaN or wrong attention: not timed, no report written", file=sys.stderr)
                return 1
            row["sparse_blocks"] = sum(layer.runs_sparse() for layer in run_.model.controller.layers)
            # After the gates' training step, before the timed ones (the profiling steps below may re-dispatch).
            row["kernels"] = _sparse_kernels(run_)
            if mode == "dsv":
                # Whole update periods: with a predictor update every k > 1 steps, one step in k carries it.
                row["ms"], row["peak_gib"], row["peak_requested_gib"] = _timed_steps(run_, args, f"{tokens}-{mode}",
                                                                                      device, period=learn_every)
                stage2_state = run_.dsv_state()
                # Without the predictor update (its cost per step is the difference). No profiling here, so the
                # sparsity profile under test stays as it is.
                run_.set_attention(learn_every_stage2=10**9)
                _reset_peak(device)
                no_predictor = statistics.median(_timed(run_.step, device) for _ in range(args.steps))
                no_predictor_peak = _peak_gib(device)
                # Profiling steps: the controller's schedule made due on every step. A profiling step measures
                # this random model's own sparsity and re-dispatches on it, so the state under test is put
                # back after each. One untimed first: it compiles the kernel variants that only profiling uses
                # (e.g. the estimation of the dense blocks' would-be selection, whose larger budgets are other
                # Triton specialisations).
                run_.set_attention(learn_every_stage2=learn_every, profile_every_stage2=1)
                _reset_peak(device)
                profiled = run_.median_ms(1, max(1, args.steps // 2), state=stage2_state, period=learn_every)
                profiling_peak = _peak_gib(device)  # before the estimation's timed step below
                run_.set_attention(profile_every_stage2=10**9)
                every = cfg.attention.profile_every_stage2
                # The estimation is timed from a Python hook, which a compiled block cannot run.
                estimation = "n/a (compiled blocks)" if cfg.model.compile else \
                    f"{_estimation_ms(run_, device):.1f} ms/step"
                row["notes"] = (f"profiling step +{profiled - row['ms']:.0f} ms (every {every} steps: "
                                f"+{(profiled - row['ms']) / every:.1f} ms/step); predictor update "
                                f"{row['ms'] - no_predictor:.0f} ms/step"
                                f"{f' (one update every {learn_every} steps)' if learn_every > 1 else ''}; "
                                "critical-KV estimation "
                                f"{estimation}; peak GiB of a stage-1 step {stage1_peak:.1f}, of a profiling step "
                                f"{profiling_peak:.1f}, of a step without the predictor update "
                                f"{no_predictor_peak:.1f}")
            else:
                row["ms"], row["peak_gib"], row["peak_requested_gib"] = _timed_steps(run_, args, f"{tokens}-{mode}",
                                                                                      device)
            if args.op_profile is not None:
                row["categories"] = write_op_profile(run_.step, device, args.op_profile / f"{tokens}-{mode}.txt")
            measured.append(row)
            kernels = f" ({row['kernels']})" if row["kernels"] else ""
            print(f"{tokens:>6} {mode:>6}: {row['ms']:.1f} ms/step, {_tflops(row):.0f} TFLOP/s, "
                  f"{row['peak_gib']:.3f} GiB ({row['peak_requested_gib']:.3f} requested), "
                  f"{row['sparse_blocks']} sparse blocks{kernels}. {row['notes']}", flush=True)
            del run_
            # The layers and their controller reference each other: only the cycle collector frees them, and
            # until it runs the last model's attention weights would count in the next run's peak.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dense_ms = next((r["ms"] for r in measured if r["mode"] == "dense"), None)
        for r in measured:
            r["speedup"] = dense_ms / r["ms"] if dense_ms is not None else float("nan")  # NaN: no dense run
        if dense_ms is not None:
            print(f"{tokens:>6} against dense: " + ", ".join(f"{r['mode']} {r['speedup']:.2f}x" for r in measured),
                  flush=True)
        rows += measured
    periods = f" (DSV: of {args.steps} update periods of {learn_every} steps, each its mean per step)" \
        if learn_every > 1 and "dsv" in args.modes else ""
    lines = [f"# Training step time, {args.recipe} shape, {machine}", "",
             f"Overrides of the recipe: {', '.join(f'`{item}`' for item in args.set) or 'none'}.", "",
             f"torch {torch.__version__}; batch 1, {'bf16 autocast' if device.type == 'cuda' else 'fp32'}, "
             "activation checkpointing, "
             f"AdamW{', blocks compiled (' + cfg.model.compile + ')' if cfg.model.compile else ''}; "
             f"{described}; token grids (T×H×W) {', '.join('×'.join(map(str, g)) for g in grids)}; random "
             f"latents of {cfg.model.in_channels} channels, patch {cfg.model.patch}; DSV in stage 2 with the "
             f"{'paper 2.7B' if args.profile == 'paper' else args.profile} sparsity profile; median of "
             f"{args.steps} steps{periods} after {args.warmup} warm-up. Before any timing, each run passed a "
             "correctness gate (below): one untimed step's loss and parameter gradients finite and, where layers "
             "run sparse, the first sparse layer's sparse attention (output and dq, dk, dv) on its own inputs and "
             "index within a dtype tolerance of the float32 PyTorch reference. DSV dispatch: sparse from mean sparsity "
             f"{cfg.attention.sparse_threshold} where the kernel-speed model says it pays; predictor update every "
             f"{cfg.attention.learn_every_stage2} step(s) on "
             f"{cfg.attention.predictor_keys or 'all'} keys; predictor state and recompute rows "
             f"{'in host memory between uses' if cfg.attention.host_offload else 'kept on the GPU'} "
             "(attention.host_offload). TFLOP/step: the step's model FLOPs (linear layers and patch convolution 3× "
             "their forward; attention 14·D per query-key pair a layer computes: all of them dense, its index's "
             "sparse; checkpointing's recompute and the detached predictors not counted), with attention's share; "
             "TFLOP/s: those over ms/step.", "",
             "| tokens | mode | ms/step | × dense | TFLOP/step (attention) | TFLOP/s | peak GiB (timed steps) "
             "| of it requested | sparse blocks | DSV overheads |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flops = r["matmul_flops"] + r["attention_flops"]
        lines.append(f"| {r['tokens']} | {r['mode']} | {r['ms']:.1f} | {r['speedup']:.2f} | "
                     f"{flops / 1e12:.2f} ({r['attention_flops'] / flops:.0%}) | {_tflops(r):.0f} | "
                     f"{r['peak_gib']:.3f} | "
                     f"{r['peak_requested_gib']:.3f} | "
                     f"{r['sparse_blocks']} | {r['notes']} |")
    lines += _peaks_against_dense(rows)
    lines += category_table(rows)
    kernels = [f"- {r['mode']} at {r['tokens']} tokens: {r['kernels']}" for r in rows if r["kernels"]]
    if kernels:
        lines += ["", "Sparse layers' attention kernels (recorded by their last training forward before the timed "
                  "steps):", "", *kernels]
    lines += ["", "Correctness gates:", "", *(f"- {gate}" for gate in gates)]
    report = "\n".join(lines) + "\n"
    print(report)
    write_report(args.out, report)
    return 0
