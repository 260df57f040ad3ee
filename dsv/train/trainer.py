"""The one trainer: flow-matching training of the video DiT with DSV attention."""

from __future__ import annotations

import datetime
import json
import math
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from tqdm import tqdm

from dsv.modules.attention import model_parameters
from dsv.modules.config import FIXED_MODES
from dsv.modules.dit import VideoDiT, flow_matching_loss
from dsv.parallel.fsdp import check_replicas_in_sync, shard_model
from dsv.parallel.scp import check_sequence_split
from dsv.train.checkpoint import (
    CheckpointError,
    check_weights_match,
    checkpoint_config,
    checkpoint_root,
    list_checkpoints,
    load_checkpoint,
    load_weights_into,
    lock_run_dir,
    remove_unfinished_saves,
    save_checkpoint,
    write_text_atomic,
)
from dsv.train.config import Config, OptimConfig, config_to_dict, device_absence, parse_device
from dsv.train.data import build_dataset
from dsv.train.durable import fsync_path

# A resumed run must match the checkpoint's configuration except in these fields, which change neither
# the model nor the sequence of batches and updates (so the continuation stays exact up to the rounding of a
# compiled graph, or of another CPU thread count, which a resume warns about). `data.path` may name the same
# videos elsewhere: the data itself is checked against the checkpoint's fingerprint of it (`_check_data`).
RESUMABLE_CHANGES = {"train": {"steps", "log_every", "eval_every", "ckpt_every", "keep_checkpoints", "tensorboard",
                               "threads", "out_dir", "device", "max_minutes"},
                     "model": {"compile"},
                     "data": {"path"}}


def check_resumable_config(saved: Config, cfg: Config, ckpt: str | Path) -> None:
    """Raise a CheckpointError naming every field in which `cfg` differs from the `saved` config of checkpoint
    `ckpt` beyond `RESUMABLE_CHANGES`, and in `train.steps` where the learning rate decays over them."""
    diff = [f"{section}.{k}: checkpoint {v!r}, run {getattr(getattr(cfg, section), k)!r}"
            for section in vars(saved) for k, v in vars(getattr(saved, section)).items()
            if getattr(getattr(cfg, section), k) != v and k not in RESUMABLE_CHANGES.get(section, ())]
    if saved.optim.schedule != "constant" and cfg.train.steps != saved.train.steps:
        # The decay is spread over train.steps: another length would change the rates of the remaining steps.
        diff.append(f"train.steps: checkpoint {saved.train.steps!r}, run {cfg.train.steps!r} (optim.schedule="
                    f"{saved.optim.schedule!r} spreads its decay over train.steps; only a constant rate may extend "
                    "a run)")
    if diff:
        allowed = " and ".join(f"{section}.{{{', '.join(sorted(fields))}}}"
                               for section, fields in RESUMABLE_CHANGES.items())
        raise CheckpointError(f"checkpoint {ckpt} was made with another configuration (only {allowed} may change on "
                              "resume): " + "; ".join(diff) + " (to continue it, --set each to the checkpoint's value)")


def _without_digest(source: dict) -> dict:
    """One source of a data fingerprint (`VideoClipDataset.fingerprint`) without its pixel digest."""
    return {k: v for k, v in source.items() if k != "sha256"}


SAVE_WAIT_TIMEOUT = datetime.timedelta(hours=2)
"""How long the other ranks wait for rank 0 to write a checkpoint. They wait in a gloo group of their own: in the
default group a large save on a slow file system could outlast its timeout (NCCL's is 10 minutes) and kill the run
in the middle of a good save. A multi-node run thus needs gloo to reach every node (`GLOO_SOCKET_IFNAME` where the
host name resolves to a loopback address)."""


def init_distributed(device_name: str) -> tuple[int, int, torch.device]:
    """`(rank, world_size, device)`. Under `torchrun` (WORLD_SIZE > 1) the process group is created here
    (NCCL on CUDA, gloo on CPU) unless the caller already did; a single process gets rank 0 of 1."""
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            device = resolve_device(device_name)
            if device.type == "cuda" and device.index is not None:
                # Code that names no device (Triton's launches, synchronize, memory stats) acts on the current
                # one: with train.device=cuda:1 that must be the run's GPU ("cuda" is the current one already).
                torch.cuda.set_device(device)
            return 0, 1, device
        use_cuda = torch.cuda.is_available() and device_name != "cpu"
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    return rank, world, device


def resolve_device(name: str, field: str = "train.device") -> torch.device:
    """The device ``name`` ("auto": CUDA where there is one) on this machine; a ValueError names ``field``."""
    try:
        device = parse_device(name)
    except ValueError as err:
        raise ValueError(f"{field} {err}") from None
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    absent = device_absence(device)
    if absent is not None:
        raise ValueError(f"{field}={name!r}, but {absent}")
    return device


def build_model(cfg: Config, device: torch.device) -> torch.nn.Module:
    """The model of `cfg.model.arch`, seeded; either has `forward(x, t, y=None)` and `.controller`."""
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    if m.arch == "wan":
        from dsv.integrations.diffusers import build_wan_for_training

        model = build_wan_for_training(
            cfg.attention, in_channels=m.in_channels, patch=m.patch, num_layers=m.depth, num_heads=m.heads,
            head_dim=m.attention_head_dim, ffn_dim=round(m.hidden * m.mlp_ratio))  # 8960 / 1536 may round below
        if m.activation_checkpointing:
            model.transformer.enable_gradient_checkpointing()
        return model.to(device)
    return VideoDiT(m, cfg.attention).to(device)


# The average's warm-up rule (`ema_decay_at`: diffusers' EMAModel, 0 at the first update, then
# min(decay, (1 + step) / (10 + step))) as a tag saved with the average: a checkpoint averaged under another rule
# would continue under this one unnoticed, its average then neither rule's. A new rule takes a new tag.
EMA_WARMUP = "diffusers-ema-model-warmup-v1"


def ema_decay_at(step: int, decay: float) -> float:
    """The moving average's decay in the update after optimizer step `step` (0: the first): 0 there (the average
    starts as the weights), then `decay`, less while `(1 + step) / (10 + step)` is smaller, as diffusers'
    EMAModel warms up (0.99 is reached at step 890). A fixed 0.99 would still hold 13% of the initial weights at
    step 200, where a quality_gpu run's held-out loss of its average was 2.3× that of its weights on one H200."""
    return 0.0 if step == 0 else min(decay, (1 + step) / (10 + step))


def lr_scale_at(update: int, optim: OptimConfig, steps: int) -> float:
    """The learning rate of optimizer update `update` (0: the first) as a multiple of `optim.lr`: a linear warmup
    over `optim.warmup_steps` updates, then 1 (`optim.schedule="constant"`) or a half cosine from 1 at the first
    update after the warmup towards `optim.final_lr_ratio`, which the update after the last of `steps` would
    reach (`"cosine"`: torch's CosineAnnealingLR curve, as diffusers' cosine schedule with warmup)."""
    warmup = optim.warmup_steps
    if update < warmup:
        return (update + 1) / warmup
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, steps - warmup))
    return optim.final_lr_ratio + (1.0 - optim.final_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def heldout_targets(n: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed (t, noise) for the held-out loss: t spread evenly over (0, 1), noise from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    t = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    return t, torch.randn((n, *shape), generator=gen)


def check_data_fits_model(cfg: Config) -> None:
    """Refuse, before any run folder is made, a model that the trainer's clips (RGB, `data.frames` frames of
    `data.size` pixels square) cannot feed: the first forward would fail with a shape error naming neither."""
    if cfg.model.in_channels != 3:
        raise ValueError(f"model.in_channels={cfg.model.in_channels}: the trainer's clips are RGB (3 channels)")
    for name, extent, patch in (("data.frames", cfg.data.frames, cfg.model.patch[0]),
                                ("data.size", cfg.data.size, cfg.model.patch[1]),
                                ("data.size", cfg.data.size, cfg.model.patch[2])):
        if extent % patch:
            raise ValueError(f"{name}={extent} is not a multiple of model.patch={tuple(cfg.model.patch)} "
                             f"along its axis ({patch}): the clips cannot be cut into whole patches")
    if cfg.parallel.cp > 1:  # the ranks' shares of the sequence (`ContextParallel.shard_tokens`)
        pt, ph, pw = cfg.model.patch
        tokens = (cfg.data.frames // pt) * (cfg.data.size // ph) * (cfg.data.size // pw)
        try:
            check_sequence_split(tokens, cfg.parallel.cp, cfg.attention.group_size, cfg.attention.key_block)
        except ValueError as err:
            raise ValueError(f"parallel.cp={cfg.parallel.cp} cannot split the {tokens} tokens of a clip "
                             f"(data.frames, data.size, model.patch) by attention.cube={tuple(cfg.attention.cube)} "
                             f"and attention.kv_block={cfg.attention.kv_block}: {err}") from None


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, quiet: bool = False):
        self._started = time.monotonic()  # train.max_minutes counts from here: the setup is part of a job's time
        self.cfg = cfg
        if cfg.model.num_classes:
            # The model would see only its null class: the datasets carry no labels to condition on.
            raise ValueError(f"model.num_classes={cfg.model.num_classes}: the trainer's data has no class labels; "
                             "set model.num_classes=0 (class conditioning needs labelled data)")
        check_data_fits_model(cfg)
        self.run_dir = Path(cfg.train.out_dir)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.rank, self.world, self.device = init_distributed(cfg.train.device)
        # Collective: every rank makes its trainer at the same point (see `SAVE_WAIT_TIMEOUT`).
        self._save_group = (dist.new_group(backend="gloo", timeout=SAVE_WAIT_TIMEOUT) if self.world > 1
                            else None)
        self.quiet = quiet or self.rank != 0  # rank 0 alone logs and writes
        self._run_lock = None
        if resume and not self.run_dir.is_dir():
            # Before the lock, which would create the folder: a mistyped out_dir must not leave one behind.
            raise CheckpointError(f"--resume: no checkpoint to continue: {self.run_dir} does not exist")
        try:
            # Rank 0 writes the folder, so it alone locks it, before looking at what the folder holds.
            self._run_lock = lock_run_dir(self.run_dir) if self.rank == 0 else None
            self._setup(cfg, resume)
        except BaseException:
            self._release_run_lock()  # a refused or failed start leaves the folder free for the next attempt
            self._release_save_group()
            raise

    def _setup(self, cfg: Config, resume: bool) -> None:
        self.metrics_file = None
        self.writer = None
        self.replicas_checked = 0  # replicated DSV tensors compared across ranks at the last save
        if self._run_lock is not None:  # no other process writes the folder: clear what crashed saves left
            for name in remove_unfinished_saves(self.run_dir):
                warnings.warn(f"{self.run_dir}: deleted {name}, left by a crashed save (not a checkpoint)",
                              stacklevel=3)
        if self.world > 1:
            dist.barrier()  # the other ranks list the folder after rank 0 has renamed and deleted in it
        existing = list_checkpoints(self.run_dir)
        if existing and not resume:
            raise FileExistsError(
                f"{self.run_dir} already holds checkpoints ({existing[-1].name}); pass --resume to continue "
                f"that run, or --set train.out_dir=<new folder> to start another (nothing was overwritten)"
            )
        if resume and not existing:
            raise CheckpointError(f"--resume: no checkpoint in {self.run_dir}/checkpoints")

        self.model = build_model(cfg, self.device)
        self.controller = self.model.controller
        self.context_parallel = None
        cp = self._enable_context_parallel()
        # Ranks of one CP group train on the same samples; data parallelism is across CP groups.
        self.dp_rank = self.rank // cp
        # Data parallel with FSDP2: blocks sharded, predictors replicated, DSV state averaged over ranks.
        # bf16 then comes from FSDP's mixed precision instead of autocast.
        mixed = self.device.type == "cuda" and cfg.train.bf16
        if self.world > 1:
            shard_model(self.model, mixed_precision=mixed)
        self.optimizer = torch.optim.AdamW(model_parameters(self.model), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                           weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda update: lr_scale_at(update, cfg.optim, cfg.train.steps))
        # The weights' moving average (`train.ema_decay`): an fp32 copy of each optimised weight, sharded as it is.
        trained = {id(p) for p in model_parameters(self.model)}
        self._ema_weights = [(name, p) for name, p in self.model.named_parameters() if id(p) in trained]
        if cfg.train.ema_decay and any(p.dtype != torch.float32 for _, p in self._ema_weights):
            # The evaluation swaps weights and average: a lower-precision weight would round the average.
            raise ValueError("train.ema_decay needs float32 weights (the trainer's own); got "
                             f"{sorted({str(p.dtype) for _, p in self._ema_weights})}")
        self.ema = [p.detach().clone() for _, p in self._ema_weights] if cfg.train.ema_decay else None
        self.data = build_dataset(cfg.data)
        if self.world > 1:
            self._check_same_sources()
        # Each data-parallel rank draws its own clips and noise; rank 0 draws what a single process would.
        self.data_gen = torch.Generator().manual_seed(cfg.train.seed + 1 + 1000 * self.dp_rank)
        self.noise_gen = torch.Generator().manual_seed(cfg.train.seed + 2 + 1000 * self.dp_rank)
        self.heldout = self.data.heldout_batch()
        self.heldout_t, self.heldout_noise = heldout_targets(
            self.heldout.shape[0], tuple(self.heldout.shape[1:]), cfg.data.heldout_seed + 1)
        self.step = 0
        # Training losses summed since the last logged step (kept on the device until logged) and their
        # count: saved with a checkpoint, so that a resumed run's first record averages the same steps.
        self._window_loss: torch.Tensor | float = 0.0
        self._window_steps = 0
        self.autocast = mixed and self.world == 1
        if resume:
            self._restore(existing[-1])
        kept_at_step = None  # the records at the checkpoint's step that stay, where some there were dropped
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resume:
                kept_at_step = self._drop_metrics_after(self.step)
            else:
                self._set_aside_logs_without_checkpoint()
            self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        if cfg.train.tensorboard and self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run's events replace those the interrupted one logged after its checkpoint, and at its
            # step too where `_drop_metrics_after` dropped records there (they are written again below).
            purge_step = None if not resume else self.step if kept_at_step is not None else self.step + 1
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)
            for record in kept_at_step or []:
                self._log_tensorboard(record)

    def _enable_context_parallel(self) -> int:
        """Split each sample's sequence over `parallel.cp` ranks; returns the CP size (1: off)."""
        par = self.cfg.parallel
        if par.cp == 1:
            return 1
        if self.cfg.model.arch != "dit":
            raise ValueError(f"parallel.cp={par.cp}: context parallelism runs on model.arch='dit', "
                             f"not {self.cfg.model.arch!r}")
        if self.world % par.cp:
            raise ValueError(f"parallel.cp={par.cp} must divide the number of processes ({self.world}); "
                             f"launch with torchrun --nproc-per-node a multiple of {par.cp}")
        from dsv.parallel.context import ContextParallel, default_cluster

        head_ranks = par.cp if par.cp_mode in ("hcp", "naive_hcp") else par.cp_hcp
        if head_ranks > self.cfg.model.heads:  # else found only at the first forward, after setup and resume
            raise ValueError(f"head-wise CP over {head_ranks} ranks needs at least {head_ranks} heads, model.heads="
                             f"{self.cfg.model.heads}; use parallel.cp_mode 'scp' or 'hybrid' (or a smaller "
                             "parallel.cp_hcp)")
        attention = self.cfg.attention
        cluster = None  # only the hybrid planner reads the links (and needs whole nodes of gpus_per_node)
        if par.cp_mode == "hybrid":
            cluster = default_cluster(par.cp, par.gpus_per_node if par.cp > par.gpus_per_node else None,
                                      par.intra_node_gbps, par.inter_node_gbps,
                                      block=min(attention.group_size, attention.key_block))
        self.context_parallel = ContextParallel(par.cp, par.cp_mode, self.device.type, cluster, hcp_size=par.cp_hcp)
        self.model.enable_context_parallel(self.context_parallel)
        return par.cp

    # ----- state -----
    def _predictors(self):
        return [layer.predictor for layer in self.controller.layers if layer.predictor is not None]

    def _rank_rng_state(self) -> dict:
        return {
            "data_generator": self.data_gen.get_state(),
            "noise_generator": self.noise_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            # Rank-local host state of context parallelism (measured SCP volumes the hybrid planner uses).
            "context_parallel": None if self.context_parallel is None else self.context_parallel.state_dict(),
            "log_window": {"loss_sum": torch.as_tensor(self._window_loss).detach().cpu(),
                           "steps": self._window_steps},
        }

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """`(full model weights, training state)`; with several ranks a collective (every rank calls it)
        that gathers the sharded weights and optimizer state and every rank's random state."""
        self._unpark_predictors()
        if self.world == 1:
            weights, optimizer = self.model.state_dict(), self.optimizer.state_dict()
            rng = [self._rank_rng_state()]
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(self.model, options=options)
            optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            rng = [None] * self.world
            dist.all_gather_object(rng, self._rank_rng_state())
        return weights, {
            "step": self.step,
            "world_size": self.world,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "predictor_optimizers": [p.optimizer.state_dict() for p in self._predictors()],
            "rng_per_rank": rng,
            "data": self.data.fingerprint(),
            # Host-side text of each layer's last dispatch decision (its inputs are buffers, in the weights),
            # so a resumed run logs what an uninterrupted one does until the next dispatch.
            "dispatch_reasons": [layer.dispatch_reason for layer in self.controller.layers],
            # CPU sums split over threads round by the thread count: a resume compares it (`_restore`).
            "cpu_threads": torch.get_num_threads(),
            "ema": None if self.ema is None else self._full_ema(),
            "ema_warmup": None if self.ema is None else EMA_WARMUP,
        }

    def _full_ema(self) -> dict[str, torch.Tensor] | None:
        """The moving average's full tensors by weight name, on rank 0's CPU (every rank gathers: a collective);
        None on the other ranks, as the gathered weights (only rank 0 saves)."""
        full = {}
        for (name, _), ema in zip(self._ema_weights, self.ema):
            tensor = ema.full_tensor() if isinstance(ema, DTensor) else ema
            if self.rank == 0:
                full[name] = tensor.detach().to("cpu", copy=True)
        return full if self.rank == 0 else None

    def save(self) -> Path:
        # Rank 0's copy of the replicated predictors and DSV state is saved for all ranks: if the replicas
        # drifted apart, write nothing and stop (every rank raises together).
        if self.world > 1:
            try:
                self.replicas_checked = check_replicas_in_sync(self.model)
            except RuntimeError as err:
                raise CheckpointError(f"step {self.step}: {err}") from err
        weights, state = self.full_state()
        path = checkpoint_root(self.run_dir) / f"step_{self.step:08d}"
        error, cause = None, None
        if self.rank == 0:
            try:
                self._sync_logs()  # in here: a full disk while syncing the logs is told to every rank too
                path = save_checkpoint(self.run_dir, self.step, weights, state, config_to_dict(self.cfg),
                                       keep=self.cfg.train.keep_checkpoints, scheduled=self._checkpoint_due)
            except Exception as err:  # told to every rank below, then raised everywhere
                error, cause = f"{type(err).__name__}: {err}", err
        if self.world > 1:
            # Every rank learns whether rank 0's write succeeded: none goes on, or waits, alone.
            status = [error]
            dist.broadcast_object_list(status, src=0, group=self._save_group)
            error = status[0]
        if error is not None:  # with rank 0's own traceback there (an internal error keeps its stack)
            raise CheckpointError(f"saving step {self.step} failed on rank 0: {error} (older checkpoints are "
                                  "intact)") from cause
        return path

    def _sync_logs(self) -> None:
        """The logs up to this step on disk before its checkpoint is: a resume from the checkpoint keeps the
        records it finds up to its step and rewrites none of them, so after a crash they must be there."""
        if self.metrics_file is not None:
            self.metrics_file.flush()
            os.fsync(self.metrics_file.fileno())
        if self.writer is not None:
            self.writer.flush()  # to the OS only: the event files' data must reach the disk too
            for events in Path(self.writer.log_dir).glob("events.out.tfevents.*"):
                fsync_path(events)

    def _unpark_predictors(self) -> None:
        # Parked (`attention.host_offload`) predictors hold host tensors; the distributed state-dict helpers
        # look at every parameter's device before any hook of ours runs.
        for predictor in self._predictors():
            predictor.unpark()

    def _checkpoint_due(self, step: int) -> bool:
        """Whether `step` is on the run's checkpoint schedule (every `ckpt_every` steps, and the last)."""
        return step % self.cfg.train.ckpt_every == 0 or step == self.cfg.train.steps

    def _check_same_sources(self) -> None:
        """Every rank decodes the folder itself: one that skipped a file (a read error on its node, a file still
        being copied in) would train on other videos than the rest, without a word, and the checkpoint, which
        holds rank 0's fingerprint, would not say so. Raises on every rank."""
        mine = [{key: value for key, value in source.items() if key != "sha256"} for source in self.data.fingerprint()]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        differing = [rank for rank, sources in enumerate(everyone) if sources != everyone[0]]
        if differing:
            names = [{source["name"] for source in sources} for sources in everyone]
            raise ValueError(f"data: ranks {differing} loaded other sources than rank 0 (rank 0: "
                             f"{sorted(names[0])}; rank {differing[0]}: {sorted(names[differing[0]])}, or other "
                             "shapes): every rank must decode the same videos; see each rank's warnings")

    def _restore(self, ckpt: Path) -> None:
        self._unpark_predictors()
        weights, state, manifest = load_checkpoint(ckpt)
        with warnings.catch_warnings():
            if self.rank != 0:  # its fields missing from an old checkpoint are named once, not by every rank
                warnings.simplefilter("ignore")
            saved = checkpoint_config(manifest, ckpt)
        check_resumable_config(saved, self.cfg, ckpt)
        if saved.model.compile != self.cfg.model.compile:
            # A resumable change (RESUMABLE_CHANGES), but a compiled graph rounds otherwise than eager code.
            warnings.warn(f"resuming with model.compile={self.cfg.model.compile!r}, saved with "
                          f"{saved.model.compile!r}: a compiled graph rounds otherwise than eager code, so the run "
                          "continues, but not bitwise as an uninterrupted one would", stacklevel=2)
        # Before anything indexes the per-rank state by this rank (a rank the checkpoint lacks would raise an
        # IndexError on that rank while rank 0 reports the real cause).
        if state["world_size"] != self.world:
            raise CheckpointError(f"checkpoint {ckpt} was saved by {state['world_size']} ranks; this run has "
                                  f"{self.world} (resume with the same number of processes)")
        self._check_data(ckpt, state.get("data"), saved.data.path)
        # For dropping the records an end of run added at this step (`_kept_on_resume`): the schedule they were
        # logged on, and whether the checkpoint carries the open loss window they closed.
        self._saved_schedule = (saved.train.log_every, saved.train.eval_every,
                                "log_window" in state["rng_per_rank"][self.rank])
        saved_on = "cpu" if state["rng_per_rank"][0]["cuda_rng"] is None else "cuda"
        if saved_on != self.device.type:
            # `train.device` may change on resume only in how it names the device: its type decides autocast,
            # the attention kernels and the random streams.
            raise CheckpointError(f"checkpoint {ckpt} was saved by a run on {saved_on}; this run is on "
                                  f"{self.device.type}, which would not continue it exactly (autocast, kernels and "
                                  f"random streams differ): resume on {saved_on}")
        if self.world == 1:
            load_weights_into(self.model, weights, str(ckpt))
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            check_weights_match(self.model, weights, str(ckpt))
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, weights, options=options)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])
        predictors = self._predictors()
        if len(predictors) != len(state["predictor_optimizers"]):
            raise CheckpointError(f"checkpoint {ckpt} has {len(state['predictor_optimizers'])} predictor "
                                  f"optimizers, the model has {len(predictors)}")
        for predictor, opt_state in zip(predictors, state["predictor_optimizers"]):
            predictor.optimizer.load_state_dict(opt_state)
        rng = state["rng_per_rank"][self.rank]
        self.data_gen.set_state(rng["data_generator"])
        self.noise_gen.set_state(rng["noise_generator"])
        torch.set_rng_state(rng["torch_rng"])
        if rng["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda_rng"], self.device)
        if self.context_parallel is not None and rng.get("context_parallel") is not None:
            self.context_parallel.load_state_dict(rng["context_parallel"])
        window = rng.get("log_window")  # absent from checkpoints saved before it was recorded
        if window is not None and window["steps"] > 0:
            self._window_loss = window["loss_sum"].to(self.device)
            self._window_steps = window["steps"]
        self._restore_ema(ckpt, state.get("ema"), state.get("ema_warmup"))
        reasons = state.get("dispatch_reasons")  # absent from checkpoints saved before it was recorded
        if reasons is not None and len(reasons) == len(self.controller.layers):
            for layer, reason in zip(self.controller.layers, reasons):
                layer.dispatch_reason = reason
        threads = state.get("cpu_threads")  # absent from checkpoints saved before it was recorded
        if self.device.type == "cpu" and threads is not None and threads != torch.get_num_threads():
            # train.threads may change on resume (RESUMABLE_CHANGES), and threads=0 takes the machine's cores.
            warnings.warn(f"resuming on {torch.get_num_threads()} CPU threads, saved on {threads}: CPU sums split "
                          "over threads round by the count, so the run continues, but not bitwise as an "
                          "uninterrupted one would (set train.threads to the saved count for that)", stacklevel=2)
        self.step = state["step"]
        self.controller.step = self.step

    def _restore_ema(self, ckpt: Path, saved: dict[str, torch.Tensor] | None, warmup: str | None) -> None:
        if self.ema is None:
            return
        names = [name for name, _ in self._ema_weights]
        if saved is None or sorted(saved) != sorted(names):
            # The configs matched (train.ema_decay included), so only an edited or foreign state gets here.
            raise CheckpointError(f"checkpoint {ckpt} lacks the weights' moving average of train.ema_decay="
                                  f"{self.cfg.train.ema_decay} (or holds it for other weights)")
        # Absent from checkpoints saved before it was recorded, which all averaged under this rule (one earlier
        # commit used a fixed decay; none of its checkpoints was kept).
        if warmup is not None and warmup != EMA_WARMUP:
            raise CheckpointError(f"checkpoint {ckpt} averaged its weights under another warm-up ({warmup!r}) than "
                                  f"this code's ({EMA_WARMUP!r}): continuing would mix the two; resume it with the "
                                  "code that saved it, or start the average afresh in a new run")
        with torch.no_grad():
            for name, ema in zip(names, self.ema):
                full = saved[name].to(ema.device, ema.dtype)
                if full.shape != ema.shape:
                    raise CheckpointError(f"checkpoint {ckpt}: the moving average of {name} is "
                                          f"{tuple(full.shape)}, the weight {tuple(ema.shape)}")
                if isinstance(ema, DTensor):
                    full = distribute_tensor(full, ema.device_mesh, ema.placements)
                ema.copy_(full)

    def _check_data(self, ckpt: Path, saved: list[dict] | None, saved_path: str | None) -> None:
        """Refuse to resume on other data than the checkpoint's (sources added, removed, cut or split
        differently: the batches would differ silently, e.g. when an optional package's photos appear);
        warn when only decoded pixels differ (the same files through another FFmpeg build)."""
        if saved is None:
            if saved_path != self.cfg.data.path:  # without a fingerprint, the path is all there is to compare
                raise CheckpointError(f"checkpoint {ckpt} (saved before data fingerprints were recorded) was "
                                      f"trained on data.path={saved_path!r}; this run has {self.cfg.data.path!r}")
            warnings.warn(f"checkpoint {ckpt} has no fingerprint of its data (saved before they were recorded): "
                          "only data.path is checked against it", stacklevel=3)
            return
        current = self.data.fingerprint()
        if [_without_digest(s) for s in saved] != [_without_digest(s) for s in current]:
            before = {s["name"]: _without_digest(s) for s in saved}
            now = {s["name"]: _without_digest(s) for s in current}
            changed = [name for name in now if name in before and now[name] != before[name]]
            raise CheckpointError(
                f"checkpoint {ckpt} was trained on other data: missing now {sorted(before.keys() - now.keys())}, "
                f"new {sorted(now.keys() - before.keys())}, other frames/size/split {changed}"
                + (", other order" if not changed and before.keys() == now.keys() else "")
                + " (resume with the data and packages the run started with)")
        differing = [s["name"] for s, c in zip(saved, current) if s["sha256"] != c["sha256"]]
        if differing:
            warnings.warn(f"resuming {ckpt}: the decoded pixels of {differing} differ from the run's (another "
                          "FFmpeg/PyAV build, or files whose content was replaced: check them): the continuation "
                          "will not be bitwise exact", stacklevel=3)

    def _set_aside_logs_without_checkpoint(self) -> None:
        """A new run in a folder whose earlier run stopped before its first checkpoint (the folder holds no
        checkpoint, or this run would have been refused) would append to that run's logs: they are renamed,
        kept, and the new run logs afresh."""
        for name in ("metrics.jsonl", "tensorboard"):
            old = self.run_dir / name
            if not old.exists():
                continue
            number = 1
            while (self.run_dir / f"{name}.unfinished-{number}").exists():
                number += 1
            old.rename(self.run_dir / f"{name}.unfinished-{number}")
            warnings.warn(f"{old} holds the logs of an earlier run that saved no checkpoint: kept as "
                          f"{name}.unfinished-{number}; this run logs afresh", stacklevel=4)

    def _kept_on_resume(self, record: dict, step: int) -> bool:
        """Records up to the checkpoint `step`, less the ones a run logged only because it ended there (a loss
        or held-out record off the schedule it was logged on, the checkpoint's `log_every` / `eval_every`):
        an uninterrupted run has none of them, and the open loss window of such an end, saved with the
        checkpoint, goes on into the resumed run's next record. Kept when this run trains no further step
        or the checkpoint predates the saved window (nothing would log those steps again)."""
        if record["step"] != step:
            return record["step"] < step
        log_every, eval_every, window_saved = self._saved_schedule
        if self.cfg.train.steps <= step or not window_saved:
            return True
        if "loss" in record:
            return step % log_every == 0
        if "heldout_loss" in record:
            return step % eval_every == 0
        return True

    def _drop_metrics_after(self, step: int) -> list[dict] | None:
        """Resuming re-runs the steps after the checkpoint: drop their old records so the log has each
        step once (rewritten atomically), and the end-of-run extras at `step` (`_kept_on_resume`). Returns
        the records kept at `step` where one there was dropped (TensorBoard rewrites that step), else None."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return None
        lines = [line for line in path.read_text().splitlines() if line]
        records = []
        for number, line in enumerate(lines):
            try:
                records.append((json.loads(line), line))
            except json.JSONDecodeError:
                if number < len(lines) - 1:
                    raise CheckpointError(f"{path} line {number + 1} is not JSON: the metrics log is corrupt "
                                          "(resuming rewrites it; move it aside to resume without it)") from None
                # A record cut short by the crash that this resume recovers from.
                warnings.warn(f"{path}: dropping its last line, cut short: {line[:80]!r}", stacklevel=2)
        kept = [(record, line) for record, line in records if self._kept_on_resume(record, step)]
        write_text_atomic(path, "".join(line + "\n" for record, line in kept))
        at_step = [record for record, _ in records if record["step"] == step]
        kept_at_step = [record for record, _ in kept if record["step"] == step]
        return kept_at_step if len(kept_at_step) < len(at_step) else None

    # ----- steps -----
    def _batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x0 = self.data.sample(self.cfg.train.batch_size, self.data_gen)
        # Logit-normal timesteps (as in SD3): more weight on the middle of the noise schedule.
        t = torch.sigmoid(torch.randn(x0.shape[0], generator=self.noise_gen))
        noise = torch.randn(x0.shape, generator=self.noise_gen)
        return x0.to(self.device), t.to(self.device), noise.to(self.device)

    def train_step(self) -> dict:
        self.model.train()
        self.controller.begin_step(self.step)
        x0, t, noise = self._batch()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = flow_matching_loss(self.model, x0, t, noise)
        loss.backward()
        # grad_clip = 0 disables clipping (the norm is still computed for the log).
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for g in self.optimizer.param_groups for p in g["params"]], self.cfg.optim.grad_clip or float("inf"))
        # One host sync per step, before the optimizer applies anything: a non-finite loss, a non-finite
        # gradient (a finite loss can overflow in the backward; clipping would then write NaN into every
        # weight) or a failed predictor (it would select garbage keys) stops the run.
        norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        bad = ~torch.isfinite(loss.detach()) | ~torch.isfinite(norm)
        predictor_failed = self.controller.predictor_failed()
        if predictor_failed is not None:
            bad = bad | predictor_failed
        bad = bad.float()
        if self.world > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank stops together instead of hanging
        if bad:
            self.optimizer.zero_grad(set_to_none=True)  # a caller that catches this must not add to NaN gradients
            raise FloatingPointError(f"step {self.step}: the training loss, the gradient norm or a DSV predictor's "
                                     "loss is not finite on some rank; stopping before the optimizer applies it "
                                     "(the last checkpoint is intact)")
        self.optimizer.step()
        if self.ema is not None:
            self._update_ema()
        # Freed now, not before the next backward: the next forward's peak need not hold a model's worth
        # of old gradients (6 GiB at the 2.7B shape).
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        events = self.controller.end_step()
        self.step += 1
        return {"loss": loss.detach(), "grad_norm": grad_norm, "events": events}

    @torch.no_grad()
    def _update_ema(self) -> None:
        def local(tensors):  # the shards: every rank averages its own part of each weight
            return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

        weights = [p for _, p in self._ema_weights]
        torch._foreach_lerp_(local(self.ema), local(weights), 1.0 - ema_decay_at(self.step, self.cfg.train.ema_decay))

    @torch.no_grad()
    def heldout_loss_of_ema(self) -> float:
        """The held-out loss with the moving average in place of the weights, which are put back after."""
        self._swap_weights_with_average()
        try:
            return self.heldout_loss()
        finally:
            self._swap_weights_with_average()

    def _swap_weights_with_average(self) -> None:
        """Exchange each weight with its average, one tensor at a time (no second copy of the model; both fp32,
        so two swaps restore the weights bitwise)."""
        for (_, weight), ema in zip(self._ema_weights, self.ema):
            held = weight.detach().clone()
            weight.copy_(ema)
            ema.copy_(held)
        self._drop_gathered_weights()

    def _drop_gathered_weights(self) -> None:
        """FSDP2 reads a sharded weight only when it gathers it: a group still gathered from the last forward (the
        root after a forward, in torch releases before mid-2025) would run with the old values."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @torch.no_grad()
    def heldout_loss(self) -> float:
        self.model.eval()
        total = 0.0
        n = self.heldout.shape[0]
        chunk = self.cfg.train.batch_size
        for i in range(0, n, chunk):
            x0 = self.heldout[i:i + chunk].to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = flow_matching_loss(self.model, x0, self.heldout_t[i:i + chunk].to(self.device),
                                          self.heldout_noise[i:i + chunk].to(self.device))
            total += float(loss) * x0.shape[0]
        return total / n

    def _mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.world > 1:
            value = value.detach().clone()
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return float(value)

    # ----- logging -----
    def _log(self, record: dict) -> None:
        if self.metrics_file is None:
            return
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self._log_tensorboard(record)

    def _log_tensorboard(self, record: dict) -> None:
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    self.writer.add_scalar(key, value, record["step"])

    def _print(self, text: str) -> None:
        if not self.quiet:
            tqdm.write(text)

    def _describe_layers(self, summary: dict) -> str:
        lines = []
        for i, layer in enumerate(summary["layers"]):
            sparsity = " ".join("  -  " if s is None else f"{s:.2f}" for s in layer["sparsity"])
            recall = [r for r in layer["recall"] if r is not None]
            recall_text = f" recall {sum(recall) / len(recall):.3f}" if recall else ""
            # On a GPU the reference path is the slow fallback: say why (a compiled block cannot warn).
            slow = (f" | slow path: {layer['backend_reason']}" if self.device.type == "cuda"
                    and layer["path"].startswith("sparse:reference") else "")
            # Which of the Triton backend's kernels ran (eager forwards record it): a layout the fastest
            # kernels leave out says so here.
            kernels = (f" | kernels: forward {layer['forward']}, backward {layer['backward']}"
                       if layer["path"].startswith("sparse:triton") and layer["forward"] is not None else "")
            # The bracket is the path the last forward took; a dispatch made since (the switch, a re-dispatch)
            # takes effect from the next step.
            verdict = "sparse" if layer["sparse"] else "dense"
            if layer["path"] != "none" and not layer["path"].startswith(verdict):
                verdict += " from the next step"
            lines.append(f"    block {i:2d} [{layer['path']:>16}] head sparsity {sparsity}{recall_text}"
                         f" | {verdict}: {layer['dispatch']}{slow}{kernels}")
        return "\n".join(lines)

    def run(self) -> dict:
        cfg = self.cfg.train
        self._print(f"DSV training: device={self.device}, mode={self.cfg.attention.mode}, "
                    f"params={sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M, "
                    f"data={len(self.data.sources())} real sources "
                    f"({', '.join(s.name.split('/')[-1] for s in self.data.sources())}), run_dir={self.run_dir}")
        bar = tqdm(total=cfg.steps, initial=self.step, disable=self.quiet, dynamic_ncols=True, leave=False,
                   mininterval=2.0)
        # Released however the loop ends: after an exception the run folder's lock and the save group would stay
        # held until the process exits, and a notebook could not start or resume a run in that folder.
        try:
            last = self._train_until_done_or_out_of_time(bar)
        except BaseException:
            try:
                bar.close()
                self.close()
            except Exception as err:  # the loop's own error is the one to see
                warnings.warn(f"closing the run after its failure failed too: {type(err).__name__}: {err}",
                              stacklevel=2)
            raise
        bar.close()
        self.close()
        last["stopped_at_time_limit"] = self.step < cfg.steps
        last["switch_step"] = int(self.controller.switch_step)
        last["sparse_blocks_list"] = self.controller.sparse_layers()
        return last

    def _train_until_done_or_out_of_time(self, bar) -> dict:
        """The training loop of `run`; returns the last logged record (with the last held-out loss)."""
        cfg = self.cfg.train
        timed_steps, t_start = 0, time.perf_counter()
        last = {}
        while self.step < cfg.steps:
            out = self.train_step()
            bar.update(1)
            self._window_loss = self._window_loss + out["loss"]  # stays on the device until logged
            self._window_steps += 1
            timed_steps += 1
            events = out["events"]
            if events.switched:
                summary = self.controller.summary()
                self._print(f"step {self.step}: stage 2 ({events.switch_reason}); "
                            f"sparse blocks: {self.controller.sparse_layers()}\n" + self._describe_layers(summary))
            on_schedule = self.step % cfg.log_every == 0
            if on_schedule or self.step == cfg.steps:
                summary = self.controller.summary()
                elapsed = time.perf_counter() - t_start
                record = {
                    "step": self.step,
                    "loss": self._mean_over_ranks(self._window_loss) / self._window_steps,
                    # The rate of the update that made this step.
                    "lr": self.cfg.optim.lr * lr_scale_at(self.step - 1, self.cfg.optim, cfg.steps),
                    "grad_norm": float(out["grad_norm"].full_tensor() if isinstance(out["grad_norm"], DTensor)
                                       else out["grad_norm"]),
                    "stage": summary["stage"],
                    "predictor_loss": summary["predictor_loss"],
                    "sparse_blocks": len(self.controller.sparse_layers()),
                    "steps_per_s": timed_steps / elapsed,
                }
                for i, layer in enumerate(summary["layers"]):
                    for key in ("sparsity", "recall"):
                        values = [v for v in layer[key] if v is not None]
                        if values:
                            record[f"{key}/block{i}"] = sum(values) / len(values)
                record["layers"] = summary["layers"]
                self._log(record)
                pl = summary["predictor_loss"]
                # Window and dense runs have no predictor and no stage switch: their mode says what runs.
                mode = self.cfg.attention.mode
                state = (f"mode {mode}" if mode in FIXED_MODES else
                         f"stage {summary['stage']} | predictor loss {'-' if pl is None else f'{pl:.4f}'}")
                self._print(f"step {self.step:5d} | loss {record['loss']:.4f} | {state} | sparse blocks "
                            f"{self.controller.sparse_layers()} | {record['steps_per_s']:.1f} it/s")
                if on_schedule:  # a record only because the run ends here leaves its window open for a resume
                    self._window_loss, self._window_steps = 0.0, 0
                timed_steps, t_start = 0, time.perf_counter()
                last = record
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                held = {"heldout_loss": self.heldout_loss()}
                if self.ema is not None:
                    held["heldout_loss_ema"] = self.heldout_loss_of_ema()
                self._log({"step": self.step, **held})
                ema_text = (f" (moving average of the weights {held['heldout_loss_ema']:.4f})"
                            if self.ema is not None else "")
                self._print(f"step {self.step:5d} | held-out loss {held['heldout_loss']:.4f}{ema_text} | per-block "
                            "state:\n" + self._describe_layers(self.controller.summary()))
                last.update(held)
            saved = self._checkpoint_due(self.step)
            if saved:
                self._save_and_tell()
            if self.step < cfg.steps and self._out_of_time():
                if not saved:
                    self._save_and_tell()
                self._print(f"step {self.step:5d} | stopped: train.max_minutes={cfg.max_minutes:g} reached; "
                            "the same command with --resume continues the run exactly")
                break
        return last

    def _save_and_tell(self) -> None:
        path = self.save()
        checked = (f" ({self.replicas_checked} replicated DSV tensors identical on {self.world} ranks)"
                   if self.world > 1 else "")
        self._print(f"step {self.step:5d} | checkpoint {path}{checked}")

    def _out_of_time(self) -> bool:
        """Whether `train.max_minutes` has run out. Rank 0's clock decides for every rank (a CPU broadcast in the
        save group, no GPU sync), so that all ranks stop after the same step."""
        if not self.cfg.train.max_minutes:
            return False
        over = torch.tensor([time.monotonic() - self._started >= 60 * self.cfg.train.max_minutes], dtype=torch.uint8)
        if self.world > 1:
            dist.broadcast(over, src=0, group=self._save_group)
        return bool(over)

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.writer is not None:
            self.writer.close()
        self._release_run_lock()
        self._release_save_group()

    def _release_save_group(self) -> None:
        if self._save_group is not None:
            dist.destroy_process_group(self._save_group)
            self._save_group = None

    def _release_run_lock(self) -> None:
        if self._run_lock is not None:
            self._run_lock.close()
            self._run_lock = None

