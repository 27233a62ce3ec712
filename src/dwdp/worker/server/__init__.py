"""The OpenAI-compatible HTTP server of one rank (FastAPI on uvicorn).

``protocol`` holds the request and response schemas, ``serving`` the serving class that turns
requests into engine calls, ``metrics`` the Prometheus collectors, ``status`` what the server
reads about DWDP, ``app`` the routers (short: take the handler from app state, await it, map
the result) and ``run`` the uvicorn lifecycle with its graceful-shutdown bound.
"""
