"""Probe: FVD, PSNR/SSIM against dense sampling and sampling time of one DSV checkpoint (CUDA) sampled densely,
at its dispatched budgets and at noise-level budgets keeping each given share of the attention mass; the 64
held-out clips of the run are the FVD's real set, 25 Euler steps from the noise of seed 0 (as `dsv bench quality`).

    python benchmarks/sparse_sampling_probe.py RUN_DIR KEPT_MASS [KEPT_MASS ...]
"""

import json
import sys

import torch

from dsv.analysis.checkpointed_model import load_model
from dsv.analysis.noise_budgets import calibrate_noise_level_budgets
from dsv.analysis.sample import similarity
from dsv.bench.quality import fvd_with_bootstrap, timed_samples
from dsv.eval import extract_features, load_i3d
from dsv.train.data import build_dataset

run, masses = sys.argv[1], [float(x) for x in sys.argv[2:]]
model, cfg, _ = load_model(run, "cuda")
dense_model, _, _ = load_model(run, "cuda", attention_mode="dense")
data = build_dataset(cfg.data)
real = data.heldout_batch()
num, steps = real.shape[0], 25
sets, seconds = {}, {}
sets["dense"], passes = timed_samples(dense_model, cfg, num, steps, 0, 1)
seconds["dense"] = passes[0]
sets["dispatched"], passes = timed_samples(model, cfg, num, steps, 0, 1)
seconds["dispatched"] = passes[0]
clips = data.sample(8, torch.Generator().manual_seed(0))
for kept_mass in masses:
    budgets = calibrate_noise_level_budgets(model, clips, kept_mass, bf16=cfg.train.bf16)
    name = f"budgets keeping {kept_mass}"
    sets[name], passes = timed_samples(model, cfg, num, steps, 0, 1, budgets)
    seconds[name] = passes[0]
    print(name, json.dumps(budgets.summary()), flush=True)
i3d = load_i3d(torch.device("cuda"))
features = {name: extract_features(videos, i3d) for name, videos in sets.items()}
by_seed, _ = fvd_with_bootstrap(extract_features(real, i3d), {"probe": features}, 100)
for name in sets:
    close = similarity(sets[name], sets["dense"]) if name != "dense" else {}
    print(json.dumps({"set": name, "seconds": seconds[name], **close, **by_seed["probe"][name]}), flush=True)
