"""A compact video DiT: 3-D patchify, adaLN-single timestep conditioning, DSV self-attention, MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsv.modules.attention import DSVAttention
from dsv.modules.config import AttentionConfig, check_config_fields
from dsv.modules.controller import DSVController
from dsv.ops.grouping import cube_permutation_on

MODEL_ARCHS = ("dit", "wan")


@dataclass
class ModelConfig:
    arch: str = "dit"  # dit: DSV's compact video DiT; wan: a diffusers Wan transformer with DSV installed
    in_channels: int = 3
    patch: tuple[int, int, int] = (1, 4, 4)  # (t, h, w) extent of one token
    hidden: int = 128
    depth: int = 4
    heads: int = 4
    head_dim: int = 0  # 0: hidden // heads
    mlp_ratio: float = 4.0
    num_classes: int = 0  # > 0 adds class conditioning (with a null class for guidance)
    activation_checkpointing: bool = False
    # A torch.compile backend for every block (fullgraph; "inductor" on GPUs), "" for eager. Each block
    # compiles once per dispatch (dense, sparse), not per step (tests/modules/test_compile.py).
    compile: str = ""

    def __post_init__(self) -> None:
        if self.arch not in MODEL_ARCHS:
            raise ValueError(f"model.arch must be one of {MODEL_ARCHS}, got {self.arch!r}")
        if self.compile and self.compile not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"model.compile must be '' (eager) or a torch.compile backend, e.g. "
                             f"{', '.join(torch._dynamo.list_backends())}; got {self.compile!r}")
        if self.compile and self.arch != "dit":
            raise ValueError(f"model.compile={self.compile!r} compiles the blocks of model.arch='dit'; for a diffusers "
                             "model compile its transformer blocks yourself, or set model.compile=''")
        check_config_fields(self, "model")
        if len(self.patch) != 3 or min(self.patch) < 1:
            raise ValueError(f"model.patch must be three positive ints (t, h, w), got {self.patch}")
        for name in ("in_channels", "hidden", "depth", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.arch == "dit" and self.hidden < 6:  # the 3-D sin-cos position embedding needs 2 channels per axis
            raise ValueError(f"model.hidden must be >= 6 for model.arch='dit', got {self.hidden}")
        if self.head_dim < 0 or self.mlp_ratio <= 0 or self.num_classes < 0:
            raise ValueError(f"model.head_dim must be >= 0, model.mlp_ratio > 0 and model.num_classes >= 0, got "
                             f"{self.head_dim}, {self.mlp_ratio}, {self.num_classes}")
        if self.head_dim == 0 and self.hidden % self.heads:
            raise ValueError(f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}")
        if self.arch == "wan" and self.attention_head_dim % 2:  # Wan's rotary embedding turns channel pairs
            raise ValueError(f"model.arch='wan' needs an even head dim (its rotary embedding turns channel pairs), "
                             f"got {self.attention_head_dim} (model.head_dim, or model.hidden / model.heads)")

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of `t [B]` in [0, 1] (scaled by 1000 as in DiT) → `[B, dim]`."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_position_3d(grid: tuple[int, int, int], dim: int, device: torch.device) -> torch.Tensor:
    """Fixed 3-D sin-cos position embedding `[T*H*W, dim]` (raster order): the channels are split over
    t, h, w so that any grid size works without retraining a table."""
    per_axis = (dim // 6) * 2
    parts = []
    coords = torch.meshgrid(*[torch.arange(n, device=device, dtype=torch.float32) for n in grid], indexing="ij")
    for axis in range(3):
        pos = coords[axis].reshape(-1)
        half = per_axis // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=device, dtype=torch.float32) / half)
        args = pos[:, None] * freqs[None]
        parts += [torch.sin(args), torch.cos(args)]
    emb = torch.cat(parts, dim=-1)
    return F.pad(emb, (0, dim - emb.shape[1]))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_cfg: AttentionConfig):
        super().__init__()
        hidden = cfg.hidden
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = DSVAttention(hidden, cfg.heads, cfg.attention_head_dim, attn_cfg)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        mlp_hidden = int(hidden * cfg.mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp_hidden), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden, hidden)
        )
        # adaLN-single (PixArt-α): one shared timestep MLP, plus a learned per-block table.
        self.scale_shift_table = nn.Parameter(torch.randn(6, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, t_mod: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """`x [B, S, C]` in grouped order (`cube_permutation` of the attention's cube): every op but the
        attention is per token, so the model permutes its tokens once instead of each layer twice."""
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.scale_shift_table[None] + t_mod).unbind(1)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1), grid, grouped=True)
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class VideoDiT(nn.Module):
    """`forward(x [B, C, T, H, W], t [B], y [B] | None) -> velocity [B, C, T, H, W]`."""

    def __init__(self, cfg: ModelConfig, attn_cfg: AttentionConfig):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.hidden
        self.patch_embed = nn.Conv3d(cfg.in_channels, hidden, kernel_size=cfg.patch, stride=cfg.patch)
        self.t_embed = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.y_embed = nn.Embedding(cfg.num_classes + 1, hidden) if cfg.num_classes > 0 else None
        self.blocks = nn.ModuleList(DiTBlock(cfg, attn_cfg) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_table = nn.Parameter(torch.randn(2, hidden) / hidden**0.5)
        self.final_linear = nn.Linear(hidden, cfg.in_channels * math.prod(cfg.patch))
        self._init_weights()
        self.controller = DSVController(attn_cfg).attach(self)
        self.context_parallel = None
        if cfg.compile:
            for block in self.blocks:  # in place: the state_dict keys stay those of the eager model
                block.compile(backend=cfg.compile, fullgraph=True)

    def enable_context_parallel(self, context_parallel) -> None:
        """Split each sample's sequence over a CP group (`dsv.parallel.context.ContextParallel`): the
        blocks see this rank's chunk in grouped order; the output is gathered back on every rank."""
        if self.cfg.compile:
            # The CP attention's collectives and host-side layout choice are not traced: refuse rather than
            # fail inside a compiled graph.
            raise ValueError(f"model.compile={self.cfg.compile!r} does not run under context parallelism yet; "
                             "set model.compile='' with parallel.cp > 1")
        self.context_parallel = context_parallel
        for block in self.blocks:
            block.attn.context_parallel = context_parallel
            # A cached layout holds the previous instance's process groups: plan afresh.
            block.attn.__dict__.pop("_cp_layout", None)

    def _init_weights(self) -> None:
        # DiT's zero-init of the output paths: every block starts as the identity.
        for block in self.blocks:
            nn.init.zeros_(block.attn.to_out.weight)
            nn.init.zeros_(block.attn.to_out.bias)
            nn.init.zeros_(block.mlp[-1].weight)
            nn.init.zeros_(block.mlp[-1].bias)
        nn.init.zeros_(self.final_linear.weight)
        nn.init.zeros_(self.final_linear.bias)

    def token_grid(self, video_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """Token grid of an input `[B, C, T, H, W]`; rejects sizes the patch does not divide."""
        t, h, w = video_shape[-3:]
        for name, size, p in zip("THW", (t, h, w), self.cfg.patch):
            if size % p:
                raise ValueError(f"input {name}={size} is not divisible by the patch extent {p} (model.patch)")
        return t // self.cfg.patch[0], h // self.cfg.patch[1], w // self.cfg.patch[2]

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 5 or x.shape[1] != self.cfg.in_channels:
            raise ValueError(f"x must be [B, {self.cfg.in_channels}, T, H, W], got {tuple(x.shape)}")
        if t.shape != (x.shape[0],):
            raise ValueError(f"t must be [B]={x.shape[0]} timesteps in [0, 1], got {tuple(t.shape)}")
        grid = self.token_grid(x.shape)
        if not torch.compiler.is_compiling():
            self.controller.refresh_host_state_if_stale()  # a state written in place since (a compiled block cannot)
        # Under FSDP mixed precision the weights arrive in bf16 and the inputs are not cast for us.
        x = x.to(self.patch_embed.weight.dtype) if not torch.is_autocast_enabled(x.device.type) else x
        # [B, S, hidden] in raster order, made contiguous once: the transposed view's strides would otherwise
        # carry through every elementwise op of the residual stream, and each norm, linear and gather would
        # copy it to a contiguous layout again, in every block.
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2).contiguous()
        tokens = tokens + sincos_position_3d(grid, self.cfg.hidden, x.device).to(tokens.dtype)
        cond = self.t_embed(timestep_embedding(t, 256).to(tokens.dtype))
        if y is not None:
            if self.y_embed is None:  # ignored, the model would train unconditionally without a word
                raise ValueError("y (class labels) given to a model without classes: set model.num_classes > 0, "
                                 "or pass y=None")
            if y.shape != (x.shape[0],) or y.dtype.is_floating_point or y.dtype == torch.bool:
                raise ValueError(f"y must be integer [B]={x.shape[0]} class ids in [0, {self.cfg.num_classes}] "
                                 f"({self.cfg.num_classes}: the null class), got {y.dtype} {tuple(y.shape)}")
            # One small device sync: an id out of range fails deep in the embedding (on a GPU as a device-side
            # assert that ends the process's CUDA use).
            low, high = torch.stack([y.min(), y.max()]).tolist() if y.numel() else (0, 0)
            if low < 0 or high > self.cfg.num_classes:
                raise ValueError(f"y must be class ids in [0, {self.cfg.num_classes}] ({self.cfg.num_classes}: the "
                                 f"null class), got values from {low} to {high}")
        if self.y_embed is not None:
            if y is None:
                y = torch.full_like(t, self.cfg.num_classes, dtype=torch.long)  # the null class
            cond = cond + self.y_embed(y)
        t_mod = self.t_block(cond).view(-1, 6, self.cfg.hidden)
        cp, attn_cfg = self.context_parallel, self.blocks[0].attn.cfg
        if cp is not None:
            tokens = cp.shard_tokens(tokens, grid, attn_cfg.cube, attn_cfg.group_size, attn_cfg.key_block)
        else:
            perm, inv = cube_permutation_on(grid, attn_cfg.cube, tokens.device)
            tokens = tokens.index_select(1, perm)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training:
                tokens = checkpoint(block, tokens, t_mod, grid, use_reentrant=False)
            else:
                tokens = block(tokens, t_mod, grid)
        shift, scale = (self.final_table[None] + cond[:, None]).unbind(1)
        out = self.final_linear(modulate(self.final_norm(tokens), shift, scale))
        out = cp.gather_tokens(out, grid, attn_cfg.cube) if cp is not None else out.index_select(1, inv)
        return self.unpatchify(out, grid)

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        b = tokens.shape[0]
        pt, ph, pw = self.cfg.patch
        c = self.cfg.in_channels
        x = tokens.view(b, *grid, pt, ph, pw, c)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, T, pt, H, ph, W, pw]
        return x.reshape(b, c, grid[0] * pt, grid[1] * ph, grid[2] * pw)


def flow_matching_loss(
    model: VideoDiT, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, y: torch.Tensor | None = None
) -> torch.Tensor:
    """Rectified flow: x_t = (1 - t)·x0 + t·noise; the model predicts the velocity noise - x0."""
    if noise.shape != x0.shape:  # a broadcast noise would share one draw across the batch without a word
        raise ValueError(f"noise must have x0's shape {tuple(x0.shape)}, got {tuple(noise.shape)}")
    tb = t.view(-1, 1, 1, 1, 1).to(x0.dtype)
    x_t = (1 - tb) * x0 + tb * noise
    pred = model(x_t, t, y)
    return F.mse_loss(pred.float(), (noise - x0).float())


@torch.no_grad()
def sample_euler(
    model: VideoDiT, noise: torch.Tensor, steps: int, y: torch.Tensor | None = None,
    before_step: Callable[[float], None] | None = None,
) -> torch.Tensor:
    """Integrate the learned velocity from t = 1 (noise) to t = 0 (data) with Euler steps; `before_step(t)` is
    called with each step's noise level before its forward (e.g. to set the attention budgets of that level)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1 (Euler steps; 0 would return the noise), got {steps!r}")
    x = noise
    times = torch.linspace(1.0, 0.0, steps + 1, device=noise.device)
    host_times = torch.linspace(1.0, 0.0, steps + 1).tolist()  # the same values, without a device sync
    for i in range(steps):
        if before_step is not None:
            before_step(host_times[i])
        t = times[i].expand(noise.shape[0])
        x = x + (times[i + 1] - times[i]) * model(x, t, y).to(x.dtype)
    return x
