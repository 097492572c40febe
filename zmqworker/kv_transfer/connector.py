"""The worker side of a KV connector, after vLLM v1's KVConnectorBase_V1 (whose
scheduler side is the engine's, zmqworker/engine/kv_connector.py).

Made in the worker's initialize_from_config, once the cache exists (it learns the
layout: layers, blocks, bytes per block, the tp rank); shut down first. Around each
step: before_step starts the step's loads and copies in those that arrived, after_step
stages the KV of the prefills the step finished; take_output says what ended since the
last report, for the step's output. Every hook runs on the worker's thread, the only
one that touches the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from messages.kv_transfer import KVConnectorMetadata, KVConnectorOutput


class KVConnector(ABC):
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
