"""``layerzoo serve``: load the model, build the app, run uvicorn; SIGTERM drains.

The first SIGTERM (or SIGINT) does not stop the server at once: new requests get 503, the ones
in flight run to their end for up to ``drain_timeout_s`` (then they are aborted), and only then
does uvicorn shut down. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from layerzoo.server.app import ServerConfig, ServerState, build_app

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the app (`ServerState.begin_drain`) before exiting."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT) and not self.state.draining:
            self.state.begin_drain()
            return
        super().handle_exit(sig, frame)

    async def main_loop(self) -> None:
        """uvicorn's tick loop, plus: once draining, exit when nothing is in flight (or time is up)."""
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            await asyncio.sleep(0.05)
            if not self.state.draining:
                continue
            if self.state.inflight == 0:
                self.should_exit = True
            elif time.monotonic() > self.state.drain_deadline:
                log.warning("drain timeout: aborting %d request(s) still in flight", len(self.state.live))
                await self.state.abort_live()
                self.state.drain_deadline = float("inf")  # the aborted streams end, then inflight reaches 0


def serve(engine, *, model_name: str, host: str, port: int, api_key: str | None, drain_timeout_s: float,
          max_body_bytes: int = 1 << 20, log_level: str = "warning") -> None:
    """Serve ``engine`` (an `AsyncLLM`) until a signal has drained it; the engine is shut down after."""
    config = ServerConfig(model_name=model_name, api_key=api_key, drain_timeout_s=drain_timeout_s,
                          max_body_bytes=max_body_bytes)
    app = build_app(engine, config)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                           timeout_graceful_shutdown=5), app.state.server)
    print(f"layerzoo: serving {model_name} at http://{host}:{port} (chat page at /, OpenAI API at /v1)", flush=True)
    try:
        server.run()
    finally:
        engine.shutdown()
