"""The transport floor: ZeroMQ sockets and the wake-ups around them, below everything.

Multipart frames without pyzmq's sugar (frames.py), a socket driven by an asyncio loop
(async_socket.py), a pipe that wakes a thread out of a poll (wake_pipe.py), the nudge that
wakes a thread blocked in a ROUTER's receive (nudge.py), and the names a spawned worker
reads from its environment (spawn_env.py). Imports messages at most, nothing of zmqworker.
"""
