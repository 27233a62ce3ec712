"""The deployment's API key as a server holds it: fixed, or read from a file that may change.

A rank, the router's gate (``dwdp.worker.gate``) and a generation server's side-channel fetches
ask ``ApiKey.current()`` on every use. A key read from a file (``DWDP_API_KEY_FILE``: the
operator mounts the Secret ``spec.server.apiKeySecretRef`` names) is re-read when the file
changes, checked at most once per ``RECHECK_S``: when the kubelet writes a rotated Secret into
the pod, the new key is the only one accepted within ``RECHECK_S`` of the write. A file that
becomes unreadable, empty or malformed keeps the key last read (an ERROR in the log): a broken
rotation never opens the door.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

RECHECK_S = 1.0
"""Seconds between two looks at a key file (its modification time, size and inode)."""


class ApiKeyError(ValueError):
    """The configured API key cannot be used (one line naming where it came from)."""


def check_api_key(value: str | None, source: str) -> str | None:
    """The API key from ``value`` (``None`` or empty: no key). Raises ``ApiKeyError`` for a
    key made only of blanks or with blanks around it, which a client could not send back
    (``source`` names where the value came from)."""
    if not value:
        return None
    if value != value.strip() or not value.strip():
        raise ApiKeyError(
            f"{source}: the API key has leading or trailing blanks (or is only blanks); "
            f"store the key without them"
        )
    return value


def _read_key(path: Path) -> str:
    """The key in ``path``; ``ApiKeyError`` naming the file when it is missing, empty or
    malformed (a file that exists must hold a key: an empty one is a mistake, not 'no key')."""
    try:
        value = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyError(f"{path}: cannot read the API key: {exc}") from exc
    key = check_api_key(value, str(path))
    if key is None:
        raise ApiKeyError(f"{path}: the API key file is empty")
    return key


class ApiKey:
    """The key a server checks and sends: ``value`` (fixed; ``None``: no key) or the content
    of ``path`` (re-read when the file changes, see the module docstring).

    Raises ``ApiKeyError`` at construction when ``path`` holds no usable key.
    """

    def __init__(
        self, value: str | None = None, *, path: str | os.PathLike[str] | None = None,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._checked = time.monotonic()
        if self.path is None:
            self._value = check_api_key(value, "API key")
        else:
            self._seen = self._stamp()
            self._value = _read_key(self.path)

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ[str], *, file_var: str,
                 value_var: str) -> ApiKey:
        """The key of a process: the file ``environ[file_var]`` names when set, else the
        value ``environ[value_var]`` (unset or empty: no key)."""
        path = environ.get(file_var)
        if path:
            return cls(path=path)
        return cls(check_api_key(environ.get(value_var), value_var))

    @property
    def required(self) -> bool:
        """Whether a key is configured (a file always holds one)."""
        return self.path is not None or self._value is not None

    def current(self) -> str | None:
        """The key now (``None``: none configured); a changed file is re-read first."""
        if self.path is None:
            return self._value
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= self.recheck_s:
                self._checked = now
                self._reload()
            return self._value

    def _stamp(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()  # follows the kubelet's ..data link
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload(self) -> None:
        stamp = self._stamp()
        if stamp == self._seen:
            return
        self._seen = stamp
        assert self.path is not None
        try:
            key = _read_key(self.path)
        except ApiKeyError as exc:
            log.error("API key not changed: %s", exc)
            return
        if key != self._value:
            log.info("API key changed (%s re-read)", self.path)
            self._value = key
