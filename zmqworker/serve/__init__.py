"""An OpenAI-compatible HTTP server over the reference engine (zmqworker serve): a main
process (server.py) that supervises the engine cores and the API server processes
(api_server.py), each running the FastAPI application (app.py) as a client of every
engine core."""
