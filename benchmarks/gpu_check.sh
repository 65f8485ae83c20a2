#!/usr/bin/env bash
# One prepared run on a CUDA machine: the Triton tests on the GPU, then the benchmark tables of the fused kernels
# against softmax attention (SDPA's flash kernel), each table into its own file under ${OUT:-gpu_results}/.
# Stages run in order of importance while the time budget (GPU_CHECK_SECONDS, default 480) lasts, so a short
# lease still returns the first tables. GPU_CHECK_STAGES (names, space-separated) runs only those stages,
# GPU_CHECK_TESTS (a pytest -k expression) only those tests, and GPU_CHECK_LENGTHS and GPU_CHECK_LAYERS set the
# lengths and layers of the layers_triton table. Needs torch with CUDA, triton and pytest; the package runs from the
# tree.
#
#     bash benchmarks/gpu_check.sh
#     GPU_CHECK_STAGES="tests profile_layer" bash benchmarks/gpu_check.sh
#
# The peer row (flash-linear-attention's chunk_simple_gla) needs its fla-core wheel in .whl/ (ignored by git; carry
# it to the GPU machine): pip download --no-deps -d .whl fla-core==0.6.0 (it needs einops, torch and triton).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_results}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-480}))

stage() {  # stage NAME MAX_SECONDS COMMAND...: run it if the budget holds MAX_SECONDS more, bounded by them
  local name=$1 limit=$2
  shift 2
  if [ -n "${GPU_CHECK_STAGES:-}" ] && [[ " $GPU_CHECK_STAGES " != *" $name "* ]]; then
    return
  fi
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "## $name: skipped, no time left" | tee -a "$out/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "## $name ($(date -u +%H:%M:%S), up to ${limit}s)" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  echo "   exit $? after $SECONDS s" | tee -a "$out/summary.txt"
  grep -v '^\s*$' "$out/$name.txt" | tail -n 40
}

{
  date -u
  # a copied tree may carry an older .git than its files: GPU_CHECK_COMMIT names the commit the caller ran
  if [ -n "${GPU_CHECK_COMMIT:-}" ]; then echo "commit $GPU_CHECK_COMMIT"; else git log -1 --format='commit %h %s' 2>/dev/null; fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$out/machine.txt"

layers="python benchmarks/layer_speed.py --device cuda --autocast bf16 --dim 1024 --heads 16 --tokens 65536 --reps 5 --rounds 1"
ops="python benchmarks/attention_speed.py --device cuda --dtype bfloat16 --heads 16 --reps 5 --rounds 1 --modes default"
decode="python benchmarks/decode_speed.py --device cuda --lengths 1024 4096 8192 32768 --steps 20 --new-tokens 32"
stage tests 240 python -m pytest -o addopts="" -q -p no:cacheprovider tests/ops/test_triton.py ${GPU_CHECK_TESTS:+-k "$GPU_CHECK_TESTS"}
# the Triton tests outside tests/ops/test_triton*.py (memory_cap, memory_decay, the float32 range, under torch.compile; the
# rest of these files is CPU)
stage tests_elsewhere 180 python -m pytest -o addopts="" -q -p no:cacheprovider tests/ops/test_memory_cap.py \
  tests/ops/test_memory_decay.py tests/ops/test_numerical_range.py tests/ops/test_ops_compile.py -k "triton or kernel"
stage layers_triton 200 $layers --lengths ${GPU_CHECK_LENGTHS:-2048 8192 32768 65536} \
  --layers ${GPU_CHECK_LAYERS:-softmax window vq_hard vq_soft}
stage layers_compiled 180 $layers --lengths 8192 32768 --layers softmax vq_hard vq_soft --compile
if ls .whl/fla_core-*.whl >/dev/null 2>&1 && python -m pip install -q --no-index --no-deps --target /tmp/fla_site \
    .whl/fla_core-*.whl; then
  export PYTHONPATH="$PYTHONPATH:/tmp/fla_site"
  peer="fla_simple_gla"
fi
stage ops_8k 120 $ops --batch 8 --lengths 8192 --methods sdpa vq_hard_rope vq_soft_rope window
stage ops_32k 60 $ops --batch 2 --lengths 32768 --methods sdpa vq_hard_rope vq_soft_rope window
# fla autotunes every kernel on first use, which takes minutes: a stage of its own, beside SDPA in the same run.
[ -n "${peer:-}" ] && stage ops_peer 200 $ops --batch 8 --lengths 8192 --methods sdpa $peer
stage profile_layer_soft 40 python benchmarks/kernel_profile.py --what layer --method vq_soft --batch 8 --length 8192
stage profile_layer 40 python benchmarks/kernel_profile.py --what layer --method vq_hard --batch 8 --length 8192
stage profile_soft 30 python benchmarks/kernel_profile.py --what op --method vq_soft_rope --batch 8 --length 8192
# the window-code kernel's launch settings at the layers' and the op's input layouts, then the vq_hard layer under each
# backward setting: one process per row (a setting that faults the GPU ends its process)
stage launch_layer 150 python benchmarks/kernel_launch.py --layouts layer --layers vq_hard
stage launch_layouts 200 python benchmarks/kernel_launch.py --layouts layer_contiguous op
stage profile_window 20 python benchmarks/kernel_profile.py --what layer --method window --batch 8 --length 8192
stage profile_window_op 20 python benchmarks/kernel_profile.py --what op --method window --batch 8 --length 8192
stage profile_op 20 python benchmarks/kernel_profile.py --what op --method vq_hard_rope --batch 8 --length 8192
# float32 inputs: IEEE products (PyTorch's default precision), then TF32 (set_float32_matmul_precision("high"))
stage profile_op_float32 30 python benchmarks/kernel_profile.py --what op --method vq_hard_rope --batch 8 --length 8192 \
  --dtype float32
stage profile_op_tf32 30 python benchmarks/kernel_profile.py --what op --method vq_hard_rope --batch 8 --length 8192 \
  --dtype float32 --tf32
stage tests_ovq 90 python -m pytest -o addopts="" -q -p no:cacheprovider tests/ops/test_triton_ovq.py
stage layers_ovq_triton 120 $layers --lengths 8192 32768 --layers softmax ovq --impl triton
# the codebook rows first: in the fourth run the stage's time ran out after the softmax row
stage decode_fused 120 $decode --methods vq_hard ovq window softmax
stage layers_codes64 150 $layers --lengths 8192 32768 --layers softmax vq_hard vq_soft --num-codes 64
stage layers_chunk 150 $layers --lengths 8192 32768 --layers softmax window vq_hard vq_soft ovq --impl chunk
stage decode_recurrent 90 $decode --methods window vq_hard ovq --step-impl recurrent
stage layers_compiled_window 120 $layers --lengths 8192 32768 --layers softmax window --compile
