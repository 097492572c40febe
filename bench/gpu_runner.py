"""The model runner of bench.gpu_decode's shapes: a config.json written
here (no weights downloaded; random transformers weights for the shapes compared with
transformers, load_format="dummy" for the others and for the mixtures of experts,
moe_floor.py), a runner with KV blocks for the requests its rows run, and the steps the
benchmarks time."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.moe_floor import CONFIG_CLASSES, MOE_SHAPES
from messages import (
    CacheConfig,
    CachedRequestData,
    ModelConfig,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from messages.step import HANDLE, NUM_COLUMNS, NUM_COMPUTED, NUM_SCHEDULED
from zmqworker.cdiv import cdiv
from zmqworker.distributed.parallel_state import single_rank_state
from zmqworker.model_runner.model_runner import ModelRunner
from zmqworker.worker.host_malloc import keep_freed_memory

BLOCK_SIZE = 16
PROMPT_LEN = 512
DECODE_STEPS = 160  # room in every request's blocks: warm-up, timed, pipelined, profiled
MAX_BATCHED = 8192
GREEDY = SamplingParams(temperature=0.0)
CUDA = torch.device("cuda")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters=_LLAMA3_ROPE,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}
# The other families' 7-8B and small shapes, to check that the kernels hold off the shapes
# they were tuned on (dummy weights).
SHAPES.update(
    {
        "qwen2.5-1.5b": dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        "qwen2.5-7b": dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        "qwen3-8b": dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        "mistral-7b": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32768,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            sliding_window=None,  # v0.3: full attention
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    }
)
_DENSE_CONFIG_CLASSES = {
    "qwen2.5-1.5b": "Qwen2Config",
    "qwen2.5-7b": "Qwen2Config",
    "qwen3-8b": "Qwen3Config",
    "mistral-7b": "MistralConfig",
}
DENSE_SHAPES = ["smollm2-135m", "llama-3.2-1b", "llama-3-8b"]  # the default rows
SHAPES.update(MOE_SHAPES)
HF_WEIGHTS = ("smollm2-135m", "llama-3.2-1b")  # the others run dummy weights
PREFILL = (8, 1024)  # the prefill row's requests, tokens each


def make_checkpoint(
    shape: str, folder: Path, max_positions: int | None = None
) -> transformers.PreTrainedModel | None:
    """config.json of the shape in folder; random transformers weights beside it (and the
    model, on the GPU) for the shapes compared with transformers. max_positions: a
    longer max_position_embeddings, for histories past the shape's own (dummy weights)."""
    fields = dict(SHAPES[shape])
    if max_positions is not None:
        fields["max_position_embeddings"] = max(max_positions, fields["max_position_embeddings"])
    classes = CONFIG_CLASSES | _DENSE_CONFIG_CLASSES
    config_class = getattr(transformers, classes.get(shape, "LlamaConfig"))
    config = config_class(**fields, bos_token_id=1, eos_token_id=2)
    config.save_pretrained(folder)
    if shape not in HF_WEIGHTS or max_positions is not None:
        return None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    return model


def model_len(prompt_len: int, decodes: int = DECODE_STEPS) -> int:
    """The most positions a request of prompt_len tokens reaches: its prompt (or history)
    and `decodes` decode steps after it, and a block more."""
    return prompt_len + decodes + BLOCK_SIZE


class Ours:
    """One runner per shape, with KV blocks for each of `loads` (requests, prompt length
    each) in turn, each request with room for `decodes` decode steps: sized per request
    and load, not max_model_len for every request, so that Mixtral-8x7B's weights leave
    room. max_num_seqs is the largest load's count. On the CPU (float32), for the benches
    that also run there."""

    def __init__(
        self,
        folder: Path,
        dummy: bool,
        loads: list[tuple[int, int]],
        max_batched: int = MAX_BATCHED,
        decodes: int = DECODE_STEPS,
        device: torch.device = CUDA,
    ) -> None:
        max_batch = max(requests for requests, _ in loads)
        self.device = device
        self.max_batched = max_batched
        self.decodes = decodes
        config = WorkerConfig(
            model=ModelConfig(
                path=str(folder),
                dtype="bfloat16" if device.type == "cuda" else "float32",
                max_model_len=max(model_len(length, decodes) for _, length in loads),
                load_format="dummy" if dummy else "auto",
            ),
            cache=CacheConfig(block_size=BLOCK_SIZE),
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_batched),
        )
        self.runner = ModelRunner(config, single_rank_state(device))
        spec = self.runner.get_kv_cache_spec()
        self.num_blocks = max(n * self.blocks_per_request(length) for n, length in loads)
        self.runner.initialize_kv_cache(make_kv_cache_config([spec], self.num_blocks))
        start = time.perf_counter()
        self.runner.warm_up([size for size in (1, 8) if size <= max_batch])
        self.sync()
        self.warm_up_s = time.perf_counter() - start
        if device.type == "cpu":
            keep_freed_memory()  # as a CPU worker does once warmed up (host_malloc.py)
        # As the worker process does once started: the collector stops walking the heap.
        gc.collect()
        gc.freeze()
        self.vocab = self.runner.model.vocab_size
        self.next_handle = 0
        self.live: list[int] = []

    def close(self) -> None:
        """Shut the runner down and give its memory back: the collector, which gc.freeze
        stopped from walking the runner's objects, takes back their reference cycles
        (the graphs' bodies hold the path, the path the model) so that the next runner's
        weights find the room."""
        self.runner.shutdown()
        del self.runner
        gc.unfreeze()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def blocks_per_request(self, prompt_len: int) -> int:
        return cdiv(model_len(prompt_len, self.decodes), BLOCK_SIZE)

    def start(
        self,
        batch: int,
        prompt_len: int,
        rng: np.random.Generator,
        cached: int = 0,
        params: SamplingParams = GREEDY,
    ) -> list[int]:
        """Prefill `batch` new requests of params (finishing the previous ones in the first
        step). cached: the prompt's first tokens are taken as already in the KV cache (a
        prefix hit), so that a long history costs one step of prompt_len - cached tokens."""
        handles = list(range(self.next_handle, self.next_handle + batch))
        self.next_handle += batch
        finished, self.live = self.live, handles
        pending = list(enumerate(handles))
        scheduled = prompt_len - cached
        per_req = self.blocks_per_request(prompt_len)
        while pending:
            new, budget = [], self.max_batched
            while pending and budget >= scheduled:
                i, handle = pending.pop(0)
                new.append(self.new_request(handle, i * per_req, prompt_len, rng, cached, params))
                budget -= scheduled
            so = SchedulerOutput(
                new, CachedRequestData.empty(), self.max_batched - budget, finished
            )
            finished = []
            self.runner.execute_model(so).get_output()
        return handles

    def new_request(
        self,
        handle: int,
        first_block: int,
        prompt_len: int,
        rng: np.random.Generator,
        cached: int = 0,
        params: SamplingParams = GREEDY,
    ) -> NewRequestData:
        """A request of a random prompt over blocks_per_request(prompt_len) blocks from
        first_block."""
        end = first_block + self.blocks_per_request(prompt_len)
        if end > self.num_blocks:
            raise ValueError(
                f"a request of {prompt_len} tokens from block {first_block} needs blocks up "
                f"to {end}; the runner has {self.num_blocks} (add its load to Ours' loads)"
            )
        prompt = rng.integers(0, self.vocab, prompt_len).astype(np.int32)
        blocks = np.arange(first_block, end, dtype=np.int32)
        return NewRequestData(
            f"r{handle}", handle, prompt, params, blocks, prompt_len - cached, cached
        )

    def decode_steps(self, handles: list[int], computed: int, n: int) -> list[SchedulerOutput]:
        columns = np.zeros((NUM_COLUMNS, len(handles)), np.int32)
        columns[HANDLE], columns[NUM_SCHEDULED] = handles, 1
        steps = []
        for k in range(n):
            columns[NUM_COMPUTED] = computed + k
            steps.append(SchedulerOutput([], CachedRequestData(columns.copy()), len(handles)))
        return steps

    def one_at_a_time(self, steps: list[SchedulerOutput]) -> list[float]:
        times = []
        for so in steps:
            start = time.perf_counter()
            self.runner.execute_model(so).get_output()
            times.append(time.perf_counter() - start)
        return times

    def pipelined(self, steps: list[SchedulerOutput]) -> float:
        start = time.perf_counter()
        previous = None
        for so in steps:
            out = self.runner.execute_model(so)
            if previous is not None:
                previous.get_output()
            previous = out
        previous.get_output()
        return (time.perf_counter() - start) / len(steps)


def floor_bytes(model: torch.nn.Module, batch: int, context: int, spec) -> int:
    """What a decode step must read: the weights (of the input embedding only the rows it
    looks up, unless the LM head shares them) and every request's KV history."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens
    lm_head = model.lm_head
    if embed is not None and not (lm_head is not None and lm_head.shares_embedding):
        weights -= embed.weight.numel() * embed.weight.element_size()
        weights += batch * embed.weight.shape[1] * embed.weight.element_size()
    kv = batch * context * spec.page_size_bytes // BLOCK_SIZE * len(spec.layer_names)
    return weights + kv
