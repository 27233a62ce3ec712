"""Shared fixtures of the worker unit tests."""

from __future__ import annotations

import threading
import time

import pytest


class UvicornThread:
    """uvicorn in a thread on 127.0.0.1 and an OS-chosen free port."""

    def __init__(self, app, **kwargs) -> None:
        import uvicorn

        from dwdp.worker.server.run import uvicorn_kwargs

        config = uvicorn.Config(app, **uvicorn_kwargs(host="127.0.0.1", port=0, **kwargs))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)



@pytest.fixture(scope="session")
def uvicorn_thread() -> type[UvicornThread]:
    """``UvicornThread``: ``with uvicorn_thread(app, graceful_shutdown_timeout_s=None) as
    base_url:`` serves ``app`` on 127.0.0.1 for the block."""
    return UvicornThread
