"""The admin key of a local `serve`, kept where same-host clients find it.

Triton's admin APIs (model load/unload, shared memory, statistics, ...) need a key. `$TRITON_ADMIN_KEY` wins
wherever it is set. Otherwise a local `serve` keeps its key in a file only you can read (mode 0600):
`$XDG_CONFIG_HOME/{{ cookiecutter.project_slug }}/admin-key`, by default `~/.config/{{ cookiecutter.project_slug }}/admin-key`.
It is made at the first start and kept across restarts, so a same-host client (`ImageClassifier`, `classify
--shared-memory`) reads it there without being given it. `serve --new-admin-key` rotates it (delete the file
for the same effect). The container's `serve` does the same in its user's home. The key is never printed.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV = "TRITON_ADMIN_KEY"
ADMIN_KEY_HEADER = "triton-grpc-protocol-admin-key"  # how a gRPC request carries the key (over HTTP: `admin-key`)


def key_file() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "{{ cookiecutter.project_slug }}" / "admin-key"


def find() -> tuple[str | None, str]:
    """(key, where it came from) for a client: $TRITON_ADMIN_KEY, else the key file; (None, ...) if neither."""
    if os.environ.get(ENV):
        return os.environ[ENV], ENV
    return _read(key_file())


def for_serve(rotate: bool = False) -> tuple[str, str]:
    """(key, where it is kept) for a local `serve`: $TRITON_ADMIN_KEY, else the key file's (made, or with
    `rotate` replaced, with a new random key, mode 0600). Where the file cannot be written: a new key for this
    start only."""
    if os.environ.get(ENV):
        return os.environ[ENV], ENV
    path = key_file()
    if not rotate:
        key, _ = _read(path)
        if key:
            return key, str(path)
    key = secrets.token_urlsafe(24)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".admin-key.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.chmod(tmp, 0o600)  # also under an unusual umask
        tmp.replace(path)
    except OSError as exc:
        return key, f"this start only ({path} cannot be written: {exc.strerror})"
    return key, str(path)


def _read(path: Path) -> tuple[str | None, str]:
    try:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)  # someone loosened it: only you may read the key
        return path.read_text().strip() or None, str(path)
    except OSError:
        return None, str(path)
