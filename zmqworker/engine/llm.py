"""The LLM API: text generation with worker processes over a Hugging Face checkpoint."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from messages import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
    WorkerConfig,
)
from messages.kv_cache import DTYPE_BYTES
from zmqworker.engine.core import EngineCore
from zmqworker.engine.detokenizer import IncrementalDetokenizer
from zmqworker.engine.outputs import RequestOutput
from zmqworker.engine.request import Request
from zmqworker.executor.abstract import STEP_TIMEOUT_S

if TYPE_CHECKING:
    from zmqworker.executor.abstract import Executor

# A prompt is text, or token ids.
Prompt = str | Sequence[int]

EXECUTORS = {
    "mp": "zmqworker.executor.multiproc.MultiprocExecutor",
    "ray": "zmqworker.executor.ray_executor.RayExecutor",
}
DEVICES = ("cpu", "cuda", "auto")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class LLM:
    """Generate text with a model served by worker processes.

    model is a Hugging Face checkpoint folder (None: the embedded default model).
    executor is "mp" (local processes), "ray", or a callable that makes an Executor from
    the WorkerConfig. max_model_len defaults to the checkpoint's max_position_embeddings.
    num_threads: torch threads in each worker (None: OMP_NUM_THREADS if a count, else the
    host's cores shared evenly among the workers). step_timeout_s: how long a step may
    go unanswered before it fails (the executor's step_timeout_s; None: no bound).
    Not thread-safe; generate() and generate_stream() are not to be mixed at one time.
    """

    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        device: str = "cpu",
        dtype: str = "float32",
        executor: str | Callable[[WorkerConfig], Executor] = "mp",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        enable_prefix_caching: bool = False,
        seed: int = 0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        step_timeout_s: float | None = STEP_TIMEOUT_S,
    ) -> None:
        self._core: EngineCore | None = None
        _check_args(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
        )
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1 or None, got {kv_cache_bytes}")
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, got {step_timeout_s!r}")
        make_executor = _executor_factory(executor)
        path = _model_folder(model)
        config = _read_json(path / "config.json")
        _check_layout(config, tensor_parallel_size, pipeline_parallel_size)
        self.tokenizer = _load_tokenizer(path)
        self.max_model_len = _max_model_len(config, max_model_len)
        self.vocab_size: int | None = config.get("vocab_size")
        self.eos_token_ids = _eos_token_ids(path, config, self.tokenizer)
        self.worker_config = WorkerConfig(
            model=ModelConfig(
                path=str(path), dtype=dtype, max_model_len=self.max_model_len, seed=seed
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
            ),
            cache=CacheConfig(block_size=block_size, kv_cache_bytes=kv_cache_bytes),
            device=DeviceConfig(device=device, num_threads=num_threads),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                # Workers warm up with batches of these sizes: none above max_num_seqs.
                warmup_batch_sizes=sorted(
                    {min(size, max_num_seqs) for size in SchedulerConfig().warmup_batch_sizes}
                ),
            ),
        )
        executor_instance = make_executor(self.worker_config)
        executor_instance.step_timeout_s = step_timeout_s
        try:
            self._core = EngineCore(
                executor_instance,
                self.max_model_len,
                self.worker_config.scheduler,
                enable_prefix_caching=enable_prefix_caching,
            )
        except BaseException:
            executor_instance.shutdown()
            raise
        self._ids = itertools.count()
        # generate_stream's state: one asyncio task steps the engine for every stream.
        self._driver: asyncio.Task[None] | None = None
        self._streams: dict[str, tuple[asyncio.Queue[Any], str | None]] = {}
        self._to_add: list[Request] = []
        self._to_abort: list[str] = []

    # -- the API ---------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (batched together); outputs in the order of prompts."""
        core = self._require_core()
        if self._streaming():
            raise RuntimeError("generate() called while generate_stream() streams are running")
        entries = self._make_requests(prompts, sampling_params)
        for request, _ in entries:
            core.add_request(request)
        try:
            while any(not request.is_finished for request, _ in entries):
                core.step()
        except BaseException:
            for request, _ in entries:
                core.abort_request(request.req_id)
            raise
        return [RequestOutput.from_request(request, text) for request, text in entries]

    async def generate_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output each time it grows (new_text, new_token_ids); the
        last one has finished=True. Several streams may run at once on one event loop."""
        self._require_core()
        [(request, text)] = self._make_requests([prompt], sampling_params)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request.req_id] = (queue, text)
        self._to_add.append(request)
        if not self._streaming():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request.req_id, None)
            if not request.is_finished:
                self._to_abort.append(request.req_id)

    def shutdown(self) -> None:
        """Stop the workers. Idempotent."""
        core, self._core = self._core, None
        if core is not None:
            core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals -------------------------------------------------------------------

    def _require_core(self) -> EngineCore:
        if self._core is None:
            raise RuntimeError("the LLM is shut down")
        return self._core

    def _streaming(self) -> bool:
        driver = self._driver
        return driver is not None and not driver.done() and not driver.get_loop().is_closed()

    async def _drive(self) -> None:
        """Step the engine while streams have work, off the event loop's thread. Requests
        are added and aborted only here, between steps."""
        core = self._require_core()
        try:
            while True:
                for request in self._to_add:
                    core.add_request(request)
                for req_id in self._to_abort:
                    core.abort_request(req_id)
                self._to_add, self._to_abort = [], []
                if not core.has_work():
                    return
                for request in await asyncio.to_thread(core.step):
                    stream = self._streams.get(request.req_id)
                    if stream is not None:
                        stream[0].put_nowait(RequestOutput.from_request(request, stream[1]))
        except Exception as exc:
            for queue, _ in self._streams.values():
                queue.put_nowait(exc)
            for req_id in self._streams:
                core.abort_request(req_id)

    def _make_requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[tuple[Request, str | None]]:
        """Validated requests for every prompt, or an error before any is made."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts: give one, "
                    "or one per prompt"
                )
        entries = []
        for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
            try:
                entries.append(self._make_request(prompt, param))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
        return entries

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> tuple[Request, str | None]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        text: str | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("the model folder has no tokenizer: give prompts as token ids")
            text = prompt
            token_ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            token_ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"a prompt is a str or a list of token ids, got {prompt!r:.80}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                f"{self.max_model_len}"
            )
        if self.vocab_size is not None:
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids) if self.tokenizer else None
        request = Request(
            f"req-{next(self._ids)}",
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            detokenizer=detokenizer,
        )
        return request, text


def _check_args(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_layout(config: dict[str, Any], tp: int, pp: int) -> None:
    """Refuse a layout the model cannot be cut into, before any process starts."""
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} is larger than the model's {layers} layers")
    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads"
        )


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and bool(value)
        and all(isinstance(t, int) for t in value)
    )


def _executor_factory(
    executor: str | Callable[[WorkerConfig], Executor],
) -> Callable[[WorkerConfig], Executor]:
    """The executor class named by executor (imported lazily), or the callable itself."""
    if callable(executor):
        return executor
    if executor not in EXECUTORS:
        raise ValueError(
            f"executor must be one of {sorted(EXECUTORS)} or a callable, got {executor!r}"
        )
    module_name, _, class_name = EXECUTORS[executor].rpartition(".")

    def make(config: WorkerConfig) -> Executor:
        return getattr(importlib.import_module(module_name), class_name)(config)

    return make


def _model_folder(model: str | None) -> Path:
    if model is None:
        from zmqworker.models.embedded import default_model_path

        model = str(default_model_path())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {model!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {model!r} has no config.json: not a Hugging Face checkpoint"
        )
    return path.resolve()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def _load_tokenizer(path: Path) -> Any:
    """The folder's transformers tokenizer, or None when it has none."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _max_model_len(config: dict[str, Any], requested: int | None) -> int:
    limit = config.get("max_position_embeddings")
    if requested is None:
        if limit is None:
            raise ValueError("config.json has no max_position_embeddings: give max_model_len")
        return int(limit)
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if limit is not None and requested > limit:
        raise ValueError(
            f"max_model_len={requested} is more than the model's max_position_embeddings={limit}"
        )
    return requested


def _eos_token_ids(path: Path, config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, together."""
    ids: set[int] = set()
    sources = [config.get("eos_token_id")]
    if (path / "generation_config.json").is_file():
        sources.append(_read_json(path / "generation_config.json").get("eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(t for t in source if isinstance(t, int))
    return frozenset(ids)
