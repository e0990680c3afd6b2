"""An OpenAI-compatible HTTP server over the continuous-batching engine.

`service.py` runs the engine in one background thread and bridges requests to asyncio;
`textstream.py` turns token pieces into safe text and applies stop strings; `choices.py` makes
one answer of them, with its tokens' log-probabilities; `protocol.py` holds the OpenAI shapes;
`app.py` the FastAPI routes; `guard.py` what a request passes before them (its API key, its
body's size); `server.py` the uvicorn server and its shutdown; `metrics.py` Prometheus;
`__main__.py` the command line (`python -m jetflow_jax.serve`).
"""

from jetflow_jax.serve.app import create_app
from jetflow_jax.serve.server import Server
from jetflow_jax.serve.service import Service

__all__ = ["Server", "Service", "create_app"]
