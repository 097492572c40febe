"""The previous pipeline stage's tensors for a step, checked and on this rank's device."""

from __future__ import annotations

import torch

from messages import IntermediateTensors, SchedulerOutput
from zmqworker.distributed.parallel_state import ParallelState

HiddenStates = dict[str, torch.Tensor]


def intermediate_inputs(
    intermediate: IntermediateTensors | None,
    so: SchedulerOutput,
    state: ParallelState,
    device: torch.device,
) -> HiddenStates | None:
    """The previous stage's tensors on this device (copied: decoded message memory is
    read-only), checked against the step's token count before the step changes state."""
    if state.is_first_stage:
        if intermediate is not None:
            raise ValueError("the first pipeline stage takes no intermediate tensors")
        return None
    if so.total_num_scheduled_tokens == 0:
        return None
    if intermediate is None:
        raise ValueError(
            f"pipeline stage {state.pp_rank} needs the previous stage's intermediate tensors"
        )
    missing = {"hidden_states", "residual"} - intermediate.tensors.keys()
    if missing:
        raise ValueError(f"intermediate tensors lack {sorted(missing)}")
    tensors = {}
    for name, tensor in intermediate.tensors.items():
        if tensor.dim() < 1 or tensor.shape[0] != so.total_num_scheduled_tokens:
            raise ValueError(
                f"intermediate tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{so.total_num_scheduled_tokens} tokens"
            )
        tensors[name] = _on_device(tensor, device)
    return tensors


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of tensor on device; from host memory to CUDA through pinned memory, so the
    copy does not make the host wait."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, copy=True)
