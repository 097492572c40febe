"""Text in, text out over engine cores: what an LLM and every API server process share.

Prompts are tokenized and checked here, the requests go to the engine cores (the least
loaded replica), and each step's outputs come back to the requests' states here (text,
stop strings, logprobs), then to their callers: generate() waits for them, a stream gets
each one as it comes. Not thread-safe (one event loop at a time); generate() and
generate_stream() are not to be mixed at one time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from messages import EngineCoreReady, EngineCoreRequest, SamplingParams
from zmqworker.engine.model_folder import ModelFolder, TextSide
from zmqworker.engine.prompts import Prompt, template_messages
from zmqworker.frontend.core_client import POLL_SLICE_S, EngineCoreClient
from zmqworker.frontend.engine_connection import Event, Failed
from zmqworker.frontend.llm_control import ControlMethods
from zmqworker.frontend.new_requests import NewRequests
from zmqworker.frontend.output_processor import OutputProcessor
from zmqworker.frontend.outputs import EngineStats, RequestOutput
from zmqworker.frontend.request_state import RequestState

if TYPE_CHECKING:
    from zmqworker.executor.weight_push import WeightPusher

logger = logging.getLogger(__name__)

# A chat: messages with a role ("system", "user", "assistant") and a content.
Conversation = Sequence[dict[str, Any]]
Sink = Callable[[RequestOutput | Exception], None]
HEALTH_TIMEOUT_S = 10.0


class Frontend(ControlMethods):
    """A client of running engine cores, with the model's text side; between
    generations, the control methods (llm_control.py)."""

    def __init__(
        self,
        client: EngineCoreClient,
        readies: Sequence[EngineCoreReady],
        texts: TextSide,
        folder: ModelFolder,
        max_logprobs: int,
        client_index: int = 0,
    ) -> None:
        self.client = client
        self.model_folder = folder
        self.tokenizer = texts.tokenizer
        self.vocab_size = folder.vocab_size
        self.eos_token_ids = texts.eos_token_ids
        self.max_model_len = readies[0].max_model_len
        self.engine_core_pids = [r.pid for r in readies]
        self.worker_pids = [pid for r in readies for pid in r.worker_pids]
        self._texts = texts
        self.max_logprobs = max_logprobs
        self._new = NewRequests(
            texts, self.vocab_size, self.max_model_len, max_logprobs, client_index
        )
        self._processor = OutputProcessor()
        self._sinks: dict[str, Sink] = {}  # request id -> where its outputs go
        self._closed = False
        self._failed: Exception | None = None  # fail_all's error: later requests get it
        self._pusher: WeightPusher | None = None  # made at the first update from here
        self._observers: list[Callable[[RequestOutput], None]] = []

    # -- the API ---------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the defaults the model's generation_config.json sets."""
        return self._texts.default_sampling_params

    @property
    def max_new_tokens(self) -> int | None:
        """generation_config.json's max_new_tokens, if it sets one."""
        return self._texts.max_new_tokens

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's LLM.get_tokenizer()); None when it has none."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: object = True,
        lora_request: object = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (batched together); outputs in the order of prompts, n
        in a row for a prompt whose params ask for n samples (RequestOutput.index): unlike
        vLLM's, each output is one sample (its .outputs, vLLM's view, holds that one).
        A prompt is text, token ids, or vLLM's {"prompt": ...} or {"prompt_token_ids":
        ...}. vLLM's keywords: use_tqdm is taken and ignored (no progress bar);
        lora_request and a non-zero priority are refused (no LoRA, no priority
        scheduling)."""
        check_vllm_keywords(lora_request, priority)
        self._require_open()
        if self._streaming():
            raise RuntimeError("generate() called while streams run: use generate_stream() instead")
        # Not streamed (only the last outputs are kept), unless an observer sees each.
        states = self._new.make(prompts, sampling_params, bool(self._observers))
        finals: dict[str, RequestOutput] = {}
        errors: list[Exception] = []

        def sink(item: RequestOutput | Exception) -> None:
            if isinstance(item, Exception):
                errors.append(item)
            elif item.finished:
                finals[item.request_id] = item

        try:
            for state in states:
                self._submit(state, sink)
            while len(finals) < len(states) and not errors:
                self._handle(self.client.receive(POLL_SLICE_S))
            if errors:
                raise errors[0]
        finally:
            self._abort([s.request_id for s in states if s.request_id not in finals])
        return [finals[s.request_id] for s in states]

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: object = True,
        lora_request: object = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """generate() on each conversation through the model's chat template (or
        chat_template, a Jinja template of one's own), with vLLM's LLM.chat options
        (chat_prompt()); every one after sampling_params by keyword."""
        check_vllm_keywords(lora_request, priority)
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [
            self.chat_prompt(
                c,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                chat_template=chat_template,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(
        self,
        messages: Conversation,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """The prompt of a conversation, ending where the assistant's reply starts, or
        inside the last message with continue_final_message; tools for the template to
        write out (TextSide.chat_prompt). Messages in OpenAI's shape are taken as the
        server takes them (template_messages())."""
        return self._texts.chat_prompt(
            template_messages(messages),
            add_generation_prompt,
            add_special_tokens,
            continue_final_message,
            chat_template_kwargs,
            tools,
            chat_template=chat_template,
        )

    async def generate_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output each time it grows (new_text, new_token_ids); the
        last one has finished=True. With n samples, each sample's outputs (told apart by
        RequestOutput.index) until all n have finished. Several streams may run at once
        on one event loop; a stream closed early aborts its requests."""
        self._require_open()
        states = self._new.make([prompt], sampling_params, streamed=True)
        self._attach()
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        running = {state.request_id for state in states}
        try:
            for state in states:
                self._submit(state, queue.put_nowait)
            while running:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item  # the stream ends: its other samples are aborted below
                if item.finished:
                    running.discard(item.request_id)
                yield item
        finally:
            if running:
                self._abort([s.request_id for s in states if s.request_id in running])

    def observe_outputs(self, observer: Callable[[RequestOutput], None]) -> None:
        """Have observer see every output this client gets, before its caller does (the
        server's metrics)."""
        self._observers.append(observer)

    def encode(self, prompt: Prompt, keep: int | None = None) -> list[int]:
        """The prompt's token ids (text goes through the tokenizer), checked against the
        model: not empty, within max_model_len and the vocabulary; keep: only the last
        keep (engine/prompts.kept_tokens)."""
        return self._new.encode(prompt, keep)

    def check_health(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Raise if an engine core or one of its workers does not answer within timeout
        (safe while steps run: they answer beside them)."""
        self._require_open()
        self.client.call("check_health", (timeout,), timeout=timeout + POLL_SLICE_S)

    async def check_health_async(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """check_health(), on the running event loop."""
        self._require_open()
        self._attach()
        await self.client.call_async("check_health", (timeout,), timeout=timeout + POLL_SLICE_S)

    def stats(self) -> EngineStats:
        """Requests and KV cache blocks now, over every engine core."""
        self._require_open()
        return EngineStats.total(self.client.call("stats"))

    async def stats_async(self) -> EngineStats:
        """stats(), on the running event loop."""
        self._require_open()
        self._attach()
        return EngineStats.total(await self.client.call_async("stats"))

    @property
    def lost(self) -> Exception | None:
        """Why an engine core is lost to this client (the first's error), one it did not
        ask to stop: it died, or dropped this client (a client silent past its bound)."""
        gone = (e.dead for e in self.client.engines if e.dead is not None and not e.stopping)
        return next(gone, None)

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with error: its caller gets it, its engine core
        aborts it; a request added later raises it (a server that stops answers what
        still runs at its deadline, and what its handlers add after: a request whose
        prompt was still being read or tokenized then)."""
        self._failed = error
        request_ids = list(self._sinks)
        self._fail(dict.fromkeys(request_ids, error))
        self._abort(request_ids)

    def close(self) -> None:
        """Close the connections to the engine cores, which go on serving their other
        clients (LLM.shutdown() stops them); open streams raise RuntimeError. Idempotent."""
        if not self._closed:
            self._closed = True
            self.fail_all(RuntimeError("the LLM is shut down"))  # else streams wait forever
            self.client.close()
            if self._pusher is not None:
                self._pusher.close()  # its shared memory segments

    # -- internals -------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the LLM is shut down")

    def _attach(self) -> None:
        """The running loop watches the engine cores; one still running elsewhere keeps them."""
        loop, other = asyncio.get_running_loop(), self.client.loop
        if other is not None and other is not loop and other.is_running():
            raise RuntimeError("the LLM is in use by another thread's event loop: use that loop")
        self.client.attach(loop, self._handle)

    def _streaming(self) -> bool:
        loop = self.client.loop
        if loop is not None and loop.is_closed():
            self.client.detach()
            return False
        return loop is not None and bool(self._sinks)

    def _submit(self, state: RequestState, sink: Sink) -> None:
        if self._failed is not None:
            raise self._failed
        self._processor.add(state)
        self._sinks[state.request_id] = sink
        request = EngineCoreRequest(
            state.request_id,
            np.array(state.prompt_token_ids, np.int32),
            state.params,
            eos_token_ids=sorted(self.eos_token_ids),
            arrival_time=time.time(),
            shares_prompt_with=state.shares_prompt_with,
        )
        try:
            self.client.add_request(request)
        except BaseException:
            self._processor.remove(state.request_id)
            del self._sinks[state.request_id]
            raise

    def _abort(self, request_ids: Sequence[str]) -> None:
        """Requests their callers gave up on: out of here and out of their engine core."""
        for request_id in request_ids:
            self._processor.remove(request_id)
            self._sinks.pop(request_id, None)
        if not self._closed:
            self.client.abort(request_ids)

    def _handle(self, events: list[Event]) -> None:
        """Hand what came from the engine cores to the requests' callers."""
        sinks = self._sinks
        for event in events:
            if isinstance(event, Failed):
                self._fail(dict.fromkeys(event.request_ids, event.error))
                continue
            processed = self._processor.process(event)
            if processed.stopped:
                self.client.abort(processed.stopped, reason="stop")
            if processed.failed:
                self.client.abort(list(processed.failed))
                self._fail(processed.failed)
            for out in processed.outputs:
                for observer in self._observers:
                    observer(out)
                sink = sinks.pop(out.request_id) if out.finished else sinks.get(out.request_id)
                if sink is not None:
                    sink(out)

    def _fail(self, errors: dict[str, Exception]) -> None:
        """Each request out of here, its caller told its error."""
        for request_id, error in errors.items():
            self._processor.remove(request_id)
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(error)


def check_vllm_keywords(lora_request: object, priority: Sequence[int] | None) -> None:
    """Refuse what vLLM's generate() and chat() take and this engine does not do."""
    if lora_request is not None:
        raise ValueError("lora_request is not supported: the engine serves no LoRA adapters")
    if priority is not None and any(priority):
        raise ValueError(
            "priority is not supported: requests are scheduled first come, first served"
        )
