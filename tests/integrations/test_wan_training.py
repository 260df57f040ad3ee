"""The trainer and the CLI tools run a diffusers Wan transformer with DSV (`model.arch=wan`)."""

import pytest

pytest.importorskip("diffusers")

from dsv.cli import main  # noqa: E402
from dsv.train.config import apply_overrides  # noqa: E402
from dsv.train.recipes import get_recipe  # noqa: E402
from dsv.train.trainer import Trainer  # noqa: E402


def test_wan_recipe_trains_through_the_switch_and_samples(tmp_path):
    cfg = apply_overrides(get_recipe("wan_debug_cpu"), [
        "model.hidden=32", "model.depth=2", "model.heads=2", "model.patch=1,2,2",
        "data.frames=4", "data.size=16", "data.load_short_side=24", "data.heldout_clips=2",
        "attention.min_stage1_steps=0", "attention.max_stage1_steps=2", "attention.sparse_threshold=0.0",
        "attention.profile_every_stage1=1", "train.steps=4", "train.batch_size=2", "train.log_every=1",
        "train.tensorboard=false", f"train.out_dir={tmp_path}", "train.ckpt_every=4",
    ])
    result = Trainer(cfg, quiet=True).run()
    assert result["switch_step"] == 2
    assert {layer["path"] for layer in result["layers"]} == {"sparse:reference"}
    assert main(["sample", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "w.gif"), "--num", "1",
                 "--steps", "2"]) == 0
    assert (tmp_path / "w.gif").stat().st_size > 0
