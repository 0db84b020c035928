"""Binding the daemon's listening address, and removing its ipc socket file at exit.

An ``ipc://`` socket's folder must be ours and closed to others (created 0700 if missing; an
existing folder's mode is never changed), so no other local user can put a fake daemon there; an
existing socket file is removed only if nothing answers on it, and at exit only the very file this
daemon bound is removed (device, inode and change time: an inode number alone is reused as soon as
a file is deleted).

The same folder holds the key local HTTP clients may present where the peer's user cannot be told
(``write_private_key``): a 0600 file, removed at exit by the same rule.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import zmq
import zmq.asyncio

from clients.address import ipc_path, runtime_dir, unsafe_reason
from scheduler.settings import BindError

#: How long an existing socket file may take to accept a connection before it counts as dead.
LIVE_SOCKET_TIMEOUT_S = 0.5

#: The bound socket file's identity: device, inode and change time.
BoundFile = tuple[int, int, int]


def bind_listen(sock: zmq.asyncio.Socket, addr: str) -> BoundFile | None:
    """Bind ``sock`` to ``addr``, or raise ``BindError``; for ``ipc://``, returns the identity of
    the socket file bound (``None`` for tcp and Linux abstract sockets, which have no file)."""
    path = ipc_path(addr)
    if path is None or str(path).startswith("@"):  # tcp, or a Linux abstract socket (no file)
        _bind_or_refuse(sock, addr)
        return None
    _own_folder(path.parent, addr)
    _clear_dead_socket(path, addr)
    _bind_or_refuse(sock, addr)
    path.chmod(0o600)
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def unlink_bound(addr: str, bound: BoundFile | None) -> None:
    """Remove the socket file ``bind_listen`` bound at ``addr``, and only if it is still that file."""
    path = ipc_path(addr)
    if path is not None:
        unlink_if_same(path, bound)


def write_private_key(addr: str, key: str) -> tuple[Path, BoundFile]:
    """Write ``key`` to a new 0600 file in the daemon's private folder (the ipc socket's folder of
    ``addr``, else the per-user runtime folder); returns its path and identity, for ``unlink_if_same``."""
    sock = ipc_path(addr)
    if sock is not None and not str(sock).startswith("@"):
        folder, name = sock.parent, f"{sock.name}.http-key"
    else:
        folder, name = runtime_dir(), f"http-{os.getpid()}.key"
    _own_folder(folder, addr)
    path = folder / name
    path.unlink(missing_ok=True)  # a private folder: only a previous daemon of ours left it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, f"{key}\n".encode())
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return path, (st.st_dev, st.st_ino, st.st_ctime_ns)


def unlink_if_same(path: Path, bound: BoundFile | None) -> None:
    """Remove ``path`` only if it is still the file ``bound`` identifies."""
    if bound is None:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino, st.st_ctime_ns) == bound:
        path.unlink(missing_ok=True)


def _own_folder(folder: Path, addr: str) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(mode=0o700)
        folder.chmod(0o700)  # ours, just made: the mode must not depend on the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise BindError(f"cannot listen on {addr}: cannot create {folder}: {exc.strerror}") from None
    reason = unsafe_reason(folder)
    if reason is not None:
        raise BindError(
            f"refusing to listen on {addr}: {reason}; use a folder only you can write "
            "(leave --listen out for the private default)"
        )


def _clear_dead_socket(path: Path, addr: str) -> None:
    """Remove a socket file left by a daemon that did not exit cleanly; refuse a live one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise BindError(f"cannot listen on {addr}: {path} exists and is not a socket; remove it or pick another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(LIVE_SOCKET_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # nobody listens: a stale file
        return
    except TimeoutError:
        pass  # a listener too busy to accept is still a listener
    except OSError as exc:
        raise BindError(f"cannot listen on {addr}: cannot check the existing {path}: {exc.strerror}") from None
    finally:
        probe.close()
    raise BindError(f"address in use: a daemon is already listening on {addr}; stop it or pick another --listen")


def _bind_or_refuse(sock: zmq.asyncio.Socket, addr: str) -> None:
    try:
        sock.bind(addr)
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise BindError(f"address in use: {addr}; stop what listens there or pick another --listen") from None
        raise BindError(f"cannot listen on {addr}: {exc}") from None
