#!/usr/bin/env bash
# The README's results table and figure in one command: the default run of each attention, one after the other in
# one Hydra multirun, then the report; the report's figure (captioned with the commit and date) becomes
# docs/default_run_val_bpb.png, and report.md holds the table's figures.
#
#   bash benchmarks/default_runs.sh                 # every attention of the README's table
#   ATTENTIONS=softmax,vq_hard bash benchmarks/default_runs.sh threads=2   # extra arguments go to train.py
set -euo pipefail
cd "$(dirname "$0")/.."
ATTENTIONS=${ATTENTIONS:-window,softmax,vq_soft,vq_hard,ovq,taylor,performer,linear}
SWEEP=${SWEEP:-multirun/default_runs/$(date +%Y-%m-%d_%H-%M-%S)}
python train.py -m "attention=$ATTENTIONS" "hydra.sweep.dir=$SWEEP" "$@"
python -m vqattn.train.report "$SWEEP"
cp "$SWEEP/val_bpb.png" docs/default_run_val_bpb.png
echo "docs/default_run_val_bpb.png updated; the README's table is $SWEEP/report.md"
