"""``python -m dsv.bench.cp`` (torchrun): sparse attention over GPUs under naive HCP, balanced HCP, SCP, hybrid.

Run under torchrun, one process per GPU (``torchrun --nproc-per-node N -m dsv.bench.cp``). Per sequence
length and per-head sparsity profile, every CP layout of `dsv.parallel.context` runs one block's sparse
attention forward + backward on the same inputs and index:

- naive HCP (Ulysses: equal contiguous head counts), balanced HCP (heads placed by LPT on kept keys),
  SCP (each rank keeps its queries and fetches the remote critical K/V blocks), and hybrid (the
  planner's factorisation and placement).

Per sequence length the dense baseline runs first: Ulysses HCP with cuDNN dense attention, the layout a
dense model would use; every row's speedup is over it, and its TFLOP/s counts all query-key pairs (the sparse
rows': the pairs their index keeps), per GPU.

A correctness gate comes first: each layout's output rows and dq/dk/dv must equal single-GPU attention on the
whole sequence (same index; dense for the baseline) in float32. Times are the slowest rank's (every rank waits
for it at the next collective), median over timed steps, each synchronised with the GPU at both ends; peak
memory is the largest over ranks of a step's own: its inputs plus what its steps allocate above what was
allocated before them (other rows' leftovers and the references left out). The planner's
prediction for each layout uses link and kernel speeds measured in the same run (all-to-all bandwidth;
cuDNN dense and the sparse kernel at the profile's mean kept fraction on one GPU), so its error is the
cost model's, not the constants'.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsv.bench.kernels import attention_flops, kept_pairs
from dsv.bench.profiling import write_op_profile
from dsv.bench.report_file import check_report_path, write_report
from dsv.bench.train import _timed, gate_tolerance
from dsv.cli import positive_int
from dsv.ops import estimate_index, keep_blocks_from_sparsity, sparse_attention
from dsv.parallel.context import MEASURED_HCP_OVERHEAD_S, MEASURED_SCP_OVERHEAD_S, ContextParallel
from dsv.parallel.hcp import select_heads
from dsv.parallel.planner import AttentionShape, Cluster, evaluate, paper_profile
from dsv.parallel.scp import LocalIndex, check_sequence_split, fetched_fraction

MODES = ("naive_hcp", "hcp", "scp", "hybrid")
TARGET_HYBRID_OVER_NAIVE_HCP = 1.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[32768, 65536], help="sequence lengths S")
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--block", type=positive_int, default=128, help="query group size = key block size")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per layout (after 3 warm-up)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: gloo and float32 (a functional check; its times mean nothing)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here (rank 0)")
    parser.add_argument("--op-profile", type=Path, default=None, metavar="FOLDER",
                        help="after timing, profile one more step of each layout and write rank 0's top "
                             "operators to FOLDER/<tokens>-<profile>-<mode>.txt")


def profiles(heads: int) -> dict[str, list[float]]:
    """Per-head sparsity profiles. "skewed": kept fractions from 50% down to 2% in head order, so the
    heavy heads sit together (the case equal contiguous head counts handle worst); "paper block 4": the
    paper's measured 2.7B profile at its least sparse sparse block (0.70-0.80)."""
    kept = torch.linspace(0.5, 0.02, heads).tolist()
    return {"skewed": [1.0 - k for k in kept], "paper block 4": paper_profile(32, heads)[3]}


def _median_ms(fn, steps: int, device: torch.device) -> float:
    """Median over `steps` of the slowest rank's time for `fn` (3 warm-up calls first)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        ms = torch.tensor(_timed(fn, device), device=device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        times.append(float(ms))
    return statistics.median(times)


def _alltoall_gbps(device: torch.device, world: int) -> float:
    """Bytes each GPU sends to its peers per second in a 256 MiB `all_to_all_single` (1 MiB on CPU)."""
    x = torch.empty((128 if device.type == "cuda" else 1) * 2**19, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(x)
    ms = _median_ms(lambda: dist.all_to_all_single(out, x), 5, device)
    return x.numel() * x.element_size() * (world - 1) / world / (ms * 1e-3) / 1e9


def _fwd_bwd(attention, q, k, v, grad):
    def step():
        q.grad = k.grad = v.grad = None
        attention(q, k, v).backward(grad)
    return step


def _cudnn(device: torch.device):
    """cuDNN attention by name on a GPU: SDPA's default order would take another backend wherever cuDNN is not
    preferred (on the CPU, SDPA's own choice)."""
    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()


def _dense_tflops(heads: int, seq_len: int, dim: int, device, dtype) -> float:
    """cuDNN dense fwd+bwd TFLOP/s on one GPU, `heads` heads."""
    q, k, v, grad = (torch.randn(1, heads, seq_len, dim, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    with _cudnn(torch.device(device)):
        dense_ms = _median_ms(_fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v, grad), 5,
                              device)
    return 14.0 * heads * seq_len * seq_len * dim / (dense_ms * 1e-3) / 1e12


def _rates(heads: int, seq_len: int, dim: int, block: int, mean_keep: float, device, dtype) -> tuple[float, float]:
    """(cuDNN dense fwd+bwd TFLOP/s, sparse kernel's efficiency relative to it) on one GPU, `heads` heads."""
    dense_tflops = _dense_tflops(heads, seq_len, dim, device, dtype)
    q, k, v, grad = (torch.randn(1, heads, seq_len, dim, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    flops = 14.0 * heads * seq_len * seq_len * dim
    blocks = seq_len // block
    keep = torch.full((heads,), max(1, round(mean_keep * blocks)))
    q_lr, k_lr = (torch.randn(1, heads, seq_len, 16, device=device) for _ in range(2))
    index = estimate_index(q_lr, k_lr, keep, block, block)
    # A new index object per step (its key-major view is built in each backward, as in training).
    sparse_ms = _median_ms(_fwd_bwd(lambda a, b, c: sparse_attention(a, b, c, dataclasses.replace(index),
                                                                      check_index=False), q, k, v, grad), 5, device)
    sparse_tflops = flops * float(keep[0]) / blocks / (sparse_ms * 1e-3) / 1e12
    return dense_tflops, min(1.0, sparse_tflops / dense_tflops)


def run(args) -> int:
    if not dist.is_initialized():
        if "LOCAL_RANK" not in os.environ:
            print("dsv bench cp runs under torchrun: torchrun --nproc-per-node N -m dsv.bench.cp", file=sys.stderr)
            return 2
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    check_report_path(args.out)
    for seq_len in args.tokens:  # every length before any is timed: a later one failing would lose the report
        try:
            check_sequence_split(seq_len, world, args.block, args.block)
        except ValueError as err:
            raise ValueError(f"--tokens {seq_len} on {world} ranks with --block {args.block}: {err}") from None
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    runtimes = {mode: ContextParallel(world, mode, device.type) for mode in MODES}
    link_gbps = _alltoall_gbps(device, world)
    rows, failures = [], []
    for seq_len in args.tokens:
        rows += _bench_dense(args, runtimes["naive_hcp"], seq_len, link_gbps, device, failures)
        if failures:
            break
        for name, sparsity in profiles(args.heads).items():
            rows += _bench(args, runtimes, seq_len, name, sparsity, link_gbps, device, failures)
            if failures:
                break  # nothing is timed after a failed gate
        if failures:
            break
    if rank == 0:
        report = _report(rows, args, world, link_gbps, failures)
        print(report)
        write_report(args.out, report)
    return 1 if failures else 0


def _bench(args, runtimes, seq_len, name, sparsity, link_gbps, device, failures) -> list[dict]:
    heads, dim, block, world = args.heads, args.head_dim, args.block, dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seq_len)
    full = [torch.randn(1, heads, seq_len, dim, device=device, dtype=dtype, generator=gen) for _ in range(4)]
    q_lr, k_lr = (torch.randn(1, heads, seq_len, 16, device=device, generator=gen) for _ in range(2))
    keep_blocks = keep_blocks_from_sparsity(torch.tensor(sparsity), seq_len // block, 1)
    index = estimate_index(q_lr, k_lr, keep_blocks, block, block)  # the same on every rank (same seed)
    (q, k, v, grad), reference, reference_grads = _rank_rows_and_reference(
        full, lambda *inputs: sparse_attention(*inputs, index))
    del full
    kept = [float(b) / (seq_len // block) for b in keep_blocks]
    fetched = {world: fetched_fraction(index, world)}
    steps = {}
    for mode, cp in runtimes.items():
        layout = cp.plan_layout(kept, True, heads, dim, seq_len, 1, fetched)
        local_index = select_heads(index, layout.heads)
        if layout.scp > 1:
            local_index = LocalIndex.from_global(local_index, layout.scp_rank, layout.scp)

        def attention(q_, k_, v_, layout=layout, local_index=local_index, cp=cp):
            qh, kh, vh = (t.contiguous() for t in cp.to_heads(torch.cat((q_, k_, v_), -1), layout).chunk(3, -1))
            # A new index object each step, as training makes: its key-major view (built in the backward and
            # cached on the object) is then built in every timed step, as in SCP's and in training's.
            fresh = dataclasses.replace(local_index) if dataclasses.is_dataclass(local_index) else local_index
            return cp.from_heads(cp.attend(qh, kh, vh, fresh, layout, dim**-0.5, "auto"), layout)

        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        error = _gate(attention, inputs, grad, reference, reference_grads, f"{mode} at S={seq_len} ({name})",
                      failures)
        steps[mode] = (layout, error, _fwd_bwd(attention, *inputs, grad), (*inputs, grad))
    if failures:
        return []
    dense_tflops, efficiency = _rates(max(1, heads // world), seq_len, dim, block, sum(kept) / heads, device, dtype)
    # Links and kernels as measured now; the layouts' fixed overheads as fitted to an earlier run.
    cluster = Cluster(gpus=world, gpus_per_node=world, intra_node_gbps=link_gbps, inter_node_gbps=link_gbps,
                      dense_tflops=dense_tflops, sparse_efficiency=efficiency,
                      hcp_overhead_s=MEASURED_HCP_OVERHEAD_S, scp_overhead_s=MEASURED_SCP_OVERHEAD_S)
    flops = attention_flops(kept_pairs(index), dim, backward=True)
    results = []
    for mode, (layout, error, step, tensors) in steps.items():
        ms, peak = _time_and_profile(step, tensors, args, device, f"{seq_len}-{name.replace(' ', '_')}-{mode}")
        predicted = evaluate(sparsity, AttentionShape(seq_len, heads, dim), cluster, layout.hcp,
                             [list(p) for p in layout.placement], True, fetched.get(layout.scp)).time_s * 1e3
        results.append({"tokens": seq_len, "profile": name, "mode": mode, "layout": layout.describe(),
                        "ms": ms, "predicted_ms": predicted, "error": error, "flops": flops, "peak_gib": peak,
                        "dense_tflops": dense_tflops, "efficiency": efficiency})
    return results


def _rank_rows_and_reference(full: list[torch.Tensor], attention):
    """From the whole sequence's `full = [q, k, v, output gradient]` ([1, H, S, D]): this rank's rows of each, and
    the float32 reference output and dq, dk, dv of those rows under `attention(q, k, v)` over the whole sequence
    (every rank's rows take the upstream gradient full[3]: each rank's keys collect gradient from every rank's
    queries). The reference rows are copies: views would keep the whole float32 tensors alive while timing."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local_len = full[0].shape[2] // world
    rows = slice(rank * local_len, (rank + 1) * local_len)
    inputs = [t.detach().to(torch.float32, copy=True).requires_grad_(True) for t in full[:3]]
    out = attention(*inputs)
    grads = torch.autograd.grad(out, inputs, full[3].to(torch.float32))
    reference = out.detach()[:, :, rows].clone()
    reference_grads = [g[:, :, rows].clone() for g in grads]
    return [t[:, :, rows].contiguous() for t in full], reference, reference_grads


def _gate(attention, inputs, grad, reference, reference_grads, what: str, failures: list[str]) -> float:
    """One forward and backward of `attention` on this rank's rows against the float32 reference: the largest
    relative error of out, dq, dk, dv over the ranks (inf for NaN); appends to `failures` above the dtype's bound."""
    out = attention(*inputs)
    grads = torch.autograd.grad(out, inputs, grad)
    errors = torch.stack([(a.float() - b).norm() / b.norm()
                          for a, b in zip((out.detach(), *grads), (reference, *reference_grads))])
    # The kernels' bound for the dtype (a fixed 1% passed a lost key block in float32). NaN fails too (it
    # compares False with any bound), on whichever rank it appears.
    failed = (~torch.isfinite(errors) | (errors > gate_tolerance(inputs[0].dtype))).any().float()
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    worst = torch.nan_to_num(errors, nan=float("inf"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank's rows
    if failed:
        failures.append(f"{what}: relative error of out, dq, dk, dv "
                        f"{', '.join(f'{e:.2e}' for e in worst.tolist())} (worst over ranks)")
    return float(worst.max())


def _time_and_profile(step, inputs: tuple[torch.Tensor, ...], args, device: torch.device,
                      name: str) -> tuple[float, float]:
    """(median ms of the slowest rank, peak GiB over the ranks; NaN off CUDA), then the operator table of one more
    step if asked (every rank steps, for the collectives; rank 0 writes). The peak is the step's own: this rank's
    `inputs` (q, k, v and the output gradient) plus the most its steps allocate above what was allocated before
    them, so what other rows left alive (their inputs and gradients, the references) does not count. The inputs'
    gradients are dropped afterwards."""
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    ms = _median_ms(step, args.steps, device)
    own = float("nan")
    if device.type == "cuda":
        own = torch.cuda.max_memory_allocated(device) - before + sum(t.nbytes for t in inputs)
    peak = torch.tensor(own / 2**30, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if args.op_profile is not None:
        if dist.get_rank() == 0:
            write_op_profile(step, device, args.op_profile / f"{name}.txt")
        else:
            step()
    for tensor in inputs:
        tensor.grad = None
    return ms, float(peak)


def _bench_dense(args, runtime: ContextParallel, seq_len: int, link_gbps: float, device, failures) -> list[dict]:
    """The dense baseline's row at `seq_len`: Ulysses HCP (equal contiguous heads per rank) with cuDNN dense
    attention, gated against float32 dense attention on the whole sequence."""
    heads, dim, world = args.heads, args.head_dim, dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seq_len + 1)
    full = [torch.randn(1, heads, seq_len, dim, device=device, dtype=dtype, generator=gen) for _ in range(4)]

    def dense_reference(*inputs):
        # By name on a GPU: float32 rules out flash and cuDNN, and the math backend would hold S² scores (256 GiB
        # at 64k tokens and 16 heads); the memory-efficient one is linear in S. On the CPU, SDPA's own choice.
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION) if device.type == "cuda" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(*inputs)

    (q, k, v, grad), reference, reference_grads = _rank_rows_and_reference(full, dense_reference)
    del full
    layout = runtime.plan_layout([1.0] * heads, False, heads, dim, seq_len, 1)

    def attention(q_, k_, v_):
        qh, kh, vh = (t.contiguous() for t in runtime.to_heads(torch.cat((q_, k_, v_), -1), layout).chunk(3, -1))
        with _cudnn(device):
            return runtime.from_heads(runtime.attend(qh, kh, vh, None, layout, dim**-0.5, "auto"), layout)

    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    error = _gate(attention, inputs, grad, reference, reference_grads, f"dense at S={seq_len}", failures)
    if failures:
        return []
    step = _fwd_bwd(attention, *inputs, grad)
    ms, peak = _time_and_profile(step, (*inputs, grad), args, device, f"{seq_len}-dense")
    dense_tflops = _dense_tflops(max(1, heads // world), seq_len, dim, device, dtype)
    cluster = Cluster(gpus=world, gpus_per_node=world, intra_node_gbps=link_gbps, inter_node_gbps=link_gbps,
                      dense_tflops=dense_tflops, sparse_efficiency=1.0,
                      hcp_overhead_s=MEASURED_HCP_OVERHEAD_S, scp_overhead_s=MEASURED_SCP_OVERHEAD_S)
    predicted = evaluate([0.0] * heads, AttentionShape(seq_len, heads, dim), cluster, layout.hcp,
                         [list(p) for p in layout.placement], False).time_s * 1e3
    return [{"tokens": seq_len, "profile": "—", "mode": "dense", "layout": layout.describe(), "ms": ms,
             "predicted_ms": predicted, "error": error, "peak_gib": peak,
             "flops": attention_flops(float(heads) * seq_len * seq_len, dim, backward=True),
             "dense_tflops": dense_tflops, "efficiency": None}]


def _report(rows, args, world, link_gbps, failures) -> str:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    lines = [
        f"# Context-parallel sparse attention on {world}x "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU (functional check)'}",
        "",
        f"Command: `torchrun --nproc-per-node {world} -m dsv.bench.cp --tokens {' '.join(map(str, args.tokens))} "
        f"--heads {args.heads} --head-dim {args.head_dim} --block {args.block} --steps {args.steps}`",
        "",
        f"One block's sparse attention, forward + backward, B = 1, {args.heads} heads x {args.head_dim}, "
        f"{'bf16' if args.device == 'cuda' else 'float32'}, "
        f"{args.block}-token query groups and key blocks; the slowest rank's time, median of {args.steps} steps. "
        f"torch {torch.__version__}. Measured all-to-all bandwidth: {link_gbps:.0f} GB/s per GPU and direction.",
        "",
        "The planner's SCP volume uses the union of each rank's critical remote blocks, measured from the "
        "index (`fetched_fraction`); the index is a random low-rank estimate, so the groups' selections hardly "
        "overlap — SCP's worst case. It adds each layout's fixed overhead beyond FLOPs and bytes as fitted to "
        f"an earlier 2-GPU run (HCP {MEASURED_HCP_OVERHEAD_S * 1e3:.1f} ms, SCP {MEASURED_SCP_OVERHEAD_S * 1e3:.1f} "
        "ms per block; `dsv/parallel/context.py`). Before timing, each layout's output and dq/dk/dv were "
        "compared with a float32 single-process reference (attention over the whole sequence, same index; dense "
        "for the dense row) on every rank: the last column is the largest relative error over the four and the "
        f"ranks (the gate fails above {gate_tolerance(dtype):.1e}, two units of the dtype's eps, or on NaN). Each "
        "timed step builds its index's key-major view, as a training step does. × dense: over the dense "
        "baseline (Ulysses HCP, cuDNN) at the same S. TFLOP/s per GPU: the attention FLOPs of the pairs computed "
        "(14·D per query-key pair: all of them dense, the index's sparse) over ms and GPUs. Peak GiB: the largest "
        "over the ranks of a step's own memory: its q, k, v and output gradient, plus the most its steps "
        "allocate above what was allocated before them"
        f"{'' if args.device == 'cuda' else ' (not tracked on the CPU)'}.",
        "",
        "| S | profile | layout | mode | ms | × dense | x naive HCP | TFLOP/s per GPU | peak GiB | planner ms "
        "| planner error | max rel. error (out, dq, dk, dv) vs float32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        dense = next(r["ms"] for r in rows if (r["tokens"], r["mode"]) == (row["tokens"], "dense"))
        naive = next((r["ms"] for r in rows if (r["tokens"], r["profile"], r["mode"]) ==
                      (row["tokens"], row["profile"], "naive_hcp")), None)
        over_naive = "—" if naive is None else f"{naive / row['ms']:.2f}"
        lines.append(f"| {row['tokens']} | {row['profile']} | {row['layout']} | {row['mode']} | {row['ms']:.2f} | "
                     f"{dense / row['ms']:.2f} | {over_naive} | "
                     f"{row['flops'] / world / row['ms'] / 1e9:.3g} | {row['peak_gib']:.2f} | "
                     f"{row['predicted_ms']:.2f} | "
                     f"{(row['predicted_ms'] - row['ms']) / row['ms']:+.0%} | {row['error']:.1e} |")
    lines += ["", "Calibration per shape (one GPU, the rank's share of heads): cuDNN dense fwd+bwd TFLOP/s and the "
              "sparse kernel's efficiency relative to it at the profile's mean kept fraction:", ""]
    seen = set()
    for row in rows:
        key = (row["tokens"], row["profile"])
        if key not in seen:
            seen.add(key)
            efficiency = "" if row["efficiency"] is None else f", efficiency {row['efficiency']:.2f}"
            lines.append(f"- S = {key[0]}, {'dense' if row['mode'] == 'dense' else key[1]}: "
                         f"{row['dense_tflops']:.0f} TFLOP/s{efficiency}")
    lines += ["", "Target: hybrid >= 1.3x naive HCP on the skewed profile."]
    for row in rows:
        if row["profile"] == "skewed" and row["mode"] == "hybrid":
            naive = next(r["ms"] for r in rows if (r["tokens"], r["profile"], r["mode"]) ==
                         (row["tokens"], "skewed", "naive_hcp"))
            met = naive / row["ms"] >= TARGET_HYBRID_OVER_NAIVE_HCP
            lines.append(f"- S = {row['tokens']}: {naive / row['ms']:.2f}x — {'met' if met else 'missed'}")
    if failures:
        lines += ["", "Correctness gate FAILED:"] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m dsv.bench.cp",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
