"""How a trained model's learned selection pairs up, for the 64-token kernels' designs (NOTES, "Left", item 1).

usage: PYTHONPATH=. python3 benchmarks/pair_selection_probe.py CHECKPOINT [CLIPS]

Runs the checkpoint's model on held-out clips (as `dsv profile`) and records every sparse layer's index. Per
layer, over groups and heads:
- key pairs: of the listed 64-token key blocks, the fraction whose partner in the 128-token tile (block ^ 1)
  is listed too, and the matmul work of walking the union of a tile's two lists (both halves computed for
  every listed pair) over the listed blocks' work;
- query pairs: for the two groups of one 128-row tile (2g, 2g + 1), |A ∩ B| / |A ∪ B| of their lists, and
  the work of one walk over A ∪ B for both groups over the work of their own lists;
- the same two fractions for random lists of the same lengths (what no structure would give).
"""

import sys

import torch

from dsv.analysis.checkpointed_model import load_model
from dsv.analysis.profile import heldout_clips


def membership(index) -> torch.Tensor:
    """[B, H, NG, num_blocks] bool: which key blocks each group lists."""
    indices, counts = index.indices.long(), index.counts.long()
    valid = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
    listed = torch.zeros(*indices.shape[:-1], index.num_kv_blocks + 1, dtype=torch.bool, device=indices.device)
    listed.scatter_(-1, torch.where(valid, indices, index.num_kv_blocks), True)
    return listed[..., :-1]


def pair_stats(listed: torch.Tensor) -> dict:
    n_blocks = listed.shape[-1] - listed.shape[-1] % 2
    blocks = listed[..., :n_blocks].view(*listed.shape[:-1], n_blocks // 2, 2)
    both = blocks.all(-1).sum().item() * 2
    touched = blocks.any(-1).sum().item()
    total = blocks.sum().item()
    groups = listed.shape[2] - listed.shape[2] % 2
    a, b = listed[:, :, 0:groups:2], listed[:, :, 1:groups:2]
    union, inter = (a | b).sum().item(), (a & b).sum().item()
    own = a.sum().item() + b.sum().item()
    return {"key_partner_listed": both / max(total, 1), "key_union_work": 2 * touched / max(total, 1),
            "query_jaccard": inter / max(union, 1), "query_union_work": 2 * union / max(own, 1)}


def random_like(listed: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random lists of the same lengths (per group and head)."""
    counts = listed.sum(-1)
    ranks = torch.rand(listed.shape, generator=gen, device="cpu").to(listed.device).argsort(-1).argsort(-1)
    return ranks < counts[..., None]


@torch.no_grad()
def main(checkpoint: str, clips: int = 8) -> None:
    model, cfg, step = load_model(checkpoint, "auto")
    dev = next(model.parameters()).device
    x0 = heldout_clips(cfg, clips).to(dev)
    recorded = {}
    for i, layer in enumerate(model.controller.layers):
        def attend(q, k, v, index, layer=layer, i=i, original=layer.attend):
            if index is not None:
                recorded[i] = membership(index)
            return original(q, k, v, index)
        layer.attend = attend
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(x0.shape[0], generator=gen).to(dev)
    noise = torch.randn(x0.shape, generator=gen).to(dev)
    tb = t.view(-1, 1, 1, 1, 1)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" and cfg.train.bf16):
        model((1 - tb) * x0 + tb * noise, t)
    print(f"checkpoint step {step}, cube {cfg.attention.cube}, key block {cfg.attention.key_block}, {clips} clips, "
          f"{len(recorded)} sparse layers")
    print("| layer | kept | key: partner listed (random) | key: union-walk work | query: Jaccard (random) "
          "| query: union-walk work |")
    print("|---|---|---|---|---|---|")
    sums = []
    for i, listed in sorted(recorded.items()):
        real, rand = pair_stats(listed), pair_stats(random_like(listed, gen))
        kept = listed.float().mean().item()
        sums.append((real, rand))
        print(f"| {i} | {kept:.3f} | {real['key_partner_listed']:.3f} ({rand['key_partner_listed']:.3f}) | "
              f"{real['key_union_work']:.2f} | {real['query_jaccard']:.3f} ({rand['query_jaccard']:.3f}) | "
              f"{real['query_union_work']:.2f} |")
    if sums:
        mean = {key: sum(r[key] for r, _ in sums) / len(sums) for key in sums[0][0]}
        print(f"mean over sparse layers: {mean}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
