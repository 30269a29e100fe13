"""The engine-core child process as the front end sees it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import subprocess
import sys


class CoreProcess:
    """The engine-core child process (``python -m moeserve.engine.core``, its arguments pickled on stdin; it
    sees this process's ``sys.path``). ``watch`` calls back on the event loop when it exits (through a pidfd,
    or by polling where there is none)."""

    def __init__(self, kwargs: dict):
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else paths)
        self.popen = subprocess.Popen([sys.executable, "-m", "moeserve.engine.core"], stdin=subprocess.PIPE, env=env)
        self.pid = self.popen.pid
        try:
            self.popen.stdin.write(pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL))
            self.popen.stdin.close()
        except BrokenPipeError:
            pass
        self._pidfd: int | None = None
        self._loop = None
        self._timer = None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def watch(self, loop: asyncio.AbstractEventLoop, callback) -> None:
        self._loop = loop
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd: look every 200 ms
            def poll():
                if self.is_alive():
                    self._timer = loop.call_later(0.2, poll)
                else:
                    callback()
            self._timer = loop.call_later(0.2, poll)
            return
        loop.add_reader(self._pidfd, callback)

    def unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
