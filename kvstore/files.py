"""Files the daemon owns: created private, opened without following links, never adopted.

Every file the daemon keeps (the DRAM region, its warm-restart manifest, the
disk tier's data, journal and lock) holds tenants' KV bytes or an index of
them, and several live in world-writable directories (``/dev/shm``). So:

- they are created ``0600`` whatever the umask (the region ``0660`` and of
  ``server.file_group`` when one is named, so engines of that group can map
  it; nothing else needs the group), with ``O_NOFOLLOW`` (a planted symlink is
  refused) and, where a file is created anew, ``O_EXCL``;
- an existing one is used only when this process's user owns it: a file
  another user owns is refused with an error naming the path and its owner,
  since that user could have written it or could still map it;
- an existing file with wider permissions than this daemon would give it is
  not trusted either (the region is then recreated empty, see tiers/dram.py).

    FilePolicy.from_group(name)            -> policy (modes, group id)
    policy.open(path, flags, what=...)     -> fd, refused if another user owns it
    check_owned(fd_stat, path, what)       -> raise ConfigError naming the owner
    owner_name(uid)                        -> "uid 65534 (nobody)"
    claim_socket_path(path)                -> remove a stale socket, refuse a live one
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from kvstore import audit
from kvstore.errors import ConfigError

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def owner_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def check_owned(st: os.stat_result, path: str, what: str) -> None:
    """Refuse a file that is not a regular file owned by this process's user."""
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what}: {path} is not a regular file; refusing to use it")
    me = os.geteuid()
    if st.st_uid != me:
        audit.denied(owner_name(st.st_uid), f"{what} {path}", audit.FOREIGN_FILE)
        raise ConfigError(
            f"{what}: {path} is owned by {owner_name(st.st_uid)}, not by this daemon's user "
            f"({owner_name(me)}); refusing to use a file another user could have written "
            "or could still map: remove it, or choose another path"
        )


def read_small_file(
    path: str, what: str, max_bytes: int, *, private: bool, owned: bool = False
) -> bytes:
    """A small file's bytes (a token, a key), opened without following a link and
    checked regular. ``private``: readable by its owner only; ``owned``: ours.
    Anything else is refused with an error naming ``what`` and the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(f"{what}: {path} is a symbolic link; refusing to follow it") from None
        raise ConfigError(f"{what}: cannot read {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if owned:
            check_owned(st, path, what)  # a regular file too; audits a foreign owner itself
        elif not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if private and mode & 0o077:
            raise ConfigError(
                f"{what}: {path} has mode {mode:04o}: others could read it; make it 0600 "
                f"(chmod 600 {path})"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigError(f"{what}: {path} is larger than {max_bytes} bytes")
    return data


@dataclass(frozen=True, slots=True)
class FilePolicy:
    """Modes and group of the files the daemon creates."""

    gid: int = -1  # -1 = no group: files are the owner's alone
    group_name: str = ""

    @classmethod
    def from_group(cls, name: str) -> FilePolicy:
        if not name:
            return cls()
        try:
            return cls(grp.getgrnam(name).gr_gid, name)
        except KeyError:
            raise ConfigError(f"server.file_group: no group named {name!r}") from None

    @property
    def shared_mode(self) -> int:
        """The region's mode: clients in the group map it read-write."""
        return 0o660 if self.gid >= 0 else 0o600

    @property
    def private_mode(self) -> int:
        """Every other file (manifest, disk data, journal, locks): only the daemon reads
        them, and the manifest names every tenant's cache_salt."""
        return 0o600

    def apply(self, fd: int, mode: int) -> None:
        """Give a file this daemon created its mode (the umask never widens or narrows
        it), and the group when the mode grants the group anything."""
        os.fchmod(fd, mode)
        if self.gid >= 0 and mode & 0o070:
            os.fchown(fd, -1, self.gid)

    def trusted(self, st: os.stat_result, mode: int) -> bool:
        """Whether an existing file we own is no more open than we would make it."""
        extra = stat.S_IMODE(st.st_mode) & ~mode & 0o777
        wrong_group = self.gid >= 0 and st.st_gid != self.gid and stat.S_IMODE(st.st_mode) & 0o070
        return not extra and not wrong_group

    def open(self, path: str, flags: int, mode: int, *, what: str, check_mode: bool = True) -> int:
        """Open (creating when ``flags`` has O_CREAT) a file only this daemon's user owns.

        Never follows a symlink at ``path`` (ConfigError); other open failures
        are the caller's OSError to word. A file created here gets ``mode``
        and the group. A file that existed must be ours (ConfigError otherwise)
        and writable by no one else; its mode is narrowed to ``mode`` (files of
        older versions were 0644). ``check_mode=False`` leaves an existing file's
        mode to the caller (the region replaces one more open than ours).
        """
        created = False
        try:
            if flags & os.O_CREAT:
                try:
                    fd = os.open(path, flags | os.O_EXCL | _OPEN_FLAGS, mode)
                    created = True
                except FileExistsError:
                    flags &= ~os.O_CREAT
            if not created:
                fd = os.open(path, flags | _OPEN_FLAGS)
        except OSError:
            if os.path.islink(path):
                raise ConfigError(
                    f"{what}: {path} is a symbolic link; refusing to follow it"
                ) from None
            raise  # the caller words a plain open failure (permissions, missing directory)
        try:
            if created:
                self.apply(fd, mode)
            else:
                st = os.fstat(fd)
                check_owned(st, path, what)
            if not created and check_mode:
                if stat.S_IMODE(st.st_mode) & 0o022 & ~mode:
                    raise ConfigError(
                        f"{what}: {path} is writable by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}); refusing to trust its contents"
                    )
                if not self.trusted(st, mode):
                    self.apply(fd, mode)
        except BaseException:
            os.close(fd)
            if created:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        return fd


def claim_socket_path(path: str, what: str = "server.socket_path") -> None:
    """Remove a stale socket left by a crashed daemon; refuse to steal a live one."""
    p = Path(path)
    if not p.parent.is_dir():
        raise ConfigError(f"{what}: directory {p.parent} does not exist")
    if not p.exists() and not p.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        p.unlink()  # nobody listens: stale
        return
    finally:
        probe.close()
    raise ConfigError(f"{what}: another process is serving on {path}")
