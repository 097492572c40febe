"""The LLM API: text generation over engine core processes, each running its workers
over a Hugging Face checkpoint."""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

from messages import WorkerConfig
from zmqworker.executor.abstract import STEP_TIMEOUT_S, Executor
from zmqworker.frontend.core_process import EngineCoreLauncher
from zmqworker.frontend.disaggregated_plan import (
    KV_TIMEOUT_S,
    DisaggregatedPlan,
    check_pair_options,
    start_engine_cores,
)
from zmqworker.frontend.engine_plan import EnginePlan
from zmqworker.frontend.engine_shutdown import shut_down_engines
from zmqworker.frontend.errors import (
    EngineCoreDiedError,
    EngineCoreError,
    EngineCoreStartupError,
)
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.llm_args import (
    AtLeastMinusOne,
    Fraction,
    GiB,
    Int64,
    Port,
    Positive,
    Seconds,
    arg_types,
    check_args,
    opt,
    vllm_options,
)
from zmqworker.frontend.remote_cores import RemotePlan

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 3600.0  # an engine core neither ready nor dead by then is given up


class LLM(Frontend):
    """Generate text with a model served by engine core processes (one per data-parallel
    replica), each driving its worker processes.

    Every argument is checked (a ValueError names the one that is wrong), and the layout
    against the model and the visible GPUs, before any process starts. The KV cache holds
    max_num_seqs sequences of max_model_len tokens, capped by memory, unless
    kv_cache_bytes, cpu_memory_fraction or (on CUDA) gpu_memory_utilization ask
    otherwise. executor may also be a factory of executors made in this process (tests):
    the engine cores then run in threads of this process, over the same protocol. With
    engine_core_addresses it starts none and connects to those (frontend/remote_cores.py;
    worker_config is then None: their configs are where they run). Not thread-safe;
    generate() and generate_stream() are not to be mixed at one time. vLLM's spellings
    are taken too: dtype "half", "float" or a torch dtype, seed=None (0), and its
    trust_remote_code, kv_cache_dtype, swap_space, disable_log_stats and tokenizer (the
    model folder) with neutral values (llm_args.VLLM_NEUTRAL); another value is refused.
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
        enable_expert_parallel: Annotated[
            bool, opt("mixture-of-experts models: each rank holds its share of the experts whole")
        ] = False,
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
        kv_offloading_size: Annotated[
            GiB,
            opt(
                "GiB of host memory (pinned on CUDA) that keeps the blocks the prefix cache "
                "evicts, over each replica's workers, for later prefix hits (0: none)",
                metavar="GIB",
            ),
        ] = 0.0,
        async_scheduling: Annotated[
            bool, opt("schedule the next step while the workers run this one (one stage)")
        ] = True,
        enforce_eager: Annotated[
            bool, opt("CUDA: run every step eagerly, capturing no CUDA graphs")
        ] = False,
        seed: Annotated[
            Int64, opt("the workers' seed (for requests without one)", flag="--engine-seed")
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
        disaggregate: Annotated[
            bool,
            opt(
                "engine cores on this host in two roles: a prefill instance computes each "
                "prompt and its first token, a decode instance pulls the prompt's KV (shared "
                "memory, CURVE-authenticated sockets) and decodes the rest, so that long "
                "prompts arriving do not stall the decodes in flight; the layout options "
                "are a prefill's (no data parallelism; on CUDA each instance on "
                "GPUs of its own where there are enough, else all on the same GPUs, with "
                "kv_cache_bytes)"
            ),
        ] = False,
        decode_tensor_parallel_size: Annotated[
            Positive | None,
            opt(
                "disaggregate: the decode instances' tensor parallel size (default: the "
                "prefill's); each decode rank pulls its KV heads from the prefill ranks that "
                "hold them, and its workers take kv_cache_bytes scaled to the same blocks",
                aliases=["--decode-tp"],
                metavar="N",
            ),
        ] = None,
        decode_pipeline_parallel_size: Annotated[
            Positive | None,
            opt(
                "disaggregate: the decode instances' pipeline stages (default: the "
                "prefill's); each decode stage pulls its layers from the prefill stages "
                "that hold them, and its workers take kv_cache_bytes scaled to the same "
                "blocks",
                aliases=["--decode-pp"],
                metavar="N",
            ),
        ] = None,
        prefill_instances: Annotated[
            Positive | None,
            opt(
                "disaggregate: how many prefill instances (default 1); each request goes "
                "to the least loaded (with prefix caching: where its prefix went, within 16 "
                "requests)",
                metavar="N",
            ),
        ] = None,
        decode_instances: Annotated[
            Positive | None,
            opt(
                "disaggregate: how many decode instances (default 1); each prefilled "
                "request goes on to the least loaded (with prefix caching: where its "
                "prefix went, within 16 requests)",
                metavar="N",
            ),
        ] = None,
        max_local_prefill_tokens: Annotated[
            Positive | None,
            opt(
                "disaggregate: a prompt of which at most N tokens are not cached on a "
                "decode instance (with prefix caching; else its length) goes straight "
                "there, which computes them (no transfer, no wait for a prefill "
                "instance); others go through a prefill instance (default: all do)",
                metavar="N",
            ),
        ] = None,
        kv_port: Annotated[
            Port | None,
            opt(
                "disaggregate: prefill instance i's rank r (pp_rank*tp+tp_rank) serves its "
                "KV on 127.0.0.1:PORT+i*tp*pp+r (default: free ports)",
                metavar="PORT",
            ),
        ] = None,
        kv_transfer_timeout_s: Annotated[
            Seconds | None,
            opt(
                "disaggregate: seconds a request's KV waits to be pulled, and a pull for its "
                f"answer, before the request fails (default: {KV_TIMEOUT_S:g})",
                flag="--kv-transfer-timeout",
                metavar="S",
            ),
        ] = None,
        engine_core_addresses: Annotated[
            list[str] | None,
            opt(
                "connect to engine cores served on their own (zmqworker engine-core, on "
                "other hosts) instead of starting them: tcp://HOST:PORT each, data-parallel "
                "replicas, or with disaggregate prefill and decode instances (each says "
                "which it is); "
                "needs $ZMQWORKER_CORE_CURVE, and shutdown() leaves them running",
                flag="--engine-core-address",
                metavar="tcp://HOST:PORT",
            ),
        ] = None,
        **vllm_args: Any,
    ) -> None:
        self._launcher: EngineCoreLauncher | None = None
        options = {k: v for k, v in locals().items() if k in OPTION_TYPES}
        options = vllm_options(options, vllm_args)  # vLLM's spellings and no-op arguments
        check_args(OPTION_TYPES, options)
        started = time.perf_counter()
        if engine_core_addresses:
            # Their configs are where they run: none here.
            self.worker_config: WorkerConfig | None = None
            self._connect(RemotePlan.from_options(options, OPTION_DEFAULTS))
            logger.info("connected: %.1f s", time.perf_counter() - started)
            return
        check_pair_options(options)
        plan = EnginePlan.from_options(options)
        pair = DisaggregatedPlan.from_options(plan, options)
        self.worker_config = plan.worker_config
        # The tokenizer loads while the engine cores start their workers; a start that
        # fails does not wait for it (its thread finishes on its own, its result unread).
        pool = ThreadPoolExecutor(1, thread_name_prefix="zmqworker-tokenizer")
        try:
            text_side = pool.submit(plan.folder.load_text_side)
            launcher, make_client = start_engine_cores(plan, pair)
            with starting("the engine did not start", launcher.stop):
                client = make_client(
                    launcher.addresses, launcher.handles, launcher.token, 0, plan.output_bytes
                )
                try:
                    readies = client.wait_ready(START_TIMEOUT_S)
                    texts = text_side.result()
                except BaseException:
                    leaving = shut_down_engines(client)
                    client.close()
                    launcher.stop(leaving)
                    raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        super().__init__(client, readies, texts, plan.folder, plan.max_logprobs)
        self._launcher = launcher
        logger.info("ready: %.1f s", time.perf_counter() - started)

    def _connect(self, plan: RemotePlan) -> None:
        """Become a client of engine cores served on their own, once they are ready."""
        texts = plan.folder.load_text_side()
        client = plan.connect()
        with starting("could not connect", client.close):
            readies = client.wait_ready(START_TIMEOUT_S)
            plan.check_readies(readies)
        super().__init__(client, readies, texts, plan.folder, plan.max_logprobs)

    def shutdown(self) -> None:
        """Stop the engine cores and their workers (engine cores at engine_core_addresses
        are left running: only this client's connections end). Idempotent."""
        launcher, self._launcher = self._launcher, None
        if launcher is None:
            self.close()
            return
        leaving: set[int] = set()
        try:
            if not self._closed:
                leaving = shut_down_engines(self.client)
        finally:
            self.close()
            launcher.stop(leaving)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@contextlib.contextmanager
def starting(what: str, undo: Callable[[], object]) -> Iterator[None]:
    """Undo a start that fails; an engine core's failure or a timeout is raised as an
    EngineCoreStartupError that says what did not happen."""
    try:
        yield
    except (EngineCoreError, EngineCoreDiedError, TimeoutError) as exc:
        undo()
        raise EngineCoreStartupError(f"{what}: {exc}") from exc
    except BaseException:
        undo()
        raise


# The options' types, Meta included, for the checks above and for the CLI.
OPTION_TYPES = arg_types(LLM.__init__)
OPTION_DEFAULTS = {
    name: p.default for name, p in inspect.signature(LLM).parameters.items() if name in OPTION_TYPES
}
