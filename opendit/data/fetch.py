"""Remote shards: a local copy of an http(s) shard, downloaded once per machine and retried with backoff.

wids (WebDataset's indexed reader) keeps the copies: `download_and_open` takes a file lock per shard, so the
DataLoader workers and ranks of one machine download each shard once and share it. Its own http handler runs curl
once and keeps whatever arrived; ours retries (connection errors, timeouts, 5xx) with exponential backoff, writes to
a temporary name and renames when complete, so an interrupted download never leaves a truncated shard behind.
"""
import hashlib
import logging
import os
import shutil
import time
import urllib.error
import urllib.request

from wids.wids_dl import default_cmds, download_and_open

logger = logging.getLogger(__name__)

# tests shorten these through the environment; a real run keeps the defaults (about a minute of retrying)
RETRIES = int(os.environ.get("OPENDIT_FETCH_RETRIES", "6"))
BACKOFF_S = float(os.environ.get("OPENDIT_FETCH_BACKOFF_S", "1.0"))
TIMEOUT_S = 60.0


class ShardUnavailable(RuntimeError):
    """A shard that could not be fetched: a run stops with its name rather than train on less data."""


def is_url(path: str) -> bool:
    return str(path).startswith(("http://", "https://"))


def default_cache() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "opendit", "shards")


def _http(remote: str, local: str) -> None:
    """wids' handler signature: download `remote` to `local`, complete or not at all."""
    partial = f"{local}.part{os.getpid()}"
    for attempt in range(RETRIES + 1):
        try:
            with urllib.request.urlopen(remote, timeout=TIMEOUT_S) as response, open(partial, "wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
            os.replace(partial, local)
            return
        except (urllib.error.URLError, OSError) as err:
            if os.path.exists(partial):
                os.remove(partial)
            code = getattr(err, "code", None)
            if code is not None and 400 <= code < 500:  # not found, forbidden: retrying will not help
                raise ShardUnavailable(f"shard {remote} cannot be fetched: HTTP {code} {getattr(err, 'reason', '')}; "
                                       f"check the URL (or the shard list)") from err
            if attempt == RETRIES:
                raise ShardUnavailable(f"shard {remote} is unreachable after {RETRIES + 1} tries ({err}); check the "
                                       f"network and the server, then resume the run with --load auto") from err
            wait = BACKOFF_S * 2 ** attempt
            logger.warning("fetching shard %s failed (%s); retrying in %.1f s (%d of %d)", remote, err, wait,
                           attempt + 1, RETRIES)
            time.sleep(wait)


HANDLERS = {**default_cmds, "http": _http, "https": _http}


def local_copy(url: str, cache_dir: str) -> str:
    """The path of a local copy of shard `url` (downloaded now when this machine has none)."""
    os.makedirs(cache_dir, exist_ok=True)
    name = hashlib.sha256(url.encode()).hexdigest()[:16] + "-" + os.path.basename(url.split("?")[0])
    local = os.path.join(cache_dir, name)
    with download_and_open(url, local, handlers=HANDLERS):
        pass
    return local
