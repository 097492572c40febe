"""The worker side of a KV connector, after vLLM v1's KVConnectorBase_V1 (whose
scheduler side is the engine's, zmqworker/engine/kv_connector.py).

Made in the worker's initialize_from_config, once the cache exists (it learns the
layout: layers, blocks, bytes per block, the tp rank); shut down first. Around each
step: cancel applies the step's cancels as soon as the step arrives, before_step starts
its loads and copies in those that arrived once the step is checked whole, after_step
stages the KV of the prefills the step finished; take_output says what ended since the
last report, for the step's output. Every hook runs on the worker's thread, the only
one that touches the cache. A step with orders of a kind no connector of the worker
serves is refused before anything of it is done (take_orders).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from messages.kv_transfer import KVConnectorMetadata, KVConnectorOutput


class KVConnector(ABC):
    @property
    @abstractmethod
    def served(self) -> frozenset[str]:
        """The KVConnectorMetadata fields this connector carries out."""

    @abstractmethod
    def cancel(self, metadata: KVConnectorMetadata) -> None:
        """Apply the step's cancel_loads and cancel_saves: before the step is checked, so
        that they stand even if the worker refuses the rest of it."""

    @abstractmethod
    def before_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Start the step's loads; copy into the cache the loads that have arrived."""

    @abstractmethod
    def after_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Stage the step's saves (their tokens are computed now)."""

    @abstractmethod
    def take_output(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        """What ended since the last call (None: nothing); with transfers under way and
        nothing to report, waits up to wait_s for one to end."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop serving and pulling; staged KV and sockets go. Safe to call twice."""

    @property
    def num_cache_readers(self) -> int:
        """Requests whose KV a transfer will still read out of the live cache (staged
        and not yet taken): the cache must not be released under them."""
        return 0


class KVConnectors(KVConnector):
    """Several connectors as one (the host tier's and the transfer's): each hook calls
    them in order, and their reports are merged."""

    def __init__(self, connectors: list[KVConnector]) -> None:
        self.connectors = connectors

    @property
    def served(self) -> frozenset[str]:
        return frozenset().union(*(connector.served for connector in self.connectors))

    def cancel(self, metadata: KVConnectorMetadata) -> None:
        for connector in self.connectors:
            connector.cancel(metadata)

    def before_step(self, metadata: KVConnectorMetadata | None) -> None:
        for connector in self.connectors:
            connector.before_step(metadata)

    def after_step(self, metadata: KVConnectorMetadata | None) -> None:
        for connector in self.connectors:
            connector.after_step(metadata)

    def take_output(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        merged = KVConnectorOutput()
        for connector in self.connectors:
            output = connector.take_output(wait_s)
            if output is not None:
                merged.finished_sending += output.finished_sending
                merged.finished_recving += output.finished_recving
                merged.failed_recving += output.failed_recving
        return merged if merged else None

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()

    @property
    def num_cache_readers(self) -> int:
        return sum(connector.num_cache_readers for connector in self.connectors)


def take_orders(metadata: KVConnectorMetadata, connector: KVConnector | None) -> None:
    """A step's KV orders as the step arrives, before the worker checks the rest of it:
    refused whole if any is of a kind no connector of this worker serves (dropped, it
    would leave the engine waiting on a transfer that never starts, or its host tier's
    index naming slots that hold nothing); else their cancels applied at once, so that
    they stand even if the worker refuses the step."""
    served = frozenset() if connector is None else connector.served
    given = [name for name in metadata.__struct_fields__ if getattr(metadata, name)]
    unserved = ", ".join(name for name in given if name not in served)
    if unserved and connector is None:
        raise ValueError(f"KV orders for a worker without KV transfer or a host tier: {unserved}")
    if unserved:
        raise ValueError(
            f"KV orders this worker's connector does not serve: {unserved} "
            f"(it serves {', '.join(sorted(served))})"
        )
    if connector is not None:
        connector.cancel(metadata)
