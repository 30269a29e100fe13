"""A local Hugging Face hub cache made in a test, laid out as huggingface_hub stores downloads:
``models--org--name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` (links to the blobs) and
``refs/<branch>`` (the commit), so a model id resolves offline (``HF_HUB_OFFLINE=1``) without a network."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(cache_dir, repo_id: str, files_from, commit: str = COMMIT, branch: str = "main") -> Path:
    """Put every file of the directory ``files_from`` into ``cache_dir`` as the snapshot ``commit`` of
    ``repo_id`` (``branch`` pointing at it); returns the snapshot directory."""
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(files_from).iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot
