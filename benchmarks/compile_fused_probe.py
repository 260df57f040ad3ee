# ruff: noqa: E401, E402, E501, E702, I001
"""Offline sm_90 compile of a fused-backward probe (PROBE=module name, default the round-12 probe): shared
memory, spills and SASS instruction counts per variant; needs triton 3.6 (the H200 host's) and no GPU."""
import os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
sys.path.insert(0, os.path.dirname(__file__))
import importlib
probe = importlib.import_module(os.environ.get("PROBE", "gluon_fused_backward_probe"))
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

def compile_var(var, S=2048, D=128, dump=None):
    q_stages, d_stages, maxnreg, preg, creg = var[:5]
    x = torch.empty(1, 2, S, D, dtype=torch.bfloat16)
    dq = torch.empty(1, 2, S, D, dtype=torch.float32)
    kernel = probe.fused_bwd_kernel
    vals = dict(q_desc=probe._desc(x, 64), do_desc=probe._desc(x, 64), k_desc=probe._desc(x, 64),
                v_desc=probe._desc(x, 64), dq_desc=probe._desc(dq, *probe.DQ_BOX) if hasattr(probe, "DQ_BOX") else probe._desc(dq, 64, 64),
                LSE=torch.empty(1), DELTA=torch.empty(1), DK=x, DV=x, DQ=dq,
                OFFSETS=torch.empty(1, dtype=torch.int32), GROUPS=torch.empty(1, dtype=torch.int32))
    sig = {}
    for name in kernel.arg_names:
        if name in vals:
            sig[name] = mangle_type(vals[name])
    for name in ("S", "NKB", "num_tiles"):
        sig[name] = "i32"
    for name in ("qk_scale", "sm_scale"):
        sig[name] = "fp32"
    consts = dict(GROUP=128, KV_BLOCK=128, BLOCK_M=64, Q_STAGES=q_stages, D_STAGES=d_stages, PRODUCER_REGS=preg,
                  CONSUMER_REGS=creg, num_warps=4)
    if not hasattr(probe, "EXTRA_CONSTS"):
        consts.update(DRIFT=var[6], ATOMICS=var[7])
    consts.update(getattr(probe, "EXTRA_CONSTS", lambda v: {})(var))
    for n in consts:
        sig[n] = "constexpr"
    missing = [n for n in kernel.arg_names if n not in sig]
    assert not missing, missing
    src = GluonASTSource(kernel, sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
    ptx = c.asm["ptx"]
    cubin = c.asm["cubin"]
    open("/tmp/k.cubin", "wb").write(cubin)
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", "/tmp/k.cubin"], capture_output=True, text=True).stdout
    if not sass:
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "/tmp/k.cubin"], capture_output=True, text=True).stdout
    res = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", "-o", "/dev/null", "-"], input=ptx,
                         capture_output=True, text=True).stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res)
    if dump:
        open(dump + ".ptx", "w").write(ptx); open(dump + ".sass", "w").write(sass)
    counts = {k: len(re.findall(k, sass)) for k in ("STS", "STS.64", "STS.128", "LDS", "STL", "LDL", "UTMAREDG", "UTMASTG", "SYNCS", "WARPGROUP", "HGMMA", "FENCE")}
    print(var, "smem", c.metadata.shared, "spills", spills, counts, flush=True)

if __name__ == "__main__":
    for v in getattr(probe, "VARS_COMPILE", None) or [(2, 2, 168, 24, 240, 0, 1, 3)]:
        compile_var(tuple(v), dump=os.environ.get("DUMP") and f"/tmp/fused_{'_'.join(map(str, v))}")
