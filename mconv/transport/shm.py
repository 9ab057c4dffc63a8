"""Carrying flat buckets between a trainer's processes and an engine's process on one host: each
bucket buffer is a file in shared memory (/dev/shm) that both sides map, so a bucket crosses as a
path and a list of entries (the CPU counterpart of one CUDA IPC handle per bucket); control
messages are JSON over an authenticated multiprocessing connection (no pickle)."""
from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import stat
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge

import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
BUCKET_PREFIX = "mconv-bucket-"


class SharedBuffer:
    """A uint8 tensor over a shared-memory file: `create` makes one of `nbytes`, `attach` maps an
    existing one by path. `close()` unmaps it; the creator's also removes the file. A creator that
    dies first (a trainer killed mid-run) leaves its files, which hold memory until removed: their
    names carry the creator's process id (and PID namespace), and the next `create` on the host
    removes those of this user's processes that are gone (remove_orphans)."""

    def __init__(self, path: str, nbytes: int, owner: bool):
        self.path, self.nbytes, self.owner = path, nbytes, owner
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int) -> "SharedBuffer":
        remove_orphans()
        fd, path = tempfile.mkstemp(prefix=f"{BUCKET_PREFIX}{_pid_namespace()}.{os.getpid()}-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        return cls(path, max(nbytes, 1), owner=True)

    @classmethod
    def attach(cls, path: str) -> "SharedBuffer":
        """Map the bucket file `path` that `create` made (in SHM_DIR, named mconv-bucket-*). Raises
        ValueError for any other path: a request naming a file is not trusted to name any file."""
        real = os.path.realpath(path)
        if os.path.dirname(real) != os.path.realpath(SHM_DIR or tempfile.gettempdir()) or \
                not os.path.basename(real).startswith(BUCKET_PREFIX):
            raise ValueError(f"{path} is not an mconv bucket file ({SHM_DIR or tempfile.gettempdir()}/{BUCKET_PREFIX}*)")
        return cls(path, os.path.getsize(path), owner=False)

    def close(self) -> None:
        del self.tensor  # the mapping cannot close while a tensor still exports it
        self._map.close()
        if self.owner and os.path.exists(self.path):
            os.unlink(self.path)


def _pid_namespace() -> int:
    """The id of this process's PID namespace (0 where the system does not say): process ids are
    only comparable within one, and containers sharing a /dev/shm may each have their own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def remove_orphans() -> list[str]:
    """Remove the bucket files (`create`'s, named mconv-bucket-<PID namespace>.<pid>-*) of this
    user's processes, in this PID namespace, that no longer run; returns their paths. A file of a
    running process, of another user's or namespace's, or without a process id in its name is
    left alone."""
    where = SHM_DIR or tempfile.gettempdir()
    namespace, removed = str(_pid_namespace()), []
    for name in os.listdir(where):
        owner = name.removeprefix(BUCKET_PREFIX).split("-", 1)[0].split(".")
        if not name.startswith(BUCKET_PREFIX) or len(owner) != 2 or owner[0] != namespace or not owner[1].isdigit():
            continue
        pid = owner[1]
        path = os.path.join(where, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # raises ProcessLookupError when no such process runs
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass  # another process removed it first
        except OSError:
            pass  # gone already, or a process we may not signal: it runs
    return removed


class AuthListener:
    """The engine side's listener on a Unix socket path (or "host:port"): multiprocessing's Listener,
    whose handshake (an HMAC challenge each way with `authkey`, as Listener(authkey=...) makes it) is
    done by `accept`, or by `serve` on each connection's own thread, so that a client that fails it
    or never answers stops no other. TypeError for an `authkey` that is not bytes (check_authkey)."""

    def __init__(self, address: str, authkey: bytes):
        check_authkey(authkey)
        try:
            self._listener = Listener(_address(address))
        except OSError as e:
            if e.errno != errno.EADDRINUSE or not _stale_socket(address):
                raise OSError(e.errno, f"cannot listen at {address}: {e.strerror}"
                              + (" (another receiver listens there)" if e.errno == errno.EADDRINUSE else "")) from None
            os.unlink(address)  # a killed receiver's socket file: no process listens at it
            self._listener = Listener(_address(address))
        self.authkey = authkey

    def accept(self, handshake: bool = True) -> Connection:
        """The next authenticated connection (multiprocessing.AuthenticationError for a wrong key);
        with `handshake=False` the next connection as it is, for the caller to authenticate
        (`serve` does, on the connection's own thread)."""
        connection = self._listener.accept()
        return _handshake(connection, self.authkey) if handshake else connection

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> "AuthListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stale_socket(address: str) -> bool:
    """Whether `address` is a Unix socket file at which no process listens (its receiver was killed)."""
    if not isinstance(_address(address), str):
        return False
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(address)
    except ConnectionRefusedError:
        return stat.S_ISSOCK(os.lstat(address).st_mode)
    except OSError:
        return False
    finally:
        probe.close()
    return False


def _handshake(conn: Connection, authkey: bytes) -> Connection:
    """The server side of multiprocessing's handshake (Listener.accept's order); closes `conn` if it fails."""
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def check_authkey(authkey) -> None:
    """TypeError, in one sentence, for an `authkey` that is not bytes (multiprocessing's handshake
    takes bytes only; a str failed every connection, on the receiver's side without a word)."""
    if not isinstance(authkey, bytes):
        raise TypeError(f"authkey is a {type(authkey).__name__}; give the key as bytes (e.g. "
                        "bytes.fromhex(hex_key), or a str's .encode())")


class Unreachable(ConnectionError):
    """`connect` found nothing listening at its address (its text says so, naming the address)."""


class RemoteError(RuntimeError):
    """The other side's error reply to a `request` (its text: the error, in one line)."""


def listen(address: str, authkey: bytes) -> AuthListener:
    """The engine side's listener on a Unix socket path (or "host:port")."""
    return AuthListener(address, authkey)


def connect(address: str, authkey: bytes, timeout: float | None = None) -> Connection:
    """A connection to the listener at `address` (a Unix socket path or "host:port"), authenticated
    with `authkey`. Raises Unreachable where nothing listens there (no such socket file, a refused
    connection, an unknown host), multiprocessing.AuthenticationError for another key than the
    listener's, TimeoutError where connecting and the handshake take more than `timeout` seconds (a
    listener that never answers: multiprocessing's Client has no timeout, so it runs on a thread of
    its own, left to end when that listener closes)."""
    if timeout is None:
        return _client(address, authkey)
    outcome: dict = {}

    def attempt() -> None:
        try:
            outcome["conn"] = _client(address, authkey)
        except BaseException as e:
            outcome["error"] = e
    thread = threading.Thread(target=attempt, daemon=True, name="mconv-connect")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"no answer from {address} within {timeout:g} s while connecting")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["conn"]


def _client(address: str, authkey: bytes) -> Connection:
    """multiprocessing's Client for `address`, with Unreachable saying what is wrong with it."""
    target = _address(address)
    try:
        return Client(target, authkey=authkey)
    except FileNotFoundError:
        raise Unreachable(f"nothing listens at {address}: no such socket file (start the receiver first)"
                          if "/" in address else f"{address!r} is neither an existing Unix socket nor host:port "
                                                 "(start the receiver first, or give its host:port)") from None
    except ConnectionRefusedError:
        raise Unreachable(f"nothing listens at {address} (start the receiver first)") from None
    except socket.gaierror as e:
        raise Unreachable(f"{address}: no host {target[0]!r} ({e.strerror})") from None


def _address(address: str):
    host, _, port = address.rpartition(":")
    return (host, int(port)) if port.isdigit() and "/" not in address else address


def send(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def receive(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes().decode())


def serve(listener: AuthListener, handle, closed=None) -> threading.Thread:
    """Accept connections on a daemon thread, each authenticated and served on a thread of its own
    (one that fails the handshake is closed; the others go on): every request
    goes to `handle(message, peer)`, `peer` a dict kept per connection; its dict is the reply, an
    exception becomes {"error": its text} (which `request` raises on the other side). When a
    connection ends, `closed(peer)` is called (if given)."""
    def answer(conn: Connection) -> None:
        try:
            _handshake(conn, listener.authkey)
        except Exception:  # a wrong key, or a client gone: this connection only
            return
        peer: dict = {}
        with conn:
            while True:
                try:
                    message = receive(conn)
                except (EOFError, OSError):
                    break
                try:
                    reply = handle(message, peer)
                except Exception as e:
                    reply = {"error": _said(e)}
                try:
                    send(conn, reply)
                except OSError:
                    break
        if closed is not None:
            closed(peer)

    def accept() -> None:
        while True:
            try:
                conn = listener.accept(handshake=False)  # authenticated on its own thread (answer)
            except OSError:  # the listener was closed
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return thread


def _said(error: Exception) -> str:
    """An error as a reply carries it: its text alone where that is a sentence of its own (a
    ValueError or RuntimeError the engine raised to say what is wrong), else prefixed by its type
    (a KeyError's text is only the key)."""
    text = str(error).strip()
    if isinstance(error, (ValueError, RuntimeError)) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def request(conn: Connection, message: dict, timeout: float | None = None) -> dict:
    """Send `message`, return the reply; an engine-side error comes back as RemoteError(its text),
    no reply within `timeout` seconds (None: wait as long as it takes) as TimeoutError."""
    send(conn, message)
    if timeout is not None and not conn.poll(timeout):
        raise TimeoutError(f"no reply to {message.get('op')!r} within {timeout:g} s")
    reply = receive(conn)
    if "error" in reply:
        raise RemoteError(reply["error"])
    return reply
