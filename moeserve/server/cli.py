"""``moeserve serve``: build the engine, then serve the OpenAI API with uvicorn.

``BackgroundServer`` runs the same server on a thread of the calling process (tests, notebooks).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import threading
import time

log = logging.getLogger("moeserve.server")


def register(subparsers, name: str, help: str) -> None:
    from moeserve.args import add_config_args

    p = subparsers.add_parser(name, help=help, description="Serve MODEL over an OpenAI-compatible HTTP API "
                              "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics): "
                              "moeserve serve Qwen/Qwen1.5-MoE-A2.7B --port 8000")
    add_config_args(p, positional_model=True)
    g = p.add_argument_group("server (flags override the config's server section)")
    g.add_argument("--host", default=None, help="address to listen on (default: config server.host, 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="port to listen on; 0 takes any free port (default: "
                   "config server.port, 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes "
                   "(default: none)")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL as "
                   "given)")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 503 once this many requests wait (default: config server.max_queue_len, 256)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: warning)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from moeserve.args import config_from_args
    from moeserve.config import ConfigError

    config = config_from_args(args)
    for field in ("host", "port", "api_key", "served_model_name", "max_queue_len"):
        value = getattr(args, field)
        if value is not None:
            try:
                setattr(config.server, field, value)
            except ValidationError as e:
                raise ConfigError(f"config error: server.{field}: {e.errors()[0]['msg']} (got {value!r})") from None
    server = build_server(config)
    try:
        return asyncio.run(_serve(server, config, args.uvicorn_log_level))
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it handled, after a clean shutdown
        return 0


def build_server(config):
    """The engine, its loop and the FastAPI app for ``config`` (the loop starts with the app)."""
    from moeserve.engine.engine import LLMEngine
    from moeserve.server.app import build_app
    from moeserve.server.async_engine import AsyncEngine
    from moeserve.server.metrics import ServerMetrics

    engine = LLMEngine(config)
    name = config.server.served_model_name or config.model
    async_engine = AsyncEngine(engine, config.server.max_queue_len, ServerMetrics(name))
    return build_app(async_engine, name, config.server.api_key)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app, log_level: str):
    import uvicorn
    cfg = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5,
                         lifespan="on")
    return uvicorn.Server(cfg)


async def _serve(app, config, log_level: str) -> int:
    sock = bind_socket(config.server.host, config.server.port)
    host, port = sock.getsockname()[:2]
    server = _uvicorn_server(app, log_level)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        state = app.state.server
        d = state.engine.describe()
        shown = f"[{host}]" if ":" in host else host
        print(f"moeserve: serving {state.served_model_name!r} at http://{shown}:{port}/v1 "
              f"(device {d['device']}, {d['dtype']}, {d['kv_pages']} KV pages of {d['page_size']} tokens, "
              f"max_model_len {d['max_model_len']})", flush=True)
        print("moeserve: backends " + ", ".join(f"{op}={b}" for op, b in d["backends"].items()), flush=True)
        if state.api_key:
            print("moeserve: /v1 routes need 'Authorization: Bearer <api key>'", flush=True)
    await task
    return 0 if server.started else 1


class BackgroundServer:
    """A real uvicorn server on a free port, on a thread of this process; ``with`` stops it."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = _uvicorn_server(app, log_level)
        self.thread = threading.Thread(target=self._run, name="moeserve-http", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as e:
            self.error = e

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.error!r}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m moeserve.server.cli [serve flags]``: the serve command on its own."""
    from moeserve.config import ConfigError

    from moeserve.args import ArgumentParser

    parser = ArgumentParser(prog="moeserve")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, "serve", "OpenAI-compatible HTTP server")
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
