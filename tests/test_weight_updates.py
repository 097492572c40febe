"""Live weight updates and sleep mode against real worker processes, at three layouts:
a transformers copy of the model is perturbed and pushed in each way (from this process
through shared memory, from a trainer process through the gloo group, from a saved
folder), and greedy tokens equal transformers' with the new weights; the old weights
come back the same ways. Bad updates change nothing; sleep cycles keep the tokens."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from messages import CachedRequestData, SamplingParams, SchedulerOutput
from tests.engine_helpers import byte_level_tokenizer
from tests.tiny import cached_tiny_checkpoint
from tests.weight_trainer import perturb
from zmqworker.distributed.weight_group import describe
from zmqworker.distributed.weight_segment import WeightSegment
from zmqworker.frontend.errors import EngineCoreError
from zmqworker.frontend.llm import LLM

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 1], [200, 201, 7, 7, 31]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEED = 11
# (tp, pp, tied embeddings): a tied model's last stage takes the embedding for its head.
LAYOUTS = [(1, 1, False), (1, 2, True), (2, 1, False)]


@functools.cache
def checkpoint(tied: bool) -> str:
    path = cached_tiny_checkpoint(
        family="llama", num_layers=4, vocab_size=320, tie_word_embeddings=tied
    )
    if not Path(path, "tokenizer.json").exists():
        byte_level_tokenizer().save_pretrained(path)
    return path


@functools.cache
def hf_model(tied: bool, seed: int | None) -> transformers.PreTrainedModel:
    """The checkpoint in transformers; moved by perturb(seed) unless seed is None."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(tied), dtype=torch.float32)
    if seed is not None:
        perturb(model, seed)
    return model.eval()


@functools.cache
def hf_tokens(tied: bool, seed: int | None) -> list[list[int]]:
    model, out = hf_model(tied, seed), []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=PARAMS.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(gen[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"tp{p[0]}-pp{p[1]}")
def layout(request):
    tp, pp, tied = request.param
    llm = LLM(
        model=checkpoint(tied),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=24,
        kv_cache_bytes=1 << 20,
        enable_prefix_caching=True,  # an update must not reuse KV of the old weights
        worker_extension_cls="bench.echo_worker.EchoExtension",
    )
    with llm:
        yield llm, tied


def tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """A trainer process that loads hf_model(tied, seed)'s weights from a file. Started
    on entering, ahead of its push: its seconds of importing torch overlap the test's
    other steps. push() has it join a new group with the workers and send them."""

    def __init__(
        self, llm: LLM, tied: bool, seed: int, bad_shape: bool = False, mode: str = ""
    ) -> None:
        self.weights = list(hf_model(tied, seed).named_parameters())
        self.bad_shape = bad_shape
        self.port, self.world = free_port(), 1 + llm.num_workers
        self.folder = tempfile.TemporaryDirectory(prefix="zmqworker-trainer-")
        saved = Path(self.folder.name, "weights.pt")
        torch.save([(name, param.detach()) for name, param in self.weights], saved)
        argv = [sys.executable, "-m", "tests.weight_trainer", str(saved), str(self.port)]
        argv += [str(self.world), *(["--bad-shape"] if bad_shape else [])]
        argv += [f"--{mode}"] if mode else []
        self.process = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:  # a test that failed before its push
            self.process.kill()
            self.process.communicate()
        self.folder.cleanup()

    def push(self, llm: LLM) -> tuple[int, Exception | None]:
        """The trainer's exit status, and what update_weights_from_group raised."""
        weights, error = list(self.weights), None
        try:
            llm.init_weight_transfer_group(
                "127.0.0.1", self.port, self.world, rank_offset=1, timeout_s=60.0
            )
            if self.bad_shape:
                weights[0] = (weights[0][0], weights[0][1][1:])
            llm.update_weights_from_group(describe(weights, piece_bytes=4096))
        except ValueError as e:
            error = e
        finally:
            _, err = self.process.communicate(timeout=120)
        if self.process.returncode not in (0, 3):
            raise AssertionError(f"the trainer failed: {err[-2000:]}")
        return self.process.returncode, error


def test_each_way_in_gives_the_new_weights_and_the_old_come_back(layout, tmp_path):
    llm, tied = layout
    old, new = hf_tokens(tied, None), hf_tokens(tied, SEED)
    assert old != new
    assert tokens(llm) == old
    with Trainer(llm, tied, SEED) as trainer:
        # From this process, through shared memory; a tied model's state_dict carries the
        # head under its own name too.
        llm.update_weights(hf_model(tied, SEED).state_dict().items(), chunk_bytes=8192)
        assert tokens(llm) == new
        llm.reload_weights()  # the checkpoint it started with
        assert tokens(llm) == old
        # From a trainer process, through the gloo group.
        assert trainer.push(llm) == (0, None)
    assert tokens(llm) == new
    # From a folder of the same architecture.
    llm.update_weights(hf_model(tied, None).named_parameters())
    assert tokens(llm) == old
    hf_model(tied, SEED).save_pretrained(tmp_path)
    llm.reload_weights(str(tmp_path))
    assert tokens(llm) == new
    # Pushed in chunks of a size that is not a multiple of the segments' alignment: its
    # plan used to grow without end.
    llm.update_weights(hf_model(tied, None).named_parameters(), chunk_bytes=1000)
    assert tokens(llm) == old


def edited_folder(folder: Path, tied: bool, edit) -> str:
    """hf_model(tied, SEED) saved in folder, its tensors through edit(dict)."""
    hf_model(tied, SEED).save_pretrained(folder)
    file = next(folder.glob("*.safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(folder)


def test_a_folder_that_one_rank_cannot_load_is_refused_by_every_rank(layout, tmp_path):
    """Each rank checked only its own tensors: at pp=2 the first stage loaded its new
    layers from a folder whose last layer the second refused, and served a model that
    was neither. Every rank now checks the whole model's, and every rank refuses."""
    llm, tied = layout
    old = hf_tokens(tied, None)
    last = "model.layers.3.mlp.down_proj.weight"  # the last stage's
    folders = {
        rf"lacks tensor\(s\): {last}": lambda t: t.pop(last),
        rf"{last} in checkpoint .* has shape \[64, 127\]": lambda t: t.update(
            {last: t[last][:, :-1].contiguous()}
        ),
    }
    if tied:  # the first stage holds no head: it compared none
        folders["holds a lm_head.weight that differs"] = lambda t: t.update(
            {"lm_head.weight": t["model.embed_tokens.weight"] + 1}
        )
    for k, (reason, edit) in enumerate(folders.items()):
        folder = edited_folder(tmp_path / str(k), tied, edit)
        with pytest.raises(ValueError, match=reason):
            llm.reload_weights(folder)
        assert llm.not_ready() is None
        assert tokens(llm) == old, reason


def test_a_tied_head_in_an_update_must_equal_the_embedding(layout):
    """A tied model's lm_head.weight used to be taken and ignored whatever it held (a
    checkpoint's is refused when it differs): now it must equal the embedding."""
    llm, tied = layout
    if not tied:
        pytest.skip("the model has a head of its own")
    old, new = hf_tokens(tied, None), hf_tokens(tied, SEED)
    embedding = dict(hf_model(tied, None).named_parameters())["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="tensor lm_head.weight differs from model.embed_tok"):
        llm.update_weights([("lm_head.weight", embedding.detach() + 1)])
    assert llm.not_ready() is None and tokens(llm) == old
    llm.update_weights([("lm_head.weight", embedding.detach())])  # the embedding it holds
    # The head before the embedding it must equal, in small chunks: compared at the end.
    state = hf_model(tied, SEED).state_dict()
    head_first = {"lm_head.weight": state["lm_head.weight"], **state}
    llm.update_weights(head_first.items(), chunk_bytes=8192)
    assert tokens(llm) == new
    llm.reload_weights()


def test_an_update_cut_short_leaves_the_engine_not_ready_until_a_whole_one(layout, monkeypatch):
    """The workers refused steps after an update that ended half-written, but the
    engine said it was ready (an API server let requests in, each failing a step)."""
    llm, tied = layout
    old = hf_tokens(tied, None)
    write, written = WeightSegment.write, []

    def failing(segment, offset, rows):
        if len(written) == 5:
            raise OSError("the caller's memory went away")
        written.append(offset)
        write(segment, offset, rows)

    monkeypatch.setattr(WeightSegment, "write", failing)
    with pytest.raises(OSError, match="went away"):
        llm.update_weights(hf_model(tied, SEED).named_parameters(), chunk_bytes=8192)
    monkeypatch.undo()
    reason = llm.not_ready()
    assert reason is not None and "without all of" in reason and "before a step" in reason
    with pytest.raises(EngineCoreError, match="without all of"):
        tokens(llm)
    llm.update_weights(hf_model(tied, None).named_parameters())
    assert llm.not_ready() is None and tokens(llm) == old
    if llm.num_workers > 1:
        return
    # A trainer killed mid-send (SIGKILL): the workers fail at once, and say why.
    with Trainer(llm, tied, SEED, mode="kill") as trainer:
        llm.init_weight_transfer_group(
            "127.0.0.1", trainer.port, trainer.world, rank_offset=1, timeout_s=60.0
        )
        with pytest.raises(RuntimeError, match="failed midway"):
            llm.update_weights_from_group(describe(trainer.weights, piece_bytes=4096))
        assert trainer.process.wait(60) == -9
    reason = llm.not_ready()
    assert reason is not None and "an update ended before all of its tensors came" in reason
    llm.update_weights(hf_model(tied, None).named_parameters())
    assert llm.not_ready() is None and tokens(llm) == old


def test_bad_updates_change_nothing(layout, tmp_path):
    llm, tied = layout
    old = hf_tokens(tied, None)
    good = list(hf_model(tied, SEED).named_parameters())
    name, first = good[0]
    bad = {
        "is not a weight of this model": [*good[1:], ("model.layers.9.mlp.up_proj.weight", first)],
        "has shape": [*good[1:], (name, first[:-1])],
        "is bfloat16, the model's weights are float32": [*good[1:], (name, first.bfloat16())],
        "comes twice": [*good, good[1]],
    }
    for reason, weights in bad.items():
        with pytest.raises(ValueError, match=reason):
            llm.update_weights(weights)
        assert tokens(llm) == old, reason
    if llm.worker_config.parallel.world_size == 1:  # the same refusal at every layout
        with Trainer(llm, tied, SEED, bad_shape=True) as trainer:
            status, error = trainer.push(llm)
        assert status == 3 and "model.embed_tokens.weight has shape" in str(error)
        assert tokens(llm) == old
        # Tensors that differ from what the engine was told: the sender refuses them
        # through the group (the workers waited out its timeout, and it was broken), and
        # the right ones go over the same group. Then a send that fails halfway closes
        # the group: the workers fail at once, and refuse steps until a reload.
        with Trainer(llm, tied, SEED, mode="differ-then-fail") as trainer:
            llm.init_weight_transfer_group(
                "127.0.0.1", trainer.port, trainer.world, rank_offset=1, timeout_s=60.0
            )
            update = describe(trainer.weights, piece_bytes=4096)
            with pytest.raises(RuntimeError, match="another rank .* refused the update"):
                llm.update_weights_from_group(update)  # not the group's timeout
            assert tokens(llm) == old
            llm.update_weights_from_group(update)
            assert tokens(llm) == hf_tokens(tied, SEED)
            with pytest.raises(RuntimeError, match="(?i)closed|reset"):
                llm.update_weights_from_group(update)
            assert trainer.process.wait(60) == 5
        with pytest.raises(EngineCoreError, match="before a step"):
            tokens(llm)
        llm.reload_weights()
    other = cached_tiny_checkpoint(family="llama", num_layers=2, vocab_size=320)
    with pytest.raises(ValueError, match="num_hidden_layers: 4 vs 2"):
        llm.reload_weights(other)
    assert tokens(llm) == old


def test_sleep_and_wake_cycles_keep_generating(layout):
    llm, tied = layout
    old, new = hf_tokens(tied, None), hf_tokens(tied, SEED)
    for _ in range(2):
        llm.sleep(1)
        assert llm.is_sleeping
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(PROMPTS, PARAMS)
        llm.wake_up(["kv_cache"])
        assert llm.is_sleeping
        llm.wake_up(["weights"])
        assert not llm.is_sleeping
        assert tokens(llm) == old
    # Level 2 keeps no copy: the weights come back as memory only.
    llm.sleep(2)
    llm.wake_up()
    assert not llm.is_sleeping
    with pytest.raises(RuntimeError, match=r"released by sleep\(level=2\)"):
        llm.generate(PROMPTS, PARAMS)
    # The workers refuse a step too, whatever engine sends it: through collective_rpc,
    # which reaches the allowlist and the extension's methods, and nothing else.
    world = llm.worker_config.parallel.world_size
    assert llm.collective_rpc("echo", ("hi",)) == ["hi"] * world
    with pytest.raises(EngineCoreError, match="not callable over RPC"):
        llm.collective_rpc("_runner")
    empty = SchedulerOutput([], CachedRequestData.empty(), 0)
    with pytest.raises(RuntimeError, match=r"released by sleep\(level=2\)"):  # a refusal
        llm.collective_rpc("execute_model", (empty,))
    with pytest.raises(ValueError, match="must give all of them"):
        llm.update_weights(list(hf_model(tied, SEED).named_parameters())[1:])
    llm.update_weights(hf_model(tied, SEED).named_parameters())
    assert tokens(llm) == new
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.reload_weights()
    llm.wake_up(["kv_cache"])
    assert tokens(llm) == old


def memfds(pid: int | str) -> list[str]:
    """The weight segments a process holds open or mapped."""
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own, closed since
            fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [x for x in fds + maps if "zmqworker-weights" in x]


def test_no_shared_memory_is_left_behind(layout):
    """Last in the file: it shuts the layout's LLM down."""
    llm, tied = layout
    shm_before = set(os.listdir("/dev/shm"))
    llm.update_weights(hf_model(tied, None).named_parameters(), chunk_bytes=8192)
    assert shm_before == set(os.listdir("/dev/shm"))  # nothing named, ever
    workers = llm.worker_pids
    assert all(memfds(pid) == [] for pid in workers)  # unmapped at the update's end
    assert memfds("self")  # the engine keeps its two segments for the next update
    llm.shutdown()
    assert memfds("self") == []
