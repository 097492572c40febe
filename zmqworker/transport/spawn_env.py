"""What an engine hands a worker it spawns through the environment, not the command
line (which every local user can read in ps)."""

TOKEN_ENV = "ZMQWORKER_TOKEN"  # the handshake token of the worker's Hello
