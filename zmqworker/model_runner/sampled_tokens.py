"""Where a sampling step's ids go: to the host, into the token table, and (Triton path)
into the next step's inputs on the device.

The host copy is asynchronous on CUDA (pinned memory, non_blocking, an event after it);
the ids reach the batch's token table once it has landed, while the next step, if it
comes first, reads them on the device (DeviceInputs.sampled and the token feed). A batch
row's position counter moves at once, so the next step is validated against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zmqworker.model_runner.device_inputs import TokenFeed
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.model_runner.sampler import SamplerOutput

# Host copies of (logprob token ids, logprobs, sampled token ranks).
HostLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Samples:
    """One sampling step's ids: batch rows and the positions they fill, in sample order."""

    rows: np.ndarray  # int64 [n]
    positions: np.ndarray  # int32 [n]
    tenures: np.ndarray  # int64 [n]: the rows' InputBatch.tenures, to tell a reused row
    host_ids: torch.Tensor  # int32 [n], pinned on CUDA
    event: torch.cuda.Event | None  # recorded after the host copy; None: already there
    written: bool = False  # in the token table


def to_host(
    sampled: SamplerOutput, stream: torch.cuda.Stream | None
) -> tuple[torch.Tensor, HostLogprobs | None, torch.cuda.Event | None]:
    """The sampled ids and logprobs on the host: copies without a stream (CPU: the ids
    may sit in the token feed's buffer, which the next step overwrites before its
    engine reads this one's output, under async scheduling); on CUDA through
    non_blocking copies into pinned memory, with an event after them."""
    tensors = [sampled.sampled_token_ids]
    if sampled.logprobs is not None:
        assert sampled.logprob_token_ids is not None and sampled.sampled_token_ranks is not None
        tensors += [sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_token_ranks]
    if stream is None:
        host, event = [t.clone() for t in tensors], None
    else:
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(host, tensors, strict=True):
            h.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    logprobs = (host[1], host[2], host[3]) if len(host) == 4 else None
    return host[0], logprobs, event


def record_samples(
    batch: InputBatch, rows: np.ndarray, host_ids: torch.Tensor, event: torch.cuda.Event | None
) -> Samples:
    """Claim each row's next position for its sample; the ids follow (write_samples)."""
    positions = batch.claim_positions(rows)
    return Samples(rows, positions, batch.tenures[rows].copy(), host_ids, event)


def write_samples(batch: InputBatch, samples: Samples | None, wait: bool) -> None:
    """Put the samples into the token table once their copy has landed (or wait for it),
    in the rows that still hold their request (another's prompt may be there now)."""
    if samples is None or samples.written:
        return
    if samples.event is not None:
        if not wait and not samples.event.query():
            return
        samples.event.synchronize()
    held = _held(batch, samples)
    ids = samples.host_ids.numpy()
    batch.token_ids[samples.rows[held], samples.positions[held]] = ids[held]
    samples.written = True


def token_feed(batch: InputBatch, samples: Samples | None) -> TokenFeed | None:
    """The samples whose rows still hold their request (a row freed and taken by another
    request since must not be fed the old request's token)."""
    if samples is None:
        return None
    same = _held(batch, samples)
    if not same.any():
        return None
    index = np.flatnonzero(same)
    return TokenFeed(samples.rows[index], samples.positions[index], index)


def _held(batch: InputBatch, samples: Samples) -> np.ndarray:
    """bool [n]: the sample's row still holds the request it sampled for."""
    return batch.tenures[samples.rows] == samples.tenures
