"""The LLM API: text generation with worker processes over a Hugging Face checkpoint."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

from messages import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
    WorkerConfig,
)
from zmqworker.cdiv import cdiv
from zmqworker.engine.core import EngineCore
from zmqworker.engine.detokenizer import IncrementalDetokenizer
from zmqworker.engine.llm_args import (
    AtLeastMinusOne,
    Fraction,
    Positive,
    Seconds,
    arg_types,
    check_args,
    executor_factory,
    opt,
)
from zmqworker.engine.llm_control import ControlMethods
from zmqworker.engine.model_folder import ModelFolder, cache_config_for, on_cpu
from zmqworker.engine.outputs import EngineStats, RequestOutput
from zmqworker.engine.prompts import Prompt, prompt_list, prompt_token_ids
from zmqworker.engine.request import Request
from zmqworker.engine.request_params import request_params
from zmqworker.executor.abstract import STEP_TIMEOUT_S, Executor

logger = logging.getLogger(__name__)

# A chat: messages with a role ("system", "user", "assistant") and a content.
Conversation = Sequence[dict[str, Any]]


class LLM(ControlMethods):
    """Generate text with a model served by worker processes.

    Every argument is checked (a ValueError names the one that is wrong), and the layout
    against the model, before any process starts. The KV cache holds max_num_seqs
    sequences of max_model_len tokens, capped by memory, unless kv_cache_bytes,
    cpu_memory_fraction or (on CUDA) gpu_memory_utilization ask otherwise. Not
    thread-safe; generate() and generate_stream() are not to be mixed at one time.
    Between generations: sleep, wake_up and weight updates (llm_control.py).
    """

    def __init__(
        self,
        model: Annotated[
            str | None, opt("Hugging Face checkpoint folder (default: the embedded model)")
        ] = None,
        tensor_parallel_size: Annotated[
            Positive, opt("tensor-parallel size", aliases=["--tp"])
        ] = 1,
        pipeline_parallel_size: Annotated[
            Positive, opt("pipeline-parallel size", aliases=["--pp"])
        ] = 1,
        enable_expert_parallel: Annotated[
            bool, opt("mixture-of-experts models: each rank holds its share of the experts whole")
        ] = False,
        device: Annotated[Literal["cpu", "cuda", "auto"], opt("device of the workers")] = "cpu",
        dtype: Annotated[
            Literal["float32", "bfloat16", "float16"], opt("weights and activations dtype")
        ] = "float32",
        load_format: Annotated[
            Literal["auto", "dummy"],
            opt("the checkpoint's weights, or random ones of its shapes (for benchmarks)"),
        ] = "auto",
        executor: Annotated[
            Literal["mp", "ray"] | Callable[[WorkerConfig], Executor],
            opt("local worker processes (mp) or Ray actors (ray)"),
        ] = "mp",
        max_num_seqs: Annotated[Positive, opt("the most requests in one step")] = 64,
        max_num_batched_tokens: Annotated[Positive, opt("the most tokens in one step")] = 2048,
        max_model_len: Annotated[
            Positive | None,
            opt("the longest sequence, prompt and output (default: the model's)"),
        ] = None,
        max_logprobs: Annotated[
            AtLeastMinusOne, opt("the most top logprobs a request may ask for (-1: all)")
        ] = 20,
        block_size: Annotated[Positive, opt("tokens per KV cache block")] = 16,
        kv_cache_bytes: Annotated[
            Positive | None, opt("KV cache bytes per worker, exactly", unit="bytes")
        ] = None,
        cpu_memory_fraction: Annotated[
            Fraction | None,
            opt(
                "CPU: fill this fraction of the available memory with the KV cache "
                "(default: what max_num_seqs x max_model_len need, at most 0.25)"
            ),
        ] = None,
        gpu_memory_utilization: Annotated[
            Fraction, opt("CUDA: the fraction of GPU memory the workers fill")
        ] = 0.9,
        enable_prefix_caching: Annotated[bool, opt("share the KV of common prefixes")] = False,
        async_scheduling: Annotated[
            bool, opt("schedule the next step while the workers run this one (one stage)")
        ] = True,
        seed: Annotated[
            int, opt("the workers' seed (for requests without one)", flag="--engine-seed")
        ] = 0,
        num_threads: Annotated[
            Positive | None, opt("torch threads per worker (default: cores / workers)")
        ] = None,
        step_timeout_s: Annotated[
            Seconds | None,
            opt("seconds a step may go unanswered before it fails"),
        ] = STEP_TIMEOUT_S,
        worker_extension_cls: Annotated[
            str, opt("package.module.Class whose public methods the workers also serve")
        ] = "",
    ) -> None:
        self._core: EngineCore | None = None
        check_args(OPTION_TYPES, {k: v for k, v in locals().items() if k in OPTION_TYPES})
        started = time.perf_counter()
        folder = ModelFolder.open(model)
        folder.check_layout(tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel)
        self.model_folder = folder
        self.max_model_len = folder.max_model_len(max_model_len)
        world = tensor_parallel_size * pipeline_parallel_size
        cache = cache_config_for(
            folder,
            CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                cpu_memory_fraction=cpu_memory_fraction or CacheConfig().cpu_memory_fraction,
                kv_cache_bytes=kv_cache_bytes,
            ),
            num_blocks=max_num_seqs * cdiv(self.max_model_len, block_size),
            fill=cpu_memory_fraction is not None,
            dtype=dtype,
            tp=tensor_parallel_size,
            pp=pipeline_parallel_size,
            local_cpu=executor == "mp" and on_cpu(device),
        )
        self.worker_config = WorkerConfig(
            model=ModelConfig(
                path=str(folder.path),
                dtype=dtype,
                max_model_len=self.max_model_len,
                load_format=load_format,
                seed=seed,
                max_logprobs=max_logprobs,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                enable_expert_parallel=enable_expert_parallel,
            ),
            cache=cache,
            device=DeviceConfig(device=device, num_threads=num_threads),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                # Workers warm up with batches of these sizes: none above max_num_seqs.
                warmup_batch_sizes=sorted(
                    {min(size, max_num_seqs) for size in SchedulerConfig().warmup_batch_sizes}
                ),
            ),
            worker_extension_cls=worker_extension_cls,
        )
        logger.info("starting %d worker(s) on %s; loading %s", world, device, folder.path)
        with ThreadPoolExecutor(1, thread_name_prefix="zmqworker-tokenizer") as pool:
            # The tokenizer loads while the workers start: most of that is their wait.
            text_side = pool.submit(folder.load_text_side)
            spawned = time.perf_counter()
            executor_instance = executor_factory(executor)(self.worker_config)
            try:
                logger.info("workers up, weights loaded: %.1f s", time.perf_counter() - spawned)
                executor_instance.step_timeout_s = step_timeout_s
                texts = text_side.result()
                self._core = EngineCore(
                    executor_instance,
                    self.max_model_len,
                    self.worker_config.scheduler,
                    enable_prefix_caching=enable_prefix_caching,
                    async_scheduling=async_scheduling,
                )
            except BaseException:
                executor_instance.shutdown()
                raise
        logger.info("ready: %.1f s", time.perf_counter() - started)
        self._texts = texts
        self.tokenizer = texts.tokenizer
        self.vocab_size = folder.vocab_size
        self.eos_token_ids = texts.eos_token_ids
        self._ids = itertools.count()
        # generate_stream's state: one asyncio task steps the engine for every stream.
        self._driver: asyncio.Task[None] | None = None
        self._streams: dict[str, tuple[asyncio.Queue[Any], str | None]] = {}
        self._to_add: list[Request] = []
        self._to_abort: list[str] = []
        self._num_aborted = 0  # streams closed before their request finished

    # -- the API ---------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the defaults the model's generation_config.json sets."""
        return self._texts.default_sampling_params

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (batched together); outputs in the order of prompts."""
        core = self._require_core()
        if self._streaming():
            raise RuntimeError("generate() called while generate_stream() streams are running")
        if (reason := core.not_ready()) is not None:
            raise RuntimeError(f"generate(): {reason}")
        entries = self._make_requests(prompts, sampling_params)
        self._take_stream_changes(core)  # a loop that ended mid-stream left them behind
        for request, _ in entries:
            core.add_request(request)
        try:
            # Until the steps in flight are back too (async scheduling sends one past a
            # finish): the workers go idle and the finished requests' blocks come back.
            while core.has_work():
                core.step()
        except BaseException:
            for request, _ in entries:
                core.abort_request(request.req_id)
            raise
        return [RequestOutput.from_request(request, text) for request, text in entries]

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """generate() on each conversation through the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.chat_prompt(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def chat_prompt(self, messages: Conversation) -> list[int]:
        """The prompt of a conversation, ending where the assistant's reply starts."""
        return self._texts.chat_prompt(messages)

    async def generate_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output each time it grows (new_text, new_token_ids); the
        last one has finished=True. Several streams may run at once on one event loop;
        a stream closed early aborts its request."""
        if (reason := self._require_core().not_ready()) is not None:
            raise RuntimeError(f"generate_stream(): {reason}")
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
                self._num_aborted += 1

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (text goes through the tokenizer), checked against the
        model: not empty, within max_model_len and the vocabulary."""
        return prompt_token_ids(prompt, self.tokenizer, self.max_model_len, self.vocab_size)

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise if a worker does not answer within timeout (safe while steps run)."""
        self._require_core().executor.check_health(timeout=timeout)

    def stats(self) -> EngineStats:
        """Requests and KV cache blocks now."""
        core = self._require_core()
        kv = core.block_manager
        return EngineStats(
            num_running=len(core.scheduler.running),
            num_waiting=len(core.scheduler.waiting),
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_preemptions=core.scheduler.num_preemptions,
            num_aborted=self._num_aborted,
        )

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

    def _take_stream_changes(self, core: EngineCore) -> None:
        """Add the streams' new requests and abort those of the streams closed early."""
        for request in self._to_add:
            core.add_request(request)
        for req_id in self._to_abort:
            core.abort_request(req_id)
        self._to_add, self._to_abort = [], []

    async def _drive(self) -> None:
        """Step the engine while streams have work, off the event loop's thread. Requests
        are added and aborted only here, between steps."""
        core = self._require_core()
        try:
            while True:
                self._take_stream_changes(core)
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
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.default_sampling_params()] * len(prompts)
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
        max_logprobs = self.worker_config.model.max_logprobs
        params = request_params(params, self.tokenizer, self.vocab_size, max_logprobs)
        token_ids = self.encode(prompt)
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids) if self.tokenizer else None
        request = Request(
            f"req-{next(self._ids)}",
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            detokenizer=detokenizer,
        )
        return request, prompt if isinstance(prompt, str) else None


# The options' types, Meta included, for the checks above and for the CLI.
OPTION_TYPES = arg_types(LLM.__init__)
