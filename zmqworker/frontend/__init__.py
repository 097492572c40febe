"""The client side of the engine: what runs in the process of a caller (the LLM, an API
server) and talks to engine core processes over ZeroMQ. Tokenization, detokenization,
stop strings, streams, the outputs' assembly and balancing over data-parallel replicas
live here; the scheduler and the workers live in the engine cores (zmqworker/engine/).

May import: everything up to zmqworker.engine.
"""
