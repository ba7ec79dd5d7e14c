"""The elastic job's key-value store: the one rendezvous point that outlives any worker.

A :class:`StoreServer` runs in the driver (the Ray driver, or whatever starts the
workers and stays up) and binds to the address the workers use. Every connection
must first prove it knows the job's secret: the server sends a random nonce and the
client answers ``HMAC-SHA256(secret, nonce)``, as Horovod's driver does with its
secret key. A client without the secret is disconnected (counted in
:attr:`StoreServer.refused`) and the job goes on. The operations are those a
``torch.distributed.Store`` needs (set, get, add, compare-and-set, check, wait,
delete).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from typing import Optional, Sequence

from ...core.errors import RendezvousError

__all__ = ["StoreServer", "StoreClient", "new_secret"]

_SET, _GET, _ADD, _CAS, _CHECK, _WAIT, _DELETE, _NUM = range(8)
_OK, _TIMEOUT = 0, 1
_NONCE = 32
_DOMAIN = b"shardwise-rendezvous-v1"
_MAX_VALUE = 1 << 31


def new_secret() -> str:
    """A fresh per-job secret (hex), handed to the workers by the launcher."""
    return secrets.token_hex(32)


def _proof(secret: str, nonce: bytes) -> bytes:
    return hmac.new(bytes.fromhex(secret), _DOMAIN + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the rendezvous connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send_frame(sock: socket.socket, head: int, parts: Sequence[bytes]) -> None:
    out = [struct.pack("!BB", head, len(parts))]
    for p in parts:
        out += [struct.pack("!I", len(p)), p]
    sock.sendall(b"".join(out))


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    head, count = struct.unpack("!BB", _recv_exact(sock, 2))
    parts = []
    for _ in range(count):
        (n,) = struct.unpack("!I", _recv_exact(sock, 4))
        if n > _MAX_VALUE:
            raise ConnectionError("rendezvous frame too large")
        parts.append(_recv_exact(sock, n))
    return head, parts


class _Data:
    """The key-value map, with a condition so that blocking reads wake on writes."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def wait_for(self, keys: Sequence[str], timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: all(k in self.values for k in keys), timeout=timeout)


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock: socket.socket = self.request
        nonce = os.urandom(_NONCE)
        try:
            sock.sendall(nonce)
            answer = _recv_exact(sock, 32)
        except (OSError, ConnectionError):
            self.server.owner._refuse()
            return
        if not hmac.compare_digest(answer, _proof(self.server.owner.secret, nonce)):
            self.server.owner._refuse()
            return  # closing the socket is the refusal
        sock.sendall(b"\x01")
        data = self.server.owner.data
        while True:
            try:
                op, args = _recv_frame(sock)
            except (OSError, ConnectionError, struct.error):
                return
            try:
                head, reply = self._apply(data, op, args)
            except (ValueError, IndexError, UnicodeDecodeError):
                return  # malformed request from an authenticated peer: drop it
            try:
                _send_frame(sock, head, reply)
            except OSError:
                return

    @staticmethod
    def _apply(data: _Data, op: int, args: list[bytes]) -> tuple[int, list[bytes]]:
        key_args = args if op in (_CHECK, _GET, _WAIT) else args[:1]
        keys = [a.decode() for a in key_args]
        with data.changed:
            if op == _SET:
                data.values[keys[0]] = args[1]
                data.changed.notify_all()
                return _OK, []
            if op == _ADD:
                value = int(data.values.get(keys[0], b"0")) + int(args[1])
                data.values[keys[0]] = str(value).encode()
                data.changed.notify_all()
                return _OK, [str(value).encode()]
            if op == _CAS:
                current = data.values.get(keys[0])
                if current is None:
                    if args[1]:
                        return _OK, [args[1]]
                    data.values[keys[0]] = args[2]
                    data.changed.notify_all()
                    return _OK, [args[2]]
                if current == args[1]:
                    data.values[keys[0]] = args[2]
                    data.changed.notify_all()
                    return _OK, [args[2]]
                return _OK, [current]
            if op == _CHECK:
                return _OK, [b"1" if all(k in data.values for k in keys) else b"0"]
            if op == _DELETE:
                return _OK, [b"1" if data.values.pop(keys[0], None) is not None else b"0"]
            if op == _NUM:
                return _OK, [str(len(data.values)).encode()]
        if op in (_GET, _WAIT):
            timeout = float(args[0])
            wanted = keys[1:]
            if not data.wait_for(wanted, timeout):
                return _TIMEOUT, []
            if op == _WAIT:
                return _OK, []
            with data.changed:
                return _OK, [data.values[wanted[0]]]
        raise ValueError(f"unknown store op {op}")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: "StoreServer"


class StoreServer:
    """The driver's store: serves authenticated clients on ``host:port`` from a background thread."""

    def __init__(self, secret: str, host: str = "0.0.0.0", port: int = 0) -> None:
        self.secret = secret
        self.data = _Data()
        self.refused = 0
        self._lock = threading.Lock()
        self._server = _Server((host, port), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="shardwise-store",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def _refuse(self) -> None:
        with self._lock:
            self.refused += 1

    # In-process access for the driver (no socket).
    def set(self, key: str, value: bytes) -> None:
        with self.data.changed:
            self.data.values[key] = value
            self.data.changed.notify_all()

    def get(self, key: str) -> Optional[bytes]:
        with self.data.changed:
            return self.data.values.get(key)

    def keys(self, prefix: str = "") -> list[str]:
        with self.data.changed:
            return [k for k in self.data.values if k.startswith(prefix)]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class StoreClient:
    """A connection to a :class:`StoreServer` that proved it holds the job's secret."""

    def __init__(self, host: str, port: int, secret: str, *, timeout: float = 300.0,
                 connect_timeout: float = 60.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._lock = threading.Lock()
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=connect_timeout)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RendezvousError(f"cannot reach the rendezvous store at {host}:{port}: {exc}") from None
                time.sleep(0.2)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            nonce = _recv_exact(self._sock, _NONCE)
            self._sock.sendall(_proof(secret, nonce))
            ok = _recv_exact(self._sock, 1)
        except (OSError, ConnectionError):
            ok = b""
        if ok != b"\x01":
            self._sock.close()
            raise RendezvousError(f"the rendezvous store at {host}:{port} refused this process "
                                  "(wrong or missing job secret)")
        self._sock.settimeout(None)

    def local_address(self) -> str:
        """This host's address on the interface that reaches the store (where peers can reach us)."""
        return self._sock.getsockname()[0]

    def _call(self, op: int, args: Sequence[bytes]) -> tuple[int, list[bytes]]:
        with self._lock:
            try:
                _send_frame(self._sock, op, args)
                return _recv_frame(self._sock)
            except (OSError, ConnectionError) as exc:
                raise RendezvousError(f"lost the rendezvous store at {self.host}:{self.port}: {exc}") from None

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, [key.encode(), value])

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        wait = self.timeout if timeout is None else timeout
        head, reply = self._call(_GET, [str(wait).encode(), key.encode()])
        if head == _TIMEOUT:
            raise TimeoutError(f"rendezvous key {key!r} did not appear within {wait:g} s")
        return reply[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(_ADD, [key.encode(), str(amount).encode()])[1][0])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(_CAS, [key.encode(), expected, desired])[1][0]

    def check(self, keys: Sequence[str]) -> bool:
        return self._call(_CHECK, [k.encode() for k in keys])[1][0] == b"1"

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        wait = self.timeout if timeout is None else timeout
        head, _ = self._call(_WAIT, [str(wait).encode()] + [k.encode() for k in keys])
        if head == _TIMEOUT:
            raise TimeoutError(f"rendezvous keys {list(keys)} did not appear within {wait:g} s")

    def delete(self, key: str) -> bool:
        return self._call(_DELETE, [key.encode()])[1][0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(_NUM, [])[1][0])

    def close(self) -> None:
        self._sock.close()
