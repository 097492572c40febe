"""The LLM API: text generation over engine core processes, each running its workers
over a Hugging Face checkpoint."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import msgspec

from messages import (
    CacheConfig,
    DeviceConfig,
    EngineCoreConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from zmqworker.cdiv import cdiv
from zmqworker.engine.core_limits import engine_core_limits
from zmqworker.engine.model_folder import ModelFolder, cache_config_for
from zmqworker.executor.abstract import STEP_TIMEOUT_S, Executor
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import EngineCoreLauncher
from zmqworker.frontend.devices import (
    check_gpu_layout,
    resolve_device,
    resolve_dtype,
    visible_gpu_count,
)
from zmqworker.frontend.errors import (
    EngineCoreDiedError,
    EngineCoreError,
    EngineCoreStartupError,
)
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.llm_args import (
    AtLeastMinusOne,
    Fraction,
    Positive,
    Seconds,
    arg_types,
    check_args,
    opt,
)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 3600.0  # an engine core neither ready nor dead by then is given up
SHUTDOWN_CALL_S = 30.0  # the shutdown call's answer: its steps in flight come back first


class LLM(Frontend):
    """Generate text with a model served by engine core processes (one per data-parallel
    replica), each driving its worker processes.

    Every argument is checked (a ValueError names the one that is wrong), and the layout
    against the model and the visible GPUs, before any process starts. The KV cache holds
    max_num_seqs sequences of max_model_len tokens, capped by memory, unless
    kv_cache_bytes, cpu_memory_fraction or (on CUDA) gpu_memory_utilization ask
    otherwise. executor may also be a factory of executors made in this process (tests):
    the engine cores then run in threads of this process, over the same protocol. Not
    thread-safe; generate() and generate_stream() are not to be mixed at one time.
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
        data_parallel_size: Annotated[
            Positive,
            opt(
                "data-parallel replicas: engine cores, each with its own workers", aliases=["--dp"]
            ),
        ] = 1,
        device: Annotated[
            Literal["cpu", "cuda", "auto"],
            opt("device of the workers (auto: CUDA when a GPU is visible)"),
        ] = "auto",
        dtype: Annotated[
            Literal["float32", "bfloat16", "float16", "auto"],
            opt(
                "weights and activations dtype (auto: float32 on the CPU; on CUDA the "
                "checkpoint's, bfloat16 for float32)"
            ),
        ] = "auto",
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
    ) -> None:
        self._launcher: EngineCoreLauncher | None = None
        check_args(OPTION_TYPES, {k: v for k, v in locals().items() if k in OPTION_TYPES})
        started = time.perf_counter()
        tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
        folder = ModelFolder.open(model)
        folder.check_layout(tp, pp)
        max_model_len = folder.max_model_len(max_model_len)
        gpus = visible_gpu_count()
        device, device_why = resolve_device(device, gpus)
        saved_dtype = folder.config.get("dtype") or folder.config.get("torch_dtype")
        dtype, dtype_why = resolve_dtype(dtype, device, saved_dtype)
        local = not callable(executor) and executor == "mp"
        if device == "cuda" and local:
            check_gpu_layout(dp, tp, pp, gpus)
        cache = cache_config_for(
            folder,
            CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                cpu_memory_fraction=cpu_memory_fraction or CacheConfig().cpu_memory_fraction,
                kv_cache_bytes=kv_cache_bytes,
            ),
            num_blocks=max_num_seqs * cdiv(max_model_len, block_size),
            fill=cpu_memory_fraction is not None,
            dtype=dtype,
            tp=tp,
            pp=pp,
            local_cpu=local and device == "cpu",
            replicas=dp,
        )
        self.worker_config = WorkerConfig(
            model=ModelConfig(
                path=str(folder.path),
                dtype=dtype,
                max_model_len=max_model_len,
                load_format=load_format,
                seed=seed,
                max_logprobs=max_logprobs,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp
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
        )

        def engine_config(index: int, address: str, token: str) -> EngineCoreConfig:
            parallel = msgspec.structs.replace(
                self.worker_config.parallel, data_parallel_rank=index
            )
            return EngineCoreConfig(
                worker=msgspec.structs.replace(self.worker_config, parallel=parallel),
                address=address,
                token=token,
                engine_index=index,
                executor="mp" if callable(executor) else executor,
                async_scheduling=async_scheduling,
                enable_prefix_caching=enable_prefix_caching,
                step_timeout_s=step_timeout_s,
                vocab_size=folder.vocab_size,
                log_level=logging.getLevelName(logging.getLogger("zmqworker").getEffectiveLevel()),
            )

        logger.info(
            "starting %d engine core(s) of %d worker(s) on %s (%s), %s (%s); loading %s",
            dp, tp * pp, device, device_why, dtype, dtype_why, folder.path,
        )  # fmt: skip
        with ThreadPoolExecutor(1, thread_name_prefix="zmqworker-tokenizer") as pool:
            # The tokenizer loads while the engine cores start their workers.
            text_side = pool.submit(folder.load_text_side)
            launcher = EngineCoreLauncher(
                dp, engine_config, make_executor=executor if callable(executor) else None
            )
            try:
                limits = engine_core_limits(self.worker_config)
                client = EngineCoreClient(
                    launcher.addresses, launcher.handles, launcher.token, 0, limits.output_bytes
                )
                try:
                    readies = client.wait_ready(START_TIMEOUT_S)
                    texts = text_side.result()
                except BaseException:
                    _shut_down_ready(client)
                    client.close()
                    raise
            except (EngineCoreError, EngineCoreDiedError, TimeoutError) as exc:
                launcher.stop(polite=False)
                raise EngineCoreStartupError(f"the engine did not start: {exc}") from exc
            except BaseException:
                launcher.stop(polite=False)
                raise
        super().__init__(client, readies, texts, folder, max_logprobs)
        self._launcher = launcher
        logger.info("ready: %.1f s", time.perf_counter() - started)

    def shutdown(self) -> None:
        """Stop the engine cores and their workers. Idempotent."""
        launcher, self._launcher = self._launcher, None
        if launcher is None:
            return
        self._closed = True
        try:
            _shut_down_ready(self.client)
        finally:
            self.client.close()
            launcher.stop(polite=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _shut_down_ready(client: EngineCoreClient) -> None:
    """Ask every engine core that is up to shut down (its workers first), and wait for
    the answers, within a bound."""
    ready = [e.index for e in client.engines if e.ready is not None and e.dead is None]
    try:
        if ready:
            client.call("shutdown", timeout=SHUTDOWN_CALL_S, engines=ready)
    except Exception as exc:  # an engine core that cannot stop politely is stopped harder
        logger.warning("the engine cores' shutdown call failed: %s", exc)


# The options' types, Meta included, for the checks above and for the CLI.
OPTION_TYPES = arg_types(LLM.__init__)
