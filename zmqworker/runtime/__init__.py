"""The worker process: its event loop, its sockets and how it serves RPCs."""
