"""The warp-specialized Hopper forward (Gluon) against the fp32 reference and the Triton forward.

On a CPU the kernel cannot run, but it is compiled for sm_90 with the installed triton (Gluon's API moves
between releases: this catches a triton the kernel no longer compiles with). On a Hopper GPU, ``-m gpu``
runs it in bf16/fp16. The module is imported inside the tests: importing triton while pytest collects would
keep test_triton_kernels from switching on the Triton interpreter first.
"""

import importlib
import math

import pytest
import torch

from dsv.ops.index import SparseIndex
from tests.ops import with_ragged_counts
from tests.ops.gluon_compile import sm90_shared_memory

IS_HOPPER = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9


def hopper_kernels():
    pytest.importorskip("triton", reason="triton not installed: pip install -e '.[triton]'")
    return importlib.import_module("dsv.ops.sparse_attention.hopper_kernels")


# Both launch settings, both head dims of the wide one and both dtypes (each (group, kv_block, D) compiles apart).
SM90_COMPILES = [(128, 128, 128, "bf16"), (128, 256, 64, "bf16"), (64, 64, 128, "bf16"), (128, 128, 128, "fp16")]


def compile_for_sm90(group_size: int, kv_block: int, head_dim: int, dtype: str) -> int:
    """Compile the forward for sm_90 without a GPU (through triton's compiler entry point); returns the shared
    memory it needs in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    hk = hopper_kernels()
    n_cons, block_n, k_stages, v_stages, _, maxnreg = hk._settings(group_size, kv_block)
    x = torch.empty(1, 2, 512, head_dim, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
    kernel = hk._sparse_attn_fwd_ws_kernel
    args = [hk._descriptor(x, 64), hk._descriptor(x, block_n), hk._descriptor(x, block_n), x,
            torch.empty(1, dtype=torch.float32), torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.int32)]
    signature = {name: mangle_type(arg) for name, arg in zip(kernel.arg_names, args)}
    signature.update({name: "i32" for name in ("sob", "soh", "sos", "H", "S", "NG", "K_MAX", "num_tiles")})
    signature["qk_scale"] = "fp32"
    constants = dict(GROUP=group_size, KV_BLOCK=kv_block, BLOCK_N=block_n, N_CONS=n_cons, K_STAGES=k_stages,
                     V_STAGES=v_stages, PRODUCER_REGS=hk._PRODUCER_REGS, CONSUMER_REGS=hk._CONSUMER_REGS,
                     num_warps=4)
    signature.update({name: "constexpr" for name in constants})
    source = GluonASTSource(kernel, signature,
                            constexprs={(kernel.arg_names.index(name),): v for name, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
    assert compiled.asm["cubin"], "no cubin"
    return compiled.metadata.shared


def test_compiles_for_sm90_with_the_installed_triton():
    """In a fresh process: the Triton interpreter (which the kernel tests switch on without a GPU) cannot
    compile Gluon."""
    hk = hopper_kernels()
    if hk.GLUON_IMPORT_ERROR is not None:  # the launcher then never takes this kernel, and says why
        pytest.skip(hk.GLUON_IMPORT_ERROR)
    shared = sm90_shared_memory("tests.ops.test_hopper_kernels")
    assert len(shared) == len(SM90_COMPILES)
    # One program per SM for the 128-row setting, two for the 64-row one: both within the H100/H200's
    # 227 KiB of shared memory per SM.
    programs_per_sm = [1 if hk._settings(g, kv) is hk._WIDE else 2 for g, kv, _, _ in SM90_COMPILES]
    assert all(n * s <= 227 * 1024 for n, s in zip(programs_per_sm, shared)), shared


def test_settings_by_grouping():
    hk = hopper_kernels()
    assert hk._settings(128, 128) == hk._WIDE and hk._settings(256, 128) == hk._WIDE
    assert hk._settings(64, 64) == hk._NARROW
    for group_size, kv_block in ((64, 128), (128, 64), (32, 32), (64, 256)):
        assert hk._settings(group_size, kv_block) is None


def test_misaligned_inputs_get_an_aligned_copy():
    """TMA needs a 16-byte aligned base: a view one element in gets a compact copy, a transposed view is used
    as it is."""
    hk = hopper_kernels()
    flat = torch.randn(1 + 2 * 3 * 64 * 128, dtype=torch.bfloat16)
    shifted = flat[1:].view(2, 3, 64, 128)
    desc = hk._descriptor(shifted, 64)
    assert desc.base.data_ptr() % 16 == 0 and torch.equal(desc.base, shifted)
    transposed = torch.randn(2, 64, 3, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert hk._descriptor(transposed, 64).base is transposed


def test_unsupported_reasons(monkeypatch):
    hk = hopper_kernels()
    assert "Hopper" in hk.hopper_forward_unsupported(torch.empty(1, 1, 64, 128), 128, 128)
    assert hk.hopper_forward_missing(torch.empty(1, 1, 64, 128), 128, 128) is None  # no GPU: nothing to warn of
    # The count check comes after the device check: on a CPU the device is the reason.
    assert hk.hopper_forward_unsupported(torch.empty(1, 1, 64, 128), 128, 128, 2).startswith("needs an NVIDIA Hopper")
    monkeypatch.setattr(hk, "ENABLED", False)
    assert "DSV_HOPPER_FORWARD=0" in hk.hopper_forward_unsupported(torch.empty(1, 1, 64, 128), 128, 128)


# ----------------------------------------------------------------------------------------------------------
# Hopper GPU
# ----------------------------------------------------------------------------------------------------------


def dtype_rel_tol(dtype: torch.dtype) -> float:
    """Two units of the dtype's eps: rounding the output costs half an ulp, rounding P before P.V one more."""
    return 2 * torch.finfo(dtype).eps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# (B, H, S, D, group_size, kv_block, keep per head)
HOPPER_CASES = [
    (1, 4, 4096, 128, 128, 128, [4, 8, 12, 32]),  # per-head k, the last head keeps every block: dense
    (2, 3, 3001, 128, 64, 64, [3, 10, 47]),  # batch > 1, ragged S, the 64-row setting
    (1, 2, 2000, 128, 128, 256, [2, 5]),  # kv_block 256 (two key tiles a block), ragged
    (2, 2, 2112, 64, 128, 128, [9, 17]),  # D = 64 in the 128-row setting; the last group ends past S
]


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: "B{}H{}S{}D{}G{}kv{}".format(*c[:6]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("counts", ["per_head", "per_group"])
@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
def test_hopper_forward_matches_fp32_reference(case, dtype, layout, counts):
    """Fresh NaN-filled memory of the outputs' sizes is what the allocator hands the kernel, so an unwritten
    element fails. `per_group`: counts that differ from group to group within a head (a window index's)."""
    hk = hopper_kernels()
    tk = importlib.import_module("dsv.ops.sparse_attention.triton_kernels")
    naive = importlib.import_module("dsv.ops.sparse_attention.naive")
    B, H, S, D, G, kv, keep = case
    scores = torch.randn(B, H, math.ceil(S / G), math.ceil(S / kv), device="cuda")
    index = SparseIndex.from_topk(scores, torch.tensor(keep), G, kv, S)
    if counts == "per_group":
        index = with_ragged_counts(index)
    if layout == "contiguous":
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
    else:  # [B, S, H, D] memory, as attention layers produce it
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
    torch.cuda.synchronize()
    poison = [torch.full((B, H, S, D), float("nan"), dtype=dtype, device="cuda"),
              torch.full((B, H, S), float("nan"), dtype=torch.float32, device="cuda")]
    del poison
    out, lse = hk.sparse_attention_fwd_hopper(q, k, v, index.indices, index.counts, G, kv, D**-0.5)
    want_out, want_lse = naive.sparse_attention_reference_with_lse(q.float(), k.float(), v.float(), index)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, want_out) < dtype_rel_tol(dtype), rel_err(out, want_out)
    # The reference takes the same rounded inputs in fp32: the LSE differs by fp32 summation order alone
    # (5.5e-8 measured), 1e-5 leaves ~200x headroom.
    assert torch.isfinite(lse).all() and rel_err(lse, want_lse) < 1e-5, rel_err(lse, want_lse)
    cfg = tk.default_config(D, G, kv, tma=True).fwd  # an explicit config runs the Triton forward
    triton_out, _ = tk.sparse_attention_fwd_launch(q, k, v, index.indices, index.counts, G, kv, D**-0.5, cfg)
    assert rel_err(out, triton_out) < dtype_rel_tol(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
def test_default_launch_takes_the_hopper_forward_and_gradients_match(monkeypatch):
    """sparse_attention_triton's forward runs here on Hopper; its LSE feeds the Triton backward."""
    hk = hopper_kernels()
    tk = importlib.import_module("dsv.ops.sparse_attention.triton_kernels")
    naive = importlib.import_module("dsv.ops.sparse_attention.naive")
    calls = []
    monkeypatch.setattr(tk, "sparse_attention_fwd_hopper",
                        lambda *a: calls.append(1) or hk.sparse_attention_fwd_hopper(*a))
    B, H, S, D, G, kv = 2, 2, 1500, 128, 128, 128
    scores = torch.randn(B, H, math.ceil(S / G), math.ceil(S / kv), device="cuda")
    index = SparseIndex.from_topk(scores, torch.tensor([3, 7]), G, kv, S)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad_out = torch.randn_like(q)
    out = tk.sparse_attention_triton(q, k, v, index)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    assert calls, "the default launch did not take the Hopper forward"
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = naive.sparse_attention_reference(q32, k32, v32, index)
    want = (ref, *torch.autograd.grad(ref, (q32, k32, v32), grad_out.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) < dtype_rel_tol(torch.bfloat16), (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
def test_reasons_on_a_hopper_gpu():
    """The cases the launcher leaves to the Triton forward, each with its reason (a layer warns with it)."""
    from dsv.ops.sparse_attention import hopper_forward_unsupported

    x = torch.empty(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    assert hopper_forward_unsupported(x, 128, 128) is None
    assert "head dim 96" in hopper_forward_unsupported(x[..., :96], 128, 128)
    assert "float32" in hopper_forward_unsupported(x.float(), 128, 128)
    assert "group_size 64 with kv_block 128" in hopper_forward_unsupported(x, 64, 128)
    assert "list 2 key blocks" in hopper_forward_unsupported(x, 128, 128, 2)
    assert hopper_forward_unsupported(x, 64, 64) is None and hopper_forward_unsupported(x[..., :64], 128, 128) is None
    assert "head dim 64" in hopper_forward_unsupported(x[..., :64], 64, 64)
    hk = hopper_kernels()
    assert "list 3 key blocks" in hk.hopper_forward_unsupported(x, 128, 128, 3)
    assert hk.hopper_forward_unsupported(x, 128, 128, hk.MIN_LISTED_BLOCKS) is None
    # A layer warns of what the kernel lacks, not of the cases Triton measured faster in.
    from dsv.ops.sparse_attention import hopper_forward_missing

    assert "head dim 96" in hopper_forward_missing(x[..., :96], 128, 128)
    assert hopper_forward_missing(x[..., :64], 64, 64) is None and hopper_forward_missing(x, 128, 128) is None
    assert hopper_forward_missing(x, 32, 32) is None  # the default 2x4x4 cube: left to Triton, no warning


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
@pytest.mark.parametrize("programs", [1, 3])
def test_persistent_walk_over_many_tiles(monkeypatch, programs):
    """With 1 or 3 programs every program walks dozens of tiles, so the K/V ring and Q buffers carry their
    phases from tile to tile; per-head keeps differ (tiles of unequal length) and some groups list no block.
    The Triton forward is the oracle (the reference refuses empty groups; both give zeros and LSE -inf)."""
    hk = hopper_kernels()
    tk = importlib.import_module("dsv.ops.sparse_attention.triton_kernels")
    monkeypatch.setattr(hk, "_sm_count", lambda device_index: programs)
    B, H, S, D, G, kv = 2, 3, 2000, 128, 128, 128
    scores = torch.randn(B, H, math.ceil(S / G), math.ceil(S / kv), device="cuda")
    index = SparseIndex.from_topk(scores, torch.tensor([1, 6, 16]), G, kv, S)
    index.counts[0, 1, 2] = 0
    index.counts[1, 2, 5:9] = 0
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = hk.sparse_attention_fwd_hopper(q, k, v, index.indices, index.counts, G, kv, D**-0.5)
    cfg = tk.default_config(D, G, kv, tma=True).fwd
    want_out, want_lse = tk.sparse_attention_fwd_launch(q, k, v, index.indices, index.counts, G, kv, D**-0.5, cfg)
    assert torch.isfinite(out).all() and rel_err(out, want_out) < dtype_rel_tol(torch.bfloat16)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)) and torch.isneginf(lse).sum() == 5 * G
    finite = torch.isfinite(want_lse)
    assert rel_err(lse[finite], want_lse[finite]) < 1e-5  # both fp32 from the same bf16 inputs


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
def test_compiled_graph_takes_the_hopper_forward(monkeypatch):
    """torch.compile(fullgraph) of the custom op, at a shape the Hopper forward takes: equal to eager."""
    hk = hopper_kernels()
    tk = importlib.import_module("dsv.ops.sparse_attention.triton_kernels")
    calls = []
    monkeypatch.setattr(tk, "sparse_attention_fwd_hopper",
                        lambda *a: calls.append(1) or hk.sparse_attention_fwd_hopper(*a))
    B, H, S, D, G = 1, 2, 1024, 128, 128
    scores = torch.randn(B, H, S // G, S // G, device="cuda")
    index = SparseIndex.from_topk(scores, torch.tensor([4, 6]), G, G, S)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad_out = torch.randn_like(q)

    def fn(q, k, v):
        return tk.sparse_attention_triton(q * 1.0, k, v, index)

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        out = f(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    assert len(calls) == 2
    for a, b in zip(*results):
        assert torch.equal(a, b)
