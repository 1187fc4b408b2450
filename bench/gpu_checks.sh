#!/usr/bin/env bash
# Every check that needs a GPU, in one run of about eight minutes on one H200:
#
#   bash bench/gpu_checks.sh [OUTDIR]      # default: $OUT, else ./gpu-checks
#
# 1. the CUDA-only tests (the CUDA allocator path of memfit.measure, CUDA profiling and
#    planning; they are skipped on machines without a GPU);
# 2. the checkpoint head-to-head on the GPU at the benchmark's CPU size (--pairs-only);
# 3. the full checkpoint frontier at a GPU size (n_embd 1024, context 1024), where the
#    matmuls are most of a block's time and the saved FLOPs should show as saved time;
# 4. activation offload (pinned host memory, side stream, prefetch) beside keep and fp8:
#    what the end of forward holds on the GPU, gradients bitwise, step time; then
#    memfit.plan on the GPU at 75% of the unplanned peak with and without coded storage,
#    each plan's predicted peak against the CUDA allocator's peak of a whole AdamW step.
#
# Each step has its own time limit and writes its log (and the plot) to OUTDIR; a step
# that fails does not stop the others. Uses the python that has torch (PYTHON to choose).
set -u
out=${1:-${OUT:-gpu-checks}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

$py -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))" \
    2>&1 | tee "$out/device.txt"
# the files that hold CUDA tests, named: collecting the whole suite would import
# TensorFlow and the other optional frameworks a GPU image may lack
timeout 120 $py -m pytest -q -p no:cacheprovider -m cuda tests/test_memory.py \
    tests/test_apply.py tests/test_profile.py tests/test_cli_start.py 2>&1 | tee "$out/cuda_tests.txt"
timeout 150 $py bench/storage.py --cuda --rounds 5 2>&1 | tee "$out/storage_offload.txt"
timeout 90 $py bench/checkpoint.py --device cuda --pairs-only --rounds 51 \
    2>&1 | tee "$out/checkpoint_small.txt"
timeout 150 $py bench/checkpoint.py --device cuda --n-embd 1024 --n-head 16 \
    --block-size 1024 --batch-size 8 --budgets 3 --rounds 21 \
    --plot "$out/checkpoint_frontier_cuda.png" 2>&1 | tee "$out/checkpoint_large.txt"
