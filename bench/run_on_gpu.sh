#!/usr/bin/env bash
# The CUDA checks on a lent GPU machine (torch, Triton and transformers installed; pyzmq
# and msgspec carried as wheels in .whl/): the Triton kernel tests, the other CUDA tests,
# bench.gpu_decode, then bench.end_to_end_cuda and bench.graph_recapture (e2e); live weights
# and sleep (weights: their CUDA tests, bench.weight_update and bench.sleep on Llama-3-8B's
# shape) and KV transfer with the host tier's copies (kv: the disaggregated pair's tests and
# bench.kv_transfer), when asked for.
#   bench/run_on_gpu.sh OUT_DIR [kernels,tests,bench,e2e,weights,kv] [bench.gpu_decode options...]
# Logs and the benchmark's JSON land in OUT_DIR.
set -uo pipefail
out=${1:?usage: bench/run_on_gpu.sh OUT_DIR [tests|bench|all] [bench args]}
what=,${2:-kernels,tests,bench,e2e},
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ZMQWORKER_TEST_DEVICE=cuda
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# On one GPU the pipeline tests' stages share it (their workers refuse to, unasked).
if [[ $(nvidia-smi -L | wc -l) == 1 ]]; then export ZMQWORKER_SHARE_GPUS=1; fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
status=0
run_tests() {  # log name, test files...
    local log=$1
    shift
    timeout 420 python3 -m pytest -q -p no:cacheprovider --timeout 300 "$@" 2>&1 \
        | tee "$out/$log.log" | tail -40
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
}
if [[ $what == *,kernels,* ]]; then
    run_tests kernels tests/test_triton_kernels.py
fi
if [[ $what == *,tests,* ]]; then
    run_tests tests tests/test_model_runner.py tests/test_worker.py tests/test_pipeline.py \
        tests/test_shm_ring.py tests/test_async_scheduling.py tests/test_host_tier.py \
        tests/test_host_tier_e2e.py
fi
if [[ $what == *,bench,* ]]; then
    timeout 480 python3 -m bench.gpu_decode --tmp /dev/shm --out "$out/gpu_decode.json" "$@" \
        2>&1 | tee "$out/bench.log" | grep -v Warning
fi
if [[ $what == *,e2e,* ]]; then
    timeout 480 python3 -m bench.end_to_end_cuda --tmp /dev/shm --out "$out/end_to_end_cuda.json" \
        2>&1 | tee "$out/e2e.log" | grep -v Warning
    timeout 240 python3 -m bench.graph_recapture --out "$out/graph_recapture.json" \
        2>&1 | tee "$out/recapture.log" | grep -v Warning
fi
if [[ $what == *,kv,* ]]; then
    run_tests kv tests/test_kv_transfer.py tests/test_host_tier_e2e.py tests/test_kv_connector.py \
        tests/test_kv_connector_tp.py tests/test_kv_staging.py tests/test_kv_cuda_ipc.py \
        tests/test_kv_block_copy_kernel.py tests/test_kv_stage_layers.py
    timeout 300 python3 -m bench.kv_transfer --device cuda --out "$out/kv_transfer_cuda.json" \
        2>&1 | tee "$out/kv_bench.log" | grep -v Warning
    timeout 300 python3 -m bench.kv_transfer --device cuda --mib 256 --repeats 10 \
        --out "$out/kv_transfer_cuda_256mib.json" 2>&1 | tee "$out/kv_256mib.log" | grep -v Warning
fi
if [[ $what == *,weights,* ]]; then
    run_tests weights tests/test_weight_updates_cuda.py tests/test_worker.py
    for name in weight_update sleep; do
        timeout 480 python3 -m bench.$name --device cuda --tmp /dev/shm \
            --out "$out/${name}_cuda.json" 2>&1 | tee "$out/$name.log" | grep -v Warning
    done
fi
exit $status
