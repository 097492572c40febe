"""The WeightTransferEngine: a worker's weights, replaced while it serves.

Three ways in, one set of rules:
- from the engine's process: start(update), load_chunk(chunk) for each chunk (shared
  memory, or CUDA IPC handles), finish();
- from a trainer through a weight-transfer group: init_group once, then
  receive_from_group(update) for each update;
- from disk: reload(path).

An update is checked whole against the model before any weight changes (WeightCatalog);
its pieces are written into this rank's slices in place. `not_ready` says why the
weights cannot serve a step: released by sleep(level=2) and not loaded since, an update
under way, or one that ended half-written. From the first two of these, only an update
that gives every weight of the rank, or a reload, makes them ready again.

A call that fails once the model's weights may have changed raises PartialLoadError (the
engine core keeps its reason, and refuses requests until a complete update or a reload):
a reload that failed after copying began; an update from the group that failed past the
ranks' agreement (every rank then refuses steps, changed or not: the others may have
changed); a chunk, or the end, of a pushed update that failed after rows of a weight had
come (every rank counts every tensor's rows, so they agree), or whose chunk failed on
this rank (the others may have taken it).
"""

from __future__ import annotations

import functools
import math

import torch

from messages import CudaWeights, ModelConfig, SharedWeights, WeightUpdate
from zmqworker.distributed.weight_group import (
    TORCH_DTYPES,
    WeightGroup,
    digest,
    pieces,
)
from zmqworker.models.dummy_weights import fill_dummy_weights
from zmqworker.models.hf_config import load_hf_config
from zmqworker.models.llama import LlamaForCausalLM
from zmqworker.models.loader import CheckpointError, PartialLoadError
from zmqworker.models.weight_names import config_differences
from zmqworker.worker.weight_transfer.catalog import WeightCatalog
from zmqworker.worker.weight_transfer.pieces import whole_parameter
from zmqworker.worker.weight_transfer.session import UpdateSession

RELEASED = (
    "the weights were released by sleep(level=2) and have not been loaded since: "
    "update or reload them before a step"
)
INTERRUPTED = (
    "an update ended before all of its tensors came, and some weights had changed: "
    "send a complete update or reload the weights before a step"
)
AFTER_CHANGES = "send a complete update or reload the weights before a step"
REFUSED_LATE = f"some weights had changed before the update was refused: {AFTER_CHANGES}"
IN_PROGRESS = "a weight update is in progress: steps wait for its end (finish_weight_update)"


class WeightTransferEngine:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig) -> None:
        self.model = model
        self.model_config = model_config
        self.device = next(model.parameters()).device
        self._not_ready: str | None = None
        self._session: UpdateSession | None = None
        self._group: WeightGroup | None = None

    @functools.cached_property
    def catalog(self) -> WeightCatalog:
        """The model's weights by checkpoint name, made at the first update (serving alone
        never needs it)."""
        return WeightCatalog(self.model)

    @property
    def not_ready(self) -> str | None:
        """Why the weights cannot serve a step now; None when they can."""
        if self._session is not None and self._session.touched:
            return IN_PROGRESS
        return self._not_ready

    def weights_released(self) -> None:
        """sleep(level=2) dropped the weights: steps wait for an update or a reload."""
        self._end_session()
        self._not_ready = RELEASED

    # from the engine's process -------------------------------------------------------

    def start(self, update: WeightUpdate) -> None:
        """Check the announcement whole; an update still open is abandoned."""
        self._end_session()
        specs = self.catalog.check(update, require_all=self._not_ready is not None)
        self._session = UpdateSession(self.catalog, specs, self.device)

    def load_chunk(self, chunk: SharedWeights | CudaWeights) -> None:
        session = self._open_session()
        try:
            if isinstance(chunk, SharedWeights):
                session.take_shared(chunk)
            elif isinstance(chunk, CudaWeights):
                session.take_cuda(chunk)
            else:
                raise TypeError(f"a weight chunk is SharedWeights or CudaWeights, not {chunk!r}")
        except Exception as exc:
            session.chunk_failed = True  # other ranks may have taken it
            if session.touched:
                raise PartialLoadError(
                    f"a chunk of the weight update failed ({type(exc).__name__}: {exc}) "
                    f"once rows of its weights had come: {AFTER_CHANGES}"
                ) from exc
            raise

    def finish(self) -> None:
        """End the update: every announced tensor must have come whole (and a tied
        model's head, if given, equal its embedding). Refused, it leaves the weights
        serving if no row of a weight came, else refusing steps (PartialLoadError)."""
        session = self._open_session()
        missing = session.missing()
        if not missing:
            session.check_head()
        if missing or session.refusal is not None:
            changed = session.touched or (bool(missing) and session.chunk_failed)
            if missing:
                more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
                why = (
                    f"the update ended without all of {len(missing)} announced tensor(s): "
                    f"{', '.join(missing[:5])}{more}"
                )
            else:
                why = f"the update is refused: {session.refusal}"
            self._end_session(changed, f"{why}; {REFUSED_LATE}")
            if changed:
                raise PartialLoadError(f"{why}; {REFUSED_LATE}")
            raise ValueError(why)
        session.wait_for_copies()
        self._session = None
        session.close()
        # Complete, and from a not-ready state it had to give every weight (start).
        self._not_ready = None

    def abort(self) -> None:
        """End the update where it is (the engine could not finish it)."""
        self._end_session()

    # from a trainer ----------------------------------------------------------------

    def init_group(
        self, host: str, port: int, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """Join a group (leaving the one it was in: a trainer starts anew)."""
        group, self._group = self._group, None
        if group is not None:
            group.close()
        self._group = WeightGroup(host, port, world_size, rank, self.device, timeout_s)

    @torch.no_grad()
    def receive_from_group(self, update: WeightUpdate) -> None:
        group = self._group
        if group is None:
            raise RuntimeError("no weight-transfer group: call init_weight_transfer_group first")
        self._end_session()
        error: Exception | None = None
        specs = {}
        try:
            specs = self.catalog.check(update, require_all=self._not_ready is not None)
        except ValueError as e:
            error = e
        count, sent = group.exchange_header(None)
        if error is None and (count, sent) != (len(update.tensors), digest(update)):
            error = ValueError(
                f"the trainer sends another update ({count} tensors) than the one announced "
                f"to the engine ({len(update.tensors)} tensors, or other names, shapes or "
                "dtypes)"
            )
        if not group.agree(error is None):
            raise error or RuntimeError(
                "another rank of the weight-transfer group refused the update; no weight "
                "has changed"
            )
        session = self._session = UpdateSession(self.catalog, specs, self.device)
        try:
            self._receive_tensors(group, session, update)
        except BaseException as exc:
            # Past the agreement every rank may have changed: all of them refuse steps.
            self._end_session(changed=True)
            if isinstance(exc, Exception):
                raise PartialLoadError(
                    f"the update from the weight-transfer group failed midway "
                    f"({type(exc).__name__}: {exc}): {INTERRUPTED}"
                ) from exc
            raise
        self.finish()

    def _receive_tensors(
        self, group: WeightGroup, session: UpdateSession, update: WeightUpdate
    ) -> None:
        """Step 3 of the exchange: each piece into its parameter's rows, when one
        parameter is exactly the tensor, else into a scratch buffer (as large as the
        largest piece) and from there into this rank's slices."""
        scratch = torch.empty(0, dtype=torch.uint8, device=self.device)
        for spec in update.tensors:
            dtype = TORCH_DTYPES[spec.dtype]
            into = whole_parameter(self.catalog.targets.get(spec.name, []), spec.shape)
            for start, rows in pieces(spec.shape, dtype.itemsize, update.piece_bytes):
                if into is not None:
                    session.touched = True
                    group.broadcast(into.data.narrow(0, start, rows))
                    session.count_rows(spec.name, start, rows)
                    continue
                shape = [rows, *spec.shape[1:]]
                nbytes = math.prod(shape) * dtype.itemsize
                if scratch.numel() < nbytes:
                    scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                piece = scratch[:nbytes].view(dtype).view(shape)
                group.broadcast(piece)
                session.take(spec.name, start, piece)

    # from disk ---------------------------------------------------------------------

    @torch.no_grad()
    def reload(self, path: str | None) -> None:
        """The checkpoint the worker started with (path None), or another of the same
        architecture and sizes; every name and shape checked before a weight changes."""
        self._end_session()
        config = self.model_config
        if path is None and config.load_format == "dummy":
            fill_dummy_weights(self.model, config.seed)
        else:
            folder = path or config.path
            if folder != config.path:
                diffs = config_differences(self.model.hf_config, load_hf_config(folder))
                if diffs:
                    raise CheckpointError(
                        f"checkpoint {folder} is not of this model's architecture and sizes: "
                        + "; ".join(diffs)
                    )
            try:
                self.model.load_weights(folder)  # copies from host memory: done on return
            except (ValueError, FileNotFoundError):  # CheckpointError too: refused from the
                raise  # headers and config.json, as every rank refuses them: none changed
            except Exception as exc:  # some weights may be the new ones, here or elsewhere
                what = str(exc) if isinstance(exc, PartialLoadError) else (
                    f"reloading checkpoint {folder} failed on this rank "
                    f"({type(exc).__name__}: {exc}); other ranks may have loaded it"
                )  # fmt: skip
                reason = f"{what}: {AFTER_CHANGES}"
                self._not_ready = self._not_ready or reason
                raise PartialLoadError(reason) from exc
        self._not_ready = None

    def shutdown(self) -> None:
        """Leave the group and drop any update in progress; safe to call twice."""
        self._end_session()
        group, self._group = self._group, None
        if group is not None:
            group.close()

    # helpers -----------------------------------------------------------------------

    def _open_session(self) -> UpdateSession:
        if self._session is None:
            raise RuntimeError("no weight update in progress: call start_weight_update first")
        return self._session

    def _end_session(self, changed: bool | None = None, reason: str = INTERRUPTED) -> None:
        """Drop the update in progress; if weights may have changed (changed, by default
        whether rows of a weight came), steps are refused, for reason, until a complete
        update or a reload."""
        session, self._session = self._session, None
        if session is not None:
            session.close()
            if session.touched if changed is None else changed:
                self._not_ready = self._not_ready or reason
