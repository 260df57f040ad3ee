import argparse
import json

import pytest
import torch

from dsv.parallel import plan_cli
from dsv.parallel.placement import check_placement, place_heads
from dsv.parallel.planner import (
    AttentionShape,
    Cluster,
    evaluate,
    factorisations,
    hybrid_plan,
    load_profile,
    naive_hcp_plan,
    naive_scp_plan,
    paper_profile,
    plan_model,
)

SHAPE = AttentionShape(tokens=65536, heads=8, head_dim=64)


def cluster(gpus, per_node=4, intra=400.0, inter=25.0):
    return Cluster(gpus, per_node, intra, inter, dense_tflops=500.0)


def skewed(heads, low=0.80, high=0.99):
    return [low + (high - low) * h / (heads - 1) for h in range(heads)]


@pytest.mark.parametrize("gpus,per_node,heads", [(8, 4, 8), (16, 4, 8), (12, 4, 16), (6, 8, 3), (32, 8, 4)])
def test_factorisations_are_valid_and_node_aligned(gpus, per_node, heads):
    c = cluster(gpus, per_node)
    pairs = factorisations(c, heads)
    assert (1, gpus) in pairs  # pure SCP is always possible
    for hcp, scp in pairs:
        assert hcp * scp == gpus and hcp <= heads
        assert gpus <= per_node or per_node % hcp == 0 or hcp % per_node == 0


@pytest.mark.parametrize("gpus", [2, 4, 8, 16, 32])
def test_hybrid_never_slower_than_either_baseline_and_always_valid(gpus):
    c = cluster(gpus)
    for _trial in range(5):
        sparsity = torch.rand(SHAPE.heads).mul(0.999).tolist()
        for sparse in (False, True):
            hybrid = hybrid_plan(sparsity, SHAPE, c, sparse)
            assert (hybrid.hcp, hybrid.scp) in factorisations(c, SHAPE.heads)
            check_placement(hybrid.placement, SHAPE.heads, hybrid.hcp)
            baselines = [naive_scp_plan(sparsity, SHAPE, c, sparse).time_s]
            hcp = naive_hcp_plan(sparsity, SHAPE, c, sparse)
            if gpus <= SHAPE.heads:
                baselines.append(hcp.time_s)
            else:
                assert hcp is None
            assert hybrid.time_s <= min(baselines)


def test_balanced_placement_beats_naive_on_a_skewed_block():
    c = cluster(4)
    sparsity = skewed(SHAPE.heads)
    naive = evaluate(sparsity, SHAPE, c, 4, place_heads([1.0] * 8, 4, "naive"), sparse=True)
    lpt = evaluate(sparsity, SHAPE, c, 4, place_heads([1 - s for s in sparsity], 4, "lpt"), sparse=True)
    assert lpt.time_s < 0.75 * naive.time_s
    # Naive leaves a straggler: its slowest rank is far above the mean rank.
    assert max(naive.rank_s) > 1.4 * sum(naive.rank_s) / len(naive.rank_s)


def test_compute_term_reproduces_the_dense_cudnn_anchor():
    # One H200 (kernel reports): S=16k, 24 heads x 128, cuDNN fwd+bwd 20.7 ms at 557 TFLOP/s.
    shape = AttentionShape(tokens=16384, heads=24, head_dim=128)
    one = Cluster(1, 8, 450.0, 50.0, dense_tflops=557.0)
    plan = evaluate([0.0] * 24, shape, one, 1, [list(range(24))], sparse=False)
    assert plan.time_s == pytest.approx(20.7e-3, rel=0.01)
    assert plan.comm_s == [0.0]


def test_scp_traffic_shrinks_with_sparsity_and_hcp_traffic_does_not():
    c = cluster(8)
    scp = [evaluate([s] * 8, SHAPE, c, 1, [list(range(8))], sparse=True).comm_s[0] for s in (0.8, 0.9, 0.95)]
    assert scp[0] > scp[1] > scp[2]
    assert scp[1] == pytest.approx(scp[0] / 2)
    hcp = [evaluate([s] * 8, SHAPE, c, 8, [[h] for h in range(8)], sparse=True).comm_s[0] for s in (0.8, 0.95)]
    assert hcp[0] == pytest.approx(hcp[1])
    # Naive SCP moves every remote row whatever the sparsity.
    full = naive_scp_plan([0.95] * 8, SHAPE, c, True).comm_s[0]
    assert full == pytest.approx(scp[0] * 5)


def test_cross_node_traffic_uses_the_slower_link():
    sparsity = [0.9] * 8
    one_node = Cluster(8, 8, 400.0, 25.0, 500.0)
    two_nodes = Cluster(8, 4, 400.0, 25.0, 500.0)
    placement = [list(range(8))]
    fast = evaluate(sparsity, SHAPE, one_node, 1, placement, sparse=True).comm_s[0]
    slow = evaluate(sparsity, SHAPE, two_nodes, 1, placement, sparse=True).comm_s[0]
    # Half the SCP peers' share (4 of 7) now crosses nodes at 1/16 of the bandwidth.
    assert slow == pytest.approx(fast * 16 * 4 / 7)


def test_memory_cap_is_respected_or_refused_clearly():
    c = cluster(8)
    sparsity = [0.95] * 8
    uncapped = hybrid_plan(sparsity, SHAPE, c, True)
    sizes = sorted({evaluate(sparsity, SHAPE, c, h, place_heads([1.0] * 8, h, "naive"), True).memory_bytes
                    for h, _ in factorisations(c, 8)})
    capped = hybrid_plan(sparsity, SHAPE, c, True, memory_cap_bytes=sizes[0])
    assert capped.memory_bytes <= sizes[0]
    assert capped.time_s >= uncapped.time_s
    with pytest.raises(ValueError, match="fits the memory cap"):
        hybrid_plan(sparsity, SHAPE, c, True, memory_cap_bytes=sizes[0] - 1)


def test_hybrid_plan_checks_its_per_head_inputs():
    """A list of more sparsities than heads was planned onto heads the model lacks; a kept fraction above 1
    (sparsity < 0) planned silently, one above 1 failed on a cost; a fetched list of the wrong length passed."""
    c = cluster(4)
    for sparsity, match in (([0.9] * 9, "sparsity profile has 9 heads per layer, the model has 8"),
                            ([-3.0] + [0.9] * 7, r"head 0 must lie in \[0, 1\)"),
                            ([1.5] + [0.9] * 7, r"head 0 must lie in \[0, 1\)")):
        with pytest.raises(ValueError, match=match):
            hybrid_plan(sparsity, SHAPE, c, True)
    with pytest.raises(ValueError, match=r"fetched\[2\] must list 8 fractions in \[0, 1\]"):
        hybrid_plan([0.9] * 8, SHAPE, c, True, fetched={2: [0.5] * 9})


def test_plan_model_totals_and_dispatch():
    profile = [[0.01] * 8, skewed(8)]
    plan = plan_model(profile, SHAPE, cluster(16))
    assert [b.hybrid.sparse for b in plan.blocks] == [False, True]
    assert plan.naive_hcp_s is None  # 16 GPUs > 8 heads
    assert plan.hybrid_s == pytest.approx(sum(b.hybrid.time_s for b in plan.blocks))
    assert plan.hybrid_s <= plan.naive_scp_s
    with pytest.raises(ValueError, match="do not split evenly over 16 GPUs"):
        plan_model(profile, AttentionShape(65537, 8, 64), cluster(16))


def test_paper_profile_is_deterministic_and_in_the_stated_ranges():
    profile = paper_profile()
    assert profile == paper_profile() and len(profile) == 32 and all(len(layer) == 16 for layer in profile)
    for layer, values in enumerate(profile):
        low, high = (0.01, 0.02) if layer in (0, 1, 2, 31) else (0.70, 0.80) if layer == 3 else (0.90, 0.99)
        assert all(low <= s <= high for s in values)
        assert len(set(values)) > 8  # a spread, not one value
    with pytest.raises(ValueError, match="at least 5 layers"):
        paper_profile(4, 16)


def test_load_profile_accepts_both_forms_and_rejects_bad_ones(tmp_path):
    rows = [[0.1, 0.2], [0.9, 0.95]]
    for i, data in enumerate((rows, {"sparsity": rows})):
        path = tmp_path / f"p{i}.json"
        path.write_text(json.dumps(data))
        assert load_profile(path) == rows
    for data, message in [
        ([[0.1, 0.2], [0.9]], "same number of heads"),
        ([[0.1, 1.0]], r"must lie in \[0, 1\)"),
        ({"layers": rows}, "needs a 'sparsity' key"),
        ([], "non-empty"),
    ]:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            load_profile(path)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(gpus=12, gpus_per_node=8), "whole nodes"),
        (dict(gpus=0), "positive int"),
        (dict(inter_node_gbps=0.0), "positive finite"),
        (dict(sparse_efficiency=1.5), r"\(0, 1\]"),
    ],
)
def test_bad_cluster_raises(kwargs, message):
    args = dict(gpus=8, gpus_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, dense_tflops=1.0)
    with pytest.raises(ValueError, match=message):
        Cluster(**{**args, **kwargs})


def parse(argv):
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_prints_summary_and_per_block_tables(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"sparsity": [[0.01, 0.02, 0.01, 0.02], [0.8, 0.9, 0.95, 0.99]]}))
    argv = ["--profile", str(path), "--tokens", "8192", "--gpus", "2", "4", "8", "--per-block", "8",
            "--gpus-per-node", "4", "--placement", "naive", "lpt", "exact"]
    assert plan_cli.run(parse(argv)) == 0
    out = capsys.readouterr().out
    assert "cost-model predictions, not measurements" in out
    summary = [line for line in out.splitlines() if line.startswith("| 8 |")]
    assert len(summary) == 1 and "| n/a |" in summary[0]  # 8 GPUs > 4 heads: no pure HCP
    assert "## 8 GPUs: per-block plans" in out and "## 4 GPUs" not in out
    assert "| 2 | 0.910 | sparse |" in out


def test_cli_builtin_profile_and_errors(capsys):
    assert plan_cli.run(parse(["--gpus", "4", "--layers", "6", "--heads", "4", "--per-block"])) == 0
    assert "built-in profile of the DSV paper's 2.7B run" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not in --gpus"):
        plan_cli.run(parse(["--gpus", "4", "--per-block", "8"]))
    for threshold in ("nan", "-1", "1.5"):  # NaN planned every block dense, -1 blocks of 1.5% sparsity sparse
        with pytest.raises(SystemExit):
            parse(["--gpus", "4", "--sparse-threshold", threshold])
        assert "argument --sparse-threshold: expected a sparsity in [0, 1]" in capsys.readouterr().err


def test_cli_plans_with_a_recipes_settings_as_the_trainer_does(capsys):
    """`--recipe` takes what `dsv train` plans with (the recipe's links and dispatch threshold, the kernel-speed
    model, the layouts' measured overheads); explicit options still win."""
    from dsv.parallel.context import default_cluster
    from dsv.train.recipes import get_recipe

    cfg, model = get_recipe("dit_2p7b"), default_cluster(1)
    assert plan_cli.run(parse(["--gpus", "8", "--tokens", "65536", "--recipe", "dit_2p7b"])) == 0
    out = capsys.readouterr().out
    assert f"{cfg.parallel.intra_node_gbps:g} GB/s intra-node, {cfg.parallel.inter_node_gbps:g} GB/s inter-node" in out
    assert f"dense attention {model.dense_tflops:g} TFLOP/s" in out and "from recipe dit_2p7b" in out
    assert f"mean head sparsity >= {cfg.attention.sparse_threshold:g}" in out
    assert f"{cfg.model.depth} blocks x {cfg.model.heads} heads x head dim {cfg.model.attention_head_dim}" in out
    assert plan_cli.run(parse(["--gpus", "8", "--recipe", "dit_2p7b", "--intra-node-gbps", "900"])) == 0
    assert "900 GB/s intra-node" in capsys.readouterr().out
    # The kernel rates of the recipe's blocks (`dsv.modules.dispatch.speed_model`): dit_2p7b's 64-token cubes
    # run at 1/1.30 of dense's per-pair rate, 32-token blocks at 1/3.95, 128-token ones at 1/1.25.
    assert plan_cli.run(parse(["--gpus", "8", "--tokens", "65536", "--recipe", "dit_2p7b"])) == 0
    assert f"sparse efficiency {1 / 1.30:.3g}" in capsys.readouterr().out
    assert default_cluster(1, block=32).sparse_efficiency == pytest.approx(1 / 3.95)
    assert default_cluster(1).sparse_efficiency == pytest.approx(1 / 1.25)
    # A length whose per-rank chunk is not whole query groups and key blocks, which the trainer refuses.
    with pytest.raises(ValueError, match=r"--tokens 65544 on --gpus 8 with recipe dit_2p7b: each rank's S/N=8193"):
        plan_cli.run(parse(["--gpus", "8", "--tokens", "65544", "--recipe", "dit_2p7b"]))
    # An explicit 0 is taken as given (and refused), not replaced by the recipe's or the default value.
    for argv in (["--recipe", "dit_2p7b", "--intra-node-gbps", "0"], ["--gpus-per-node", "0"]):
        with pytest.raises(ValueError, match="must be"):
            plan_cli.run(parse(["--gpus", "8", *argv]))


def test_scp_cost_grows_with_the_fetched_union():
    from dsv.parallel.planner import evaluate

    shape = AttentionShape(tokens=32768, heads=4, head_dim=128)
    cluster = Cluster(gpus=2, gpus_per_node=2, intra_node_gbps=200, inter_node_gbps=200, dense_tflops=560)
    sparsity = [0.9] * 4
    per_group = evaluate(sparsity, shape, cluster, 1, [[0, 1, 2, 3]], True)
    union = evaluate(sparsity, shape, cluster, 1, [[0, 1, 2, 3]], True, fetched=[0.5] * 4)
    assert union.comm_s[0] == pytest.approx(per_group.comm_s[0] * 5)  # 0.5 of the remote keys instead of 0.1
    assert union.compute_s == per_group.compute_s


def test_layout_overheads_steer_the_hybrid_choice():
    shape = AttentionShape(tokens=32768, heads=16, head_dim=128)
    base = dict(gpus=2, gpus_per_node=2, intra_node_gbps=200, inter_node_gbps=200, dense_tflops=560)
    sparsity = [1.0 - k for k in torch.linspace(0.5, 0.02, 16).tolist()]
    union = {2: [1.0] * 16}  # random selections: SCP moves nearly every remote block
    free = hybrid_plan(sparsity, shape, Cluster(**base), True, fetched=union)
    costly_scp = hybrid_plan(sparsity, shape, Cluster(**base, scp_overhead_s=0.05), True, fetched=union)
    assert (costly_scp.hcp, costly_scp.scp) == (2, 1)
    assert costly_scp.time_s >= free.time_s
    with pytest.raises(ValueError, match="scp_overhead_s"):
        Cluster(**base, scp_overhead_s=-1.0)
