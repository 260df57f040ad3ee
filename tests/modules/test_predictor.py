"""The low-rank predictor learns to rank keys like the true QKᵀ on a toy problem."""

import copy

import pytest
import torch

from dsv.modules.predictor import LowRankPredictor, predictor_loss
from dsv.ops import estimate_index, index_recall, sample_key_positions, sample_query_rows


def test_loss_is_zero_for_equal_rows_and_positive_otherwise():
    rows = torch.randn(2, 3, 5, 40)
    assert predictor_loss(rows, rows, 0.9, 0.1) < 1e-5
    # A positive rescale keeps the ranking: both terms are scale-invariant.
    assert predictor_loss(3.0 * rows, rows, 0.9, 0.1) < 1e-5
    assert predictor_loss(torch.randn_like(rows), rows, 0.9, 0.1) > 0.5


def test_predictor_learns_the_score_ranking():
    torch.manual_seed(0)
    batch, seq, dim, heads, head_dim, rank = 2, 128, 32, 2, 16, 8
    # The "model": fixed projections whose QKᵀ has rank <= rank, so a perfect predictor exists.
    wq = torch.randn(heads, dim, rank) / dim**0.5
    wk = torch.randn(heads, dim, rank) / dim**0.5
    mix_q, mix_k = torch.randn(heads, rank, head_dim), torch.randn(heads, rank, head_dim)
    predictor = LowRankPredictor(dim, heads, rank=rank, lr=1e-2)
    rows = sample_query_rows(seq, 4)
    scale = head_dim**-0.5

    def batch_qk():
        hidden = torch.randn(batch, seq, dim)
        q = torch.einsum("bsc,hcr,hrd->bhsd", hidden, wq, mix_q)
        k = torch.einsum("bsc,hcr,hrd->bhsd", hidden, wk, mix_k) * 3.0
        return hidden, q, k

    def recall(hidden, q, k):
        with torch.no_grad():
            q_lr, k_lr = predictor.project(hidden)
            keep = torch.full((heads,), 4, dtype=torch.int32)  # 4 of 32 key blocks (12.5%)
            index = estimate_index(q_lr, k_lr, keep, group_size=8, kv_block=4)
            return index_recall(q, k, index, rows, scale=scale).mean().item()

    hidden, q, k = batch_qk()
    first_loss = predictor.update(hidden, q, k, rows, scale).item()
    first_recall = recall(hidden, q, k)
    for _ in range(300):
        predictor.update(*batch_qk(), rows, scale)
    hidden, q, k = batch_qk()
    with torch.no_grad():
        last_loss = predictor.loss(hidden, q, k, rows, scale).item()
    last_recall = recall(hidden, q, k)
    assert last_loss < 0.2 * first_loss, (first_loss, last_loss)
    assert last_recall > first_recall + 0.1, (first_recall, last_recall)


def test_update_does_not_touch_the_model_graph():
    torch.manual_seed(1)
    predictor = LowRankPredictor(16, 2, rank=4)
    hidden = torch.randn(1, 32, 16, requires_grad=True)
    q = torch.randn(1, 2, 32, 8, requires_grad=True)
    k = torch.randn(1, 2, 32, 8, requires_grad=True)
    before = [p.detach().clone() for p in predictor.parameters()]
    predictor.update(hidden, q, k, sample_query_rows(32, 4), 8**-0.5)
    assert hidden.grad is None and q.grad is None and k.grad is None
    assert any(not torch.equal(b, p) for b, p in zip(before, predictor.parameters()))
    # Its own gradients are freed by the update, not kept through the rest of the training step.
    assert all(p.grad is None for p in predictor.parameters())


@pytest.mark.parametrize("dtype,tol", [
    (torch.float64, 1e-10),  # exact algebra: only summation order differs
    (torch.float32, 2e-4),  # float32 Grams over S = 512 keys: ~1e-6 relative per moment, amplified in 1 - cos
])
def test_loss_from_factors_equals_the_loss_on_explicit_scores(dtype, tol):
    from dsv.modules.predictor import predictor_loss_from_factors

    gen = torch.Generator().manual_seed(0)
    q_lr = torch.randn(2, 3, 24, 8, generator=gen, dtype=dtype).requires_grad_(True)
    # Keys with a common offset: the scores' rows have a mean far from zero, which the centring must handle.
    k_lr = (torch.randn(2, 3, 512, 8, generator=gen, dtype=dtype) + 2.0).requires_grad_(True)
    q = torch.randn(2, 3, 24, 16, generator=gen, dtype=dtype)
    k = torch.randn(2, 3, 512, 16, generator=gen, dtype=dtype) + 1.5
    scale = 16**-0.5
    explicit = predictor_loss(q_lr @ k_lr.transpose(-1, -2), (q @ k.transpose(-1, -2)) * scale, 0.9, 0.1)
    factored = predictor_loss_from_factors(q_lr, k_lr, q, k, scale, 0.9, 0.1)
    torch.testing.assert_close(factored, explicit, rtol=tol, atol=tol)
    grads_explicit = torch.autograd.grad(explicit, (q_lr, k_lr))
    grads_factored = torch.autograd.grad(factored, (q_lr, k_lr))
    for a, b in zip(grads_factored, grads_explicit):
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol * 10)


def test_an_all_zero_hidden_row_leaves_the_predictor_finite():
    """A sampled token whose hidden state is all zeros (LayerNorm of a constant row) projects to a zero row:
    its cosine's norm is 0, and the update must step on finite gradients, not write NaN weights."""
    torch.manual_seed(0)
    predictor = LowRankPredictor(16, 2, rank=4)
    hidden = torch.randn(1, 64, 16)
    hidden[0, 0] = 0.0
    q, k = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    before = [p.detach().clone() for p in predictor.parameters()]
    loss = predictor.update(hidden, q, k, torch.arange(0, 64, 8), 8**-0.5)
    assert torch.isfinite(loss)
    for old, new in zip(before, predictor.parameters()):
        assert torch.isfinite(new).all() and not torch.equal(old, new)


def test_loss_on_a_key_sample_is_the_loss_of_those_keys_and_tracks_the_full_gradient():
    """`keys` restricts the loss to those key positions exactly; a random eighth of the keys gives nearly the
    full loss's gradient on inputs with structure (low-rank scores plus noise), which the update follows."""
    torch.manual_seed(3)
    seq, dim, heads, head_dim = 8192, 32, 2, 16
    wq, wk = torch.randn(heads, dim, 4) / dim**0.5, torch.randn(heads, dim, 4) / dim**0.5
    mix_q, mix_k = torch.randn(heads, 4, head_dim), torch.randn(heads, 4, head_dim)
    hidden = torch.randn(1, seq, dim)
    q = torch.einsum("bsc,hcr,hrd->bhsd", hidden, wq, mix_q) + 0.3 * torch.randn(1, heads, seq, head_dim)
    k = torch.einsum("bsc,hcr,hrd->bhsd", hidden, wk, mix_k) + 0.3 * torch.randn(1, heads, seq, head_dim)
    predictor = LowRankPredictor(dim, heads, rank=8)
    rows, scale = sample_query_rows(seq, 16), head_dim**-0.5
    keys = sample_key_positions(seq, 1024, seed=5)

    def gradient(*args) -> tuple[torch.Tensor, torch.Tensor]:
        predictor.zero_grad(set_to_none=True)
        loss = predictor.loss(*args)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in predictor.parameters()])

    sampled_loss, sampled_grad = gradient(hidden, q, k, rows, scale, keys)
    # Exactly the loss over those keys: the same as handing the predictor only them.
    explicit_loss = predictor.factors_loss(
        predictor.q_proj(hidden[:, rows]).view(1, len(rows), heads, 8).transpose(1, 2),
        predictor.k_proj(hidden[:, keys]).view(1, len(keys), heads, 8).transpose(1, 2),
        q[:, :, rows], k[:, :, keys], scale)
    torch.testing.assert_close(sampled_loss, explicit_loss.detach(), rtol=1e-6, atol=1e-7)  # same fp32 ops
    full_loss, full_grad = gradient(hidden, q, k, rows, scale)
    # The sample's error is sampling variance, ∝ 1/m: over four draws of these inputs 1 − cos was 0.04–0.06
    # at m = 256 and 0.010–0.019 at m = 1024 (loss within 0.3%); 0.97 and 2% leave room for the draw. This
    # checks that M keys suffice for the loss, not the sampler (its uniformity: tests/ops/test_measure.py).
    assert abs(sampled_loss - full_loss) <= 0.02 * full_loss
    assert torch.nn.functional.cosine_similarity(sampled_grad, full_grad, dim=0) > 0.97


@pytest.mark.parametrize("seq, group_size, kv_block", [(128, 8, 4), (45, 8, 8), (37, 5, 3)],
                         ids=["even", "ragged-equal-blocks", "ragged-both"])
def test_pooled_projection_selects_as_the_projected_rows(seq, group_size, kv_block):
    """Pooling the hidden states before the (linear, bias-free) projections is the same selection as pooling
    the projected rows, which is what `estimate_index` does with `project`'s output."""
    from dsv.ops import estimate_index_from_means

    torch.manual_seed(0)
    predictor = LowRankPredictor(32, 3, rank=4).double()
    hidden = torch.randn(2, seq, 32, dtype=torch.float64)
    keep = torch.tensor([1, 3, 100])  # includes a count past NKB, which is clipped
    with torch.no_grad():
        proxies, block_keys = predictor.pooled_project(hidden, group_size, kv_block)
        want = estimate_index(*predictor.project(hidden), keep, group_size, kv_block)
        q_lr, k_lr = predictor.project(hidden)
    # float64 end to end: the two summation orders differ by ~1e-15, far below any score gap of random data.
    from dsv.ops.estimate.naive import segment_means

    torch.testing.assert_close(proxies, segment_means(q_lr, group_size), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_keys, segment_means(k_lr, kv_block), rtol=1e-12, atol=1e-12)
    got = estimate_index_from_means(proxies, block_keys, keep, group_size, kv_block, seq)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.counts, want.counts)
    assert (got.group_size, got.kv_block, got.seq_len) == (group_size, kv_block, seq)


def test_pooled_projection_ignores_autocast():
    """Under bf16 autocast the pooled rows still come out in the predictor's fp32, from an fp32 projection:
    the selection must not depend on the caller's autocast (context parallelism and one process agree)."""
    from dsv.ops.estimate.naive import segment_means

    torch.manual_seed(0)
    predictor = LowRankPredictor(32, 2, rank=4)
    hidden = torch.randn(1, 40, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        proxies, block_keys = predictor.pooled_project(hidden, 8, 8)
    assert proxies.dtype == block_keys.dtype == torch.float32
    q_lr, k_lr = predictor.project(hidden.float())
    # fp32 throughout: only summation order differs (pooling before or after the projection).
    torch.testing.assert_close(proxies, segment_means(q_lr, 8), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block_keys, segment_means(k_lr, 8), rtol=1e-5, atol=1e-6)


def test_a_predictor_update_that_overflows_reports_nan_at_once():
    """A predictor step from a finite loss that leaves a weight non-finite returns NaN, so the loss EMA and
    `predictor_failed` catch it in the same step (not at its next update, up to learn_every_stage2 later)."""
    predictor = LowRankPredictor(dim=8, heads=2, rank=2)
    finite = predictor.step(lambda: sum((p ** 2).sum() for p in predictor.parameters()), "cpu")
    assert torch.isfinite(finite)
    weight = next(predictor.parameters())
    handle = weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    failed = predictor.step(lambda: sum((p ** 2).sum() for p in predictor.parameters()), "cpu")
    handle.remove()
    assert torch.isnan(failed) and not torch.isfinite(weight).all()


def test_an_optimizer_state_of_the_earlier_foreach_adamw_loads_into_the_fused_one():
    """Checkpoints of earlier versions hold a foreach AdamW's state (`fused=None`, host step counts): loaded, the
    predictor keeps stepping fused, as the unfused optimizer would (float32 rounding apart)."""
    def loss(predictor):
        return lambda: sum((p ** 2).sum() for p in predictor.parameters())

    earlier = LowRankPredictor(dim=8, heads=2, rank=2)
    earlier.optimizer = torch.optim.AdamW(earlier.parameters(), lr=1e-2, weight_decay=0.0)  # the earlier default
    earlier.step(loss(earlier), "cpu")
    loaded = LowRankPredictor(dim=8, heads=2, rank=2, lr=1e-2)
    loaded.load_state_dict(earlier.state_dict())
    # A copy, as from a checkpoint file: loading keeps the given tensors, which `earlier` goes on updating.
    loaded.optimizer.load_state_dict(copy.deepcopy(earlier.optimizer.state_dict()))
    assert all(group["fused"] for group in loaded.optimizer.param_groups)
    for _ in range(2):
        earlier.step(loss(earlier), "cpu")
        loaded.step(loss(loaded), "cpu")
    # Two float32 AdamW steps of the same values in another kernel: within a few ulps of weights of order 1.
    for a, b in zip(earlier.parameters(), loaded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(state["step"].dtype == torch.float32 and float(state["step"]) == 3
               for state in loaded.optimizer.state.values())


def test_the_optimizer_state_follows_a_dtype_change_after_a_step():
    """`.double()` after a step converts the AdamW moments with the weights (left float32, the fused step raised
    a dtype error): the next step equals that of a float64 copy given the same state."""
    def loss(predictor):
        return lambda: sum((p ** 2).sum() for p in predictor.parameters())

    predictor = LowRankPredictor(dim=8, heads=2, rank=2, lr=1e-2)
    predictor.step(loss(predictor), "cpu")
    copy_64 = LowRankPredictor(dim=8, heads=2, rank=2, lr=1e-2).double()
    copy_64.load_state_dict(predictor.state_dict())
    state = copy.deepcopy(predictor.optimizer.state_dict())
    for entry in state["state"].values():
        entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg"].double(), entry["exp_avg_sq"].double()
    copy_64.optimizer.load_state_dict(state)
    predictor.double()
    assert all(v.dtype == (torch.float64 if v.dim() else torch.float32)
               for entry in predictor.optimizer.state.values() for v in entry.values())
    predictor.step(loss(predictor), "cpu")
    copy_64.step(loss(copy_64), "cpu")
    for a, b in zip(predictor.parameters(), copy_64.parameters()):
        assert a.dtype == torch.float64 and torch.equal(a, b)


@pytest.mark.parametrize("init", ["to_empty", "assign"])
def test_a_predictor_built_on_the_meta_device_steps_its_materialised_weights(init):
    """Meta-device init gives the module new Parameter objects (`to_empty`, then an in-place init; or a load
    with `assign=True`): the predictor's own optimizer must step those, not the meta ones it was built with (they get
    no gradient, and the predictor would silently stop learning). Its steps then equal a CPU-built copy's, from a
    state that has AdamW moments (they follow their Parameters)."""
    def loss(predictor):
        return lambda: sum((p ** 2).sum() for p in predictor.parameters())

    reference = LowRankPredictor(dim=8, heads=2, rank=2, lr=1e-2)
    reference.step(loss(reference), "cpu")
    with torch.device("meta"):
        built = LowRankPredictor(dim=8, heads=2, rank=2, lr=1e-2)
    state = {key: value.clone() for key, value in reference.state_dict().items()}
    if init == "to_empty":  # then initialised in place, as `reset_parameters` would
        built.to_empty(device="cpu")
        with torch.no_grad():
            for param, value in zip(built.parameters(), reference.parameters()):
                param.copy_(value)
    else:  # the module takes the tensors themselves: a copy of its own, as one loaded from a file
        built.load_state_dict({key: value.clone() for key, value in state.items()}, assign=True)
    built.optimizer.load_state_dict(copy.deepcopy(reference.optimizer.state_dict()))
    for _ in range(2):
        reference.step(loss(reference), "cpu")
        built.step(loss(built), "cpu")
    assert all(not p.is_meta for group in built.optimizer.param_groups for p in group["params"])
    for a, b in zip(built.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(built.parameters()), state["q_proj.weight"])  # it stepped


def test_a_predictor_whose_parameters_were_replaced_steps_the_new_ones():
    """An init that assigns new `nn.Parameter`s (`module.weight = nn.Parameter(...)`) bypasses `_apply` and
    `load_state_dict`: the next step still updates the live weights, as a freshly built predictor would."""
    def loss(predictor):
        return lambda: sum((p ** 2).sum() for p in predictor.parameters())

    predictor = LowRankPredictor(dim=8, heads=2, rank=2, lr=1e-2)
    reference = LowRankPredictor(dim=8, heads=2, rank=2, lr=1e-2)
    for linear, reference_linear in ((predictor.q_proj, reference.q_proj), (predictor.k_proj, reference.k_proj)):
        linear.weight = torch.nn.Parameter(reference_linear.weight.detach().clone())
    for _ in range(2):
        predictor.step(loss(predictor), "cpu")
        reference.step(loss(reference), "cpu")
    for a, b in zip(predictor.parameters(), reference.parameters()):
        assert torch.equal(a, b)
