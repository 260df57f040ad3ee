"""Sample sets of `dsv bench quality` kept on disk between its commands of one output folder, so that a command
with --resume that evaluates again (one cut short in its evaluation, or one that adds --sampling-kept-mass
shares) samples only the sets it lacks: on one H200 a seed's sets take minutes, most of an evaluation.

A set is reused only where everything that made it is the same: the run's checkpoint (the SHA-256 of its files,
from its manifest), the sampling settings (videos, Euler steps, noise seed, timed passes), the machine and the
dsv sources. Anything else, or a file that does not read back, samples the set again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from dsv.train.checkpoint import latest_manifest

# What a set's producer returns: the samples, the seconds of its timed passes and the facts measured with them.
Sampled = tuple[torch.Tensor, list[float], dict]


def machine_name(device: torch.device) -> str:
    """The device samples were timed on: the GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class SampleStore:
    """Sets under ``root`` (one folder per run, one file per set), keyed by what made them (module docstring).
    ``settings`` holds the sampling settings, machine and code shared by every set of a command; ``reused``
    lists the sets this command read back instead of sampling, as ``run folder: set``."""

    def __init__(self, root: Path, settings: dict):
        self.root = root
        self.settings = settings
        self.reused: list[str] = []

    def key(self, run_dir: Path, name: str, repeats: int) -> dict:
        found = latest_manifest(run_dir)
        if found is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint to sample")
        path, manifest = found
        return {**self.settings, "set": name, "timing_repeats": repeats, "checkpoint": path.name,
                "checkpoint_sha256": manifest.get("sha256")}

    def path(self, run_dir: Path, name: str) -> Path:
        # Set names hold commas and spaces ("dsv, budgets keeping 0.97 of the mass"): a file name of their words.
        return self.root / run_dir.name / ("_".join(name.replace(",", " ").split()) + ".pt")

    def get_or_make(self, run_dir: Path, name: str, repeats: int, make: Callable[[], Sampled]) -> Sampled:
        """Set ``name`` of the run in ``run_dir`` as stored by an earlier command where its key matches, else
        ``make()``'s, stored (atomically: a command cut while writing leaves the earlier file or none)."""
        key = self.key(run_dir, name, repeats)
        file = self.path(run_dir, name)
        if file.is_file():
            try:
                stored = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as err:  # a file that does not read back is sampled again, and said so
                print(f"[quality] {file} does not read back ({type(err).__name__}: {err}); sampling {name} again",
                      flush=True)
            else:
                if stored.get("key") == key:
                    self.reused.append(f"{run_dir.name}: {name}")
                    return stored["videos"], stored["passes"], stored["facts"]
        videos, passes, facts = make()
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        torch.save({"key": key, "videos": videos.cpu(), "passes": passes, "facts": facts}, partial)
        os.replace(partial, file)
        return videos, passes, facts
