#!/usr/bin/env bash
# Two-GPU checks on one host: the context-parallel kernel benchmark, `dsv train` with context parallelism
# (then resumed from its checkpoint), and `dsv train` with FSDP2 data parallelism and activation
# checkpointing. At 4,096 tokens the kernel-speed model would keep every block dense, so the runs dispatch
# on sparsity alone (attention.speed_dispatch=false) to train sparse blocks across the GPUs.
# usage: benchmarks/gpu_multi_check.sh OUTDIR [PART ...]   (2 GPUs visible; parts: bench cp dp, default all)
# Every part runs even when an earlier one fails; the exit status is nonzero if any of them failed.
set -o pipefail
out=${1:?usage: benchmarks/gpu_multi_check.sh OUTDIR [bench] [cp] [dp]}; shift; mkdir -p "$out"
parts=${*:-bench cp dp}
for part in $parts; do  # check every name before anything runs
  case $part in bench|cp|dp) ;; *) echo "unknown part $part (bench, cp, dp)" >&2; exit 2 ;; esac
done
common=(--recipe small_gpu --set data.frames=16 --set data.size=64 --set attention.cube=4,4,4
  --set attention.min_stage1_steps=0 --set attention.max_stage1_steps=60 --set attention.switch_loss_threshold=0.05
  --set attention.sparse_threshold=0.25 --set attention.profile_every_stage1=20 --set attention.profile_every_stage2=40
  --set attention.speed_dispatch=false
  --set train.batch_size=2 --set train.log_every=20 --set train.eval_every=100 --set train.ckpt_every=100)
# grep -v that selects nothing exits 1; only a real error (2) counts as a failure of the pipe.
drop() { grep -v "$@"; local rc=$?; [ "$rc" -le 1 ]; }
train() { torchrun --nproc-per-node 2 -m dsv.cli train "${common[@]}" "$@" 2>&1 | tr '\r' '\n' \
  | drop 'it/s]$\|s/it]$\|^ *$' ; }
failed=()
check() { local rc=$?; if [ "$rc" -ne 0 ]; then echo "== $1 FAILED (exit $rc)" >&2; failed+=("$1"); fi; }
for part in $parts; do
  case $part in
    bench) torchrun --nproc-per-node 2 -m dsv.bench.cp --tokens 32768 65536 --steps 5 --out "$out/cp-bench.md" \
             --op-profile "$out/cp-ops" 2>&1 | tail -40
           check bench ;;
    cp) for mode in hybrid hcp scp; do
          echo "== context parallel, cp_mode=$mode"
          train --set parallel.cp=2 --set parallel.cp_mode=$mode --set train.steps=100 \
            --set train.out_dir="$out/cp-$mode" | tail -25
          check "cp $mode"
        done
        echo "== context parallel hybrid, resumed to step 140"
        train --set parallel.cp=2 --set train.steps=140 --set train.out_dir="$out/cp-hybrid" --resume | tail -12
        check "cp hybrid resumed" ;;
    dp) echo "== data parallel (FSDP2), activation checkpointing, 2 GPUs"
        train --set model.activation_checkpointing=true --set train.steps=100 --set train.out_dir="$out/dp" \
          | drop "^    block"
        check dp ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}" >&2; exit 1; fi
