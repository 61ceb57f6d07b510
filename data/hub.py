"""Hugging Face hub access for data.prepare: offline or online decided before `datasets` is imported
(the environment's HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, else a 3-second TCP probe of the hub or
its HTTPS proxy), and loading a hub dataset in memory or streaming."""
from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any
from urllib.parse import urlparse


from data.shards import PrepareError

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


# ----------------------------------------------------------------------------- hub access

def env_offline() -> bool | None:
    """True/False if the environment decides offline mode, None if it says nothing."""
    vals = [os.environ[v] for v in OFFLINE_VARS if v in os.environ]
    if not vals:
        return None
    return any(v.strip().upper() in {"1", "ON", "YES", "TRUE"} for v in vals)


def _probe_target() -> tuple[str, int]:
    """The hub endpoint's host:port, or the HTTPS proxy's when one is configured."""
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(v)), None)
    url = urlparse(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy
                   else os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub (or proxy), bounded by `timeout` including DNS (in a thread)."""
    host, port = _probe_target()
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)


def configure_hub_access(mode: str) -> bool:
    """Settle offline mode before `datasets` is imported; return True if offline.
    auto: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE if set, else online iff the probe reaches the hub;
    online: the probe must reach the hub (else PrepareError at once, not datasets' ~25 s of
    retries); offline: local HF cache only."""
    if mode not in ("auto", "online", "offline"):
        raise ValueError(f"hub mode must be auto, online or offline, got {mode!r}")
    env = env_offline()
    if mode == "offline" or (mode == "auto" and env):
        offline = True
    elif hub_reachable():
        offline = False
    elif mode == "online":
        host, port = _probe_target()
        raise PrepareError(f"--online, but {host}:{port} is unreachable from this machine (3 s probe). Run this "
                           f"command where the hub is reachable (set HF_ENDPOINT for a mirror, HTTPS_PROXY for "
                           f"a proxy), or prepare local files with `python -m data.prepare text --input PATH "
                           f"... --out DIR`")
    else:
        offline = True
    if "datasets" in sys.modules:
        import datasets.config
        if bool(datasets.config.HF_HUB_OFFLINE) != offline:
            raise PrepareError("`datasets` was imported before the hub mode was set; run data.prepare "
                               "as its own process (python -m data.prepare ...)")
        return offline
    for var in OFFLINE_VARS:
        os.environ[var] = "1" if offline else "0"
    return offline


def load_hub(path: str, name: str | None, *, offline: bool, num_proc: int | None,
             cache_dir: str | None, subcommand: str, revision: str | None = None, streaming: bool = False) -> Any:
    """`datasets.load_dataset(path, name, split="train")` (an IterableDataset with `streaming`);
    offline misses become one clear error."""
    import datasets

    try:
        if streaming:
            return datasets.load_dataset(path, name=name, split="train", revision=revision, streaming=True,
                                         cache_dir=cache_dir)
        return datasets.load_dataset(path, name=name, split="train", revision=revision,
                                     num_proc=num_proc if num_proc and num_proc > 1 else None, cache_dir=cache_dir)
    except Exception as e:  # what a miss raises differs between datasets versions
        if "scripts are no longer supported" in str(e):
            raise PrepareError(f"{path} is a script-based hub dataset, which datasets {datasets.__version__} "
                               f"no longer runs; read the hub's parquet conversion instead: add "
                               f"`--revision refs/convert/parquet`") from e
        if os.path.isdir(os.path.expanduser(path)):  # a local copy of the hub's files: no cache or hub involved
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            hint = (f"; a local folder of parquet files has the config 'default', not {name!r}: pass --sample "
                    f"default" if name and "BuilderConfig" in str(e) else "")
            raise PrepareError(f"the local folder {path} could not be read as the {subcommand} dataset "
                               f"({type(e).__name__}: {msg}){hint}") from None
        if not offline:
            raise
        target = f"{path}" + (f" ({name})" if name else "")
        raise PrepareError(
            f"the hub dataset {target} is not in the local HF cache and the hub is offline "
            f"(unreachable, or HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set). Run `python -m data.prepare "
            f"{subcommand} --online ...` on a machine that reaches huggingface.co (or copy its HF cache "
            f"here), or prepare local files with `python -m data.prepare text --input PATH ... --out DIR`. "
            f"[{type(e).__name__}: {str(e)[:300]}]") from None
