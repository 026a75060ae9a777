"""The one Hugging Face Hub check of every model family, tokenizer and dataset: may the Hub be contacted, can it be
reached, and what to do instead.

``available()`` is False when ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` (or ``huggingface_hub``'s own constant)
say offline, or when a TCP connection to the Hub endpoint (through the ``https`` proxy the environment names) does not
open within :data:`PROBE_S` seconds. Loaders then read only local folders and caches, so a run without the network
fails in a few seconds with one message instead of retrying for a minute.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from urllib.parse import urlparse

PROBE_S = 3.0
"""Seconds the reachability probe waits for a TCP connection (the whole check stays under the 5 s a refusal takes)."""

_TRUE = ("1", "true", "yes", "on")


def offline() -> bool:
    """Whether the environment forbids the Hub: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` or
    ``huggingface_hub.constants.HF_HUB_OFFLINE``."""
    if any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
    try:
        from huggingface_hub import constants
    except ImportError:
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    return constants.ENDPOINT


def _target(url: str) -> tuple[str, int]:
    """Where a request to ``url`` connects first: the environment's proxy for its scheme, else the host itself."""
    u = urlparse(url)
    host, port = u.hostname or "huggingface.co", u.port or (443 if u.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(u.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        return p.hostname or "", p.port or 80
    return host, port


def reachable(timeout: float = PROBE_S) -> bool:
    """Whether a TCP connection to the Hub endpoint (or its proxy) opens within ``timeout`` seconds (name
    resolution included: the probe runs in a thread that is abandoned when it takes longer)."""
    host, port = _target(endpoint())
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


def available() -> bool:
    """The Hub may be contacted and can be reached."""
    return not offline() and reachable()


def why_not() -> str:
    """Why the Hub gave nothing, for messages (probes again when the environment allows the Hub)."""
    if offline():
        return "HF_HUB_OFFLINE is set"
    if reachable():
        return f"{endpoint()} answers, but the download failed: check the name"
    return f"{endpoint()} cannot be reached within {PROBE_S:g} s (no network, or a proxy that does not answer)"


def download_command(repo: str, *args: str) -> str:
    """The command that fetches ``repo`` with the installed ``huggingface_hub``: ``hf download`` (0.34 and later)
    or ``huggingface-cli download`` (earlier versions)."""
    try:
        from huggingface_hub import __version__
        major, minor = (int(x) for x in __version__.split(".")[:2])
    except (ImportError, ValueError):
        major, minor = 1, 0
    tool = "hf download" if (major, minor) >= (0, 34) else "huggingface-cli download"
    return " ".join([tool, repo, *args])
