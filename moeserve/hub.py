"""Models named by their Hugging Face hub id (``Qwen/Qwen1.5-MoE-A2.7B``): the snapshot in the local Hugging
Face cache, downloaded first when the hub is reachable.

Only what the engine reads is fetched: config.json, generation_config.json, the tokenizer files, the
safetensors shards and their index. Where the hub cannot be reached (no network, ``HF_HUB_OFFLINE=1``) the
cached snapshot is used; when there is none, the error says so in one line. ``HF_HUB_CACHE`` / ``HF_HOME``
and ``HF_TOKEN`` are read as huggingface_hub reads them.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# What a model directory needs: configs, the tokenizer, the weights and their index (vLLM fetches the same).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


class HubError(ValueError):
    """A hub model that cannot be found or fetched; the message says why in one line."""


def looks_like_hub_id(model: str) -> bool:
    """``org/name`` with the characters the hub allows (and not a path such as ``./x`` or ``a/../b``)."""
    return bool(_HUB_ID.match(model)) and ".." not in model and not model.endswith((".json", "/"))


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether the hub may not be contacted (``HF_HUB_OFFLINE``, read now rather than at import)."""
    return _env_true("HF_HUB_OFFLINE")


def hub_cache_dir() -> str:
    """The hub cache huggingface_hub uses: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else its default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def model_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The directory of ``repo_id``'s snapshot (at ``revision``, default ``main``), fetched when needed."""
    return _snapshot(repo_id, revision, hub_cache_dir(), hub_offline())


@functools.lru_cache(maxsize=32)
def _snapshot(repo_id: str, revision: str | None, cache_dir: str, offline: bool) -> Path:
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError as e:  # it comes with transformers; a broken install still gets a plain answer
        raise HubError(f"model: {repo_id!r} is a Hugging Face hub id but huggingface_hub cannot be imported "
                       f"({_first_line(e)}); pip install huggingface_hub") from None

    class _Absent(Exception):
        """An error class this huggingface_hub version does not have."""

    def err(name: str) -> type[Exception]:
        return getattr(errors, name, _Absent)

    where = f"the Hugging Face cache ({cache_dir})"
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                 allow_patterns=ALLOW_PATTERNS)
    except err("GatedRepoError"):
        raise HubError(f"model: {repo_id!r} is gated on the Hugging Face hub: accept its terms on "
                       f"https://huggingface.co/{repo_id} and set HF_TOKEN") from None
    except err("RepositoryNotFoundError"):
        raise HubError(f"model: {repo_id!r} is not a local directory, and the Hugging Face hub has no model of "
                       "that name (or it is private: set HF_TOKEN)") from None
    except err("RevisionNotFoundError"):
        raise HubError(f"revision: {revision!r} does not exist for the model {repo_id!r}") from None
    except err("IncompleteSnapshotError"):
        raise HubError(f"model: the cached snapshot of {repo_id!r} in {where} is incomplete (an interrupted "
                       "download?) and the hub cannot be reached to finish it") from None
    except err("LocalEntryNotFoundError") as e:
        why = ("the hub is offline (HF_HUB_OFFLINE is set)" if offline else
               f"the hub could not be reached ({_first_line(e.__cause__ or e)})")
        raise HubError(f"model: {repo_id!r} is not a local directory, not in {where}, and {why}") from None
    except err("HFValidationError") as e:
        raise HubError(f"model: {repo_id!r} is not a valid Hugging Face model id: {_first_line(e)}") from None
    except OSError as e:  # disk full, permissions, a failed transfer
        raise HubError(f"model: fetching {repo_id!r} into {where} failed: {_first_line(e)}") from None
    except Exception as e:  # an HTTP error of the hub (5xx, rate limit)
        if type(e).__module__.startswith(("huggingface_hub", "httpx", "requests")):
            raise HubError(f"model: fetching {repo_id!r} from the Hugging Face hub failed: {_first_line(e)}") from None
        raise
    return Path(path)
