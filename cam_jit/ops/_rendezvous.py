"""The rendezvous of a group of ranks: the one place where cam_jit accepts connections from other
processes (used by `cam_get_comm` and `FusedDeepMoeBuffer.init`).

Rank 0 listens on the given address only (127.0.0.1 listens on loopback, never on every
interface); ranks 1..R-1 connect to it. A joiner is admitted only if it proves it belongs to the
job:

* with a per-job secret in ``CAM_JIT_RENDEZVOUS_TOKEN`` (the same on every rank; e.g. generated
  by the launcher), both sides prove knowledge of it with HMAC-SHA256 over fresh nonces, so a
  process without it can neither join nor pose as rank 0;
* without a secret, the address must be a loopback one and the process at the other end of the
  connection must run as the same user (or root), as the kernel's socket table says; a
  non-loopback address is refused unless ``CAM_JIT_RENDEZVOUS_INSECURE=1`` opts in to an
  unauthenticated rendezvous (anyone who can reach the port can then join).

Then each `exchange(record)` round gathers one JSON-able record per rank and returns them all to
every rank (rank 0 relays); `close()` closes every socket. Every wait is bounded by the deadline
given at construction; a peer whose connection drops is reported as such, with the time.
Messages are length-prefixed JSON of at most MAX_FRAME bytes.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import selectors
import socket
import struct
import time
from typing import Dict, List, Optional, Tuple

TOKEN_ENV = "CAM_JIT_RENDEZVOUS_TOKEN"
INSECURE_ENV = "CAM_JIT_RENDEZVOUS_INSECURE"
MAGIC = b"cam_jit-rendezvous-1"
MAX_FRAME = 1 << 20
RETRY_SECONDS = 0.05


class RendezvousError(RuntimeError):
    """The rendezvous failed: timed out, refused, or a member dropped out."""


def token() -> Optional[bytes]:
    """The per-job secret from CAM_JIT_RENDEZVOUS_TOKEN, None if unset or empty."""
    value = os.environ.get(TOKEN_ENV, "")
    return value.encode() if value else None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_address(where: str, host: str) -> None:
    """Without a secret, only loopback addresses, unless CAM_JIT_RENDEZVOUS_INSECURE=1."""
    if token() is None and not is_loopback(host) and os.environ.get(INSECURE_ENV, "") != "1":
        raise ValueError(
            f"{where}: a rendezvous at {host} (not a loopback address) needs a per-job secret: set {TOKEN_ENV} to "
            f"the same random string on every rank (e.g. `export {TOKEN_ENV}=$(openssl rand -hex 16)` in the "
            f"launcher), or set {INSECURE_ENV}=1 to let anyone who can reach the port join")


def _mac(key: bytes, *parts: bytes) -> str:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).hexdigest()


def _peer_uid(sock: socket.socket) -> Optional[int]:
    """uid owning the socket at the other end of a loopback TCP connection (from /proc/net/tcp*)."""
    local, remote = sock.getsockname()[:2], sock.getpeername()[:2]
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if _endpoint(fields[1]) == remote and _endpoint(fields[2]) == local:
                return int(fields[7])
    return None


def _endpoint(text: str) -> Tuple[str, int]:
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        host = str(ipaddress.ip_address(words).ipv4_mapped or ipaddress.ip_address(words))
    return host, int(port, 16)


class Rendezvous:
    """A formed group (see the module docstring). Construct it on every rank with the same
    (host, port, size); `what` names the caller in messages."""

    def __init__(self, what: str, host: str, port: int, rank: int, size: int, timeout: float):
        check_address(what, host)
        self.what, self.host, self.port, self.rank, self.size = what, host, port, rank, size
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self._token = token()
        self._peers: Dict[int, socket.socket] = {}  # rank 0: the members' connections
        self._server: Optional[socket.socket] = None  # ranks > 0: the connection to rank 0
        self._nonces: Dict[int, str] = {}  # rank 0: each member's nonce, for the table's MAC
        self.local_host = host  # the address of this rank on the interface that reaches rank 0
        try:
            if size > 1:
                self._serve() if rank == 0 else self._join()
        except BaseException:
            self.close()
            raise

    # -- forming the group -------------------------------------------------------------------------
    def _fail(self, text: str) -> RendezvousError:
        return RendezvousError(f"{self.what}: rendezvous at {self.host}:{self.port} (rank {self.rank} of {self.size}): "
                               f"{text}")

    def _left(self, doing: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._fail(f"{doing} did not finish within {self.timeout:g} s (CAM_JIT_COMM_TIMEOUT or the "
                             "caller's timeout)")
        return left

    def _serve(self) -> None:
        """Accepts joiners until every rank is admitted. Joiners are served side by side (one
        that stays silent or is refused delays nobody) until the deadline."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        selector = selectors.DefaultSelector()
        pending: Dict[socket.socket, List[bytes]] = {}  # joiner -> [nonce, bytes received]
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((self.host, self.port))
            except OSError as err:
                raise self._fail(f"rank 0 cannot listen there: {err}") from err
            listener.listen(64)
            listener.setblocking(False)
            selector.register(listener, selectors.EVENT_READ)
            while len(self._peers) < self.size - 1:
                missing = sorted(set(range(1, self.size)) - set(self._peers))
                for key, _ in selector.select(self._left(f"waiting for rank(s) {missing} to join")):
                    if key.fileobj is listener:
                        self._greet(listener, selector, pending)
                    else:
                        self._hear(key.fileobj, selector, pending)
        finally:
            for conn in pending:
                conn.close()
            selector.close()
            listener.close()

    def _greet(self, listener: socket.socket, selector, pending: Dict[socket.socket, List[bytes]]) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        nonce = secrets.token_hex(16).encode()
        data = json.dumps({"magic": MAGIC.decode(), "nonce": nonce.decode()}).encode()
        try:
            conn.setblocking(True)
            conn.settimeout(1.0)  # a few bytes into a fresh connection's empty buffer
            conn.sendall(struct.pack("!I", len(data)) + data)
            conn.setblocking(False)
        except OSError:
            conn.close()
            return
        pending[conn] = [nonce, b""]
        selector.register(conn, selectors.EVENT_READ)

    def _hear(self, conn: socket.socket, selector, pending: Dict[socket.socket, List[bytes]]) -> None:
        """Reads what a joiner sent; admits or refuses it once its whole hello arrived."""
        nonce, data = pending[conn]
        length = struct.unpack("!I", data[:4])[0] if len(data) >= 4 else 0
        wanted = 4 - len(data) if len(data) < 4 else 4 + length - len(data)  # never past the hello
        try:
            chunk = conn.recv(min(wanted, MAX_FRAME)) if length <= MAX_FRAME else b""
        except OSError:
            chunk = b""
        data += chunk
        pending[conn][1] = data
        complete = len(data) >= 4 and len(data) == 4 + struct.unpack("!I", data[:4])[0]
        if chunk and not complete:
            return
        selector.unregister(conn)
        del pending[conn]
        if not chunk:
            conn.close()
            return
        try:
            rank = self._admit(conn, nonce, json.loads(data[4:]) if complete else None)
        except (ValueError, KeyError, TypeError) as err:
            self._refuse(conn, str(err))
            return
        conn.setblocking(True)
        self._peers[rank] = conn

    def _admit(self, conn: socket.socket, nonce: bytes, hello: object) -> int:
        """Checks a joiner's hello; returns its rank, or raises ValueError (then it is refused)."""
        if not isinstance(hello, dict):
            raise ValueError("it did not send a cam_jit hello")
        rank, size = hello["rank"], hello["size"]
        if size != self.size or not isinstance(rank, int) or not 0 < rank < size or rank in self._peers:
            raise ValueError(f"it announced rank {rank} of {size}: not a free rank of this group of {self.size}")
        if self._token is not None:
            want = _mac(self._token, b"join", nonce, str(rank).encode(), str(size).encode())
            if not hmac.compare_digest(str(hello.get("mac", "")), want):
                raise ValueError(f"rank {rank} did not prove the secret of {TOKEN_ENV}")
        elif is_loopback(self.host):
            uid = _peer_uid(conn)
            if uid not in (os.geteuid(), 0):
                raise ValueError(f"the process claiming rank {rank} runs as uid {uid}, not as this user "
                                 f"(uid {os.geteuid()}); set {TOKEN_ENV} to admit other users")
        self._nonces[rank] = str(hello.get("nonce", ""))
        return rank

    def _refuse(self, conn: socket.socket, why: str) -> None:
        data = json.dumps({"error": why}).encode()
        try:
            conn.setblocking(True)
            conn.settimeout(0.5)
            conn.sendall(struct.pack("!I", len(data)) + data)
        except OSError:
            pass
        conn.close()

    def _join(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        last = None
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(min(self._left(f"reaching rank 0 ({last})" if last else "reaching rank 0"), 1.0))
            try:
                sock.connect((self.host, self.port))
                break
            except OSError as err:
                sock.close()
                last = str(err)  # not the exception: its traceback would keep the callers' frames alive
                time.sleep(min(RETRY_SECONDS, max(self.deadline - time.monotonic(), 0)))
        self._server = sock
        self.local_host = sock.getsockname()[0]
        hello = self._recv(sock, "rank 0's greeting")
        if hello.get("magic") != MAGIC.decode():
            raise self._fail(f"the process listening there is not a cam_jit rendezvous (it sent {str(hello)[:80]})")
        nonce = secrets.token_hex(16).encode()
        answer = {"rank": self.rank, "size": self.size, "nonce": nonce.decode()}
        if self._token is not None:
            answer["mac"] = _mac(self._token, b"join", hello["nonce"].encode(), str(self.rank).encode(),
                                 str(self.size).encode())
        elif is_loopback(self.host):
            uid = _peer_uid(sock)
            if uid not in (os.geteuid(), 0):
                raise self._fail(f"the process listening there runs as uid {uid}, not as this user "
                                 f"(uid {os.geteuid()}); set {TOKEN_ENV} to rendezvous with other users")
        self._send(sock, answer, "rank 0")
        self._nonce = nonce

    # -- rounds --------------------------------------------------------------------------------------
    def exchange(self, record: object) -> List[object]:
        """Every rank's `record` (JSON-able), by rank; raises RendezvousError naming a rank that
        dropped out (and when) or the timeout."""
        if self.size == 1:
            return [record]
        if self.rank == 0:
            records = {0: record}
            for rank, conn in sorted(self._peers.items()):
                records[rank] = self._recv(conn, f"rank {rank}")["record"]
            table = [records[r] for r in range(self.size)]
            blob = json.dumps(table, sort_keys=True)
            for rank, conn in self._peers.items():
                reply = {"records": blob}
                if self._token is not None:
                    reply["mac"] = _mac(self._token, b"table", self._nonces[rank].encode(), blob.encode())
                self._send(conn, reply, f"rank {rank}")
            return table
        self._send(self._server, {"record": record}, "rank 0")
        reply = self._recv(self._server, "rank 0")
        if "error" in reply:
            raise self._fail(f"rank 0 refused this process: {reply['error']}")
        blob = reply["records"]
        if self._token is not None and not hmac.compare_digest(
                str(reply.get("mac", "")), _mac(self._token, b"table", self._nonce, blob.encode())):
            raise self._fail(f"the process listening there did not prove the secret of {TOKEN_ENV}")
        return json.loads(blob)

    def close(self) -> None:
        """Closes every connection (idempotent)."""
        for conn in self._peers.values():
            conn.close()
        self._peers.clear()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- framing -------------------------------------------------------------------------------------
    def _send(self, sock: socket.socket, message: dict, whom: str) -> None:
        data = json.dumps(message).encode()
        sock.settimeout(self._left(f"sending to {whom}"))
        try:
            sock.sendall(struct.pack("!I", len(data)) + data)
        except OSError as err:
            raise self._dropped(whom, err) from err

    def _recv(self, sock: socket.socket, whom: str) -> dict:
        header = self._read(sock, 4, whom)
        (length,) = struct.unpack("!I", header)
        if length > MAX_FRAME:
            raise self._fail(f"{whom} sent a message of {length} bytes (more than {MAX_FRAME}): not a cam_jit rank")
        try:
            message = json.loads(self._read(sock, length, whom))
        except ValueError as err:
            raise self._fail(f"{whom} sent a malformed message: {err}") from err
        if not isinstance(message, dict):
            raise self._fail(f"{whom} sent a malformed message")
        if "error" in message and self.rank != 0:
            raise self._fail(f"rank 0 refused this process: {message['error']}")
        return message

    def _read(self, sock: socket.socket, count: int, whom: str) -> bytes:
        data = b""
        while len(data) < count:
            sock.settimeout(self._left(f"waiting for {whom}"))
            try:
                chunk = sock.recv(count - len(data))
            except socket.timeout:
                continue
            except OSError as err:
                raise self._dropped(whom, err) from err
            if not chunk:
                raise self._dropped(whom, None)
            data += chunk
        return data

    def _dropped(self, whom: str, err: Optional[BaseException]) -> RendezvousError:
        return self._fail(f"{whom} closed its connection at {time.strftime('%H:%M:%S')}, "
                          f"{self.timeout - (self.deadline - time.monotonic()):.2f} s into the rendezvous (it exited, "
                          f"failed or gave up: see its error)" + (f": {err}" if err else ""))
