"""The previous pipeline stage's tensors for a step, checked and on this rank's device.

They are waited for and checked whole before the step changes the batch: a step whose
tensors never come (the previous stage refused it: its refusal comes instead) or do not fit
(token count, hidden size, dtype) is refused and leaves the batch as it was, as the
previous stage's batch is.
"""

from __future__ import annotations

import torch

from messages import IntermediateTensors, SchedulerOutput
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.distributed.pp_channel import PendingTensors

HiddenStates = dict[str, torch.Tensor]
NAMES = ("hidden_states", "residual")


def intermediate_inputs(
    intermediate: IntermediateTensors | PendingTensors | None,
    so: SchedulerOutput,
    state: ParallelState,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> HiddenStates | None:
    """The previous stage's tensors on this device (copied: decoded message memory is
    read-only), each [tokens, hidden_size] in dtype; waited for when still pending (a
    TimeoutError if they never come). A step that computes nothing has none."""
    if state.is_first_stage:
        if intermediate is not None:
            raise ValueError("the first pipeline stage takes no intermediate tensors")
        return None
    if so.total_num_scheduled_tokens == 0:
        return None
    if isinstance(intermediate, PendingTensors):
        intermediate = intermediate.wait()
    if intermediate is None:
        raise ValueError(
            f"pipeline stage {state.pp_rank} needs the previous stage's intermediate tensors"
        )
    names = intermediate.tensors.keys()
    missing, unknown = set(NAMES) - names, names - set(NAMES)
    if missing or unknown:
        raise ValueError(
            f"intermediate tensors must be {list(NAMES)}: {sorted(missing)} missing, "
            f"{sorted(unknown)} unknown"
        )
    shape = (so.total_num_scheduled_tokens, hidden_size)
    for name in NAMES:
        tensor = intermediate.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"intermediate tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{shape[0]} tokens of hidden size {hidden_size}"
            )
        if tensor.dtype != dtype:
            raise ValueError(
                f"intermediate tensor {name!r} has dtype {tensor.dtype}, expected the "
                f"model's {dtype}"
            )
    return {name: _on_device(intermediate.tensors[name], device) for name in NAMES}


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of tensor on device; from host memory to CUDA through pinned memory, so the
    copy does not make the host wait."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, copy=True)
