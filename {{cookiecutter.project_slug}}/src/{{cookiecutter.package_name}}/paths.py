"""Where the project keeps its state outside the repository, and the one check every such directory passes.

A directory under the shared temporary directory (/tmp) has a name another local user can guess and create first,
as a folder of theirs or a symlink to somewhere else. So every directory the project keeps there is this user's
own: `private_dir` makes it mode 0700, or, if it is already there, checks without following a symlink (lstat) that
it is a directory of this user's, and refuses it otherwise (`NotPrivate`), before anything in it is read, trusted
or deleted.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

SLUG = "{{ cookiecutter.project_slug }}"


class NotPrivate(OSError):
    """A directory the project would keep its state in is not this user's own."""


def private_dir(path: Path | str) -> Path:
    """`path` as a directory only this user can enter: made (mode 0700) if missing, its mode narrowed to 0700 if it
    is this user's; NotPrivate, naming the fix, if it is a symlink, not a directory or another user's."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise NotPrivate(f"{path} is not a directory of this user's (a symlink or a file): remove it, or set TMPDIR")
    if info.st_uid != os.getuid():
        raise NotPrivate(
            f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()}): remove it, or set TMPDIR"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def user_tmp(name: str) -> Path:
    """This user's own directory `<tmp>/<slug>-<name>-<uid>` (not made here): `private_dir` it before use."""
    return Path(tempfile.gettempdir()) / f"{SLUG}-{name}-{os.getuid()}"


def cache_dir() -> Path:
    """The user's cache for this project ($XDG_CACHE_HOME, an empty one as unset): logs, the local runtime's files."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / SLUG


def is_own_file(path: Path) -> bool:
    """Whether `path` is a file (not a symlink) of this user's: the only kind the project deletes by name pattern."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
