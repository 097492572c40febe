"""The engine's side of a set of workers: the Executor interface, MultiprocExecutor
(worker processes on this machine) and RayExecutor (Ray actors), the RPC client over the
engine's ROUTER socket, the handshake, and the errors an engine sees.

May import: everything up to zmqworker.runtime (a Ray actor runs a worker server).
"""
