"""The retrieval HTTP service: a server for any `Retriever` and its client, with Search-R1's request and response:

    POST /retrieve  {"queries": ["Bara Kovin"], "topk": 3}  ->  {"result": [["passage", ...]]}
    GET  /health    -> {"status": "ok", "num_docs": 1234}

What one request may ask is bounded (`Limits`: 413 / 422, each message naming the flag); a body over the limit is
refused on its Content-Length or as soon as the streamed body passes it, the rest unread. With a token every request
must carry ``Authorization: Bearer <token>`` (else 401). A connection that sends no request for
`Limits.idle_timeout` seconds is closed (`IdleClosing`), so that idle connections cannot hold the server's file
descriptors until nobody else is answered.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from experiments.ops.retrieval import Retriever, check_k

DEFAULT_HOST = "127.0.0.1"
# the retriever's token: read by `emapg retriever serve` (unless --token is given) and by every client
TOKEN_ENV = "EMAPG_RETRIEVER_TOKEN"


@dataclass(frozen=True)
class Limits:
    """What one request or connection may ask of the server; the field defaults are `emapg retriever serve`'s."""

    max_body_bytes: int = 8 * 2**20  # a request body: 413 beyond (--max-body-bytes)
    max_queries: int = 4096  # queries in one POST /retrieve: 422 beyond (--max-queries)
    max_topk: int = 100  # topk of a POST /retrieve: 422 outside 1..max_topk (--max-topk)
    idle_timeout: float = 5.0  # seconds a connection may wait without a request before it is closed


def configured_token(given: str | None = None) -> str | None:
    """`given`, else the value of $EMAPG_RETRIEVER_TOKEN; None when neither is set (or both are empty)."""
    return given or os.environ.get(TOKEN_ENV) or None


class HTTPRetriever(Retriever):
    """Client for a retrieval server started by `serve` (or Search-R1-compatible ones). It sends the token
    `token`, else that of $EMAPG_RETRIEVER_TOKEN, when there is one."""

    def __init__(self, url: str, timeout: float = 30.0, token: str | None = None):
        import httpx

        self.url = url.rstrip("/")
        self.token = configured_token(token)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._client = httpx.Client(timeout=timeout, headers=headers)

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]:
        check_k(k)
        response = self._answer(self._client.post(f"{self.url}/retrieve", json={"queries": list(queries), "topk": k}))
        response.raise_for_status()
        return response.json()["result"]

    def health(self) -> dict:
        response = self._answer(self._client.get(f"{self.url}/health"))
        response.raise_for_status()
        return response.json()

    def _answer(self, response):
        """`response`, unless it is a 401: then ValueError, one line saying the token was refused (or is missing)."""
        if response.status_code != 401:
            return response
        why, whose = "needs a token", "the server's token"
        if self.token:
            why = "refused this client's token"
            whose = f"the token the server was started with (its --token or ${TOKEN_ENV})"
        raise ValueError(f"the retriever at {self.url} {why} (HTTP 401): set ${TOKEN_ENV} to {whose}")

    def close(self) -> None:
        self._client.close()


def check_answers(url: str, timeout: float = 4.0) -> None:
    """Return once the retriever at `url` answers GET /health, asked with this process's token, with anything but a
    401 (Search-R1-compatible servers may have no /health: a 404 answers); ValueError (one line) when it refuses the
    token, httpx's error when nothing answers (`timeout` seconds to connect, then as many to answer)."""
    client = HTTPRetriever(url, timeout=timeout)
    try:
        client._answer(client._client.get(f"{client.url}/health"))
    finally:
        client.close()


# ---------------------------------------------------------------- server
class RetrieveRequest(BaseModel):
    """Body of POST /retrieve (Search-R1's field names)."""

    queries: list[str]
    topk: int = 3


def make_app(retriever: Retriever, num_docs: int | None = None, limits: Limits = Limits(), token: str | None = None):
    """The ASGI app serving `retriever` (POST /retrieve, GET /health), behind `guarded`."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="emapg retriever")

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict:
        n, topk = len(request.queries), request.topk
        if n > limits.max_queries:
            detail = f"{n} queries in one request; at most {limits.max_queries} (emapg retriever serve --max-queries)"
            raise HTTPException(status_code=422, detail=detail)
        if not 1 <= topk <= limits.max_topk:
            detail = f"topk={topk}; allowed: 1..{limits.max_topk} (emapg retriever serve --max-topk)"
            raise HTTPException(status_code=422, detail=detail)
        return {"result": retriever.batch_search(request.queries, request.topk)}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_docs": num_docs}

    return guarded(app, limits, token)


def guarded(app, limits: Limits, token: str | None):
    """`app` behind the token (401 without it) and the body limit (413): a request is refused on its
    headers when it can be, and its body is read up to `limits.max_body_bytes` at most, never further."""
    too_big = f"request body over {limits.max_body_bytes} bytes (emapg retriever serve --max-body-bytes)"
    no_token = f"missing or wrong token: send 'Authorization: Bearer <token>' (clients read ${TOKEN_ENV})"

    async def guard(scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        sent = headers.get(b"authorization")
        if token and (sent is None or not hmac.compare_digest(sent, f"Bearer {token}".encode())):
            await _refuse(send, 401, no_token, [(b"www-authenticate", b"Bearer")])
            return
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limits.max_body_bytes:
            await _refuse(send, 413, too_big)
            return
        body = await _read_body(receive, limits.max_body_bytes)
        if body is None:
            await _refuse(send, 413, too_big)
            return
        await app(scope, _replay(body, receive), send)

    return guard


async def _read_body(receive, limit: int) -> bytes | None:
    """The request body, read chunk by chunk; None as soon as it passes `limit` bytes (the rest unread)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI `receive` that hands the app the body read already, then the connection's own events."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def _refuse(send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A JSON {"detail": ...} response that closes the connection (whatever the client still sends is unread)."""
    body = json.dumps({"detail": detail}).encode()
    own = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": [*own, *headers]})
    await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (127.0.0.0/8, ::1); ValueError naming --host
    when it is neither an address nor a name this machine resolves."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        raise ValueError(f"--host {host!r}: not an address, nor a name this machine resolves") from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (0: any free port) for `serve`; ValueError naming --port when the
    port is in use, or --host when the address cannot be had, before anything is served."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart reuses its port
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: in use on {host} (another server listens there); pick another, or --port 0"
            ) from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def _server(retriever: Retriever, limits: Limits, token: str | None):
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleClosing(H11Protocol):
        """uvicorn's HTTP/1.1 protocol, which closes an idle connection only after a response (its keep-alive
        timeout), made to close one that sends no request, or part of a request head, as long too."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._close_when_idle()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is None or self.cycle.response_complete:  # no whole request yet: still idle
                self._close_when_idle()

        def _close_when_idle(self) -> None:
            self._unset_keepalive_if_required()
            if not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    num_docs = len(retriever.docs) if hasattr(retriever, "docs") else None
    app = make_app(retriever, num_docs, limits, token)
    config = uvicorn.Config(app, log_level="warning", http=IdleClosing, timeout_keep_alive=limits.idle_timeout)
    return uvicorn.Server(config)


def serve(retriever: Retriever, sock: socket.socket, limits: Limits = Limits(), token: str | None = None) -> None:
    """Serve `retriever` on the socket `bind` returned, until interrupted (blocking)."""
    _server(retriever, limits, token).run(sockets=[sock])


@contextlib.contextmanager
def running_server(
    retriever: Retriever,
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    startup_timeout: float = 10.0,
    limits: Limits = Limits(),
    token: str | None = None,
) -> Iterator[str]:
    """Serve `retriever` in a background thread (`port=0`: any free port); yields its base URL, stops it on exit."""
    sock = bind(host, port)
    server = _server(retriever, limits, token)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"retriever server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout)
        sock.close()
