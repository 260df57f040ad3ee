import dataclasses
import importlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from dsv.ops.index import SparseIndex
from dsv.ops.sparse_attention import (
    resolve_backend,
    sparse_attention,
    sparse_attention_reference,
    sparse_attention_reference_with_lse,
)
from tests import assert_opcheck_passes

TOLERANCES = {
    # Both sides fp64; only the summation order differs over <= ~100-term sums.
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    # fp32 accumulation (eps 1.2e-7) over <= ~100-term sums against an fp64 reference, 100x headroom.
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
    # bf16 rounding of outputs and gradients (2^-8 relative), and D_i uses the bf16-rounded output.
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def random_index(B, H, S, group_size, kv_block, keep):
    num_groups, num_kv_blocks = math.ceil(S / group_size), math.ceil(S / kv_block)
    scores = torch.randn(B, H, num_groups, num_kv_blocks)
    return SparseIndex.from_topk(scores, torch.tensor(keep), group_size, kv_block, S)


def dense_mask(index):
    """Bool [B, H, S, S]: query i may see key j, built by looping over the index rows."""
    B, H, NG, _ = index.indices.shape
    G, kv, S = index.group_size, index.kv_block, index.seq_len
    mask = torch.zeros(B, H, S, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for g in range(NG):
                for j in index.indices[b, h, g, : index.counts[b, h, g]].tolist():
                    mask[b, h, g * G : (g + 1) * G, j * kv : (j + 1) * kv] = True
    return mask


def dense_masked_attention(q, k, v, mask, scale=None):
    """fp64 dense attention with a boolean mask; returns (out, lse)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


def make_inputs(B, H, S, D, dtype):
    return [torch.randn(B, H, S, D, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3)]


def forward_and_grads(attention, q, k, v, grad_out):
    out = attention(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def assert_matches_dense(q, k, v, index, scale=None, chunk_groups=None):
    """Forward and dq, dk, dv of the reference against fp64 dense masked attention on the same values."""
    mask = dense_mask(index)
    grad_out = torch.randn_like(q)
    ours = forward_and_grads(
        lambda *qkv: sparse_attention_reference(*qkv, index, scale=scale, chunk_groups=chunk_groups),
        q, k, v, grad_out,
    )
    upcast = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = forward_and_grads(
        lambda *qkv: dense_masked_attention(*qkv, mask, scale)[0], *upcast, grad_out.double()
    )
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert got.dtype == q.dtype, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, **TOLERANCES[q.dtype], msg=lambda m, name=name: f"{name}: {m}")


CASES = {
    "even, kv_block = group_size": (1, 2, 32, 8, 8, 8, [1, 4]),
    "ragged, batch 2, kv_block 4": (2, 3, 37, 8, 8, 4, [1, 3, 10]),
    "ragged, token-level keys": (1, 2, 29, 4, 4, 1, [3, 17]),
    "ragged, one head keeps every block": (2, 2, 45, 16, 8, 8, [2, 6]),
    "single partial group": (1, 1, 5, 4, 8, 4, [1]),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_dense_masked_attention(case, dtype):
    B, H, S, D, group_size, kv_block, keep = case
    index = random_index(B, H, S, group_size, kv_block, keep)
    assert_matches_dense(*make_inputs(B, H, S, D, dtype), index)


def test_bfloat16_matches_dense_within_bf16_rounding():
    B, H, S, D = 1, 2, 40, 16
    index = random_index(B, H, S, 8, 8, [2, 4])
    assert_matches_dense(*make_inputs(B, H, S, D, torch.bfloat16), index)


def test_reference_ignores_the_callers_autocast():
    """The reference computes in float32 under the caller's bf16 autocast too (its matmuls would otherwise run
    in bf16, and eager training would differ from a compiled graph, which runs them with autocast off):
    forward and gradients identical with and without it."""
    B, H, S, D = 1, 2, 40, 16
    index = random_index(B, H, S, 8, 8, [2, 4])
    q, k, v = make_inputs(B, H, S, D, torch.bfloat16)
    grad_out = torch.randn(B, H, S, D).to(torch.bfloat16)

    def run(autocast: bool):
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = sparse_attention_reference(*inputs, index)
        return (out, *torch.autograd.grad(out, inputs, grad_out))

    for plain, autocast in zip(run(False), run(True)):
        assert torch.equal(plain, autocast)


@pytest.mark.parametrize("chunk_groups", [1, 3])
def test_chunked_matches_dense(chunk_groups):
    index = random_index(2, 2, 43, 4, 4, [3, 7])
    assert_matches_dense(*make_inputs(2, 2, 43, 8, torch.float64), index, chunk_groups=chunk_groups)


def test_custom_scale_matches_dense():
    index = random_index(1, 2, 24, 4, 4, [2, 5])
    assert_matches_dense(*make_inputs(1, 2, 24, 8, torch.float64), index, scale=0.7)


@pytest.mark.parametrize("S, group_size, kv_block", [(48, 8, 8), (39, 8, 4), (21, 4, 1)])
def test_keeping_every_block_equals_sdpa(S, group_size, kv_block):
    B, H, D = 2, 2, 8
    index = random_index(B, H, S, group_size, kv_block, [math.ceil(S / kv_block)] * H)
    q, k, v = make_inputs(B, H, S, D, torch.float64)
    grad_out = torch.randn_like(q)
    ours = forward_and_grads(lambda *qkv: sparse_attention(*qkv, index), q, k, v, grad_out)
    expected = forward_and_grads(F.scaled_dot_product_attention, q, k, v, grad_out)
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, expected):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float64], msg=lambda m, name=name: f"{name}: {m}")


def test_lse_matches_dense_and_every_output_is_written():
    B, H, S, D = 2, 2, 37, 8
    index = random_index(B, H, S, 8, 4, [2, 5])
    q, k, v = make_inputs(B, H, S, D, torch.float32)
    # Outputs start as NaN; a row missed by the chunk loop would stay NaN here.
    out, lse = sparse_attention_reference_with_lse(q, k, v, index, chunk_groups=2)
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32 and not lse.requires_grad
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    _, dense_lse = dense_masked_attention(q, k, v, dense_mask(index))
    torch.testing.assert_close(lse.double(), dense_lse, **TOLERANCES[torch.float32])
    out.backward(torch.randn_like(out))
    for name, grad in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(grad).all(), name


def test_reference_ops_pass_opcheck():
    """The reference is the custom ops `dsv::sparse_attention_reference_fwd/bwd` (what torch.compile sees):
    schema, fake (meta) implementation, autograd registration; q in a transposed layout too."""
    B, H, S, D = 2, 2, 37, 8
    index = random_index(B, H, S, 8, 4, [2, 5])
    q, k, v = make_inputs(B, H, S, D, torch.float64)
    q_transposed = torch.randn(B, S, H, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    for query, chunk_groups in ((q, 2), (q_transposed, None)):
        args = (query, k, v, index.indices, index.counts, 8, 4, 0.3, chunk_groups)
        assert_opcheck_passes(torch.ops.dsv.sparse_attention_reference_fwd.default, args)
    out, lse = torch.ops.dsv.sparse_attention_reference_fwd(q.detach(), k.detach(), v.detach(), index.indices,
                                                            index.counts, 8, 4, 0.3, 2)
    assert_opcheck_passes(torch.ops.dsv.sparse_attention_reference_bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, index.indices,
                           index.counts, 8, 4, 0.3, 2))


def test_keys_no_group_selects_get_zero_gradient():
    S, group_size, kv_block = 16, 4, 4
    # Every group keeps blocks 0 and 2 only.
    indices = torch.tensor([0, 2], dtype=torch.int32).expand(1, 1, 4, 2).contiguous()
    index = SparseIndex(indices, torch.full((1, 1, 4), 2, dtype=torch.int32), group_size, kv_block, S)
    q, k, v = make_inputs(1, 1, S, 4, torch.float64)
    sparse_attention(q, k, v, index).sum().backward()
    unselected = torch.cat([torch.arange(4, 8), torch.arange(12, 16)])
    assert (k.grad[0, 0, unselected] == 0).all() and (v.grad[0, 0, unselected] == 0).all()
    assert (k.grad[0, 0, :4] != 0).any() and (v.grad[0, 0, 8:12] != 0).any()


def test_gradcheck_float64():
    index = random_index(1, 2, 7, 3, 2, [1, 3])
    q, k, v = make_inputs(1, 2, 7, 3, torch.float64)
    assert torch.autograd.gradcheck(lambda *qkv: sparse_attention_reference(*qkv, index, chunk_groups=2),
                                    (q, k, v))


def test_dispatcher_backends():
    index = random_index(1, 2, 16, 4, 4, [1, 2])
    q, k, v = make_inputs(1, 2, 16, 8, torch.float64)
    expected = sparse_attention_reference(q, k, v, index)
    for backend in ("auto", "reference"):
        assert torch.equal(sparse_attention(q, k, v, index, backend=backend), expected)
    # Triton cannot take CPU float64 inputs: "auto" says why it fell back, "triton" refuses with the reason.
    assert resolve_backend("auto", q, index.group_size, index.kv_block) == (
        "reference", "inputs are on cpu; the Triton kernels need a CUDA device")
    with pytest.raises(ValueError, match=r"backend='triton' cannot run: inputs are on cpu"):
        sparse_attention(q, k, v, index, backend="triton")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'reference', 'triton'\), got 'cuda'"):
        sparse_attention(q, k, v, index, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_says_once_per_reason_when_the_reference_runs_on_a_gpu(monkeypatch):
    """float32 on a GPU takes the reference, many times slower than the kernels: "auto" used to say nothing."""
    # The package, not the function of the same name that dsv.ops exports (`import ... as` would find that).
    public = importlib.import_module("dsv.ops.sparse_attention")
    monkeypatch.setattr(public, "_WARNED_FALLBACKS", set())
    cpu_index = random_index(1, 2, 64, 16, 16, [1, 2])
    index = dataclasses.replace(cpu_index, indices=cpu_index.indices.cuda(), counts=cpu_index.counts.cuda())
    q, k, v = (t.cuda() for t in make_inputs(1, 2, 64, 16, torch.float32))
    with pytest.warns(UserWarning, match="the PyTorch reference runs on cuda:0, not the Triton kernels: dtype"):
        sparse_attention(q, k, v, index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: silent
        sparse_attention(q, k, v, index)
        sparse_attention(q, k, v, index, backend="reference")  # asked for: silent


def good_arguments():
    index = random_index(2, 2, 16, 4, 4, [1, 2])
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    return {"q": q, "k": k, "v": v, "index": index}


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {"q": a["q"][0]}, r"q must be 4-D \[B, H, S, D\]"),
        (lambda a: {"k": a["k"].double()}, r"k has dtype torch.float64 but q has torch.float32"),
        (lambda a: {"v": a["v"][..., :4]}, r"v has shape \(2, 2, 16, 4\) but q has \(2, 2, 16, 8\)"),
        (lambda a: {name: a[name].to(torch.int32) for name in "qkv"}, r"q must have a floating dtype"),
        (lambda a: {"index": random_index(1, 2, 16, 4, 4, [1, 2])}, r"index.indices has \[B, H, NG\]"),
        (lambda a: {"index": random_index(2, 2, 15, 4, 4, [1, 2])}, r"index.seq_len=15 does not match"),
        (lambda a: {"index": a["index"].indices}, r"index must be a SparseIndex"),
        # Read before their checks: an AttributeError, a ZeroDivisionError.
        (lambda a: {"q": a["q"].numpy()}, r"q must be a torch.Tensor \[B, H, S, D\], got ndarray"),
        (lambda a: {"index": dataclasses.replace(a["index"], group_size=0)},
         r"SparseIndex.group_size must be a positive int, got 0"),
        (lambda a: {"index": dataclasses.replace(a["index"], counts=a["index"].counts * 0)},
         r"SparseIndex.counts must lie in"),
        (lambda a: {"scale": -1.0}, r"scale must be a positive finite float"),
        # The meta device stands in for "another device" on a CPU-only machine.
        (lambda a: {"k": a["k"].to("meta")}, r"k is on meta but q is on cpu"),
        (lambda a: {"index": dataclasses.replace(a["index"], indices=a["index"].indices.to("meta"),
                                                 counts=a["index"].counts.to("meta"))},
         r"index tensors are on meta/meta, inputs on cpu"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(change, match):
    arguments = good_arguments()
    sparse_attention(**arguments)
    with pytest.raises(ValueError, match=match):
        sparse_attention(**(arguments | change(arguments)))


def test_the_triton_path_validates_a_given_index_once_and_the_scale(monkeypatch):
    """The Triton kernels read the listed blocks as given (a duplicate counts twice, an out-of-range id reads
    outside k/v): the public entry validates an index before them, once per index object, and refuses a
    scale that is not a finite positive number. DSV's layers pass check_index=False for their own indices."""
    import importlib

    # `dsv.ops.sparse_attention` is also a function of `dsv.ops`: the modules are looked up by name.
    public = importlib.import_module("dsv.ops.sparse_attention")
    kernels = importlib.import_module("dsv.ops.sparse_attention.triton_kernels")
    launched = []
    monkeypatch.setattr(public, "resolve_backend", lambda *args: ("triton", None))
    monkeypatch.setattr(kernels, "sparse_attention_triton", lambda q, k, v, index, scale: launched.append(index) or q)
    q = k = v = torch.randn(1, 1, 32, 16)
    duplicate = SparseIndex(torch.tensor([[[[0, 0]], [[0, 1]]]], dtype=torch.int32).view(1, 1, 2, 2),
                            torch.full((1, 1, 2), 2, dtype=torch.int32), 16, 16, 32)
    with pytest.raises(ValueError, match="strictly ascending"):
        public.sparse_attention(q, k, v, duplicate)
    with pytest.raises(ValueError, match="strictly ascending"):  # parameters hold real values too
        public.sparse_attention(torch.nn.Parameter(q), k, v, duplicate)
    assert not launched
    public.sparse_attention(q, k, v, duplicate, check_index=False)  # trusted by the caller: launched as given
    good = dataclasses.replace(duplicate, indices=torch.tensor([0, 1, 0, 1], dtype=torch.int32).view(1, 1, 2, 2))
    validations = []
    monkeypatch.setattr(SparseIndex, "validate", lambda self: validations.append(self))
    public.sparse_attention(q, k, v, good)
    public.sparse_attention(q, k, v, good)
    assert len(validations) == 1 and len(launched) == 3
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fake_mode:  # tracing: values cannot be read, the check is left to the caller
        fake_q = fake_mode.from_tensor(q)
        fake_index = dataclasses.replace(duplicate, indices=fake_mode.from_tensor(duplicate.indices),
                                         counts=fake_mode.from_tensor(duplicate.counts))
        public.sparse_attention(fake_q, fake_q, fake_q, fake_index)
    assert len(validations) == 1
    for scale in (0.0, -1.0, float("nan"), float("inf"), "1", True):  # "1" raised a bare TypeError before
        with pytest.raises(ValueError, match="scale must be a positive finite float"):
            public.sparse_attention(q, k, v, good, scale=scale)


def test_a_sequence_stride_past_int32_over_the_rows_is_made_compact():
    """The kernels offset rows in int32: v as a view of a fused qkv projection (stride 3*H*D) at 100k+ tokens
    would wrap. Such a layout is copied to the compact one (meta tensors: no memory)."""
    import importlib

    kernels = importlib.import_module("dsv.ops.sparse_attention.triton_kernels")
    heads, dim, seq_len = 24, 256, 120_000
    fused = torch.empty(1, seq_len, 3, heads, dim, device="meta")
    v = fused[:, :, 2].transpose(1, 2)  # [B, H, S, D], sequence stride 3 * H * D
    assert v.stride(2) * seq_len >= 2**31
    compact = kernels._last_dim_contiguous(v)
    assert compact.is_contiguous() and compact.stride(2) * seq_len < 2**31
    small = fused[:, :1000, 2].transpose(1, 2)
    assert kernels._last_dim_contiguous(small) is small  # below the bound: used in place
