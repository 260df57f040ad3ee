"""Compiles a test module's Gluon kernels for sm_90 in a fresh process, where no GPU is needed."""

import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sm90_shared_memory(module: str) -> list[int]:
    """Runs ``compile_for_sm90(*case)`` for each of ``module``'s ``SM90_COMPILES`` in a fresh process (the
    Triton interpreter, which the kernel tests switch on without a GPU, cannot compile Gluon); returns the
    shared memory of each compile in bytes, or fails the test with the compiler's error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"from {module} import SM90_COMPILES, compile_for_sm90\n"
            "for case in SM90_COMPILES: print(*case, compile_for_sm90(*case))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=_ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return [int(line.split()[-1]) for line in run.stdout.splitlines()]
