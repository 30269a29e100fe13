"""Optional dependencies: imported where a feature uses them, with a one-line answer naming the package and
the extra that installs it when one is missing (``pip install 'moeserve[bench]'``)."""
from __future__ import annotations

import importlib

# module -> (package to install, the extra that brings it)
EXTRAS = {"matplotlib": ("matplotlib", "bench"), "httpx": ("httpx", "bench"), "openai": ("openai", "bench"),
          "zmq": ("pyzmq", None)}
SERVER_MODULES = ("zmq", "fastapi", "uvicorn")  # what ``moeserve serve`` needs beyond the engine


class MissingDependency(RuntimeError):
    """A feature's optional package is not installed; the message says how to install it."""


def require(module: str, feature: str):
    """``import module`` for ``feature``, or MissingDependency naming the package and its extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name != module and not module.startswith(e.name + "."):
            raise  # the package is there but something it imports is broken: let that be seen
        package, extra = EXTRAS.get(module.split(".")[0], (module.split(".")[0], None))
        how = f"pip install 'moeserve[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
        raise MissingDependency(f"{feature}: {package} is not installed; {how}") from None
