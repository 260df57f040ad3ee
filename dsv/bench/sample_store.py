"""Sample sets of `dsv bench quality` kept on disk between its commands of one output folder, so that a command
with --resume that evaluates again (one cut short in its evaluation, or one that adds --sampling-kept-mass
shares) samples only the sets it lacks: on one H200 a seed's sets take minutes, most of an evaluation.

A set is read back only where everything that made it is the same: the run's checkpoint (the SHA-256 of its
files, from its manifest), the sampling settings (videos, Euler steps, noise seed, timed passes), the GPU model,
the software (torch, CUDA, Triton) and the dsv sources. Anything else, or a file that does not read back, samples
the set again. Each set also records the command that made it: timings of two commands are not divided into one
speed ratio (`dsv.bench.quality`'s `_sample_run` reads timed sets back only all from one command).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

import torch

from dsv.train.checkpoint import MANIFEST, resolve_checkpoint


def machine_name(device: torch.device) -> str:
    """The device samples were timed on: the GPU's model, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def software_versions() -> dict:
    """What changes numerics and kernel timings besides the sources: torch, its CUDA and Triton."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": str(torch.__version__), "cuda": torch.version.cuda, "triton": triton_version}


class SampleStore:
    """Sets under ``root`` (one folder per run, one file per set), keyed by what made them (module docstring).
    ``settings`` holds the sampling settings, GPU model and code shared by every set of a command; ``reused``
    lists what this command read back instead of making, as ``run folder: set``."""

    def __init__(self, root: Path, settings: dict):
        self.root = root
        self.settings = {**settings, **software_versions()}
        # This command, recorded with each set it writes: which sets' timings came from one process.
        self.command = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self.reused: list[str] = []

    def key(self, run_dir: Path, name: str, repeats: int) -> dict:
        # The checkpoint `load_model` loads (the newest complete one), and the digests its manifest checks it by.
        checkpoint = resolve_checkpoint(run_dir)
        digests = json.loads((checkpoint / MANIFEST).read_text()).get("sha256")
        return {**self.settings, "set": name, "timing_repeats": repeats, "checkpoint": checkpoint.name,
                "checkpoint_sha256": digests}

    def path(self, run_dir: Path, name: str) -> Path:
        # Set names hold commas and spaces ("dsv, budgets keeping 0.97 of the mass"): a file name of their words.
        return self.root / run_dir.name / ("_".join(name.replace(",", " ").split()) + ".pt")

    def read(self, run_dir: Path, name: str, repeats: int) -> dict | None:
        """The stored record of set ``name`` (``videos``, ``passes``, ``facts``, ``command``) where its key
        matches this command's, else None; a file that does not read back as one is None, and said so."""
        file = self.path(run_dir, name)
        if not file.is_file():
            return None
        try:
            stored = torch.load(file, map_location="cpu", weights_only=True)
            if isinstance(stored, dict) and stored.get("key") != self.key(run_dir, name, repeats):
                return None  # made from another checkpoint, settings or code: sampled again, quietly
            if not (isinstance(stored, dict) and isinstance(stored.get("videos"), torch.Tensor)
                    and isinstance(stored.get("command"), str) and isinstance(stored.get("passes"), list)
                    and stored["passes"] and isinstance(stored.get("facts"), dict) and "paths" in stored["facts"]):
                raise ValueError("not a stored sample set")
        except Exception as err:  # any unreadable file: sampled again, not trusted
            print(f"[quality] {file} does not read back ({type(err).__name__}: {err}); sampling {name} again",
                  flush=True)
            return None
        return stored

    def write(self, run_dir: Path, name: str, repeats: int, videos: torch.Tensor, passes: list[float],
              facts: dict) -> None:
        """Store a set atomically (a command cut while writing leaves the earlier file or none). The store is a
        saving of time, not a result: a failed write (a full disk) is said and the evaluation goes on."""
        file = self.path(run_dir, name)
        partial = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        record = {"key": self.key(run_dir, name, repeats), "command": self.command, "videos": videos.cpu(),
                  "passes": passes, "facts": facts}
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            torch.save(record, partial)
            os.replace(partial, file)
        except (OSError, RuntimeError) as err:  # torch.save reports a short write (a full disk) as RuntimeError
            with contextlib.suppress(OSError):  # a partial file, where there is one to remove
                partial.unlink()
            print(f"[quality] could not store {name} under {file.parent} ({err}); a later command samples it again",
                  flush=True)

    def get_or_make(self, run_dir: Path, name: str, repeats: int, make) -> tuple[torch.Tensor, list[float], dict]:
        """Set ``name`` as stored by an earlier command where its key matches, else ``make()``'s
        ``(videos, passes, facts)``, stored."""
        stored = self.read(run_dir, name, repeats)
        if stored is not None:
            self.reused.append(f"{run_dir.name}: {name}")
            return stored["videos"], stored["passes"], stored["facts"]
        videos, passes, facts = make()
        self.write(run_dir, name, repeats, videos, passes, facts)
        return videos, passes, facts
