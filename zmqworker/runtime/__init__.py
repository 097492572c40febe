"""The worker process: its command line, its event loop and compute thread, its socket
to the engine, and how it notices that the engine is gone. `python -m zmqworker.runtime`
runs one.

May import: everything up to zmqworker.worker.
"""
