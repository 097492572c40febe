"""The LLM API over a fake executor (its engine core in a thread of this process, over the
same protocol as a process): generate, streaming, bad input, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import FakeExecutor, byte_level_tokenizer, reference_tokens

from messages import SamplingParams, WorkerConfig
from zmqworker.frontend.errors import EngineCoreStartupError
from zmqworker.frontend.llm import LLM
from zmqworker.frontend.request_state import RequestState

MAX_MODEL_LEN = 64
TOKEN_S = 0.002


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    folder = tmp_path_factory.mktemp("model")
    config = {
        "model_type": "llama",
        "vocab_size": len(tok),
        "max_position_embeddings": MAX_MODEL_LEN,
        "eos_token_id": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(folder)
    return str(folder)


class Factory:
    """Makes FakeExecutors whose 'model' spells a fixed text, and remembers them."""

    def __init__(self, tok, num_blocks: int = 64) -> None:
        self.script = tok.encode(" Paris. The end. And then more words follow here")
        self.num_blocks = num_blocks
        self.made: list[FakeExecutor] = []
        self.configs: list[WorkerConfig] = []

    def token_fn(self, seq: list[int]) -> int:
        # A token takes a moment, as on a model: the engine core's thread does not run a
        # request to its end before the test's next move (another stream, a close).
        time.sleep(TOKEN_S)
        return self.script[len(seq) % len(self.script)]

    def __call__(self, config: WorkerConfig) -> FakeExecutor:
        self.configs.append(config)
        self.made.append(
            FakeExecutor(self.num_blocks, config.cache.block_size, token_fn=self.token_fn)
        )
        return self.made[-1]


@pytest.fixture
def factory(tok):
    return Factory(tok)


@pytest.fixture
def llm(model_dir, factory):
    with LLM(model_dir, executor=factory, block_size=4, max_num_batched_tokens=16) as llm:
        yield llm


def test_generate_returns_text_tokens_and_timings_in_prompt_order(llm, factory, tok):
    prompts = ["The capital of France is", "Hello", [5, 6, 7, 8]]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (12, 3, 5)]
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == ["The capital of France is", "Hello", None]
    for out, prompt, param in zip(outputs, prompts, params, strict=True):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids
        assert out.token_ids == reference_tokens(ids, param.max_tokens, factory.token_fn)
        assert out.text == tok.decode(out.token_ids)
        assert out.finished and out.finish_reason == "length"
        assert 0 <= out.timings.ttft <= out.timings.total and out.timings.tpot >= 0
    config = factory.configs[0]
    assert config.cache.block_size == 4 and config.model.max_model_len == MAX_MODEL_LEN


def test_generate_honours_stop_strings(llm):
    [out] = llm.generate("Hi", SamplingParams(max_tokens=40, stop=[" The"]))
    assert out.finish_reason == "stop" and out.stop_reason == " The"
    assert " The" not in out.text and out.text.endswith(".")


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([], None, "no prompts given"),
        ("", None, "prompt 0: the prompt is empty"),
        (["ok", [[]]], None, "prompt 1: a prompt is a str or a list of token ids"),
        (["ok", []], None, "prompt 1: the prompt is empty"),
        # vLLM's prompt dicts: no multimodal data. Listed, bytes' values would be prompts.
        ({"prompt": "Hi", "multi_modal_data": {}}, None, "'multi_modal_data' is not supported"),
        (b"Hi", None, "prompts are a str, .* got bytes"),
        ([[True, False]], None, "prompt 0: a prompt is a str or a list of token ids"),
        ([[1] * (MAX_MODEL_LEN + 1)], None, "more than max_model_len=64"),
        ([[1, 10**6]], None, "outside the vocabulary"),
        (["a", "b"], [SamplingParams()], "1 sampling params for 2 prompts"),
        ("a", {"max_tokens": 2}, "must be a SamplingParams or one per prompt, not a dict"),
        ("Hello \udcff", None, "prompt 0: the prompt is not valid Unicode text: .* character 7"),
        ("Hi", SamplingParams(stop=["\udcff"]), "prompt 0: stop string 0 is not valid Unicode"),
        ("Hi", SamplingParams(stop_token_ids=[3] * 1025), "prompt 0: stop_token_ids holds 1025"),
    ],
)
def test_bad_input_raises_and_the_engine_stays_usable(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert idle(llm)
    [out] = llm.generate("Hello", SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}</s>{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_takes_vllms_template_options(llm, tok, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", CHAT_TEMPLATE)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]
    params = SamplingParams(max_tokens=2)
    [new] = llm.chat(conversation, params)
    [more] = llm.chat([conversation], params, add_generation_prompt=False)
    [going_on] = llm.chat(
        conversation, params, add_generation_prompt=False, continue_final_message=True
    )
    prompts = [tok.decode(o.prompt_token_ids) for o in (new, more, going_on)]
    assert prompts == [
        "user: Hi</s>assistant: The</s>assistant:",
        "user: Hi</s>assistant: The</s>",
        "user: Hi</s>assistant: The",
    ]
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(conversation, params, continue_final_message=True)


TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }}({{ c.function.arguments.city }})>"
    "{% endfor %}</s>{% endfor %}"
)


def test_code_written_for_vllms_llm_runs(model_dir, factory, tok):
    # vLLM's constructor spellings; enforce_eager reaches the workers' config
    with LLM(
        model_dir, executor=factory, block_size=4, dtype="float", seed=None, enforce_eager=True,
        trust_remote_code=False, tokenizer=model_dir, disable_log_stats=True,
    ) as llm:  # fmt: skip
        model = factory.configs[0].model
        assert (model.dtype, model.seed, model.enforce_eager) == ("float32", 0, True)
        assert llm.get_tokenizer() is llm.tokenizer
        params = SamplingParams(max_tokens=3, temperature=0.0)
        # vLLM's result shape, prompt dicts and generate() keywords
        [plain, text, ids] = llm.generate(
            ["Hello", {"prompt": "Hello"}, {"prompt_token_ids": tok.encode("Hello")}],
            params,
            use_tqdm=False,
            priority=[0, 0, 0],
        )
        assert text.prompt_token_ids == ids.prompt_token_ids == plain.prompt_token_ids
        assert text.token_ids == ids.token_ids == plain.token_ids
        [completion] = plain.outputs
        assert completion.text == plain.text and completion.token_ids == plain.token_ids
        assert completion.finish_reason == "length" and completion.cumulative_logprob is None
        with pytest.raises(ValueError, match="priority is not supported"):
            llm.generate("Hello", params, priority=[1])
        with pytest.raises(ValueError, match="lora_request is not supported"):
            llm.chat([{"role": "user", "content": "Hi"}], params, lora_request=object())
        # vLLM's third positional argument is use_tqdm: here everything after
        # sampling_params is by keyword
        with pytest.raises(TypeError):
            llm.chat([{"role": "user", "content": "Hi"}], params, False)  # type: ignore[misc]
        # A tool round trip in OpenAI's shape, through a template of the caller's own
        call = {"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
        conversation = [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
        [out] = llm.chat(conversation, params, chat_template=TOOL_TEMPLATE, use_tqdm=False)
        assert tok.decode(out.prompt_token_ids) == (
            "system: Use tools.</s>user: Weather?</s>assistant: <call weather(Paris)></s>"
            "tool: sunny</s>"
        )
    with pytest.raises(ValueError, match="trust_remote_code=True is not supported"):
        LLM(model_dir, executor=factory, trust_remote_code=True)


def test_numpy_integers_are_token_ids(llm):
    [out] = llm.generate([[np.int64(5), np.int32(6)]], SamplingParams(max_tokens=2))
    assert out.prompt_token_ids == [5, 6] and len(out.token_ids) == 2


def test_an_engine_seed_past_int64_is_refused_by_name(model_dir, factory):
    with pytest.raises(ValueError, match=r"seed=9223372036854775808: Expected `int` <= "):
        LLM(model_dir, executor=factory, seed=2**63)
    assert factory.made == []


def test_unknown_model_folder_fails_before_any_executor(tmp_path, factory):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"), executor=factory)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path), executor=factory)
    with pytest.raises(ValueError, match="executor='threads': Invalid enum value"):
        LLM(str(tmp_path), executor="threads")
    assert factory.made == []


def test_unsupported_architecture_fails_before_any_executor(tmp_path, model_dir, factory):
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        LLM(str(tmp_path), executor=factory)
    assert factory.made == []


def idle(llm: LLM) -> bool:
    """No request in the engine cores, and every KV block free."""
    stats = llm.stats()
    return stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks


def test_step_timeout_reaches_the_executor_and_is_checked(model_dir, tok):
    factory = Factory(tok)
    LLM(model_dir, executor=factory, step_timeout_s=12.5).shutdown()
    assert factory.made[0].step_timeout_s == 12.5
    with pytest.raises(ValueError, match=r"step_timeout_s=0: Expected `float` > 0.0"):
        LLM(model_dir, executor=factory, step_timeout_s=0)
    assert len(factory.made) == 1


def test_kv_cache_too_small_shuts_the_executor_down(model_dir, tok):
    factory = Factory(tok, num_blocks=4)
    with pytest.raises(EngineCoreStartupError, match="ValueError: .*fewer than max_model_len"):
        LLM(model_dir, executor=factory, block_size=4)
    assert factory.made[0].is_shut_down


def test_concurrent_streams(llm, factory, tok):
    async def collect(prompt, max_tokens):
        pieces, tokens, last = [], [], None
        async for out in llm.generate_stream(prompt, SamplingParams(max_tokens=max_tokens)):
            pieces.append(out.new_text)
            tokens += out.new_token_ids
            last = out
        return pieces, tokens, last

    async def main():
        return await asyncio.gather(collect("The capital", 10), collect("Hello there", 6))

    results = asyncio.run(main())
    for (pieces, tokens, last), n in zip(results, (10, 6), strict=True):
        assert last.finished and len(last.token_ids) == n and tokens == last.token_ids
        assert "".join(pieces) == last.text == tok.decode(last.token_ids)
        assert len(pieces) > 1  # it streamed
    # The two requests ran in the same steps.
    executor = factory.made[0]
    assert any(len(so.scheduled_cached_reqs) == 2 for so in executor.workers[-1].steps)


def test_a_stream_closed_early_is_aborted(llm, factory, tok):
    async def first_output():
        stream = llm.generate_stream("Hello", SamplingParams(max_tokens=30))
        async with contextlib.aclosing(stream):
            async for out in stream:
                return out

    async def main():
        other = llm.generate_stream("Hi", SamplingParams(max_tokens=8))
        return await asyncio.gather(first_output(), _all(other))

    short, outputs = asyncio.run(main())
    assert not short.finished and outputs[-1].finished and len(outputs[-1].token_ids) == 8
    assert idle(llm)
    # The closed stream's request stopped well before its 30 tokens, and was dropped.
    steps = factory.made[0].workers[-1].steps
    handle = next(
        r.req_handle for so in steps for r in so.scheduled_new_reqs if r.req_id == short.request_id
    )
    computed = [so for so in steps if handle in so.scheduled_cached_reqs.req_handles]
    assert len(computed) < 29
    assert any(handle in so.finished_req_handles for so in steps)
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].finished


def test_a_stream_left_by_its_ended_event_loop_is_aborted_by_the_next_generate(llm, factory):
    async def first_output():
        async for out in llm.generate_stream("Hello", SamplingParams(max_tokens=30)):
            return out  # asyncio.run then ends the loop, and the driver with it

    short = asyncio.run(first_output())
    assert not short.finished
    [out] = llm.generate("Hi", SamplingParams(max_tokens=3))
    assert out.finished and len(out.token_ids) == 3
    assert idle(llm) and llm.stats().num_aborted == 1
    # generate() did not run the orphan on to its 30 tokens.
    steps = factory.made[0].workers[-1].steps
    handle = next(
        r.req_handle for so in steps for r in so.scheduled_new_reqs if r.req_id == short.request_id
    )
    assert len([so for so in steps if handle in so.scheduled_cached_reqs.req_handles]) < 10


def test_a_request_whose_output_cannot_be_applied_fails_alone(llm, monkeypatch):
    """An error applying one request's output (its text, its logprobs) used to leave the
    rest of the step's outputs unapplied and their callers waiting forever."""
    apply = RequestState.apply

    def failing(state, *args, **kwargs):
        if state.prompt == "boom" and state.output_token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken tokenizer")
        return apply(state, *args, **kwargs)

    monkeypatch.setattr(RequestState, "apply", failing)

    async def main():
        broken = _all(llm.generate_stream("boom", SamplingParams(max_tokens=30)))
        fine = _all(llm.generate_stream("Hello", SamplingParams(max_tokens=8)))
        return await asyncio.wait_for(asyncio.gather(broken, fine, return_exceptions=True), 30)

    error, outputs = asyncio.run(main())
    assert isinstance(error, RuntimeError)
    assert "its output could not be applied: UnicodeDecodeError" in str(error)
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 8
    assert idle(llm) and llm.stats().num_aborted == 1  # aborted in its engine core too
    with pytest.raises(RuntimeError, match="could not be applied"):
        llm.generate(["Hello", "boom"], SamplingParams(max_tokens=4))
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].finished


def test_an_awaited_utility_call_times_out_while_its_engine_core_is_wedged(model_dir, tok):
    """Its deadline was looked at only when something came from the engine core: during a
    wedged step nothing does, and /health's check waited for the step's end."""
    wedged, inside = threading.Event(), threading.Event()

    class Wedging(Factory):
        def token_fn(self, seq):
            if wedged.is_set():
                wedged.clear()
                inside.set()
                time.sleep(3.0)  # one step outlasts the call's 0.2 + 1 s
            return super().token_fn(seq)

    with LLM(model_dir, executor=Wedging(tok), block_size=4) as llm:

        async def main():
            stream = llm.generate_stream("Hello", SamplingParams(max_tokens=40))
            await anext(stream)
            wedged.set()
            await asyncio.to_thread(inside.wait, 10)
            with pytest.raises(TimeoutError, match="check_health: no answer from engine core"):
                await llm.check_health_async(0.2)
            await stream.aclose()

        asyncio.run(main())


async def _all(stream):
    return [out async for out in stream]


def test_shutdown_ends_the_open_streams_with_an_error(llm):
    """They used to wait forever: nothing more comes to a closed client."""
    errors: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        stream = llm.generate_stream("Hello", SamplingParams(max_tokens=30))
        await anext(stream)
        llm.shutdown()
        with pytest.raises(RuntimeError, match="the LLM is shut down"):
            await asyncio.wait_for(_all(stream), 5)
        await asyncio.sleep(0.05)  # a dispatch already scheduled finds the sockets closed

    asyncio.run(main())
    assert errors == []


def test_a_loop_running_in_another_thread_keeps_the_llm(llm):
    """A second loop used to take the sockets' readers from the first, whose streams then
    got their outputs from the wrong thread, if at all."""
    started, done = threading.Event(), threading.Event()
    results: list[list] = []

    async def first() -> None:
        stream = llm.generate_stream("Hello", SamplingParams(max_tokens=20))
        outputs = [await anext(stream)]
        started.set()
        await asyncio.to_thread(done.wait, 10)
        results.append(outputs + await _all(stream))

    thread = threading.Thread(target=asyncio.run, args=(first(),))
    thread.start()
    try:
        assert started.wait(10)
        with pytest.raises(RuntimeError, match="another thread's event loop: use that loop"):
            asyncio.run(_all(llm.generate_stream("Hi", SamplingParams(max_tokens=3))))
    finally:
        done.set()
        thread.join(10)
    assert results[0][-1].finished and len(results[0][-1].token_ids) == 20
    assert idle(llm)


def test_shutdown_is_final_and_idempotent(model_dir, factory):
    llm = LLM(model_dir, executor=factory, block_size=4)
    llm.shutdown()
    llm.shutdown()
    assert factory.made[0].is_shut_down
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hello")
