"""``moeserve serve``: bind the port, start the engine core (a child process that loads the model), then
serve the OpenAI API with uvicorn.

The listening socket is bound first, so a port in use is reported in one line before anything loads.
SIGTERM or Ctrl+C drains: no new connections, running requests finish (up to ``server.shutdown_timeout``
seconds), then the engine core stops and the process exits 0. ``BackgroundServer`` runs the same server
on a thread of the calling process (tests, notebooks); its engine core is still a child process.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
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
    g.add_argument("--chat-template", default=None, help="a Jinja chat template, inline or a file (default: the "
                   "tokenizer's)")
    p.set_defaults(func=run_serve)


def serve_config_from_args(args: argparse.Namespace):
    """The engine config of ``moeserve serve``'s flags, the server flags set on ``config.server`` (a bad value
    is a ``ConfigError`` naming its field)."""
    from pydantic import ValidationError

    from moeserve.args import config_from_args
    from moeserve.config import ConfigError

    config = config_from_args(args)
    for field in ("host", "port", "api_key", "served_model_name", "max_queue_len", "chat_template"):
        value = getattr(args, field, None)
        if value is not None:
            try:
                setattr(config.server, field, value)
            except ValidationError as e:
                raise ConfigError(f"config error: server.{field}: {e.errors()[0]['msg']} (got {value!r})") from None
    return config


def run_serve(args: argparse.Namespace) -> int:
    from moeserve.deps import SERVER_MODULES, require
    for module in SERVER_MODULES:  # installed with moeserve; one line, not an import traceback, where one is not
        require(module, "moeserve serve")
    from moeserve.server.engine_client import EngineStartError

    config = serve_config_from_args(args)
    host, port = config.server.host, config.server.port
    try:
        sock = bind_socket(host, port)
    except OSError as e:
        print(f"error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    app = build_server(config)
    bound = sock.getsockname()[:2]
    print(f"moeserve: listening on {_url(*bound)}; starting the engine", flush=True)
    try:
        app.state.server.start()
    except EngineStartError as e:
        print(f"error: the engine did not start: {e}", file=sys.stderr)
        return 2 if e.user_error else 1
    previous = signal.signal(signal.SIGTERM, _terminated)  # uvicorn re-raises SIGTERM once it has drained
    try:
        return asyncio.run(_serve(app, sock, args.uvicorn_log_level))
    except (KeyboardInterrupt, _Terminated):  # uvicorn re-raises the signal it handled, after draining
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if app.state.server.client.process is not None:
            app.state.server.client.close(5.0)


class _Terminated(Exception):
    pass


def _terminated(signum, frame):
    raise _Terminated()


def _url(host, port) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def build_server(config, engine_factory: str | None = None):
    """The FastAPI app for ``config``: its engine core starts with the app (or earlier, through
    ``app.state.server.start()``). ``engine_factory`` (``"module:function"``) builds the core's engine
    instead of ``LLMEngine`` (tests inject faults this way)."""
    from moeserve.server.app import ServerState, build_app
    from moeserve.server.engine_client import EngineClient
    from moeserve.server.metrics import ServerMetrics

    name = config.server.served_model_name or config.model
    client = EngineClient(config, config.server.max_queue_len, ServerMetrics(name), engine_factory)
    return build_app(ServerState(client, config, name, config.server.api_key))


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket. It must say IPPROTO_TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    on connections of sockets that do; with proto 0, a streamed chunk written behind the response headers
    waited for the client's delayed ACK, adding ~40 ms to the first token."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app, log_level: str, graceful: float = 30.0):
    import uvicorn
    cfg = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=graceful,
                         lifespan="on")
    return uvicorn.Server(cfg)


async def _serve(app, sock, log_level: str) -> int:
    host, port = sock.getsockname()[:2]
    state = app.state.server
    server = _uvicorn_server(app, log_level, state.config.server.shutdown_timeout)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        d = state.info
        print(f"moeserve: serving {state.served_model_name!r} at {_url(host, port)}/v1 "
              f"(device {d['device']}, {d['dtype']}, {d['kv_pages']} KV pages of {d['page_size']} tokens, "
              f"max_model_len {d['max_model_len']}; engine core pid {d['pid']})", flush=True)
        print("moeserve: backends " + ", ".join(f"{op}={b}" for op, b in d["backends"].items())
              + (f"; fused kernels: {', '.join(d['fusions'])}" if d.get("fusions") else "")
              + (f"; PDL for steps of up to {d['pdl_max_tokens']} tokens" if d.get("pdl_max_tokens") else ""),
              flush=True)
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
