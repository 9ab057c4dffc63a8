"""Carrying flat buckets between a trainer's processes and an engine's process on one host: each
bucket buffer is a file in shared memory (/dev/shm) that both sides map, so a bucket crosses as a
path and a list of entries (the CPU counterpart of one CUDA IPC handle per bucket); control
messages are JSON over an authenticated multiprocessing connection (no pickle)."""
from __future__ import annotations

import atexit
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
    existing one by path. `close()` unmaps it; the creator's also removes the file, and the
    creator's process removes those it never closed when it exits normally (an engine never
    closed: a file in /dev/shm holds its memory until removed; a forked child that exits leaves
    its parent's files alone). A creator that dies (a trainer killed mid-run) leaves its files:
    their names carry the creator's process id (and PID namespace), and the next `create` on the
    host removes those of this user's processes that are gone (remove_orphans)."""

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
        _CREATED[path] = os.getpid()
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
        if self.owner:
            _CREATED.pop(self.path, None)
            _remove(self.path)


_CREATED: dict[str, int] = {}  # the bucket files `create` made and `close` did not remove: path -> creator's pid


@atexit.register
def _remove_created() -> None:
    """At the interpreter's normal exit, remove the bucket files this process created and never
    closed. Only the creator's: a forked child inherits this dict (and this handler, which runs
    when it exits normally) while its parent still uses the files."""
    for path, creator in list(_CREATED.items()):
        if creator == os.getpid():
            _remove(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # removed already


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
    or never answers stops no other. `close()` ends the connections `serve` serves too.

    Refused in one sentence: an `authkey` that is not bytes (TypeError, check_authkey) or is empty
    (ValueError), an `address` that is no str or path (TypeError) or is empty (ValueError:
    multiprocessing would listen at a path of its own choosing, which no trainer knows), and an
    address it cannot listen at (OSError: in use by a live listener, a Unix path too long, ...)."""

    def __init__(self, address: str, authkey: bytes):
        check_authkey(authkey)
        if not isinstance(address, (str, os.PathLike)):
            raise TypeError(f"address={address!r} is no str or path: give a Unix socket path or \"host:port\"")
        address = os.fspath(address)
        if not address:
            raise ValueError("address is empty: give a Unix socket path or \"host:port\"")
        if "://" in address:
            raise ValueError(f"{address} is a URL: a receiver listens at a Unix socket path or \"host:port\"")
        self._listener = _listen(address)
        self.address, self.authkey = address, authkey
        self._guard = threading.Lock()  # _served and _closed, between the accept thread, serving threads and close()
        self._served: dict[Connection, threading.Thread] = {}  # connections `serve` serves: their threads
        self._accepting: threading.Thread | None = None  # serve's accepting thread
        self._closed = False

    def accept(self, handshake: bool = True) -> Connection:
        """The next authenticated connection (multiprocessing.AuthenticationError for a wrong key);
        with `handshake=False` the next connection as it is, for the caller to authenticate
        (`serve` does, on the connection's own thread)."""
        connection = self._listener.accept()
        return _handshake(connection, self.authkey) if handshake else connection

    def serve(self, handle, closed=None) -> threading.Thread:
        """Accept connections on a daemon thread, each authenticated and served on a thread of its
        own (one that fails the handshake is closed; the others go on): every request goes to
        `handle(message, peer)`, `peer` a dict kept per connection; its dict is the reply, an
        exception becomes {"error": its text} (which `request` raises on the other side). When an
        authenticated connection ends (the client closed it, a message that is no JSON, or
        `close()`), `closed(peer)` is called (if given). A callable `handle` leaves in
        `peer["then"]` is called once its reply is sent (work the client need not wait for).
        Returns the accepting thread."""
        def answer(conn: Connection) -> None:
            try:
                _handshake(conn, self.authkey)
            except Exception:  # a wrong key, or a client gone: this connection only
                self._drop(conn)
                return
            peer: dict = {}
            try:
                while True:
                    try:
                        message = receive(conn)
                    except (EOFError, OSError, ValueError):  # closed (by either side), or no JSON
                        break
                    try:
                        reply = handle(message, peer)
                    except Exception as e:
                        reply = {"error": _said(e)}
                    then = peer.pop("then", None)
                    try:
                        send(conn, reply)
                    except OSError:
                        break
                    finally:
                        if then is not None:
                            try:
                                then()
                            except Exception:  # (its own errors are its to report: the connection goes on)
                                pass
            finally:
                self._drop(conn)
            if closed is not None:
                closed(peer)

        def accept() -> None:
            while True:
                try:
                    conn = self.accept(handshake=False)  # authenticated on its own thread (answer)
                except OSError:  # the listener was closed
                    return
                with self._guard:
                    if self._closed:
                        conn.close()
                        return
                    thread = threading.Thread(target=answer, args=(conn,), daemon=True,
                                              name=f"mconv-serve {self.address}")
                    self._served[conn] = thread
                    thread.start()  # (under the guard: close() joins only started threads)

        self._accepting = threading.Thread(target=accept, daemon=True, name=f"mconv-accept {self.address}")
        self._accepting.start()
        return self._accepting

    def _drop(self, conn: Connection) -> None:
        """A served connection ends: closed, under the guard, so that close() never shuts down a
        descriptor number the system may have given to another file since."""
        with self._guard:
            self._served.pop(conn, None)
            conn.close()

    def close(self) -> None:
        """Stop listening (the address is free for another listener) and end every connection
        `serve` serves: a client's next request on one fails (a RemoteEngine then connects anew, to
        whatever listens at the address by then). Returns once `serve`'s threads have ended, each
        connection's having called `closed`; one in the middle of a request ends once it has
        handled it."""
        with self._guard:
            if not self._closed:
                self._closed = True
                # Closing a socket does not wake a thread blocked in accept() or recv() on it; shutting it down does.
                _shut_down(getattr(getattr(self._listener, "_listener", None), "_socket", None))
                self._listener.close()
            for conn in self._served:
                try:
                    _shut_down(socket.socket(fileno=os.dup(conn.fileno())), close=True)
                except OSError:
                    pass  # closed already
            threads = [t for t in (self._accepting, *self._served.values())
                       if t is not None and t is not threading.current_thread()]
        for thread in threads:
            thread.join()

    def __enter__(self) -> "AuthListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shut_down(sock: socket.socket | None, close: bool = False) -> None:
    """Shut `sock` down both ways (a thread blocked in accept() or recv() on it returns), then
    close it if `close` (a duplicate of another object's descriptor)."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (the other side left first)
    finally:
        if close:
            sock.close()


# Linux's limit on a Unix socket path (sun_path is 108 bytes, a terminating zero included); others' is lower
UNIX_PATH_MAX = 107


def _too_long(error: OSError) -> bool:
    """Whether `error` is socket's refusal of a Unix socket path longer than the OS allows (it has no errno)."""
    return error.errno is None and "too long" in str(error)


def _too_long_reason(address: str) -> str:
    return (f"the path is {len(os.fsencode(address))} bytes, longer than the OS allows for a Unix socket (about "
            f"{UNIX_PATH_MAX}): give the receiver and the trainer's engine a shorter one (e.g. in /tmp)")


def _listen(address: str) -> Listener:
    """multiprocessing's Listener at `address`, taking over a Unix socket file at which no process
    listens (a killed receiver's); OSError in one sentence saying what to do where it cannot."""
    try:
        return Listener(_address(address))
    except OverflowError:  # (socket's error for a port number out of range)
        raise OSError(f"cannot listen at {address}: no port {_address(address)[1]} (0-65535): give another") from None
    except OSError as e:
        error = e
    if error.errno == errno.EADDRINUSE and _stale_socket(address):
        os.unlink(address)  # a killed receiver's socket file: no process listens at it
        try:
            return Listener(_address(address))
        except OSError as e:
            error = e
    if _too_long(error):
        reason = _too_long_reason(address)
    elif error.errno == errno.EADDRINUSE:
        reason = "address already in use (another receiver listens there: close it, or give this one another address)"
    elif error.errno == errno.ENOENT:
        reason = f"no directory {os.path.dirname(address) or '.'}: create it, or give a path in an existing one"
    else:
        reason = f"{error.strerror or error}: give another address"
    refused = OSError(f"cannot listen at {address}: {reason}")
    refused.errno = error.errno  # the one-sentence text without "[Errno N]", the number kept for callers
    raise refused from None


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
    takes bytes only; a str failed every connection, on the receiver's side without a word);
    ValueError for an empty one (the trainer's engine and the receiver share the refusal)."""
    if not isinstance(authkey, bytes):
        raise TypeError(f"authkey is a {type(authkey).__name__}; give the key as bytes (e.g. "
                        "bytes.fromhex(hex_key), or a str's .encode())")
    if not authkey:
        raise ValueError("authkey is empty, so any process could connect: give a secret key, the same to the "
                         "receiver and the trainer's engine (e.g. bytes.fromhex of `openssl rand -hex 32`)")


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
        raise TimeoutError(f"no answer from {address} within {timeout:g} s while connecting: something accepts "
                           "connections there but does not answer (a receiver made but not started: call its "
                           "start(); or another service)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["conn"]


def _client(address: str, authkey: bytes) -> Connection:
    """multiprocessing's Client for `address`, with Unreachable saying what is wrong with it."""
    if not address:
        raise Unreachable("the engine's address is empty: give its receiver's Unix socket path or \"host:port\"")
    if "://" in address:
        raise Unreachable(f"{address} is a URL: give the receiver's Unix socket path or \"host:port\" (a vLLM server's "
                          "HTTP address is VLLMServerEngine's)")
    target = _address(address)
    try:
        return Client(target, authkey=authkey)
    except OverflowError:  # (socket's error for a port number out of range)
        raise Unreachable(f"{address}: no port {target[1]} (0-65535)") from None
    except FileNotFoundError:
        raise Unreachable(f"nothing listens at {address}: no such socket file (start the receiver first)"
                          if "/" in address else f"{address!r} is neither an existing Unix socket nor host:port "
                                                 "(start the receiver first, or give its host:port)") from None
    except ConnectionRefusedError:
        raise Unreachable(f"nothing listens at {address} (start the receiver first)") from None
    except socket.gaierror as e:
        raise Unreachable(f"{address}: no host {target[0]!r} ({e.strerror})") from None
    except OSError as e:
        if not _too_long(e):
            raise
        raise Unreachable(f"nothing can listen at {address}: {_too_long_reason(address)}") from None


def _address(address: str):
    host, _, port = address.rpartition(":")
    return (host, int(port)) if port.isdigit() and "/" not in address else address


def send(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def receive(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes().decode())


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
    return await_reply(conn, message, timeout)


def await_reply(conn: Connection, message: dict, timeout: float | None = None) -> dict:
    """The reply to `message`, sent already (`send`): as `request` returns it."""
    if timeout is not None and not conn.poll(timeout):
        raise TimeoutError(f"no reply to {message.get('op')!r} within {timeout:g} s")
    reply = receive(conn)
    if "error" in reply:
        raise RemoteError(reply["error"])
    return reply
