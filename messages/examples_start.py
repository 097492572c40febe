"""Example messages of the start-up strand (the handshake, the workers' configuration
and a rank's KV cache spec), for the golden fixtures. Deterministic, like examples.py."""

from __future__ import annotations

from messages.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    WorkerConfig,
)
from messages.kv_cache import KVCacheSpec
from messages.rpc import Hello, Welcome
from messages.version import PROTOCOL_VERSION

BLOCK_SIZE = 16


def worker_config() -> WorkerConfig:
    return WorkerConfig(
        model=ModelConfig(
            path="/models/SmolLM2-135M-Instruct", dtype="bfloat16", max_model_len=4096, seed=7
        ),
        parallel=ParallelConfig(
            pipeline_parallel_size=2, distributed_init_method="tcp://127.0.0.1:29511"
        ),
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_bytes=512 * 2**20),
        device=DeviceConfig(device="cpu", num_threads=1),
        profiler=ProfilerConfig(profiler="torch", output_dir="/tmp/zmqworker-profile"),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
    )


def kv_cache_spec() -> KVCacheSpec:
    """Rank 1's half of SmolLM2's 30 layers, named as a worker reports them."""
    names = [f"model.layers.{i}.self_attn" for i in range(15, 30)]
    return KVCacheSpec(
        block_size=BLOCK_SIZE, num_kv_heads=3, head_size=64, dtype="bfloat16", layer_names=names
    )


def hello() -> Hello:
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        rank=1,
        pid=48213,
        token="9c1f5e0a2b7d4c3e8f6a1b2c3d4e5f60",
        hostname="node-0",
        data_address=DATA_ADDRESSES[1],
    )


# A Welcome's secret run id (32 hex digits, as the engine makes them), as the pipeline
# messages carry it.
RUN_ID = "3f9a0c1e5b7d42a86c0e9b17d5f4a203"
# Where ranks 0 and 1 (pids 48212 and 48213) bind their pipeline receivers: beside the
# engine's ipc socket, named by rank and pid.
DATA_ADDRESSES = [
    "ipc:///tmp/zmqworker-q7x2k9ab/data-0-48212.sock",
    "ipc:///tmp/zmqworker-q7x2k9ab/data-1-48213.sock",
]


def welcome() -> Welcome:
    return Welcome(
        config=worker_config(),
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        data_addresses=list(DATA_ADDRESSES),
        run_id=RUN_ID,
    )
