"""`dsv plan`: predicted attention time of naive HCP, naive SCP and the hybrid plan, from the cost model.

``add_arguments(parser)`` fills an argparse parser; ``run(args)`` prints the plan as markdown and
returns 0. Everything printed is a model prediction (``dsv.parallel.planner``), not a measurement.
Until ``dsv plan`` is wired, ``python -m dsv.parallel.plan_cli [options]`` runs the same thing.

Without ``--recipe`` the links and kernel speeds are the planning defaults below (ideal sparse kernels, no
per-layout overheads). With ``--recipe NAME`` they are what ``dsv train --recipe NAME`` plans with: the
recipe's ``parallel`` links, the kernel-speed model's dense rate and sparse efficiency, the layouts' measured
overheads (``dsv.parallel.context.default_cluster``), its dispatch threshold and model shape. Options given
explicitly win over both.
"""

from __future__ import annotations

import argparse
import sys

from dsv.cli import float_where
from dsv.parallel.placement import METHODS
from dsv.parallel.planner import (
    AttentionShape,
    BlockPlan,
    Cluster,
    ModelPlan,
    load_profile,
    paper_profile,
    plan_model,
)
from dsv.parallel.scp import check_sequence_split

# The DSV paper's 2.7B model, and cuDNN's rate on one H200 (benchmarks/results, kernel reports).
DEFAULT_LAYERS, DEFAULT_HEADS, DEFAULT_HEAD_DIM = 32, 16, 128
# Planning defaults without --recipe: NVLink-class and 400 Gb/s links, cuDNN's fwd+bwd rate, ideal sparse
# kernels, the released code's dispatch rule.
PLANNING_DEFAULTS = dict(intra_node_gbps=450.0, inter_node_gbps=50.0, dense_tflops=560.0, sparse_efficiency=1.0,
                         sparse_threshold=0.8)


# As `attention.sparse_threshold` (NaN planned every block dense).
sparsity_threshold = float_where("a sparsity in [0, 1]", lambda value: 0.0 <= value <= 1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=int, default=None,
                       help=f"attention blocks (default {DEFAULT_LAYERS}, or the profile's)")
    model.add_argument("--heads", type=int, default=None, help=f"heads (default {DEFAULT_HEADS}, or the profile's)")
    model.add_argument("--head-dim", type=int, default=None, help=f"default {DEFAULT_HEAD_DIM}, or the recipe's")
    model.add_argument("--recipe", default=None,
                       help="plan as `dsv train --recipe NAME` does: its links, kernel-speed model, measured "
                            "overheads, dispatch threshold and model shape (explicit options still win)")
    model.add_argument("--tokens", type=int, default=262144, help="sequence length S per sample")
    model.add_argument("--batch", type=int, default=1, help="samples per GPU group")
    model.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16")
    model.add_argument("--profile", default=None,
                       help="JSON per-layer per-head sparsity ([[s, ...], ...] or {\"sparsity\": ...}); "
                            "default: the built-in paper 2.7B profile")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    cluster.add_argument("--gpus-per-node", type=int, default=None, help="default 8, or the recipe's")
    cluster.add_argument("--intra-node-gbps", type=float, default=None,
                         help="GB/s per GPU and direction inside a node (NVLink; default 450, or the recipe's)")
    cluster.add_argument("--inter-node-gbps", type=float, default=None,
                         help="GB/s per GPU and direction between nodes (default 50: a 400 Gb/s NIC per GPU; "
                              "or the recipe's)")
    cluster.add_argument("--dense-tflops", type=float, default=None,
                         help="dense attention fwd+bwd TFLOP/s per GPU (default 560: cuDNN on an H200, kernel reports; "
                              "with --recipe, the kernel-speed model's)")
    cluster.add_argument("--sparse-efficiency", type=float, default=None,
                         help="sparse kernel TFLOP/s per kept FLOP as a fraction of dense (default 1 = ideal; "
                              "with --recipe, the kernel-speed model's)")
    planning = parser.add_argument_group("planning")
    planning.add_argument("--sparse-threshold", type=sparsity_threshold, default=None,
                          help="a block runs sparse when its mean head sparsity is at least this (default 0.8, "
                               "or the recipe's)")
    planning.add_argument("--memory-cap-gib", type=float, default=None,
                          help="per-GPU cap on one block's attention working set for the hybrid plan")
    planning.add_argument("--placement", nargs="+", choices=METHODS, default=["naive", "lpt"],
                          help="head placement methods the hybrid search tries")
    planning.add_argument("--per-block", type=int, nargs="*", default=None,
                          help="GPU counts whose per-block plans are printed (default: all of --gpus)")


def _given(value, default):
    """An option's value, or ``default`` when it was not given (None): an explicit 0 stays 0, for the checks
    downstream to refuse."""
    return default if value is None else value


def _resolve(args) -> tuple[str, object]:
    """Fill the options left unset (None): from ``--recipe`` as ``dsv train`` plans, else the planning defaults.
    Returns a description of the source and a function ``gpus -> Cluster``."""
    import dataclasses

    from dsv.parallel.context import default_cluster

    explicit = {name: getattr(args, name) for name in ("intra_node_gbps", "inter_node_gbps", "dense_tflops",
                                                       "sparse_efficiency")}
    if args.recipe is None:
        args.layers = _given(args.layers, None if args.profile else DEFAULT_LAYERS)
        args.heads = _given(args.heads, None if args.profile else DEFAULT_HEADS)
        args.head_dim = _given(args.head_dim, DEFAULT_HEAD_DIM)
        args.gpus_per_node = _given(args.gpus_per_node, 8)
        if args.sparse_threshold is None:
            args.sparse_threshold = PLANNING_DEFAULTS["sparse_threshold"]
        for name, value in explicit.items():
            setattr(args, name, PLANNING_DEFAULTS[name] if value is None else value)
        return "planning defaults (no per-layout overheads)", lambda gpus: Cluster(
            gpus, args.gpus_per_node, args.intra_node_gbps, args.inter_node_gbps, args.dense_tflops,
            args.sparse_efficiency)
    from dsv.train.recipes import get_recipe

    cfg = get_recipe(args.recipe)
    args.layers = _given(args.layers, None if args.profile else cfg.model.depth)
    args.heads = _given(args.heads, None if args.profile else cfg.model.heads)
    args.head_dim = _given(args.head_dim, cfg.model.attention_head_dim)
    args.gpus_per_node = _given(args.gpus_per_node, cfg.parallel.gpus_per_node)
    if args.sparse_threshold is None:
        args.sparse_threshold = cfg.attention.sparse_threshold
    args.intra_node_gbps = _given(explicit["intra_node_gbps"], cfg.parallel.intra_node_gbps)
    args.inter_node_gbps = _given(explicit["inter_node_gbps"], cfg.parallel.inter_node_gbps)
    block = min(cfg.attention.group_size, cfg.attention.key_block)  # the kernel rates of its blocks
    args.token_split = (cfg.attention.group_size, cfg.attention.key_block)  # what each rank's chunk must hold
    model = default_cluster(1, block=block)
    args.dense_tflops = _given(explicit["dense_tflops"], model.dense_tflops)
    args.sparse_efficiency = _given(explicit["sparse_efficiency"], model.sparse_efficiency)

    def cluster(gpus: int) -> Cluster:
        base = default_cluster(gpus, args.gpus_per_node if gpus > args.gpus_per_node else None,
                               args.intra_node_gbps, args.inter_node_gbps, block=block)
        return dataclasses.replace(base, dense_tflops=args.dense_tflops, sparse_efficiency=args.sparse_efficiency)

    return (f"recipe {args.recipe} (as dsv train plans: measured per-layout overheads "
            f"{model.hcp_overhead_s * 1e3:g} ms HCP, {model.scp_overhead_s * 1e3:g} ms SCP per block)"), cluster


def _profile(args) -> tuple[list[list[float]], str]:
    if args.profile is None:
        layers, heads = args.layers, args.heads
        description = (
            f"built-in profile of the DSV paper's 2.7B run, {layers} blocks x {heads} heads: blocks 1-3 and the "
            "last in [0.01, 0.02], block 4 in [0.70, 0.80], the rest in [0.90, 0.99]; heads spread "
            "deterministically over each range by a golden-ratio sequence (not measured values)"
        )
        return paper_profile(layers, heads), description
    profile = load_profile(args.profile)
    if args.layers is not None and args.layers != len(profile):
        raise ValueError(f"--layers={args.layers} but {args.profile} lists {len(profile)} layers")
    if args.heads is not None and args.heads != len(profile[0]):
        raise ValueError(f"--heads={args.heads} but {args.profile} lists {len(profile[0])} heads per layer")
    return profile, f"{args.profile}, {len(profile)} blocks x {len(profile[0])} heads"


def _ms(plan: BlockPlan | None) -> str:
    return "n/a" if plan is None else f"{plan.time_s * 1e3:.2f}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _per_block_table(plan: ModelPlan, cap_bytes: int | None) -> list[str]:
    lines = [
        "| block | mean s | path | hybrid HCP x SCP | heads per HCP rank | naive HCP ms | "
        "naive SCP ms | hybrid ms | hybrid compute / comm ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layer, block in enumerate(plan.blocks):
        hybrid = block.hybrid
        slowest = max(range(hybrid.hcp), key=lambda r: hybrid.rank_s[r])
        counts = "/".join(str(len(heads)) for heads in hybrid.placement)
        over = [
            name for name, p in (("naive HCP", block.naive_hcp), ("naive SCP", block.naive_scp))
            if p is not None and cap_bytes is not None and p.memory_bytes > cap_bytes
        ]
        note = f" (over cap: {', '.join(over)})" if over else ""
        lines.append(
            f"| {layer + 1} | {sum(block.sparsity) / len(block.sparsity):.3f} | "
            f"{'sparse' if hybrid.sparse else 'dense'} | {hybrid.hcp} x {hybrid.scp} | {counts} | "
            f"{_ms(block.naive_hcp)} | {_ms(block.naive_scp)} | {_ms(hybrid)}{note} | "
            f"{hybrid.compute_s[slowest] * 1e3:.2f} / {hybrid.comm_s[slowest] * 1e3:.2f} |"
        )
    return lines


def run(args) -> int:
    source, make_cluster = _resolve(args)
    for gpus in args.gpus if getattr(args, "token_split", None) else ():
        try:  # the trainer's own rule: a plan of a layout it refuses would mislead
            check_sequence_split(args.tokens, gpus, *args.token_split)
        except ValueError as err:
            raise ValueError(f"--tokens {args.tokens} on --gpus {gpus} with recipe {args.recipe}: {err}; "
                             "dsv train refuses it") from None
    profile, description = _profile(args)
    shape = AttentionShape(args.tokens, len(profile[0]), args.head_dim, args.batch, args.bytes_per_element)
    cap_bytes = None if args.memory_cap_gib is None else int(args.memory_cap_gib * 2**30)
    plans = []
    for gpus in args.gpus:
        cluster = make_cluster(gpus)
        plans.append(plan_model(profile, shape, cluster, args.sparse_threshold, cap_bytes, args.placement))

    print("# Context-parallel plan (cost-model predictions, not measurements)\n")
    print(f"- model: {len(profile)} blocks x {shape.heads} heads x head dim {shape.head_dim}; "
          f"{shape.tokens} tokens, batch {shape.batch}, {shape.bytes_per_element} bytes per element")
    print(f"- cluster: {args.gpus_per_node} GPUs per node; {args.intra_node_gbps:g} GB/s intra-node, "
          f"{args.inter_node_gbps:g} GB/s inter-node per GPU and direction; dense attention "
          f"{args.dense_tflops:g} TFLOP/s fwd+bwd; sparse efficiency {args.sparse_efficiency:.3g}; from {source}")
    print(f"- profile: {description}")
    print(f"- dispatch: a block runs sparse when its mean head sparsity >= {args.sparse_threshold:g}, "
          "else dense with every key kept")
    print(f"- hybrid head placement methods: {', '.join(args.placement)}; memory cap: "
          f"{'none' if cap_bytes is None else f'{args.memory_cap_gib:g} GiB'}")
    print("- times: attention forward+backward of all blocks in one step, compute + communication, "
          "no overlap; naive HCP = Ulysses over all GPUs with equal head counts (n/a: more GPUs than "
          "heads); naive SCP = every GPU keeps its queries and fetches every remote K/V row\n")

    print("| GPUs | naive HCP s/step | naive SCP s/step | hybrid s/step | hybrid speedup vs best naive |")
    print("|---|---|---|---|---|")
    for plan in plans:
        naive = [t for t in (plan.naive_hcp_s, plan.naive_scp_s) if t is not None]
        print(f"| {plan.cluster.gpus} | {_seconds(plan.naive_hcp_s)} | {_seconds(plan.naive_scp_s)} | "
              f"{_seconds(plan.hybrid_s)} | {min(naive) / plan.hybrid_s:.2f}x |")

    detail = args.gpus if args.per_block is None else args.per_block
    unknown = sorted(set(detail) - set(args.gpus))
    if unknown:
        raise ValueError(f"--per-block lists {unknown}, which are not in --gpus {args.gpus}")
    for plan in plans:
        if plan.cluster.gpus in detail:
            print(f"\n## {plan.cluster.gpus} GPUs: per-block plans\n")
            print("\n".join(_per_block_table(plan, cap_bytes)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
