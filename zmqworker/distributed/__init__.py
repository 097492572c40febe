"""Parallel layouts across ranks: the process groups of tensor, pipeline and expert
parallelism and their collectives, the pipeline channel between stages (frames or a shared-memory
ring) and a stage's view of it.

Nothing is imported here, so that a worker process can bind its pipeline receiver without
torch (a stand-in worker never imports it): import the module you need
(parallel_state.py for the process groups).

May import: messages, zmqworker.transport, zmqworker.attention, zmqworker.cdiv.
"""
