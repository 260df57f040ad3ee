"""``dsv bench kernels``: DSV's Triton sparse attention against cuDNN dense attention and FlexAttention.

One run on one GPU. A correctness gate comes first (DSV kernels against the PyTorch references on a small
ragged shape, forward and gradients; the fused estimation against ``estimate_index``) and the run aborts if
it fails. Then per sequence length S: cuDNN SDPA dense, and per sparsity: FlexAttention (compiled, a
``BlockMask`` of the same index), DSV forward, forward+backward and estimation. Times are medians of
``triton.testing.do_bench`` (CUDA events, L2 flushed between runs); TFLOP/s counts attention FLOPs of the
kept query-key pairs (``4 * pairs * D`` forward, 2.5x that backward); peak memory is
``torch.cuda.max_memory_allocated`` over one forward+backward, q, k, v and the output gradient included, the
index and the ``BlockMask`` left out alike (``_peak_gib``).

The kernel modules are imported inside ``run``: the CLI imports this module to build its parser, and that
must not decorate the Triton kernels before a test process sets ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch

from dsv.bench.report_file import check_report_path, write_report
from dsv.cli import positive_int
from dsv.ops.sparse_attention import hopper_backward_unsupported, hopper_forward_unsupported

TARGETS = {0.90: 8.0, 0.95: 15.0, 0.98: 25.0}
"""Forward+backward speedup over dense cuDNN asked for at S >= 32k, by sparsity."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-lens", type=positive_int, nargs="+", default=[16384, 32768, 65536],
                        help="sequence lengths S")
    parser.add_argument("--sparsities", type=sparsity, nargs="+", default=[0.90, 0.95, 0.98],
                        help="fraction of key blocks each group drops, in [0, 1)")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=24)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--group-size", type=positive_int, default=128, help="query tokens per group")
    parser.add_argument("--kv-block", type=positive_int, default=128, help="key tokens per block")
    parser.add_argument("--rank", type=positive_int, default=16, help="per-head dim of the low-rank estimation inputs")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rep-ms", type=positive_int, default=300, help="do_bench repetition budget per measurement")
    parser.add_argument("--skip-dense", action="store_true", help="leave out cuDNN dense")
    parser.add_argument("--skip-flex", action="store_true", help="leave out FlexAttention (saves its compiles)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")


def sparsity(text: str) -> float:
    """argparse type: a fraction of key blocks dropped, in [0, 1) (a negative one read as dense, 1 or more kept
    one block)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a sparsity in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a sparsity in [0, 1), got {value}")
    return value


def attention_flops(pairs: float, head_dim: int, backward: bool) -> float:
    """FLOPs over ``pairs`` query-key pairs: 4*pairs*D forward (QK^T and PV), 2.5x that for the backward."""
    forward = 4.0 * pairs * head_dim
    return forward * 3.5 if backward else forward


def kept_pairs(index) -> float:
    """Query-key pairs an index keeps, summed over batch and heads; ragged tails counted exactly."""
    S, G, kv = index.seq_len, index.group_size, index.kv_block
    device = index.indices.device
    block_starts = torch.arange(index.num_kv_blocks, device=device) * kv
    block_tokens = (block_starts + kv).clamp(max=S) - block_starts
    keys = torch.where(index.valid_mask(), block_tokens[index.indices.clamp(min=0).long()], 0).sum(-1)
    group_starts = torch.arange(index.num_groups, device=device) * G
    rows = (group_starts + G).clamp(max=S) - group_starts
    return float((keys.double() * rows.double()).sum())


def speed_model_fit(rows: list[dict]) -> list[str]:
    """The report's check of the dispatch's kernel-speed model (`dsv.modules.dispatch`) on this GPU: a least-squares
    fit of `fixed_ms + relative_cost · kept · dense_ms` to DSV's per-call time (fwd+bwd, the fused estimation and
    the key-major build, as a training step pays them), against dense measured at the same S, and each row's error
    of the model that the dispatch uses for these blocks. Empty without two DSV rows of distinct kept·dense."""
    from dsv.modules.dispatch import speed_model

    points = [(r["kept"] * r["dense_ms"], r["ms"] + r["est_ms"] + r["key_major_ms"], r) for r in rows
              if r["method"] == "DSV" and r.get("dense_ms")]
    if len({round(x, 9) for x, _, _ in points}) < 2:
        return []
    design = torch.tensor([[1.0, x] for x, _, _ in points], dtype=torch.float64)
    times = torch.tensor([[y] for _, y, _ in points], dtype=torch.float64)
    fixed, relative = torch.linalg.lstsq(design, times).solution.flatten().tolist()
    fit_error = max(abs(fixed + relative * x - y) / y for x, y, _ in points)
    group, block = points[0][2]["group_size"], points[0][2]["kv_block"]
    model, words = speed_model("triton", group, block)
    lines = ["", f"Dispatch speed model check ({group}-token groups, {block}-token key blocks): DSV's time per call "
             "(fwd+bwd + fused estimation + key-major build) fitted as fixed + relative cost · kept · dense fwd+bwd "
             f"(least squares over the {len(points)} DSV rows): fixed {fixed:.2f} ms, relative cost {relative:.2f}, "
             f"largest error of the fit {fit_error:.1%}."]
    if model is not None:
        errors = [(model.fixed_ms + model.relative_cost * x - y) / y for x, y, _ in points]
        dense_rates = sorted({round(r["tflops"]) for r in rows if r["method"] == "cuDNN dense"})
        lines.append(f"The dispatch's model ({words}: fixed {model.fixed_ms:.2f} ms, relative cost "
                     f"{model.relative_cost:.2f}, dense at {model.dense_tflops:.0f} TFLOP/s; measured here "
                     f"{', '.join(map(str, dense_rates))}) on this GPU's dense times, error per DSV row in table order "
                     f"(positive: it predicts sparse slower than measured, so near break-even it keeps a block dense): "
                     f"{', '.join(f'{e:+.0%}' for e in errors)}.")
    return lines


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def correctness_gate(args, dtype: torch.dtype, device: str = "cuda") -> list[str]:
    """DSV kernels against the references on a small ragged shape; returns the failures (empty: passed)."""
    from dsv.ops.estimate.naive import estimate_index
    from dsv.ops.estimate.triton_kernels import estimate_index_triton
    from dsv.ops.sparse_attention import sparse_attention_reference
    from dsv.ops.sparse_attention.triton_kernels import sparse_attention_triton

    failures = []
    G, kv, D = args.group_size, args.kv_block, args.head_dim
    B, H = 2, 3
    # A ragged length (masked tails) and a multiple of the blocks: the timed lengths compile the kernels'
    # unmasked variants, which the ragged length alone would leave unchecked.
    # The third length's index lists enough blocks a group for the fused Hopper backward (it runs at the timed
    # shapes that list 10 or more); the first two take the split backward.
    for S, lists_many in ((8 * max(G, kv) + 37, False), (8 * max(G, kv), False), (24 * max(G, kv) + 37, True)):
        n_blocks = math.ceil(S / kv)
        keep = torch.tensor([1, 3, n_blocks - 3 if lists_many else n_blocks // 2])
        q_lr, k_lr = (torch.randn(B, H, S, args.rank, device=device, dtype=dtype) for _ in range(2))
        index = estimate_index_triton(q_lr, k_lr, keep, G, kv)
        index.validate()
        ref_index = estimate_index(q_lr, k_lr, keep, G, kv)
        mismatch = (index.indices != ref_index.indices).float().mean().item()
        # The fused kernel sums fp32 scores in another order: only near-ties may swap (rare).
        if not torch.equal(index.counts, ref_index.counts) or mismatch > 1e-2:
            failures.append(f"S={S} estimation: {mismatch:.2%} of index entries differ from estimate_index")

        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype).requires_grad_() for _ in range(3))
        grad_out = torch.randn_like(q)
        out = sparse_attention_triton(q, k, v, index)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref = sparse_attention_reference(q32, k32, v32, index)
        want = (ref, *torch.autograd.grad(ref, (q32, k32, v32), grad_out.float()))
        # Two units of the dtype's eps, as tests/ops/test_triton_kernels.py derives.
        tol = 2 * torch.finfo(dtype).eps
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            err = _rel_err(a, b)
            if not torch.isfinite(a).all() or err > tol:
                failures.append(f"S={S} sparse attention {name}: relative L2 error {err:.2e} > {tol:.2e}")
    return failures


def _flex_block_mask(index):
    """FlexAttention BlockMask listing the index's blocks as full blocks (no mask_mod calls)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, H, NG, K = index.indices.shape
    n_blocks = index.num_kv_blocks
    full_indices = torch.zeros(B, H, NG, n_blocks, dtype=torch.int32, device=index.indices.device)
    full_indices[..., :K] = index.indices.clamp(min=0)
    no_partial = torch.zeros_like(index.counts)
    return BlockMask.from_kv_blocks(no_partial, torch.zeros_like(full_indices), index.counts.contiguous(),
                                    full_indices, BLOCK_SIZE=(index.group_size, index.kv_block),
                                    seq_lengths=(index.seq_len, index.seq_len))


def _flex_compile_mode(group_size: int, kv_block: int) -> str | None:
    """FlexAttention's compile mode for these blocks. Its default Hopper backward tile at head dim 128 is
    64×128, and torch (2.11 at least) checks the block divisibility against that default before applying
    `kernel_options`, so blocks that 128 does not divide leave its backward no tile at all
    (NoValidChoicesError; pytorch issue 176025). There it autotunes instead: its search includes 32- and
    64-token tiles, and the peer runs its own best one."""
    return None if group_size % 128 == 0 and kv_block % 128 == 0 else "max-autotune-no-cudagraphs"


def _fwd_bwd(attention, q, k, v, grad_out):
    def step():
        out = attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad_out)
    return step


def _peak_gib(fn, inputs: tuple[torch.Tensor, ...]) -> float:
    """GiB of the `inputs` plus the most one call of `fn` allocates above what was allocated before it: the
    same baseline for every method, whatever else is alive (the estimation's inputs, DSV's index, a BlockMask)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    held = sum(t.numel() * t.element_size() for t in inputs)
    return (torch.cuda.max_memory_allocated() - before + held) / 2**30


def _gpu_kernel_ms(fn, reps: int = 10) -> float:
    """GPU time of the kernels ``fn`` launches, per call (torch.profiler), without host launch overhead."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / reps / 1e3 if total_us > 0 else None  # None: the profiler recorded no kernels


def _fmt_len(S: int) -> str:
    return f"{S // 1024}k" if S % 1024 == 0 else str(S)


def _fmt(x, spec=".2f"):
    return "—" if x is None else format(x, spec)


def _bench_ms(fn, rep_ms: float) -> float:
    """Median ms of ``fn`` by triton.testing.do_bench, with at least ~10 timed runs for slow cases."""
    from triton.testing import do_bench

    fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=max(rep_ms, 10 * start.elapsed_time(stop)), return_mode="median")


def _cudnn_attention(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _bench_seq_len(S: int, args, dtype: torch.dtype, flex, device: str = "cuda") -> list[dict]:
    """Rows of one sequence length: cuDNN dense, then per sparsity FlexAttention and DSV."""
    from dsv.ops.estimate.naive import estimate_index
    from dsv.ops.estimate.triton_kernels import estimate_index_triton
    from dsv.ops.index import key_major_csr
    from dsv.ops.sparse_attention.triton_kernels import sparse_attention_triton

    B, H, D, G, kv = args.batch, args.heads, args.head_dim, args.group_size, args.kv_block
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn_like(q)
    inputs = (q, k, v, grad_out)  # counted in every method's peak
    rows = []
    dense_ms = None
    if not args.skip_dense:
        step = _fwd_bwd(_cudnn_attention, q, k, v, grad_out)
        dense_ms, dense_mem, dense_gpu_ms = _bench_ms(step, args.rep_ms), _peak_gib(step, inputs), _gpu_kernel_ms(step)
        with torch.no_grad():
            dense_fwd_ms = _bench_ms(lambda: _cudnn_attention(q, k, v), args.rep_ms)
        dense_flops = attention_flops(B * H * float(S) * S, D, backward=True)
        rows.append(dict(S=S, method="cuDNN dense", kept=1.0, fwd_ms=dense_fwd_ms, ms=dense_ms,
                         tflops=dense_flops / dense_ms / 1e9, mem=dense_mem, gpu_ms=dense_gpu_ms))
        print(rows[-1], flush=True)
    q_lr, k_lr = (torch.randn(B, H, S, args.rank, device=device, dtype=dtype) for _ in range(2))
    n_blocks = math.ceil(S / kv)
    for sparsity in args.sparsities:
        # Rounded up: DSV never keeps fewer blocks than the sparsity it is judged at (rounded to 6 places
        # first, so that 0.1 * 256 = 25.6000000001 stays 26).
        keep = torch.full((H,), max(1, math.ceil(round((1 - sparsity) * n_blocks, 6))), dtype=torch.int64)
        index = estimate_index_triton(q_lr, k_lr, keep, G, kv)
        pairs = kept_pairs(index)
        kept = pairs / (B * H * float(S) * S)
        flops = attention_flops(pairs, D, backward=True)
        # functools.partial binds this iteration's keep/index/... at once (no late-bound loop variables).
        estimate = functools.partial(estimate_index_triton, q_lr, k_lr, keep, G, kv)
        est_ms, est_gpu_ms = _bench_ms(estimate, args.rep_ms), _gpu_kernel_ms(estimate)
        est_ref_ms = _bench_ms(functools.partial(estimate_index, q_lr, k_lr, keep, G, kv), args.rep_ms)
        # The key-major view of the index that the dk/dv pass walks: built once per index (cached on it), as a
        # training step builds it once per layer; timed on its own, like the estimation.
        key_major_ms = _bench_ms(functools.partial(key_major_csr, index.indices, index.num_kv_blocks), args.rep_ms)
        attention = functools.partial(sparse_attention_triton, index=index)
        flex_ms = flex_gpu_ms = None
        if not args.skip_flex:
            block_mask = _flex_block_mask(index)
            flex_attention = functools.partial(flex, block_mask=block_mask)
            # Before either is timed: two independent implementations of one mask must agree, forward and
            # backward (eager FlexAttention ignores a BlockMask without a mask_mod: dense), at this shape.
            flex_out, dsv_out = flex_attention(q, k, v), attention(q, k, v)
            flex_grads = torch.autograd.grad(flex_out, (q, k, v), grad_out)
            dsv_grads = torch.autograd.grad(dsv_out, (q, k, v), grad_out)
            errors = [_rel_err(a, b) for a, b in zip((flex_out, *flex_grads), (dsv_out, *dsv_grads))]
            agree = max(errors)
            del flex_out, dsv_out, flex_grads, dsv_grads
            if not agree <= 2 * torch.finfo(dtype).eps:  # the gate's tolerance; NaN fails too
                raise RuntimeError(f"S={S}: FlexAttention differs from DSV on the same mask (relative error of out, "
                                   f"dq, dk, dv {', '.join(f'{e:.2e}' for e in errors)}): its block mask was "
                                   "ignored or wrong; neither is timed")
        step = _fwd_bwd(attention, q, k, v, grad_out)
        dsv_ms, dsv_mem, dsv_gpu_ms = _bench_ms(step, args.rep_ms), _peak_gib(step, inputs), _gpu_kernel_ms(step)
        with torch.no_grad():
            dsv_fwd_ms = _bench_ms(functools.partial(attention, q, k, v), args.rep_ms)
        if not args.skip_flex:
            with torch.no_grad():
                flex_fwd_ms = _bench_ms(functools.partial(flex_attention, q, k, v), args.rep_ms)
            step = _fwd_bwd(flex_attention, q, k, v, grad_out)
            flex_ms, flex_mem, flex_gpu_ms = _bench_ms(step, args.rep_ms), _peak_gib(step, inputs), _gpu_kernel_ms(step)
            rows.append(dict(S=S, method="FlexAttention", kept=kept, fwd_ms=flex_fwd_ms, ms=flex_ms,
                             tflops=flops / flex_ms / 1e9, mem=flex_mem, agree=agree, dense_ms=dense_ms,
                             gpu_ms=flex_gpu_ms))
            print(rows[-1], flush=True)
        # Which forward and backward ran: the Hopper kernels leave short group lists (and other inputs) to Triton.
        hopper_why = hopper_forward_unsupported(q, G, kv, index.indices.shape[3])
        fused_why = hopper_backward_unsupported(q, G, kv, index.indices.shape[3])
        rows.append(dict(S=S, method="DSV", kept=kept, sparsity=sparsity, fwd_ms=dsv_fwd_ms, ms=dsv_ms,
                         forward="Triton" if hopper_why else "Hopper",
                         backward="split Triton" if fused_why else "fused Hopper",
                         tflops=flops / dsv_ms / 1e9, mem=dsv_mem, est_ms=est_ms, est_gpu_ms=est_gpu_ms,
                         key_major_ms=key_major_ms, group_size=G, kv_block=kv,
                         est_ref_ms=est_ref_ms, dense_ms=dense_ms, flex_ms=flex_ms, gpu_ms=dsv_gpu_ms,
                         flex_gpu_ms=flex_gpu_ms))
        print(rows[-1], flush=True)
    return rows


def run(args) -> int:
    if not torch.cuda.is_available():
        print("dsv bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    check_report_path(args.out)
    from torch.nn.attention.flex_attention import flex_attention

    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    failures = correctness_gate(args, dtype)
    if failures:
        print("correctness gate FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("correctness gate passed", flush=True)
    rows = []
    for S in args.seq_lens:
        # Compiled afresh per length: past torch.compile's recompile limit FlexAttention would run uncompiled,
        # and eager FlexAttention ignores this block mask (dense attention).
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False,
                             mode=_flex_compile_mode(args.group_size, args.kv_block))
        rows += _bench_seq_len(S, args, dtype, flex)
        torch.cuda.empty_cache()  # the next length's inputs start from a clean pool
    report = _report(rows, args, torch.cuda.get_device_name(), *_dsv_kernels(args, dtype))
    print(report)
    write_report(args.out, report)
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0


def _dsv_kernels(args, dtype, device: str = "cuda") -> tuple[str, str]:
    """Which forward and backward kernels DSV's rows run at this grouping (the note column says per row)."""
    probe = torch.empty(1, 1, args.group_size, args.head_dim, dtype=dtype, device=device)
    forward_why = hopper_forward_unsupported(probe, args.group_size, args.kv_block)
    backward_why = hopper_backward_unsupported(probe, args.group_size, args.kv_block)
    split = "the split Triton dq and dk/dv passes"
    forward = (f"the Triton kernel ({forward_why})" if forward_why else "the warp-specialized Hopper kernel (Gluon) "
               "where the index allows it, else the Triton kernel (the note column says which ran)")
    backward = (f"{split} ({backward_why})" if backward_why else "the fused Hopper kernel (Gluon) where the index "
                f"lists enough blocks a group, else {split} (the note column says which ran)")
    return forward, backward


def _report(rows, args, device_name: str, forward_kernel: str, backward_kernel: str) -> str:
    lines = [
        f"# Sparse attention kernels on {device_name}",
        "",
        f"DSV's forward: {forward_kernel}; backward: {backward_kernel}.",
        "",
        f"torch {torch.__version__}, triton {__import__('triton').__version__}; B={args.batch}, H={args.heads}, "
        f"D={args.head_dim}, {args.dtype}, group_size={args.group_size}, kv_block={args.kv_block}, "
        f"estimation rank {args.rank}. Median ms of triton.testing.do_bench; fwd+bwd = forward and "
        "backward (dq, dk, dv). TFLOP/s counts the kept query-key pairs (4·pairs·D forward, ×3.5 with the "
        "backward). Peak memory: q, k, v and dout plus the most one fwd+bwd allocates above what was "
        "allocated before it (state built once per mask, DSV's index or FlexAttention's BlockMask, left out "
        "alike). Est.: critical-KV estimation, fused Triton wall time (do_bench; a call this small is bound "
        "by host launch overhead) / its kernels' GPU time (torch.profiler) / PyTorch reference wall time; "
        "share = fused GPU time ÷ DSV fwd+bwd. GPU ms: the fwd+bwd kernels' device time (torch.profiler, "
        "summed), i.e. without the host's launch overhead, with DSV's speedup over FlexAttention by that "
        "measure. Key-major ms: building the index's key-major view (the dk/dv pass's walk), once per index, "
        "as FlexAttention's BlockMask is built once per mask; both are left out of fwd+bwd. × dense and the "
        "targets compare fwd+bwd, without the estimation and the key-major build. Kept blocks per group are "
        "rounded up from the sparsity. A correctness gate (ragged and block-multiple lengths against float32 "
        "references) runs before any timing, and at every timed shape FlexAttention is compared with DSV "
        "(out, dq, dk, dv) before either is timed (not with --skip-flex)."
        + (" FlexAttention is compiled with mode max-autotune-no-cudagraphs: its default backward tile (128 "
           "tokens) does not divide these blocks." if _flex_compile_mode(args.group_size, args.kv_block) else ""),
        "",
        "| S | method | kept | fwd ms | fwd+bwd ms | TFLOP/s | × dense | × Flex | GPU ms (× Flex) "
        "| est. ms (fused / GPU / ref) | est. share | key-major ms | peak GiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speed_dense = r["dense_ms"] / r["ms"] if r.get("dense_ms") else None
        speed_flex = r["flex_ms"] / r["ms"] if r.get("flex_ms") else None
        if r["method"] == "FlexAttention":
            speed_flex = 1.0
        est = share = "—"
        if "est_ms" in r:
            est = f"{r['est_ms']:.3f} / {_fmt(r['est_gpu_ms'], '.3f')} / {r['est_ref_ms']:.3f}"
            if r["est_gpu_ms"] is not None:
                share = f"{r['est_gpu_ms'] / r['ms']:.1%}"
        notes = []
        if "agree" in r:
            notes.append(f"vs DSV (out, grads): {r['agree']:.1e}")
        if "forward" in r:
            notes.append(f"{r['forward']} forward, {r['backward']} backward")
        if r["method"] == "DSV" and speed_dense is not None and r["S"] >= 32768:
            target = TARGETS.get(round(r["sparsity"], 2))
            if target is not None:
                # The ratio to two places: the table's one-place column can read 8.0 for a missed 7.98.
                notes.append(f"target ≥{target:g}×: {'met' if speed_dense >= target else 'missed'} "
                             f"({speed_dense:.2f}×)")
        note = "; ".join(notes)
        gpu = _fmt(r.get("gpu_ms"))
        if r.get("gpu_ms") and r.get("flex_gpu_ms"):
            gpu += f" ({r['flex_gpu_ms'] / r['gpu_ms']:.2f}×)"
        lines.append(
            f"| {_fmt_len(r['S'])} | {r['method']} | {r['kept']:.1%} | {_fmt(r['fwd_ms'])} | {_fmt(r['ms'])} "
            f"| {_fmt(r['tflops'], '.0f')} | {_fmt(speed_dense, '.1f')} | {_fmt(speed_flex, '.2f')} | {gpu} | {est} "
            f"| {share} | {_fmt(r.get('key_major_ms'), '.3f')} | {_fmt(r['mem'])} | {note} |"
        )
    lines += speed_model_fit(rows)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
