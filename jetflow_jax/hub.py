"""Hugging Face Hub ids as checkpoint paths: `Qwen/Qwen3-8B`, `JetSpec/jetspec-qwen3-8b@REV`.

Resolved with `huggingface_hub` through its cache, so `HF_HUB_OFFLINE=1` and
`HF_HUB_CACHE` behave as everywhere else; `@REV` pins a branch, tag or commit.
"""

from __future__ import annotations

import os
import re

from jetflow_jax.errors import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def is_hub_id(path: str) -> bool:
  """A `org/name[@revision]` that is not an existing local path."""
  return not os.path.exists(os.path.expanduser(path)) and bool(_REPO_ID.match(path))


def resolve(path: str) -> str:
  """A local directory for `path`: itself, or the cached (or downloaded) snapshot of a hub id."""
  if not is_hub_id(path):
    return path
  from huggingface_hub import constants, snapshot_download
  from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
  repo_id, _, revision = path.partition("@")
  try:
    return snapshot_download(repo_id, revision=revision or None, allow_patterns=_FILES)
  except LocalEntryNotFoundError:
    raise CheckpointError(
        f"{path} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be "
        f"downloaded here (offline); on a machine with internet run `hf download {repo_id}"
        f"{' --revision ' + revision if revision else ''}` and copy the cache, or pass a "
        "local directory") from None
  except (HfHubHTTPError, OSError) as e:
    raise CheckpointError(f"cannot fetch {path} from the Hugging Face Hub: {e}") from None
