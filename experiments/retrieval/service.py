"""The retrieval HTTP service: a server for any `Retriever` and its client, with the request and
response shape of Search-R1's retrieval server (POST /retrieve, GET /health; see experiments.retrieval)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

from pydantic import BaseModel, Field

from experiments.retrieval import Retriever, check_k

DEFAULT_HOST = "127.0.0.1"


class HTTPRetriever:
    """Client for a retrieval server started by `serve` (or Search-R1-compatible ones)."""

    def __init__(self, url: str, timeout: float = 30.0):
        import httpx

        self.url = url.rstrip("/")
        self._client = httpx.Client(timeout=timeout)

    def search(self, query: str, k: int = 3) -> list[str]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]:
        check_k(k)
        response = self._client.post(f"{self.url}/retrieve", json={"queries": list(queries), "topk": k})
        response.raise_for_status()
        return response.json()["result"]

    def health(self) -> dict:
        response = self._client.get(f"{self.url}/health")
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


# ---------------------------------------------------------------- server


class RetrieveRequest(BaseModel):
    """Body of POST /retrieve (Search-R1's field names)."""

    queries: list[str]
    topk: int = Field(default=3, ge=1, le=100)


def make_app(retriever: Retriever, num_docs: int | None = None):
    """The FastAPI app serving `retriever` (POST /retrieve, GET /health)."""
    from fastapi import FastAPI

    app = FastAPI(title="emapg retriever")

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict:
        return {"result": retriever.batch_search(request.queries, request.topk)}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_docs": num_docs}

    return app


def _server(retriever: Retriever, host: str, port: int):
    import uvicorn

    num_docs = len(retriever.docs) if hasattr(retriever, "docs") else None
    config = uvicorn.Config(make_app(retriever, num_docs), host=host, port=port, log_level="warning")
    return uvicorn.Server(config)


def serve(retriever: Retriever, host: str = DEFAULT_HOST, port: int = 8000) -> None:
    """Serve `retriever` over HTTP until interrupted (blocking)."""
    _server(retriever, host, port).run()


@contextlib.contextmanager
def running_server(
    retriever: Retriever, host: str = DEFAULT_HOST, port: int = 0, startup_timeout: float = 10.0
) -> Iterator[str]:
    """Serve `retriever` in a background thread; yields its base URL and shuts it down on exit.

    `port=0` lets the OS pick a free port.
    """
    server = _server(retriever, host, port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"retriever server did not start on {host}:{port}")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout)
