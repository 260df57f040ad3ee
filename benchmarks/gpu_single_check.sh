#!/usr/bin/env bash
# One-GPU checks, in parts (default: all, ~9 min on one H200 by estimate; run the parts separately to keep each run short):
#   tests     the GPU tests of the kernels and modules
#   sweep     kernel launch-setting sweep (benchmarks/kernel_sweep.py --quick)
#   train     `dsv bench train` at 32k and 64k tokens, with operator tables
#   memory    the allocator's history over one dense and one DSV step at 64k (where DSV's extra GiB come from)
#   compiled  dense, window and DSV with every block compiled (model.compile=inductor), with operator tables
# usage: benchmarks/gpu_single_check.sh OUTDIR [PART ...]
# Every part runs even when an earlier one fails; the exit status is nonzero if any part failed.
set -o pipefail
out=${1:?usage: benchmarks/gpu_single_check.sh OUTDIR [tests] [sweep] [train] [memory] [compiled]}; shift
mkdir -p "$out"
parts=${*:-tests sweep train memory compiled}
for part in $parts; do  # check every name before anything runs
  case $part in tests|sweep|train|memory|compiled) ;;
    *) echo "unknown part $part (tests, sweep, train, memory, compiled)" >&2; exit 2 ;; esac
done
# grep -v that selects nothing exits 1; only a real error (2) counts as a failure of the pipe.
drop() { grep -v "$@"; local rc=$?; [ "$rc" -le 1 ]; }
failed=()
for part in $parts; do
  echo "== $part ($(date +%T))"
  case $part in
    tests) python3 -m pytest tests/ops tests/modules tests/bench -m gpu -q -rs 2>&1 | tail -15 ;;
    sweep) python3 benchmarks/kernel_sweep.py --out "$out/sweep" --quick 2>&1 | cut -c1-300 | tail -60 ;;
    train) python3 -m dsv.cli bench train --tokens 32768 65536 --steps 2 --out "$out/train-step.md" \
             --op-profile "$out/ops" 2>&1 | drop "it/s\]\|s/it\]\|rms_norm" | tail -20 ;;
    memory) python3 -m dsv.cli bench train --tokens 65536 --steps 1 --modes dense dsv \
              --memory-history "$out/memory" 2>&1 | drop "it/s\]\|s/it\]\|rms_norm" | tail -6 ;;
    compiled) python3 -m dsv.cli bench train --tokens 32768 65536 --steps 2 --modes dense window dsv \
                --set model.compile=inductor --out "$out/train-step-compiled.md" --op-profile "$out/ops-compiled" 2>&1 \
                | drop "it/s\]\|s/it\]\|rms_norm" | tail -20 ;;
  esac
  rc=$?
  if [ "$rc" -ne 0 ]; then echo "== $part FAILED (exit $rc)" >&2; failed+=("$part"); fi
done
if [ ${#failed[@]} -gt 0 ]; then echo "failed parts: ${failed[*]}" >&2; exit 1; fi
