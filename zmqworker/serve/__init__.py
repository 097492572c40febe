"""An OpenAI-compatible HTTP server over the reference engine (zmqworker serve)."""

from zmqworker.serve.server import serve

__all__ = ["serve"]
