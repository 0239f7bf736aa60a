"""Models named as on the Hugging Face hub (`org/name`, `org/name@revision`), found in the local hub cache.

`hf download org/name` (huggingface_hub) stores a repository as `<cache>/models--org--name/snapshots/<commit>/`, with
`refs/<branch or tag>` holding the commit a name points at. moeserve reads that snapshot like any checkpoint
directory and never touches the network: a name that is not downloaded is a one-line error saying how to get it.
The cache is HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from moeserve.errors import MoeserveError

HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"


def resolve_model(model: str) -> str:
    """The checkpoint directory `model` names: a path that exists is itself; `org/name[@revision]` (revision: a
    branch, tag or commit; default main) is its snapshot in the local hub cache. Anything else is returned as given
    (reading it then says the path does not exist)."""
    match = HUB_NAME.match(model)
    if Path(model).exists() or match is None:
        return model
    repo, revision = match["repo"], match["revision"] or "main"
    root = hub_cache() / f"models--{repo.replace('/', '--')}"
    commit = revision if COMMIT.match(revision) else _read_ref(root / "refs" / revision)
    snapshot = root / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        fetch = f"hf download {repo}" + (f" --revision {revision}" if match["revision"] else "")
        raise MoeserveError(f"{model} is neither a directory nor a model in the local Hugging Face cache "
                            f"({hub_cache()}); download it first (`{fetch}`) or give its directory")
    return str(snapshot)


def _read_ref(ref: Path) -> str | None:
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None
