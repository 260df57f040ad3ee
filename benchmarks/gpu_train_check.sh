#!/usr/bin/env bash
# Short training on one GPU through both stages (small_gpu at 16 frames of SIZE² pixels, 4×4×4 cubes):
# usage: benchmarks/gpu_train_check.sh OUTDIR STEPS SIZE MODE [--set ...]
# Exits with the training's status (nonzero if it fails), not with that of the output filter.
set -o pipefail
out=${1:?usage: benchmarks/gpu_train_check.sh OUTDIR STEPS SIZE MODE [--set ...]}; steps=${2:?steps}
size=${3:?size}; mode=${4:?mode}; shift 4
python3 -m dsv.cli train --recipe small_gpu --set train.steps=$steps --set data.frames=16 --set data.size=$size \
  --set data.load_short_side=144 --set attention.cube=4,4,4 --set attention.mode=$mode \
  --set attention.min_stage1_steps=0 --set attention.max_stage1_steps=100 --set attention.switch_loss_threshold=0.05 \
  --set attention.sparse_threshold=0.3 --set attention.profile_every_stage1=25 --set attention.profile_every_stage2=50 \
  --set train.batch_size=2 --set train.log_every=25 --set train.eval_every=150 --set train.ckpt_every=$steps \
  --set train.out_dir=$out "$@" 2>&1 | tr '\r' '\n' | { grep -v -e 'it/s]$' -e 's/it]$' -e '^ *$'; [ $? -le 1 ]; }
