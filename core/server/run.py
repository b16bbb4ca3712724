"""``layerzoo serve``: load the model, build the app, run uvicorn; SIGTERM drains.

The port is bound before the model loads (`bind_port`), so a busy port is a one-line error at
once rather than after minutes of loading. The first SIGTERM (or SIGINT) does not stop the server
at once: new requests get 503, the ones in flight run to their end for up to ``drain_timeout_s``;
then the engine requests still running are aborted, and what is still open a moment later (a
client that stalled mid-upload, or stopped reading its stream) is cut, so the process always ends
within about ``drain_timeout_s`` + `CUT_AFTER_S`. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time

import uvicorn

from layerzoo.errors import UserError
from layerzoo.server.app import ServerConfig, ServerState, build_app

log = logging.getLogger(__name__)

# After the drain timeout: how long aborted streams get to send their last event before every
# request still open is cut.
CUT_AFTER_S = 1.0


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet: connections are refused until serving
    starts); a port in use or an address not of this machine is a `UserError` naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"--port: {host}:{port} is already in use (another server?); pick another --port") from None
        raise UserError(f"--host: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    except UnicodeError as exc:  # a host name IDNA cannot encode
        sock.close()
        raise UserError(f"--host: {host!r} is not a host name ({exc})") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the app (`ServerState.begin_drain`) before exiting."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.cut_at: float | None = None  # set at the drain timeout

    def handle_exit(self, sig: int, frame) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT) and not self.state.draining:
            self.state.begin_drain()
            return
        super().handle_exit(sig, frame)

    async def main_loop(self) -> None:
        """uvicorn's tick loop, plus: once draining, exit when nothing is in flight. When the drain
        time is up the engine requests still running are aborted; their streams get `CUT_AFTER_S`
        to send their last events, then every request still open is cut."""
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            await asyncio.sleep(0.05)
            if not self.state.draining:
                continue
            now = time.monotonic()
            if self.state.inflight == 0:
                self.should_exit = True
            elif self.cut_at is None and now > self.state.drain_deadline:
                log.warning("drain timeout: aborting %d engine request(s) still running", len(self.state.live))
                await self.state.abort_live()
                self.cut_at = now + CUT_AFTER_S
            elif self.cut_at is not None and now > self.cut_at:
                log.warning("drain timeout: cutting %d request(s) still open (a stalled upload, or a client "
                            "that does not read)", self.state.inflight)
                self.state.cut_open()
                self.should_exit = True


def serve(engine, *, model_name: str, sock: socket.socket, api_key: str | None, drain_timeout_s: float,
          max_body_bytes: int = 1 << 20, log_level: str = "warning", pooling: str | None = None) -> None:
    """Serve ``engine`` (an `AsyncLLM`) on ``sock`` (from `bind_port`) until a signal has drained
    it; the engine is shut down after."""
    config = ServerConfig(model_name=model_name, api_key=api_key, drain_timeout_s=drain_timeout_s,
                          max_body_bytes=max_body_bytes, pooling=pooling)
    app = build_app(engine, config)
    host, port = sock.getsockname()[:2]
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                           timeout_graceful_shutdown=CUT_AFTER_S), app.state.server)
    print(f"layerzoo: serving {model_name} at http://{host}:{port} (chat page at /, OpenAI API at /v1)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
