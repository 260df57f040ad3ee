"""Triton kernels of sparse attention and critical-KV estimation against the PyTorch references.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on small fp32 shapes. The
variable must be set before triton is first imported; this module sets it when it is the first importer.
When an earlier test already imported triton (torch.compile does), the interpreter tests run instead in a
fresh pytest process (``test_interpreter_suite_in_fresh_process``). With CUDA, ``-m gpu`` runs the
compiled kernels in bf16/fp16 against fp32 references, and the interpreter tests are skipped (one process
cannot hold both builds).
"""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not HAS_CUDA and not TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton not installed: pip install -e '.[triton]'")

# Late imports (E402): TRITON_INTERPRET must be set above before these first import triton.
from dsv.ops.estimate.naive import estimate_index, segment_means  # noqa: E402  (estimate_index: the reference)
from dsv.ops.estimate.triton_kernels import estimate_index_triton  # noqa: E402
from dsv.ops.index import SparseIndex  # noqa: E402
from dsv.ops.sparse_attention import sparse_attention_reference, sparse_attention_reference_with_lse  # noqa: E402
from dsv.ops.sparse_attention import triton_kernels as tk  # noqa: E402
from dsv.ops.sparse_attention.triton_kernels import (  # noqa: E402
    KernelConfig,
    SparseAttentionConfig,
    sparse_attention_triton,
    sparse_attention_triton_with_lse,
)
from tests import assert_opcheck_passes  # noqa: E402

interpreter = pytest.mark.skipif(
    HAS_CUDA or TRITON_PREIMPORTED,
    reason="CUDA present (-m gpu covers it)" if HAS_CUDA else
    "triton was imported before TRITON_INTERPRET=1 could be set: test_interpreter_suite_in_fresh_process runs these",
)
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# fp32 kernels (IEEE dots) against an fp64 reference: fp32 rounding (eps 1.2e-7) over <= ~200-term sums,
# with ~100x headroom.
FP32_REL_TOL = 1e-5


def dtype_rel_tol(dtype: torch.dtype) -> float:
    """Relative L2 error allowed for a low-precision kernel against an fp32 reference on the same inputs.

    Two units of the dtype's eps: rounding the output to the dtype costs half an ulp, and rounding P and dS
    to the dtype before the second matmul of each pair (as every flash kernel does) at most one more.
    """
    return 2 * torch.finfo(dtype).eps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def random_index(B, H, S, group_size, kv_block, keep, device="cpu"):
    """Random index with per-head keep counts (top-k of random scores)."""
    scores = torch.randn(B, H, math.ceil(S / group_size), math.ceil(S / kv_block), device=device)
    return SparseIndex.from_topk(scores, torch.tensor(keep), group_size, kv_block, S)


def ragged_index(B, H, S, group_size, kv_block, max_keep):
    """Random index whose every row keeps its own number of blocks (per-row counts)."""
    nkb = math.ceil(S / kv_block)
    ng = math.ceil(S / group_size)
    indices = torch.full((B, H, ng, max_keep), -1, dtype=torch.int32)
    counts = torch.randint(1, max_keep + 1, (B, H, ng), dtype=torch.int32)
    for row, count in zip(indices.view(-1, max_keep), counts.flatten().tolist()):
        row[:count] = torch.randperm(nkb)[:count].sort().values
    return SparseIndex(indices, counts, group_size, kv_block, S)


def dense_masked_attention(q, k, v, index, scale=None):
    """fp64 dense attention over the index's token mask; returns (out, lse), both differentiable."""
    B, H, S, D = q.shape
    mask = torch.zeros(B, H, S, S, dtype=torch.bool)
    G, kv = index.group_size, index.kv_block
    for b in range(B):
        for h in range(H):
            for g in range(index.num_groups):
                for j in index.indices[b, h, g, : index.counts[b, h, g]].tolist():
                    mask[b, h, g * G:(g + 1) * G, j * kv:(j + 1) * kv] = True
    scale = D**-0.5 if scale is None else scale
    scores = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~mask.to(q.device), float("-inf"))
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


def leaf_inputs(B, H, S, D, dtype, device="cpu"):
    return [torch.randn(B, H, S, D, device=device).to(dtype).requires_grad_() for _ in range(3)]


def outputs_and_grads(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


# ----------------------------------------------------------------------------------------------------------
# CPU, Triton interpreter, fp32
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA or not TRITON_PREIMPORTED, reason="the interpreter tests run in this process")
def test_interpreter_suite_in_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-m", "not gpu", "-p", "no:cacheprovider"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout

# (B, H, S, D, group_size, kv_block): aligned; ragged S; D padded to a power of two; G < kv_block; G > kv_block.
CPU_SHAPES = [
    (1, 2, 64, 16, 16, 16),
    (2, 2, 100, 32, 16, 16),
    (1, 1, 90, 24, 16, 32),
    (1, 2, 97, 16, 32, 16),
]


@interpreter
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "B{}H{}S{}D{}G{}kv{}".format(*s))
def test_interpreter_matches_reference(shape):
    B, H, S, D, G, kv = shape
    index = ragged_index(B, H, S, G, kv, max_keep=min(3, math.ceil(S / kv)))
    q, k, v = leaf_inputs(B, H, S, D, torch.float32)
    grad_out = torch.randn(B, H, S, D)
    got = outputs_and_grads(lambda *x: sparse_attention_triton(*x, index), q, k, v, grad_out)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = outputs_and_grads(lambda *x: sparse_attention_reference(*x, index), q64, k64, v64, grad_out.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < FP32_REL_TOL, name


@interpreter
@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq-pass", "atomic-dq"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_interpreter_sub_tiles_and_lse_gradient(tma, atomic_dq):
    """Tiles smaller than the group and the key block (several sub-tiles per block), and a loss on the LSE;
    dq from its own pass or added by the dk/dv pass."""
    if tma and atomic_dq:
        pytest.skip("the interpreter has no TMA reductions (descriptor atomic_add); the GPU tests cover them")
    B, H, S, D, G, kv = 1, 2, 120, 24, 32, 32
    tile = KernelConfig(16, 16, 4, 1, tma=tma)
    cfg = SparseAttentionConfig(tile, tile, tile, atomic_dq=atomic_dq)
    index = random_index(B, H, S, G, kv, keep=[2, 3])
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out, lse = tk.sparse_attention_fwd_launch(q, k, v, index.indices, index.counts, G, kv, 0.3, cfg.fwd)
    grad_out, grad_lse = torch.randn(B, H, S, D), torch.randn(B, H, S)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out64, lse64 = dense_masked_attention(q64, k64, v64, index, scale=0.3)
    want = torch.autograd.grad((out64 * grad_out.double()).sum() + (lse64 * grad_lse.double()).sum(),
                               (q64, k64, v64))
    assert rel_err(out, out64) < FP32_REL_TOL
    assert rel_err(lse, lse64) < FP32_REL_TOL
    # The backward builds the key-major index itself, or takes the index's cached one.
    for key_major in (None, index.key_major()):
        grads = tk.sparse_attention_bwd_launch(grad_out, q, k, v, out, lse, grad_lse, index.indices, index.counts,
                                               G, kv, 0.3, cfg, key_major=key_major)
        for name, a, b in zip(("dq", "dk", "dv"), grads, want):
            assert rel_err(a, b) < FP32_REL_TOL, (name, key_major is None)


@interpreter
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("S", [48, 80], ids=["S48", "S80"])
def test_interpreter_ragged_tail_on_a_tile_boundary(tma, S):
    """S a multiple of the 16-row tiles but not of the 32-token groups and key blocks: the walked sub-tiles of
    the last group and block lie wholly past S and must count as absent (keys masked out, query rows adding
    nothing), not be read as data."""
    B, H, D, G, kv = 2, 2, 24, 32, 32
    tile = KernelConfig(16, 16, 4, 1, tma=tma)
    cfg = SparseAttentionConfig(tile, tile, tile)
    index = random_index(B, H, S, G, kv, keep=[2, 3])
    assert (index.indices == S // kv).any(), "the partial last key block must be listed somewhere"
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out, lse = tk.sparse_attention_fwd_launch(q, k, v, index.indices, index.counts, G, kv, 0.3, cfg.fwd)
    grad_out, grad_lse = torch.randn(B, H, S, D), torch.randn(B, H, S)
    grads = tk.sparse_attention_bwd_launch(grad_out, q, k, v, out, lse, grad_lse, index.indices, index.counts,
                                           G, kv, 0.3, cfg)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out64, lse64 = dense_masked_attention(q64, k64, v64, index, scale=0.3)
    want = torch.autograd.grad((out64 * grad_out.double()).sum() + (lse64 * grad_lse.double()).sum(),
                               (q64, k64, v64))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (out64, lse64, *want)):
        assert torch.isfinite(a).all() and rel_err(a, b) < FP32_REL_TOL, name


@interpreter
def test_interpreter_all_blocks_is_dense_attention():
    B, H, S, D = 1, 2, 80, 16
    nkb = math.ceil(S / 16)
    index = random_index(B, H, S, 16, 16, keep=[nkb] * H)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out = sparse_attention_triton(q, k, v, index)
    assert rel_err(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double())) < FP32_REL_TOL


@interpreter
def test_interpreter_lse_matches_reference_and_strided_inputs():
    """Non-contiguous [B, S, H, D]-transposed inputs; LSE equals the reference's."""
    B, H, S, D = 2, 3, 48, 16
    index = random_index(B, H, S, 16, 16, keep=[1, 2, 3])
    q, k, v = (torch.randn(B, S, H, D).transpose(1, 2) for _ in range(3))
    out, lse = sparse_attention_triton_with_lse(q, k, v, index)
    out_ref, lse_ref = sparse_attention_reference_with_lse(q.double(), k.double(), v.double(), index)
    assert rel_err(out, out_ref) < FP32_REL_TOL
    assert rel_err(lse, lse_ref) < FP32_REL_TOL


@interpreter
def test_interpreter_compile_checkpoint_and_opcheck():
    B, H, S, D = 1, 2, 64, 16
    index = random_index(B, H, S, 16, 16, keep=[2, 3])
    q, k, v = leaf_inputs(B, H, S, D, torch.float32)
    grad_out = torch.randn(B, H, S, D)
    eager = outputs_and_grads(lambda *x: sparse_attention_triton(*x, index), q, k, v, grad_out)
    compiled_fn = torch.compile(lambda *x: sparse_attention_triton(*x, index), backend="aot_eager", fullgraph=True)
    compiled = outputs_and_grads(compiled_fn, q, k, v, grad_out)
    checkpointed = outputs_and_grads(
        lambda *x: torch.utils.checkpoint.checkpoint(sparse_attention_triton, *x, index, use_reentrant=False),
        q, k, v, grad_out)
    # The eager autograd.Function and the custom ops that torch.compile traces run the same launches.
    for a, b, c in zip(eager, compiled, checkpointed):
        assert torch.equal(a, b) and torch.equal(a, c)
    qkv, index_args = (q.detach(), k.detach(), v.detach()), (index.indices, index.counts)
    key_major, scalars = index.key_major(), (16, 16, 0.25)
    for saved_key_major in (key_major, (None, None)):  # None: the forward ran without grad
        assert_opcheck_passes(torch.ops.dsv.sparse_attention_fwd.default,
                              (*qkv, *index_args, *saved_key_major, *scalars))
    out, lse = torch.ops.dsv.sparse_attention_fwd(*qkv, *index_args, None, None, *scalars)
    grads = {}
    for name, given in (("given", key_major), ("built", (None, None))):  # built: the bwd op makes its own
        bwd_args = (grad_out, *qkv, out, lse, None, *index_args, *given, *scalars)
        assert_opcheck_passes(torch.ops.dsv.sparse_attention_bwd.default, bwd_args)
        grads[name] = torch.ops.dsv.sparse_attention_bwd(*bwd_args)
    for a, b, want in zip(grads["given"], grads["built"], eager[1:]):
        assert torch.equal(a, b) and torch.equal(a, want)


@interpreter
def test_interpreter_key_major_index_built_once_per_index(monkeypatch):
    """Backward passes over one index (a checkpointed one too) build its key-major view once, and forwards
    whose backward never runs build none; the gradients through the cached view match the reference."""
    import dsv.ops.index as index_module

    builds = []

    def counted(build):
        def wrapper(*args):
            builds.append(args)
            return build(*args)
        return wrapper

    monkeypatch.setattr(index_module, "key_major_csr", counted(index_module.key_major_csr))
    monkeypatch.setattr(tk, "key_major_csr", counted(tk.key_major_csr))  # the backward's own build
    B, H, S, D = 1, 2, 80, 16
    index = ragged_index(B, H, S, 16, 16, max_keep=3)
    q, k, v = leaf_inputs(B, H, S, D, torch.float32)
    grad_out = torch.randn(B, H, S, D)
    with torch.no_grad():
        sparse_attention_triton(q, k, v, index)
    sparse_attention_triton(q.detach(), k.detach(), v.detach(), index)
    sparse_attention_triton(q, k, v, index)  # as the first pass of a checkpointed layer: no backward follows
    assert builds == []
    first = outputs_and_grads(lambda *x: sparse_attention_triton(*x, index), q, k, v, grad_out)
    second = outputs_and_grads(
        lambda *x: torch.utils.checkpoint.checkpoint(sparse_attention_triton, *x, index, use_reentrant=False),
        q, k, v, grad_out)
    assert len(builds) == 1
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = outputs_and_grads(lambda *x: sparse_attention_reference(*x, index), q64, k64, v64, grad_out.double())
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), first, second, want):
        assert torch.equal(a, b), name
        assert rel_err(a, c) < FP32_REL_TOL, name


@interpreter
def test_interpreter_checkpoint_recompute_with_another_index_is_caught():
    """The eager path saves the index tensors like the activations: a checkpoint recompute that selects
    other blocks (here another K_max) raises rather than pairing the first pass's index with the
    recompute's outputs."""
    B, H, S, D = 1, 1, 64, 16
    indices = iter([random_index(B, H, S, 16, 16, keep=[1]), random_index(B, H, S, 16, 16, keep=[3])])
    q, k, v = leaf_inputs(B, H, S, D, torch.float32)
    out = torch.utils.checkpoint.checkpoint(lambda *x: sparse_attention_triton(*x, next(indices)), q, k, v,
                                            use_reentrant=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        out.sum().backward()


@interpreter
def test_interpreter_eager_graph_does_not_keep_the_index_object():
    """The eager autograd node keeps the index tensors as saved tensors (which a checkpoint drops until its
    recompute), not the index object: in a checkpointed layer's first pass the object would otherwise stay
    alive until the backward. A backward whose index object is gone builds the key-major view itself."""
    import gc
    import weakref

    B, H, S, D = 1, 2, 64, 16
    index = random_index(B, H, S, 16, 16, keep=[1, 3])
    q, k, v = leaf_inputs(B, H, S, D, torch.float32)
    grad_out = torch.randn(B, H, S, D)
    want = outputs_and_grads(lambda *x, given=index: sparse_attention_triton(*x, given), q, k, v, grad_out)
    out = sparse_attention_triton(q, k, v, index)
    alive = weakref.ref(index)
    del index
    gc.collect()
    assert alive() is None, "the autograd graph holds the SparseIndex object"
    out.backward(grad_out)
    for name, got, expected in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want[1:]):
        assert torch.equal(got, expected), name


@interpreter
def test_interpreter_eager_calls_take_the_function_and_meta_inputs_the_custom_op():
    """Plain tensors take the eager autograd.Function; meta inputs (shape propagation) reach the custom op,
    whose fake implementation answers without launching a kernel."""
    index = random_index(1, 2, 64, 16, 16, keep=[1, 2])
    q, k, v = leaf_inputs(1, 2, 64, 16, torch.float32)
    out, lse = sparse_attention_triton_with_lse(q, k, v, index)
    assert type(out.grad_fn).__name__ == "_SparseAttentionEagerBackward"
    meta = [x.detach().to("meta") for x in (q, k, v)]
    meta_index = SparseIndex(index.indices.to("meta"), index.counts.to("meta"), 16, 16, 64)
    out, lse = sparse_attention_triton_with_lse(*meta, meta_index)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (1, 2, 64)


@interpreter
def test_interpreter_double_backward_raises():
    """The kernels have no double backward: a loss on the gradients raises instead of dropping that term."""
    index = random_index(1, 1, 32, 16, 16, keep=[1])
    q, k, v = leaf_inputs(1, 1, 32, 16, torch.float32)
    out = sparse_attention_triton(q, k, v, index)
    dq, _, _ = torch.autograd.grad((out**2).sum(), (q, k, v), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (dq.sum() + q.sum()).backward()


@interpreter
def test_tma_descriptor_of_a_misaligned_view_is_an_aligned_copy():
    """A view one element into its storage is contiguous but not 16-byte aligned: TMA gets a compact copy
    (it was refused with a misleading head-dim error)."""
    flat = torch.randn(1 + 2 * 3 * 64 * 128, dtype=torch.bfloat16)
    shifted = flat[1:].view(2, 3, 64, 128)
    desc = tk._descriptor(shifted, 64, 128, KernelConfig(64, 64, 4, 2, tma=True))
    assert desc.base.data_ptr() % 16 == 0 and torch.equal(desc.base, shifted)


def test_rejects_unsupported_arguments():
    q = torch.randn(1, 1, 64, 16)
    bad_group = SparseIndex(torch.zeros(1, 1, 8, 1, dtype=torch.int32), torch.ones(1, 1, 8, dtype=torch.int32),
                            8, 16, 64)
    with pytest.raises(ValueError, match="power of two"):
        sparse_attention_triton(q, q, q, bad_group)
    index = random_index(1, 1, 64, 16, 16, keep=[1])
    with pytest.raises(ValueError, match="dtype"):
        sparse_attention_triton(q, q, q.double(), index)
    wide = torch.randn(1, 1, 64, 320)
    with pytest.raises(ValueError, match="head dim"):
        sparse_attention_triton(wide, wide, wide, index)
    with pytest.raises(ValueError, match="seq_len"):
        sparse_attention_triton(q[:, :, :48], q[:, :, :48], q[:, :, :48], index)
    offsets, groups = index.key_major()
    lse = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="key_major must be int32"):
        tk.sparse_attention_bwd_launch(q, q, q, q, q, lse, None, index.indices, index.counts, 16, 16, 0.25,
                                       key_major=(offsets[:-1], groups))
    # The backward's own tensors: undersized ones would be read past their end by the kernels.
    for args, match in (((q[:, :, :32], q, lse, None), r"do must be \[B, H, S, D\]"),
                        ((q, q.double(), lse, None), r"out must be \[B, H, S, D\]"),
                        ((q, q, lse[:, :, :5], None), r"lse must be float32 \[B, H, S\]"),
                        ((q, q, lse, lse.double()), r"dlse must be float32 \[B, H, S\]")):
        do, out, lse_arg, dlse = args
        with pytest.raises(ValueError, match=match):
            tk.sparse_attention_bwd_launch(do, q, q, q, out, lse_arg, dlse, index.indices, index.counts, 16, 16, 0.25)


def assert_valid_topk(index: SparseIndex, q_lr, k_lr, keep, tol):
    """Rows keep ``keep[h]`` (clipped) blocks whose fp64 scores are a top-k up to ``tol``."""
    index.validate()
    counts = index.valid_mask().sum(-1)
    want_counts = torch.as_tensor(keep).clamp(max=index.num_kv_blocks).to(counts).view(1, -1, 1)
    assert torch.equal(counts, want_counts.expand_as(counts))
    scores = segment_means(q_lr.double(), index.group_size) @ segment_means(k_lr.double(), index.kv_block).mT
    nkb = scores.shape[-1]
    # PAD entries scatter into an extra column that is dropped.
    ids = torch.where(index.valid_mask(), index.indices.long(), nkb)
    kept = torch.zeros(*scores.shape[:-1], nkb + 1, dtype=torch.bool, device=scores.device)
    kept = kept.scatter_(-1, ids, True)[..., :nkb]
    min_kept = scores.masked_fill(~kept, float("inf")).amin(-1)
    max_dropped = scores.masked_fill(kept, float("-inf")).amax(-1)
    assert bool((max_dropped <= min_kept + tol).all())


@interpreter
@pytest.mark.parametrize("shape", [(1, 2, 100, 16, 16, 16), (2, 3, 257, 8, 24, 8), (1, 1, 64, 4, 64, 1)],
                         ids=lambda s: "B{}H{}S{}r{}G{}kv{}".format(*s))
def test_interpreter_estimate_matches_reference(shape):
    B, H, S, r, G, kv = shape
    nkb = math.ceil(S / kv)
    keep = torch.tensor([1, nkb + 5, 7][:H])  # includes a count past NKB, which is clipped
    q_lr, k_lr = torch.randn(B, H, S, r), torch.randn(B, H, S, r)
    got = estimate_index_triton(q_lr, k_lr, keep, G, kv)
    want = estimate_index(q_lr, k_lr, keep, G, kv)
    assert_valid_topk(got, q_lr, k_lr, keep, tol=1e-5)
    assert torch.equal(got.counts, want.counts)
    # fp32 scores summed in another order can swap two blocks only at a near-tie.
    assert (got.indices != want.indices).float().mean().item() < 0.02


@interpreter
def test_interpreter_estimate_from_means_matches_reference():
    """The top-k launch alone, on already pooled rows (ragged: NG != NKB), against the reference."""
    from dsv.ops.estimate.naive import estimate_index_from_means
    from dsv.ops.estimate.triton_kernels import estimate_index_from_means_triton

    B, H, S, r, G, kv = 2, 3, 100, 8, 16, 8
    proxies, block_keys = torch.randn(B, H, math.ceil(S / G), r), torch.randn(B, H, math.ceil(S / kv), r)
    keep = torch.tensor([1, 4, 20])  # 20 > NKB = 13: clipped
    got = estimate_index_from_means_triton(proxies, block_keys, keep, G, kv, S)
    want = estimate_index_from_means(proxies, block_keys, keep, G, kv, S)
    assert (got.group_size, got.kv_block, got.seq_len) == (G, kv, S)
    assert torch.equal(got.counts, want.counts)
    # Both score in fp32 over r = 8 products; only a near-tie could order two blocks differently.
    assert (got.indices != want.indices).float().mean().item() < 0.02


@interpreter
def test_interpreter_estimate_rows_equal_those_rows_of_the_whole_index():
    """A rank's groups alone (sequence-parallel selection): the fused launch on a slice of the proxies gives
    the whole index's rows of those groups."""
    from dsv.ops.estimate.triton_kernels import estimate_index_from_means_triton, estimate_rows_from_means_triton

    B, H, S, r, G, kv = 1, 2, 96, 8, 16, 8
    proxies, block_keys = torch.randn(B, H, S // G, r), torch.randn(B, H, S // kv, r)
    keep = torch.tensor([3, 5])
    whole = estimate_index_from_means_triton(proxies, block_keys, keep, G, kv, S)
    indices, counts = estimate_rows_from_means_triton(proxies[:, :, 2:5], block_keys, keep, G, kv, S, 2)
    assert torch.equal(indices, whole.indices[:, :, 2:5]) and torch.equal(counts, whole.counts[:, :, 2:5])


@interpreter
def test_interpreter_estimate_ranks_nan_scores_last():
    """A NaN score (a diverged predictor's) is never preferred to a real one: its float bits would map to the
    top of the order. With more blocks kept than real scores, the NaN blocks fill the rest."""
    from dsv.ops.estimate.triton_kernels import estimate_index_from_means_triton

    B, H, S, r, G, kv = 1, 1, 64, 4, 16, 8
    proxies, block_keys = torch.randn(B, H, S // G, r), torch.randn(B, H, S // kv, r)
    block_keys[..., 3, :] = float("nan")
    got = estimate_index_from_means_triton(proxies, block_keys, torch.tensor([7]), G, kv, S)
    assert (got.indices[..., :7] != 3).all()  # 7 of the 7 real blocks
    got = estimate_index_from_means_triton(proxies, block_keys, torch.tensor([8]), G, kv, S)
    assert (got.indices == 3).any(-1).all()  # all 8: the NaN block comes last, still listed


@interpreter
def test_interpreter_estimate_ties_keep_lower_ids():
    """Integer-valued inputs make fp32 scores exact, so ties are real and must match the reference bit for bit."""
    B, H, S, r, G, kv = 2, 2, 96, 4, 16, 8
    q_lr = torch.randint(-2, 3, (B, H, S, r)).float()
    k_lr = torch.randint(-1, 2, (B, H, S, r)).float()
    k_lr[:, 1] = 1.0  # head 1: every block scores the same, so the lowest ids win
    keep = torch.tensor([5, 3])
    got = estimate_index_triton(q_lr, k_lr, keep, G, kv)
    want = estimate_index(q_lr, k_lr, keep, G, kv)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.counts, want.counts)
    assert got.indices[:, 1].eq(torch.tensor([0, 1, 2, -1, -1], dtype=torch.int32)).all()


# ----------------------------------------------------------------------------------------------------------
# GPU, compiled kernels, bf16/fp16
# ----------------------------------------------------------------------------------------------------------

# (B, H, S, D, group_size, kv_block, keep per head)
GPU_CASES = [
    (1, 4, 4096, 128, 128, 128, [4, 8, 12, 32]),   # per-head k, last head keeps every block
    (2, 3, 3001, 64, 64, 64, [3, 10, 47]),          # batch > 1, ragged S, D = 64
    (1, 2, 2048, 128, 64, 128, [5, 9]),             # G < kv_block
    (1, 2, 1500, 96, 64, 32, [7, 20]),              # D padded to 128, kv_block 32, ragged
    (1, 2, 1024, 256, 64, 64, [3, 16]),             # D = 256, the largest head dim accepted
    # S a multiple of the default 64-row tiles but not of kv_block / the group: the last key block's (or
    # query group's) second sub-tile lies wholly past S.
    (1, 2, 2112, 128, 64, 128, [5, 17]),
    (2, 2, 2112, 128, 128, 64, [9, 33]),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "B{}H{}S{}D{}G{}kv{}".format(*c[:6]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_matches_fp32_reference(case, dtype):
    B, H, S, D, G, kv, keep = case
    index = random_index(B, H, S, G, kv, keep, device="cuda")
    q, k, v = leaf_inputs(B, H, S, D, dtype, device="cuda")
    grad_out = torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    got = outputs_and_grads(lambda *x: sparse_attention_triton(*x, index), q, k, v, grad_out)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = outputs_and_grads(lambda *x: sparse_attention_reference(*x, index), q32, k32, v32, grad_out.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert rel_err(a, b) < dtype_rel_tol(dtype), (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq-pass", "atomic-dq"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_gpu_load_paths_on_strided_inputs(tma, atomic_dq):
    """Both load paths (the defaults use TMA on Hopper) on [B, S, H, D]-transposed inputs, ragged S, and both
    ways of computing dq (its own pass, or atomics from the dk/dv pass: TMA bulk reductions with TMA)."""
    B, H, S, D, G, kv = 2, 3, 2000, 128, 128, 128
    index = random_index(B, H, S, G, kv, [2, 5, 9], device="cuda")
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    grad_out = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    cfg = dataclasses.replace(tk.default_config(D, G, kv, tma=tma), atomic_dq=atomic_dq)
    out, lse = tk.sparse_attention_fwd_launch(q, k, v, index.indices, index.counts, G, kv, D**-0.5, cfg.fwd)
    # Both sources of the key-major index: the index's cached view, or the launcher's own build.
    key_major = index.key_major() if atomic_dq else None
    grads = tk.sparse_attention_bwd_launch(grad_out, q, k, v, out, lse, None, index.indices, index.counts, G, kv,
                                           D**-0.5, cfg, key_major=key_major)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = sparse_attention_reference(q32, k32, v32, index)
    want = (ref, *torch.autograd.grad(ref, (q32, k32, v32), grad_out.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        assert rel_err(a, b) < dtype_rel_tol(torch.bfloat16), (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_all_blocks_equals_dense_sdpa():
    """k = every block is dense attention: our bf16 error is within 2x of PyTorch's own bf16 SDPA error."""
    B, H, S, D = 1, 4, 2048, 128
    index = random_index(B, H, S, 128, 128, [S // 128] * H, device="cuda")
    q, k, v = leaf_inputs(B, H, S, D, torch.bfloat16, device="cuda")
    grad_out = torch.randn_like(q)
    got = outputs_and_grads(lambda *x: sparse_attention_triton(*x, index), q, k, v, grad_out)
    sdpa = outputs_and_grads(F.scaled_dot_product_attention, q, k, v, grad_out)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = outputs_and_grads(F.scaled_dot_product_attention, q32, k32, v32, grad_out.float())
    for name, a, s, w in zip(("out", "dq", "dk", "dv"), got, sdpa, want):
        # 2x PyTorch's own error, plus a floor of a quarter ulp for outputs SDPA happens to round well.
        assert rel_err(a, w) <= 2 * rel_err(s, w) + torch.finfo(torch.bfloat16).eps / 4, name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_writes_every_output_element():
    """Freed NaN blocks of the outputs' sizes are what the caching allocator hands the kernels next."""
    B, H, S, D, G, kv = 2, 3, 3001, 128, 128, 64
    index = random_index(B, H, S, G, kv, [2, 5, 9], device="cuda")
    q, k, v = leaf_inputs(B, H, S, D, torch.bfloat16, device="cuda")
    grad_out = torch.randn_like(q)
    torch.cuda.synchronize()
    poison = [torch.full((B, H, S, D), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(6)]
    poison += [torch.full((B, H, S), float("nan"), dtype=torch.float32, device="cuda") for _ in range(3)]
    del poison
    out, lse = sparse_attention_triton_with_lse(q, k, v, index)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert torch.isfinite(t).all(), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_inductor_fullgraph():
    B, H, S, D = 1, 2, 1024, 64
    index = random_index(B, H, S, 64, 64, [3, 6], device="cuda")
    q, k, v = leaf_inputs(B, H, S, D, torch.bfloat16, device="cuda")
    grad_out = torch.randn_like(q)
    fn = lambda q, k, v: sparse_attention_triton(q * 1.0, k, v, index)  # noqa: E731 - a traced pointwise op too
    eager = outputs_and_grads(fn, q, k, v, grad_out)
    compiled = outputs_and_grads(torch.compile(fn, fullgraph=True), q, k, v, grad_out)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_estimate_matches_reference(dtype):
    B, H, S, r, G, kv = 2, 4, 16384 + 37, 16, 64, 64
    keep = torch.tensor([1, 26, 103, 300])
    q_lr = torch.randn(B, H, S, r, device="cuda").to(dtype)
    k_lr = torch.randn(B, H, S, r, device="cuda").to(dtype)
    got = estimate_index_triton(q_lr, k_lr, keep, G, kv)
    want = estimate_index(q_lr, k_lr, keep, G, kv)
    # fp32 pooling and scoring; another summation order may reorder scores within a few fp32 ulps.
    assert_valid_topk(got, q_lr, k_lr, keep, tol=1e-5)
    assert (got.indices != want.indices).float().mean().item() < 1e-3
    # Integer inputs with power-of-two tails (S' = 16384 + 32) make every mean and score exact in fp32.
    S = 16384 + 32
    q_int, k_int = (torch.randint(-2, 3, (B, H, S, r), device="cuda").float() for _ in range(2))
    got = estimate_index_triton(q_int, k_int, keep, G, kv)
    want = estimate_index(q_int, k_int, keep, G, kv)
    assert torch.equal(got.indices, want.indices)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_float64_estimation_goes_to_the_reference():
    """The kernels score in float32: blocks 1e-12 apart tied and the lower id won, where the reference (float64)
    picks the higher one. float64 inputs now take the reference under "auto"."""
    from dsv.ops.estimate import estimate_index as estimate_index_auto
    from dsv.ops.estimate import triton_estimation_unsupported

    q_lr = torch.ones(1, 1, 48, 1, dtype=torch.float64, device="cuda")
    k_lr = torch.tensor([1.0] * 16 + [1.0 + 1e-12] * 16 + [0.5] * 16, dtype=torch.float64, device="cuda")
    k_lr = k_lr.view(1, 1, 48, 1)
    keep = torch.tensor([1], device="cuda")
    assert "float64" in triton_estimation_unsupported(q_lr, 16, 48)
    chosen = estimate_index_auto(q_lr, k_lr, keep, 16, 16)
    reference = estimate_index(q_lr, k_lr, keep, 16, 16)
    assert torch.equal(chosen.indices, reference.indices) and int(reference.indices[0, 0, 0, 0]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (inputs on cuda:1, cuda:0 current)")
def test_gpu_kernels_run_on_their_inputs_device_when_another_is_current():
    """Triton launches on the current device: a model on cuda:1 in a process whose current device is cuda:0 must
    still have its estimation, forward and backward run on cuda:1 (on NaN-poisoned memory there), and right."""
    torch.cuda.set_device(0)
    device = torch.device("cuda", 1)
    B, H, S, D, r, G, kv = 1, 2, 3001, 128, 16, 64, 64
    keep = torch.tensor([5, 12])
    q_lr, k_lr = (torch.randn(B, H, S, r, device=device) for _ in range(2))
    index = estimate_index_triton(q_lr, k_lr, keep, G, kv)
    assert index.indices.device == device
    assert_valid_topk(index, q_lr, k_lr, keep, tol=1e-5)  # as test_gpu_estimate_matches_reference
    q, k, v = leaf_inputs(B, H, S, D, torch.bfloat16, device=device)
    grad_out = torch.randn_like(q)
    poison = [torch.full((B, H, S, D), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(6)]
    del poison  # freed NaN blocks: what cuda:1's caching allocator hands the kernels' outputs next
    got = outputs_and_grads(lambda *x: sparse_attention_triton(*x, index), q, k, v, grad_out)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = outputs_and_grads(lambda *x: sparse_attention_reference(*x, index), q32, k32, v32, grad_out.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.device == device and torch.isfinite(a).all(), name
        assert rel_err(a, b) < dtype_rel_tol(torch.bfloat16), (name, rel_err(a, b))
    assert torch.cuda.current_device() == 0  # the guard puts the caller's device back
