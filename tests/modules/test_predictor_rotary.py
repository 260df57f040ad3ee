"""The predictor's rotary dims (`attention.predictor_rotary`): position enters its scores as it enters the
scores of a model with rotary embeddings, whose hidden states carry none."""

import copy

import pytest
import torch

from dsv.modules.attention import DSVAttention
from dsv.modules.config import AttentionConfig
from dsv.modules.predictor import LowRankPredictor, position_phasors, rotary_frequencies, turn
from dsv.ops import estimate_index_from_means, index_recall, oracle_index, sample_query_rows
from dsv.ops.estimate import triton_estimation_unsupported
from dsv.ops.estimate.naive import segment_means
from dsv.ops.grouping import cube_permutation, grouped_positions_on
from dsv.train.config import apply_overrides
from dsv.train.recipes import get_recipe
from tests.modules.test_attention import DIM, GRID, HEADS, make


def rotate_by_position(x: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x [..., S, r]` at `positions [S, 3]`, as the predictor applies it to its rows."""
    return turn(x, *position_phasors(positions, frequencies, x.dtype))


def test_grouped_positions_are_the_raster_coordinates_in_grouped_order():
    grid, cube = (3, 5, 6), (2, 2, 4)  # a grid the cube does not tile: edge tokens after the whole cubes
    perm, _ = cube_permutation(grid, cube)
    t, h, w = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
    raster = torch.stack((t, h, w), dim=-1).reshape(-1, 3).float()
    assert torch.equal(grouped_positions_on(grid, cube, torch.device("cpu")), raster[perm])


def test_rotated_scores_depend_on_the_offset_between_positions_only():
    torch.manual_seed(0)
    frequencies = rotary_frequencies(2, (2, 4, 4))  # 12 rotated dims
    queries, keys = torch.randn(2, 20, 16, dtype=torch.float64), torch.randn(2, 20, 16, dtype=torch.float64)
    positions = torch.randint(0, 30, (20, 3)).double()
    shifted = positions + torch.tensor([7.0, -3.0, 11.0], dtype=torch.float64)
    scores = rotate_by_position(queries, positions, frequencies) @ rotate_by_position(keys, positions,
                                                                                     frequencies).mT
    moved = rotate_by_position(queries, shifted, frequencies) @ rotate_by_position(keys, shifted, frequencies).mT
    # float64 rotations: equal to ~1e-13 of scores of magnitude ~10.
    torch.testing.assert_close(moved, scores, rtol=0, atol=1e-10)
    # The first rank - 12 dims are untouched; a rotation keeps each pair's norm.
    rotated = rotate_by_position(queries, positions, frequencies)
    assert torch.equal(rotated[..., :4], queries[..., :4])
    torch.testing.assert_close(rotated.norm(dim=-1), queries.norm(dim=-1), rtol=1e-12, atol=0)
    # And the scores do depend on the offset: a zero frequency would make rotation a no-op.
    assert (scores - queries @ keys.mT).abs().max() > 1.0


@pytest.mark.parametrize("kv_block", [32, 64], ids=["cube-blocks", "two-cube-blocks"])
@pytest.mark.parametrize("grid", [(4, 8, 8), (3, 10, 13)], ids=["tiled", "edge-groups"])
def test_pooled_rotary_rows_are_the_mean_of_the_rotated_rows_for_the_position_term(grid, kv_block):
    """The estimation turns each group's mean row by the mean of its rows' unit phasors: for the offset (the
    term of position alone) that is the mean of the rotated rows exactly, also in the edge groups of a grid the
    cube does not tile, which span several partial cubes."""
    torch.manual_seed(0)
    cube = (2, 4, 4)
    predictor = LowRankPredictor(16, 2, rank=12, rotary_frequencies=rotary_frequencies(2, cube)).double()
    with torch.no_grad():
        predictor.q_proj.weight.zero_()
        predictor.k_proj.weight.zero_()
    positions = grouped_positions_on(grid, cube, torch.device("cpu"))
    hidden = torch.randn(1, len(positions), 16, dtype=torch.float64)
    with torch.no_grad():
        proxies, block_keys = predictor.pooled_project(hidden, 32, kv_block, positions)
        q_lr, k_lr = predictor.project(hidden, positions)
    # float64 end to end: only summation order differs.
    torch.testing.assert_close(proxies, segment_means(q_lr, 32), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_keys, segment_means(k_lr, kv_block), rtol=1e-12, atol=1e-12)
    # The position term does shrink in a mean over a group (not a no-op): its norm falls below the offset's.
    assert (proxies[..., -12:].norm(dim=-1) < predictor.q_rotary_offset.norm(dim=-1)[None, :, None]).all()


def test_the_rotary_frequencies_stay_float32_through_a_cast_to_bf16():
    """A diffusers pipeline casts the model to bf16: the angles must not be rounded with it (the frequencies
    are constants of the config, restored from a float32 master on every `.to()`)."""
    predictor = LowRankPredictor(16, 2, rank=6, rotary_frequencies=rotary_frequencies(1, (2, 4, 4)))
    want = predictor.rotary_frequencies.clone()
    predictor.to(torch.bfloat16).float()
    assert predictor.rotary_frequencies.dtype == torch.float32 and torch.equal(predictor.rotary_frequencies, want)
    with torch.device("meta"):  # a large model built on the meta device, then materialised
        on_meta = LowRankPredictor(16, 2, rank=6, rotary_frequencies=rotary_frequencies(1, (2, 4, 4)))
    # Built where the default device says, as the weights (on the host it would cost a synchronising copy per use).
    assert on_meta.rotary_frequencies.device.type == on_meta.q_proj.weight.device.type == "meta"
    assert torch.equal(on_meta.to_empty(device="cpu").rotary_frequencies, want)
    predictor.cpu().rotary_frequencies.mul_(2)  # a copy, never the host master: a later move restores the values
    assert torch.equal(predictor.double().rotary_frequencies, want)


def test_the_loss_over_a_key_sample_scores_the_sampled_keys_at_their_positions():
    torch.manual_seed(0)
    grid, cube = (2, 4, 8), (1, 2, 2)
    predictor = LowRankPredictor(16, 2, rank=6, rotary_frequencies=rotary_frequencies(1, cube)).double()
    positions = grouped_positions_on(grid, cube, torch.device("cpu"))
    hidden = torch.randn(1, 64, 16, dtype=torch.float64)
    q, k = torch.randn(1, 2, 64, 8, dtype=torch.float64), torch.randn(1, 2, 64, 8, dtype=torch.float64)
    rows, keys = torch.arange(0, 64, 8), torch.tensor([3, 17, 18, 40, 63, 5])
    with torch.no_grad():
        q_lr, k_lr = predictor.project(hidden, positions)
        want = predictor.factors_loss(q_lr[:, :, rows], k_lr[:, :, keys], q[:, :, rows], k[:, :, keys], 0.3)
        got = predictor.loss(hidden, q, k, rows, 0.3, keys, positions)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_predictor_with_rotary_dims_needs_the_positions():
    predictor = LowRankPredictor(16, 2, rank=6, rotary_frequencies=rotary_frequencies(1, (2, 2, 2)))
    hidden = torch.randn(1, 70, 16)
    needs = r"positions must be the tokens' \(t, h, w\), a \[70, 3\] tensor, got "
    with pytest.raises(ValueError, match=needs + "None"):
        predictor.project(hidden)
    # Positions of another length are refused, also where they would pool to as many groups.
    with pytest.raises(ValueError, match=needs + r"\[65, 3\]"):
        predictor.pooled_project(hidden, 32, 32, torch.zeros(65, 3))
    with pytest.raises(ValueError, match=needs + r"\[200, 3\]"):
        predictor.loss(hidden, torch.randn(1, 2, 70, 8), torch.randn(1, 2, 70, 8), torch.arange(0, 70, 7), 0.3,
                       torch.tensor([1, 2, 3]), torch.zeros(200, 3))
    with pytest.raises(ValueError, match=r"rotary_frequencies must be \[3, n\] with 6n <= rank=4"):
        LowRankPredictor(16, 2, rank=4, rotary_frequencies=rotary_frequencies(1, (2, 2, 2)))


@pytest.mark.parametrize("value", [3, 18, -6])
def test_the_config_rejects_rotary_dims_that_do_not_fit(value):
    with pytest.raises(ValueError, match="attention.predictor_rotary must be a multiple of 6"):
        AttentionConfig(rank=16, predictor_rotary=value)


def test_an_undecided_rotary_setting_follows_the_model():
    """`predictor_rotary=None` (the default) is 6 for a model whose rotary embeddings position q and k, where the
    rank has room, and 0 for DSV's own layers; a value that is set stays; `--set` parses it as an int or none."""
    assert AttentionConfig().predictor_rotary is None
    assert AttentionConfig().with_rotary_default(True).predictor_rotary == 6
    assert AttentionConfig().with_rotary_default(False).predictor_rotary == 0
    assert AttentionConfig(rank=4).with_rotary_default(True).predictor_rotary == 0
    assert AttentionConfig(predictor_rotary=12).with_rotary_default(False).predictor_rotary == 12
    assert AttentionConfig(predictor_rotary=0).with_rotary_default(True).predictor_rotary == 0
    layer = DSVAttention(32, 2, cfg=AttentionConfig(mode="dsv"))
    assert layer.cfg.predictor_rotary == 0 and layer.predictor.rotary_dims == 0
    cfg = get_recipe("debug_cpu")
    assert apply_overrides(cfg, ["attention.predictor_rotary=6"]).attention.predictor_rotary == 6
    assert apply_overrides(cfg, ["attention.predictor_rotary=none"]).attention.predictor_rotary is None
    with pytest.raises(ValueError, match="attention.predictor_rotary must be an int or None"):
        AttentionConfig(predictor_rotary=6.0)


def test_rotary_dims_let_the_predictor_learn_scores_set_by_position():
    """Attention whose scores come mostly from rotary embeddings of the positions (q = R(p)(u + content)): a
    predictor that sees the hidden states alone (no position) selects barely better than chance, one with
    rotary dims close to the exact selection, though its frequencies are not the model's."""
    torch.manual_seed(0)
    grid, cube = (4, 16, 16), (1, 4, 4)
    seq, dim, heads, head_dim, block = 1024, 32, 2, 16, 16
    positions = grouped_positions_on(grid, cube, torch.device("cpu"))
    model_frequencies = torch.tensor([[0.5, 0.1], [0.8, 0.2], [0.8, 0.2]])  # 12 of the model's 16 dims rotate
    offset_q, offset_k = 2 * torch.randn(heads, 1, head_dim), 2 * torch.randn(heads, 1, head_dim)
    w_q, w_k = torch.randn(heads, dim, head_dim) / dim**0.5, torch.randn(heads, dim, head_dim) / dim**0.5
    scale, rows = head_dim**-0.5, sample_query_rows(seq, 8)
    keep = torch.full((heads,), seq // block // 4)  # a quarter of the key blocks

    def batch():
        hidden = torch.randn(2, seq, dim)
        q = rotate_by_position(torch.einsum("bsc,hcd->bhsd", hidden, w_q) + offset_q, positions, model_frequencies)
        k = rotate_by_position(torch.einsum("bsc,hcd->bhsd", hidden, w_k) + offset_k, positions, model_frequencies)
        return hidden, q, k

    def trained_recall(rotary: int) -> float:
        torch.manual_seed(1)
        frequencies = rotary_frequencies(rotary // 6, cube) if rotary else None
        predictor = LowRankPredictor(dim, heads, rank=16, lr=1e-2, rotary_frequencies=frequencies)
        at = positions if rotary else None
        for _ in range(150):
            predictor.update(*batch(), rows, scale, None, at)
        torch.manual_seed(2)
        hidden, q, k = batch()
        with torch.no_grad():
            proxies, block_keys = predictor.pooled_project(hidden, block, block, at)
            index = estimate_index_from_means(proxies, block_keys, keep, block, block, seq)
        return index_recall(q, k, index, rows, scale=scale).mean().item()

    torch.manual_seed(2)
    _, q, k = batch()
    exact = index_recall(q, k, oracle_index(q, k, keep, block, block, scale=scale), rows, scale=scale).mean().item()
    plain, rotary = trained_recall(0), trained_recall(12)
    # Chance keeps ~0.25 of the mass (a quarter of the keys); measured: plain 0.24, rotary 0.74, exact 0.84.
    assert plain < 0.4, plain
    assert rotary > 0.8 * exact and rotary > plain + 0.3, (plain, rotary, exact)


def test_a_dsv_layer_with_rotary_dims_trains_and_selects_at_its_grid():
    """Through DSVAttention: the predictor's update trains the rotary offsets, and the selection of a stage-2
    forward comes from the grid's positions (another grid of as many tokens selects otherwise)."""
    x = torch.randn(2, 64, DIM, dtype=torch.float64)
    model = make("dsv", max_stage1_steps=1, sparse_threshold=0.0, profile_every_stage1=1, predictor_rotary=6)
    predictor = model.attn.predictor
    before = predictor.q_rotary_offset.detach().clone()
    model.controller.begin_step(0)
    model(x).sum().backward()
    model.controller.end_step()
    assert not torch.equal(predictor.q_rotary_offset, before)
    model.controller.begin_step(1)
    model(x)
    assert model.attn.last_path == "sparse:reference"
    layer = model.attn
    hidden = x[:, cube_permutation(GRID, (2, 2, 2))[0]]
    q = k = torch.randn(2, HEADS, 64, DIM // HEADS, dtype=torch.float64)
    keep = torch.full((HEADS,), 2)
    at_grid = layer.compute_index(hidden, q, k, GRID, keep_blocks=keep)
    elsewhere = layer.compute_index(hidden, q, k, (1, 8, 8), keep_blocks=keep)
    assert (at_grid.counts == 2).all() and not torch.equal(at_grid.indices, elsewhere.indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_rotary_predictor_selects_the_top_blocks_of_its_float64_scores():
    """The fused Triton estimation takes the turned rows as any pooled rows: a float32 layer with rotary dims
    on the GPU keeps, in every group, key blocks that rank first by the same layer's float64 scores on the CPU
    at this grid (not at another grid of as many tokens, which turns the rows otherwise)."""
    grid, other_grid, dim, heads, keep = (4, 16, 16), (16, 8, 8), 128, 2, 4
    torch.manual_seed(0)
    layer = DSVAttention(dim, heads, cfg=AttentionConfig(mode="dsv", cube=(4, 4, 4), predictor_rotary=6))
    predictor = layer.predictor
    with torch.no_grad():  # offsets large against the content terms, so that position decides much of the ranking
        predictor.q_rotary_offset.normal_(0, 3)
        predictor.k_rotary_offset.normal_(0, 3)
    reference = copy.deepcopy(layer).double()
    layer = layer.cuda()
    seq_len, group, block = 1024, layer.cfg.group_size, layer.cfg.key_block
    hidden = torch.randn(1, seq_len, dim, dtype=torch.float64)
    rows = torch.empty(1, heads, seq_len, dim // heads, device="cuda")
    assert triton_estimation_unsupported(rows, block) is None
    keep_blocks = torch.full((heads,), keep)
    chosen = layer.compute_index(hidden.cuda().float(), rows, rows, grid, keep_blocks=keep_blocks)
    chosen.validate()
    assert (chosen.counts == keep).all()
    picked = chosen.indices[0, :, :, :keep].cpu().long()  # [H, NG, keep]

    def float64_scores(at_grid):
        proxies, keys = reference.predictor.pooled_project(hidden, group, block,
                                                           reference.predictor_positions(at_grid, hidden.device))
        return proxies[0] @ keys[0].transpose(-1, -2), proxies[0].norm(dim=-1), keys[0].norm(dim=-1)

    scores, proxy_norms, key_norms = float64_scores(grid)
    kth_best = scores.topk(keep, dim=-1).values[..., -1:]
    # float32 rows and products, possibly TF32 (10-bit mantissa) dots in the kernel: a score may be off by
    # ~2^-10 of |proxy|·|key|; a block within that of the k-th best is a tie the kernel may break either way.
    slack = 2**-10 * proxy_norms[..., None] * key_norms.amax(-1)[:, None, None]
    assert (scores.gather(-1, picked) >= kth_best - slack).all()

    def agreement(with_scores):
        best = with_scores.topk(keep, dim=-1).indices.sort(-1).values
        return (picked.sort(-1).values == best).all(-1).float().mean().item()

    assert agreement(scores) > 0.9
    assert agreement(float64_scores(other_grid)[0]) < 0.5, "setup: another grid must rank other blocks first"
