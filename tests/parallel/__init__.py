"""Helpers for distributed tests: run a worker on N gloo ranks in new processes (forked from a server that has
imported torch and dsv) and collect results.

Each rank writes what its worker returns to ``<dir>/rank<r>.pt``; a rank that raises writes the
traceback instead, so the parent fails with the worker's own error rather than a bare exit code.
"""

import datetime
import multiprocessing
import os
import socket
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "dsv.train.trainer", "dsv.parallel"]
# Set by pytest per test, and by torch's inductor and Triton for their own bookkeeping once anything compiles
# (their cache folders among them): none is something a rank reads, and counting them would spawn every rank
# after the first compiled test.
ENVIRON_IGNORED = ("PYTEST_", "_TORCHINDUCTOR_", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
_forkserver_environ: dict[str, str] | None = None
"""The environment the forkserver started with: its ranks see it, not the caller's later changes."""
COLLECTIVE_TIMEOUT_S = 30
"""A rank left waiting in a collective (its peer died) gives up after this long instead of hanging."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(worker, rank, world_size, port, args, out_dir, collective_timeout_s):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # A fresh random stream per rank, as a new interpreter would have: forked ranks share the server's.
    torch.seed()
    # One thread per rank: the ranks share two cores, and oversubscription makes every step slower.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout_s)
    )
    try:
        result = worker(rank, world_size, *args)
        torch.save({"result": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(worker, world_size: int, *args, out_dir: Path, timeout_s: float = 60.0,
                    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> list:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``worker`` must be a module-level function (it is pickled into the rank processes). ``collective_timeout_s``
    is the default process group's timeout.
    """
    global _forkserver_environ
    environ = {k: v for k, v in os.environ.items() if not k.startswith(ENVIRON_IGNORED)}
    if _forkserver_environ is None:
        _forkserver_environ = environ
    if environ == _forkserver_environ:
        # The ranks fork from one server process that has imported torch and dsv once for the whole session:
        # spawned ranks re-imported them (5-9 s on a two-core machine), most of every distributed test. A fork
        # from that server, not from this process, keeps the ranks clear of this process's threads.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    else:
        # The environment changed since the server started (a test's setenv; flags read at import): the
        # server's ranks would not see it, so these ranks start fresh, and the warning shows the slower path.
        changed = sorted(k for k in environ.keys() | _forkserver_environ.keys()
                         if environ.get(k) != _forkserver_environ.get(k))
        warnings.warn(f"run_distributed: the environment changed since the forkserver started ({', '.join(changed)}): "
                      "these ranks are spawned, each importing torch and dsv anew", stacklevel=2)
        context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=_entry, args=(worker, rank, world_size, port, args, str(out_dir), collective_timeout_s))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join()
    outcomes = []
    for rank in range(world_size):
        path = Path(out_dir) / f"rank{rank}.pt"
        outcomes.append(torch.load(path, weights_only=False) if path.exists() else None)
    errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outcomes) if o is not None and "error" in o]
    if errors:
        raise AssertionError("worker failed\n" + "\n".join(errors))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
    missing = [rank for rank, outcome in enumerate(outcomes) if outcome is None]
    if missing:
        codes = [processes[r].exitcode for r in missing]
        raise AssertionError(f"ranks {missing} exited with codes {codes} without a result")
    return [outcome["result"] for outcome in outcomes]
