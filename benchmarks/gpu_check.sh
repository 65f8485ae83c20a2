#!/usr/bin/env bash
# One prepared run on a CUDA machine, in order of what a GPU run needs first, each stage into its own file under
# ${OUT:-gpu_results}/ as it finishes (a run cut short keeps what it measured):
#
#   1. layers, layers_64k  the layer table: softmax, window, vq_hard, vq_soft, ovq at 8k and 32k, then vq_hard and
#                          softmax at 64k (eager, bf16 autocast, dim 1024, 16 heads of 64, S = 512, 64k tokens a step)
#   2. ops                 the op against SDPA at 8k and 32k (bf16 inputs, the layer's head shape), and at 8k
#                          with the per-block caches (the design before superblock caches)
#   3. profile_8k, profile_32k, profile_layer, profile_soft, profile_ovq
#                          the vq_hard step kernel by kernel, each beside its floor (benchmarks/kernel_floor.py), at
#                          8k and 32k and in its layer, then the vq_soft and ovq ops' steps at 8k
#   4. train               python train.py on the GPU at seq_len 8192, softmax and vq_hard: tokens/s side by side
#   5. tests               the CUDA tests, with whatever time is left
#
# The default run fits GPU_CHECK_SECONDS (default 290). GPU_CHECK_STAGES (names, space-separated) runs only those
# stages, the extra ones below too; GPU_CHECK_TESTS (a pytest -k expression) selects tests. Needs torch with CUDA,
# triton and pytest; the package runs from the tree. The trainer needs hydra-core, omegaconf and antlr4 (4.9), and the
# peer row fla-core: wheels in .whl/ (ignored by git; carry it), installed here without an index.
#
#     bash benchmarks/gpu_check.sh
#     GPU_CHECK_STAGES="profile_8k tests" bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_results}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-290}))

selected() { [ -z "${GPU_CHECK_STAGES:-}" ] || [[ " $GPU_CHECK_STAGES " == *" $1 "* ]]; }

stage() {  # stage NAME MAX_SECONDS COMMAND...: run it, bounded by MAX_SECONDS and by the time left
  local name=$1 limit=$2
  shift 2
  selected "$name" || return 0
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "## $name: skipped, no time left" | tee -a "$out/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "## $name ($(date -u +%H:%M:%S), up to ${limit}s)" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  echo "   exit $? after $SECONDS s" | tee -a "$out/summary.txt"
  grep -v '^\s*$' "$out/$name.txt" | tail -n 40
}

extra() {  # extra NAME MAX_SECONDS COMMAND...: a stage that runs only when GPU_CHECK_STAGES names it
  [ -n "${GPU_CHECK_STAGES:-}" ] && stage "$@"
}

{
  date -u
  # a copied tree may carry an older .git than its files: GPU_CHECK_COMMIT names the commit the caller ran
  if [ -n "${GPU_CHECK_COMMIT:-}" ]; then echo "commit $GPU_CHECK_COMMIT"; else git log -1 --format='commit %h %s' 2>/dev/null; fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$out/machine.txt"
if ls .whl/*.whl >/dev/null 2>&1 && python -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site \
    .whl/*.whl >/dev/null 2>&1; then
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

layers="python benchmarks/layer_speed.py --device cuda --autocast bf16 --dim 1024 --heads 16 --tokens 65536 --reps 5 --rounds 1 --in-process"
ops="python benchmarks/attention_speed.py --device cuda --dtype bfloat16 --heads 16 --reps 5 --rounds 1 --modes default --in-process"
profile="python benchmarks/kernel_profile.py --what op --method vq_hard_rope --top 14"
stage layers 80 $layers --lengths 8192 32768 --layers softmax window vq_hard vq_soft ovq
stage layers_64k 25 $layers --lengths 65536 --layers softmax vq_hard
# the third run: hard keys with every block's cache and the walks (the design before superblock caches)
stage ops 45 bash -c "$ops --batch 8 --lengths 8192 --methods sdpa vq_hard_rope window; \
  $ops --batch 2 --lengths 32768 --methods sdpa vq_hard_rope window; \
  $ops --batch 8 --lengths 8192 --methods sdpa vq_hard_rope --superblock-blocks 0"
stage profile_8k 25 $profile --batch 8 --length 8192
stage profile_32k 20 $profile --batch 2 --length 32768
stage profile_layer 20 python benchmarks/kernel_profile.py --what layer --method vq_hard --batch 8 --length 8192 --top 20
stage profile_soft 25 $profile --method vq_soft_rope --batch 8 --length 8192
stage profile_ovq 20 $profile --method ovq --num-codes 64 --batch 8 --length 8192
stage train 65 python benchmarks/train_speed.py --attentions softmax vq_hard --seq-len 8192 --batch 8 --steps 30
stage tests 240 python -m pytest -o addopts="" -q -x -p no:cacheprovider tests/ops/test_triton_superblock.py \
  tests/ops/test_triton_soft.py tests/ops/test_triton.py tests/ops/test_triton_ovq.py ${GPU_CHECK_TESTS:+-k "$GPU_CHECK_TESTS"}

# Extra stages, run only when named in GPU_CHECK_STAGES.
decode="python benchmarks/decode_speed.py --device cuda --lengths 1024 4096 8192 32768 --steps 20 --new-tokens 32"
extra tests_elsewhere 180 python -m pytest -o addopts="" -q -p no:cacheprovider tests/ops/test_memory_cap.py \
  tests/ops/test_memory_decay.py tests/ops/test_numerical_range.py tests/ops/test_ops_compile.py -k "triton or kernel"
extra layers_compiled 180 $layers --lengths 8192 32768 --layers softmax vq_hard vq_soft --compile
# fla autotunes every kernel on first use, which takes minutes
extra ops_peer 200 $ops --batch 8 --lengths 8192 --methods sdpa fla_simple_gla
# the recurrent baselines: Gated DeltaNet, DeltaNet and Mamba-2's layers beside softmax (fla's kernels where fla-core
# is in .whl/, else the library's chunk forms), and the gated delta rule op beside fla's chunk_gated_delta_rule, the
# anchor, in the same process: through the library (fla's kernels) and as the library's own chunk form
extra recurrent 300 bash -c "$layers --lengths 8192 32768 --layers softmax gated_deltanet deltanet mamba2; \
  $ops --batch 8 --lengths 8192 --methods sdpa fla_gated_delta_rule delta_rule; \
  $ops --batch 8 --lengths 8192 --methods fla_gated_delta_rule delta_rule --impl chunk"
# hard keys' superblock caches of K = 4 and 16 blocks beside the default 8 (Schedule.superblocks), and the per-block
# design (0), in the layer and kernel by kernel
extra layers_superblocks 120 bash -c "for K in 0 4 16; do $layers --lengths 8192 32768 --layers softmax vq_hard \
  --superblock-blocks \$K; done"
extra profile_8k_block_dc 25 $profile --batch 8 --length 8192 --superblock-blocks 0
extra profile_layer_soft 40 python benchmarks/kernel_profile.py --what layer --method vq_soft --batch 8 --length 8192
extra profile_window_op 20 python benchmarks/kernel_profile.py --what op --method window --batch 8 --length 8192
extra profile_op_tf32 30 $profile --batch 8 --length 8192 --dtype float32 --tf32
extra launch_layer 150 python benchmarks/kernel_launch.py --layouts layer --layers vq_hard
extra decode 120 $decode --methods vq_hard ovq window softmax
# packed documents (cu_seqlens): a packed row (one 7168-token document and sixteen of 64) against the same tokens as
# one document, op by op; the length classes' Triton path against the float64 references; and a packed training
# run beside an unpacked one (the stdlib files are ~14 KB, so 8k rows hold a boundary or two each)
extra packed 90 python benchmarks/packed_speed.py --device cuda --heads 16 --dtype bfloat16 --in-process --rounds 2 \
  --reps 5
# the segmented form (Segments) that a compiled model runs, compiled, against one compiled document
extra packed_segments 240 python benchmarks/packed_speed.py --device cuda --heads 16 --dtype bfloat16 --in-process \
  --rounds 1 --reps 5 --form segments --compile
extra tests_varlen 120 python -m pytest -o addopts="" -q -p no:cacheprovider tests/ops/test_varlen.py \
  tests/model/test_varlen_model.py
extra train_packed 130 bash -c "python benchmarks/train_speed.py --attentions softmax vq_hard --seq-len 8192 \
  --batch 8 --steps 30; python benchmarks/train_speed.py --attentions softmax vq_hard --seq-len 8192 --batch 8 \
  --steps 30 data.pack_documents=true; python benchmarks/train_speed.py --attentions vq_soft --seq-len 8192 \
  --batch 8 --steps 30 compile=true data.pack_documents=true"
# the launch candidates of the superblock kernels timed by @triton.autotune (vqattn/ops/triton/tuning.py), each
# kernel's choice printed: the op against SDPA, the step kernel by kernel, the layers, and superblocks of K blocks
tune="env VQATTN_AUTOTUNE=1 TRITON_PRINT_AUTOTUNING=1"
extra tune_ops 150 bash -c "$tune $ops --batch 8 --lengths 8192 --methods sdpa vq_hard_rope; \
  $tune $ops --batch 2 --lengths 32768 --methods sdpa vq_hard_rope"
extra tune_profile 40 $tune $profile --batch 8 --length 8192
extra tune_layers 80 $tune $layers --lengths 8192 32768 --layers softmax vq_hard
# the soft caches' candidates (soft.*_CONFIGS: code tile, warps, stages), in vq_soft's op and layer
extra tune_soft 90 bash -c "$tune $profile --method vq_soft_rope --batch 8 --length 8192; \
  $tune $layers --lengths 8192 32768 --layers softmax vq_soft"
# the online assignment's candidates (online_slots.SLOTS_CONFIGS: warps and slot tile), in ovq's op and layer
extra tune_ovq 60 bash -c "$tune python benchmarks/kernel_profile.py --what op --method ovq --batch 8 --length 8192 \
  --top 14; $tune $layers --lengths 8192 32768 --layers softmax ovq"
extra tune_superblocks 120 bash -c "for K in 4 16; do $tune $layers --lengths 8192 32768 --layers softmax vq_hard \
  --superblock-blocks \$K; done"
extra layers_chunk 150 $layers --lengths 8192 32768 --layers softmax window vq_hard vq_soft ovq --impl chunk
true
