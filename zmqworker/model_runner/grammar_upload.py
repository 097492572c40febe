"""The CUDA step's way for a grammar bitmask to the device: buffers that live as long as
the runner, so that a step allocates nothing. Pinning fresh host memory every step (what
a plain pin_memory() does while the previous step's copy is still queued behind a
forward) costs the sampling call milliseconds of host time, and the step waits for it."""

from __future__ import annotations

import numpy as np
import torch

from zmqworker.cdiv import cdiv


class BitmaskUpload:
    """A host buffer (pinned on CUDA) and a device buffer of [max_rows, 1 + words] int32:
    column 0 is the logits row a bitmask row applies to, the rest its words. The host
    buffer is written again only once the previous copy has read it."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.words = cdiv(vocab, 32)
        pinned = device.type == "cuda"
        shape = (max_rows, 1 + self.words)
        self._host = torch.zeros(shape, dtype=torch.int32, pin_memory=pinned)
        self._device = torch.zeros(shape, dtype=torch.int32, device=device)
        self._uploaded: torch.cuda.Event | None = None

    def upload(self, rows: np.ndarray, bitmask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's (logits rows int32 [n], words int32 [n, words]) for rows (int [n])
        and bitmask (int32 [n, <= words]: a narrower one bans the tokens it lacks)."""
        n, width = bitmask.shape
        if n > self.max_rows or width > self.words or len(rows) != n:
            raise ValueError(
                f"a bitmask of shape {bitmask.shape} for {len(rows)} rows does not fit "
                f"[{self.max_rows}, {self.words}]"
            )
        if self._uploaded is not None:
            self._uploaded.synchronize()
        host = self._host.numpy()
        host[:n, 0] = rows
        host[:n, 1 : 1 + width] = bitmask
        host[:n, 1 + width :] = 0
        device = self._device[:n]
        if self._device.device.type == "cuda":
            device.copy_(self._host[:n], non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        else:
            device.copy_(self._host[:n])
        return device[:, 0], device[:, 1:]
