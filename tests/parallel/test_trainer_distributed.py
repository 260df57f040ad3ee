"""`dsv train` on 2 gloo ranks (data parallel, or context parallel; FSDP2): it trains through the switch,
checkpoints from rank 0, and resuming continues the run exactly."""

import json
import time
from pathlib import Path

import pytest
import torch

from tests.parallel import run_distributed
from tests.train.test_training import TINY

# With the weights' moving average: its shards are averaged, gathered, saved and restored per rank.
SCHEDULE = ["attention.max_stage1_steps=2", "train.ckpt_every=2", "train.threads=1", "train.ema_decay=0.5"]


def _train(rank: int, world: int, root: str, extra: list[str]) -> dict:
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe
    from dsv.train.trainer import Trainer

    def config(run: str, steps: int):
        return apply_overrides(get_recipe("debug_cpu"),
                               TINY + SCHEDULE + extra + [f"train.out_dir={Path(root) / run}", f"train.steps={steps}"])

    Trainer(config("straight", 4), quiet=True).run()
    Trainer(config("resumed", 2), quiet=True).run()
    Trainer(config("resumed", 4), resume=True, quiet=True).run()
    results = {}
    for run in ("straight", "resumed"):
        trainer = Trainer(config(run, 4), resume=True, quiet=True)
        weights, state = trainer.full_state()
        # The loss of the sharded model holding the saved average, for the one logged at the last step.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from dsv.train.checkpoint import load_checkpoint

        saved_weights, saved_state, _ = load_checkpoint(Path(root) / run)
        set_model_state_dict(trainer.model, {**saved_weights, **saved_state["ema"]},
                             options=StateDictOptions(full_state_dict=True))
        loss_of_saved_ema = trainer.heldout_loss()
        layers = trainer.controller.layers
        results[run] = {
            "weights": weights if rank == 0 else None,
            "ema": state["ema"],
            "loss_of_saved_ema": loss_of_saved_ema,
            "rng": state["rng_per_rank"],
            "predictor": [p.detach().clone() for layer in layers for p in layer.predictor.parameters()],
            "sparsity": [layer.sparsity_ema.clone() for layer in layers],
            "stage": trainer.controller.current_stage,
        }
        trainer.close()
    return results


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


CONTEXT_PARALLEL = ["parallel.cp=2", "parallel.cp_mode=hybrid"]


@pytest.mark.parametrize("extra", [[], CONTEXT_PARALLEL], ids=["data_parallel", "context_parallel"])
def test_two_rank_training_resumes_exactly(tmp_path, extra):
    ranks = run_distributed(_train, 2, str(tmp_path), extra, out_dir=tmp_path, timeout_s=150)
    straight, resumed = ranks[0]["straight"], ranks[0]["resumed"]
    assert straight["stage"] == 2
    assert set(straight["weights"]) == set(resumed["weights"])
    for name, value in straight["weights"].items():
        assert bitwise_equal(value, resumed["weights"][name]), name
    assert straight["ema"] and set(straight["ema"]) <= set(straight["weights"])
    for name, value in straight["ema"].items():
        assert torch.equal(value, resumed["ema"][name]), name
    assert any(not torch.equal(value, straight["weights"][name]) for name, value in straight["ema"].items())
    held = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                  if "heldout_loss" in line] for run in ("straight", "resumed")}
    assert held["straight"] == held["resumed"]
    assert held["straight"][-1]["heldout_loss_ema"] == straight["loss_of_saved_ema"] != held["straight"][-1][
        "heldout_loss"]
    assert ranks[1]["straight"]["ema"] is None  # gathered on every rank, kept on rank 0 alone
    # The shards were averaged: the average left the initial weights (the same seed builds them again).
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe
    from dsv.train.trainer import build_model

    initial = dict(build_model(apply_overrides(get_recipe("debug_cpu"), TINY + SCHEDULE + extra),
                               torch.device("cpu")).named_parameters())
    assert any(not torch.equal(value, initial[name]) for name, value in straight["ema"].items())
    # Every rank's random state was saved and restored (data-parallel ranks draw different data; the
    # ranks of one context-parallel group share their samples).
    same_data = torch.equal(straight["rng"][0]["data_generator"], straight["rng"][1]["data_generator"])
    assert same_data == (extra == CONTEXT_PARALLEL)
    for a, b in zip(straight["rng"], resumed["rng"]):
        assert torch.equal(a["data_generator"], b["data_generator"])
    # Predictors and DSV state are replicated: identical on both ranks.
    for run in ("straight", "resumed"):
        for p0, p1 in zip(ranks[0][run]["predictor"], ranks[1][run]["predictor"]):
            assert torch.equal(p0, p1)
        for s0, s1 in zip(ranks[0][run]["sparsity"], ranks[1][run]["sparsity"]):
            assert bitwise_equal(s0, s1)
    # Rank 0 alone wrote the log.
    assert (tmp_path / "straight" / "metrics.jsonl").read_text().count('"step"') >= 2


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_context_parallel_training_equals_one_process(tmp_path):
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe
    from dsv.train.trainer import Trainer

    run_distributed(_train, 2, str(tmp_path / "cp"), CONTEXT_PARALLEL, out_dir=tmp_path, timeout_s=150)
    records = [json.loads(line) for line in (tmp_path / "cp" / "straight" / "metrics.jsonl").read_text().splitlines()]
    last_paths = [layer["path"] for layer in [r for r in records if "layers" in r][-1]["layers"]]
    assert all(path.startswith("sparse:") and " cp " in path for path in last_paths), last_paths
    single = apply_overrides(get_recipe("debug_cpu"), TINY + SCHEDULE + [
        f"train.out_dir={tmp_path / 'single'}", "train.steps=4"])
    Trainer(single, quiet=True).run()
    parallel, one = _losses(tmp_path / "cp" / "straight"), _losses(tmp_path / "single")
    assert [step for step, _ in parallel] == [step for step, _ in one]
    # fp32: the CP run sums the same products in another order (per-rank partial gradients, gathered
    # K/V); over 4 AdamW steps that stays within ~1e-5 of the loss, far inside 1e-4.
    for (_, a), (_, b) in zip(parallel, one):
        assert abs(a - b) <= 1e-4 * abs(b), (parallel, one)


# Rank 0's save takes longer than the default group's timeout in this test (`WAIT_TEST_TIMEOUT_S`): a rank that
# waited for it there would raise. The timeout holds for every collective of the run (rendezvous, barrier, FSDP's),
# so it leaves room for the ranks' skew on a loaded 2-core machine.
WAIT_TEST_TIMEOUT_S = 15
SLOW_SAVE_S = 20


def _train_with_a_slow_save(rank: int, world: int, root: str) -> list[str]:
    import dsv.train.trainer as trainer_module
    from dsv.train.checkpoint import list_checkpoints
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe

    save = trainer_module.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(SLOW_SAVE_S)
        return save(*args, **kwargs)

    trainer_module.save_checkpoint = slow_save  # only rank 0 calls it
    cfg = apply_overrides(get_recipe("debug_cpu"), TINY + [
        "train.threads=1", "train.steps=1", "train.ckpt_every=1", f"train.out_dir={root}"])
    trainer_module.Trainer(cfg, quiet=True).run()
    return [path.name for path in list_checkpoints(root)]


def test_ranks_wait_for_a_save_longer_than_the_process_group_timeout(tmp_path):
    """The other ranks wait for rank 0's checkpoint in a group with a long timeout of its own: a save that takes
    longer than the default group's timeout (NCCL's 10 minutes on a slow file system) does not kill the run."""
    ranks = run_distributed(_train_with_a_slow_save, 2, str(tmp_path / "run"), out_dir=tmp_path, timeout_s=120,
                            collective_timeout_s=WAIT_TEST_TIMEOUT_S)
    assert ranks[0] == ranks[1] == ["step_00000001"]


def _construct(rank: int, world: int, root: str, extra: list[str]) -> str | None:
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe
    from dsv.train.trainer import Trainer

    cfg = apply_overrides(get_recipe("debug_cpu"), TINY + extra + [f"train.out_dir={root}"])
    try:
        Trainer(cfg, quiet=True).close()
    except ValueError as err:
        return str(err)
    return None


def test_context_parallel_settings_are_checked_at_setup_for_their_mode(tmp_path):
    """Head-wise CP over more ranks than heads failed only at the first forward (after setup and any resume);
    and the planner's whole-node rule refused CP modes that never plan (here 3 ranks with 2 GPUs per node)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    heads = run_distributed(_construct, 2, str(tmp_path / "hcp"), ["parallel.cp=2", "parallel.cp_mode=hcp",
                            "model.heads=1", "model.hidden=16"], out_dir=tmp_path / "a", timeout_s=60)
    assert all("needs at least 2 heads, model.heads=1" in message for message in heads), heads
    # 6×8×8 tokens: 128 a rank, whole 2×2×2 cubes (TINY's 4 frames do not split over 3 ranks, refused at setup)
    scp = run_distributed(_construct, 3, str(tmp_path / "scp"), ["parallel.cp=3", "parallel.cp_mode=scp",
                          "parallel.gpus_per_node=2", "data.frames=6"], out_dir=tmp_path / "b", timeout_s=60)
    assert scp == [None, None, None]


def _construct_with_one_file_unreadable_on_rank_1(rank: int, world: int, folder: str, root: str) -> str | None:
    from dsv.train import data
    from dsv.train.video_io import VideoDecodeError

    if rank == 1:  # as a read error on one node, or a file still being copied in when that rank listed it
        read = data.read_video

        def failing(path, short_side):
            if Path(path).name == "b.mp4":
                raise VideoDecodeError(f"read_video: PyAV cannot decode {path}: moov atom not found")
            return read(path, short_side)

        data.read_video = failing
    return _construct(rank, world, root, [f"data.path={folder}"])


def test_ranks_that_loaded_other_videos_are_refused(tmp_path):
    """Every rank decodes the folder itself: a rank that skipped a file trained on other videos than the rest
    without a word (the checkpoint holds rank 0's fingerprint only). Every rank raises, naming the difference."""
    from dsv.train.video_io import write_video
    from tests.train.test_training import _drifting_video

    folder = tmp_path / "videos"
    folder.mkdir()
    for name, phase in (("a.mp4", 0.0), ("b.mp4", 1.0)):
        write_video(_drifting_video(20, phase), folder / name)
    errors = run_distributed(_construct_with_one_file_unreadable_on_rank_1, 2, str(folder), str(tmp_path / "run"),
                             out_dir=tmp_path, timeout_s=60)
    assert all(error is not None and "data: ranks [1] loaded other sources than rank 0" in error
               and "rank 1: ['a.mp4']" in error for error in errors), errors


def _train_with_a_full_disk_on_rank_0(rank: int, world: int, root: str) -> str | None:
    from dsv.train import trainer as trainer_module
    from dsv.train.checkpoint import CheckpointError
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe

    if rank == 0:
        def full_disk(self):
            raise OSError(28, "No space left on device")

        trainer_module.Trainer._sync_logs = full_disk
    cfg = apply_overrides(get_recipe("debug_cpu"), TINY + [
        "train.threads=1", "train.steps=1", "train.ckpt_every=1", f"train.out_dir={root}"])
    try:
        trainer_module.Trainer(cfg, quiet=True).run()
    except CheckpointError as err:
        return str(err)
    return None


def test_a_failure_syncing_the_logs_before_a_save_is_told_to_every_rank(tmp_path):
    """Rank 0 syncs the logs before it writes a checkpoint: a full disk there raised on rank 0 alone, outside what
    it tells the others, who then failed on a closed connection with no cause (or waited two hours)."""
    errors = run_distributed(_train_with_a_full_disk_on_rank_0, 2, str(tmp_path / "run"), out_dir=tmp_path,
                             timeout_s=120)
    assert all(error is not None and "saving step 1 failed on rank 0: OSError: [Errno 28] No space left" in error
               for error in errors), errors
