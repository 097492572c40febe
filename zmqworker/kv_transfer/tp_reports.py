"""The tp ranks' KV connector reports, combined: only the output rank's step output
reaches the engine, so every rank's transfers must be in it. A transfer is reported once
every rank has reported it; a failed load as soon as any rank has failed it.

The ranks exchange their reports (msgspec bytes in a tensor: no pickle crosses a
process) in every step that has a transfer outstanding. Whether one is outstanding is
decided from what every rank holds alike, the orders the steps carried and the reports
the engine got, so all ranks join the exchange in the same steps.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from messages.kv_transfer import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVFailure,
)
from zmqworker.kv_transfer.connector import KVConnector

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(KVConnectorOutput).decode


class TPCombined(KVConnector):
    def __init__(self, inner: KVConnector, group: dist.ProcessGroup, device: torch.device):
        self.inner = inner
        self._group = group
        self._device = device
        self._size = dist.get_world_size(group)
        self._outstanding: set[tuple[str, str]] = set()  # ("send" | "recv", req_id)
        self._sent: set[str] = set()  # this rank's, not reported by all yet
        self._recved: set[str] = set()
        self._failed: dict[str, str] = {}

    @property
    def served(self) -> frozenset[str]:
        return self.inner.served

    def cancel(self, metadata: KVConnectorMetadata) -> None:
        """Every rank gets the same cancels, so they stay in step: a cancelled load is
        forgotten (reported by no rank any more; one sent again under its id must be
        copied by every rank anew), and a withdrawn save is outstanding until every rank
        reports it sent (the engine frees its blocks then, even where no step staged it)."""
        self.inner.cancel(metadata)
        for req_id in metadata.cancel_loads:
            self._outstanding.discard(("recv", req_id))
            self._recved.discard(req_id)
            self._failed.pop(req_id, None)
        self._outstanding.update(("send", name) for name in metadata.cancel_saves)

    def before_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is not None:
            self._outstanding.update(("send", s.req_id) for s in metadata.saves)
            self._outstanding.update(("recv", load.req_id) for load in metadata.loads)
        self.inner.before_step(metadata)

    def after_step(self, metadata: KVConnectorMetadata | None) -> None:
        self.inner.after_step(metadata)

    def take_output(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        local = self.inner.take_output(wait_s)
        if local is not None:
            self._sent.update(local.finished_sending)
            self._recved.update(local.finished_recving)
            self._failed.update((f.req_id, f.error) for f in local.failed_recving)
        if not self._outstanding:
            return None
        mine = KVConnectorOutput(
            sorted(self._sent),
            sorted(self._recved),
            [KVFailure(r, e) for r, e in sorted(self._failed.items())],
        )
        ranks = self._all_gather(mine)
        sent = set.intersection(*(set(r.finished_sending) for r in ranks))
        failed = {f.req_id: f.error for r in ranks for f in r.failed_recving}
        recved = set.intersection(*(set(r.finished_recving) for r in ranks)) - failed.keys()
        self._sent -= sent
        self._recved -= recved | failed.keys()
        for req_id in failed:
            self._failed.pop(req_id, None)
        self._outstanding -= {("send", r) for r in sent}
        self._outstanding -= {("recv", r) for r in recved | failed.keys()}
        combined = KVConnectorOutput(
            sorted(sent), sorted(recved), [KVFailure(r, e) for r, e in sorted(failed.items())]
        )
        return combined if combined else None

    def shutdown(self) -> None:
        self.inner.shutdown()

    def _all_gather(self, mine: KVConnectorOutput) -> list[KVConnectorOutput]:
        data = torch.frombuffer(bytearray(_encode(mine)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self._device)
        sizes = [torch.empty_like(size) for _ in range(self._size)]
        dist.all_gather(sizes, size, group=self._group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self._device)
        padded[: data.numel()] = data.to(self._device)
        gathered = [torch.empty_like(padded) for _ in range(self._size)]
        dist.all_gather(gathered, padded, group=self._group)
        return [
            _decode(g[: int(s.item())].cpu().numpy().tobytes())
            for g, s in zip(gathered, sizes, strict=True)
        ]
