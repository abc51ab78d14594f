"""The Redis connection under `RemoteStore`: every call ends by its deadline and reads at most its budget.

redis-py's `socket_timeout` bounds each read, not a call: a server trickling one byte every 0.3 s holds a
call as long as it likes, name resolution has no timeout at all, and a bulk reply's header is believed (a
fake `$100000000000` is buffered for as long as bytes come). `limits(seconds, budget)` sets, for the
calling thread, a deadline and a byte budget; the connections made here resolve, connect, write and read
only within them, and refuse a bulk reply longer than the budget before reading any of it.

Imported only where the `redis` package is installed. Uses two redis-py internals (`_RESP2Parser`,
`SocketBuffer`, present from redis-py 5 on) for the bulk-header check; the socket-level limits need none.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import redis
from redis._parsers import _RESP2Parser
from redis._parsers.socket import SocketBuffer
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from .remote import RemoteReplyError

SLACK_BYTES = 1 << 20  # what a call may read besides the values it announces with allow(): headers, small replies


class _Limits(threading.local):
    deadline: float | None = None  # time.monotonic() by which the thread's current call ends; None: no call
    budget: int = 0  # bytes the current call may still read


_limits = _Limits()


@contextmanager
def limits(seconds: float, budget: int = SLACK_BYTES) -> Iterator[None]:
    """Within the block, this thread's Redis I/O ends `seconds` from now (or at an enclosing block's
    deadline, if sooner) and reads at most `budget` bytes."""
    outer = (_limits.deadline, _limits.budget)
    deadline = time.monotonic() + seconds
    _limits.deadline = deadline if outer[0] is None else min(deadline, outer[0])
    _limits.budget = budget
    try:
        yield
    finally:
        _limits.deadline, _limits.budget = outer


def allow(nbytes: int) -> None:
    """Let the current call read `nbytes` more: a value whose length the server has just told (STRLEN)."""
    _limits.budget += nbytes


def _left(cap: float | None) -> float | None:
    """The socket timeout for the next operation: `cap`, cut to what is left of the call (socket.timeout
    when nothing is)."""
    if _limits.deadline is None:
        return cap
    left = _limits.deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("the remote call's deadline has passed")
    return left if cap is None else min(cap, left)


def _spend(nbytes: int) -> None:
    if _limits.deadline is None:
        return
    if nbytes > _limits.budget:
        raise RemoteReplyError("a command", f"is longer than the {_limits.budget} bytes this call may still read")
    _limits.budget -= nbytes


class _LimitedSocket:
    """A connected socket whose every write and read ends by the call's deadline and whose reads count
    against its budget; anything else goes to the socket itself."""

    def __init__(self, sock: socket.socket):
        self._sock, self._timeout = sock, sock.gettimeout()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, value: float | None) -> None:
        self._timeout = value  # redis-py's per-operation timeout: applied, cut to the deadline, at each operation

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, size: int, *flags: int) -> bytes:
        self._sock.settimeout(_left(self._timeout))
        data = self._sock.recv(size, *flags)
        _spend(len(data))
        return data

    def sendall(self, data: bytes, *flags: int) -> None:
        self._sock.settimeout(_left(self._timeout))  # sendall's timeout covers the whole send (Python >= 3.5)
        self._sock.sendall(data, *flags)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _resolve(host: str, port: int, family: int, seconds: float | None) -> list:
    """getaddrinfo within `seconds`: the C resolver has no timeout of its own (a silent DNS server holds it
    ~10 s), so it runs on a daemon thread that is left behind when it is late."""
    if _is_address(host):
        return socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    box: list = []

    def run() -> None:
        try:
            box.append(socket.getaddrinfo(host, port, family, socket.SOCK_STREAM))
        except OSError as err:
            box.append(err)

    worker = threading.Thread(target=run, name="cudnn-graphs-resolve", daemon=True)
    worker.start()
    worker.join(seconds)
    if not box:
        raise socket.timeout(f"resolving {host!r} took longer than {seconds} s")
    if isinstance(box[0], OSError):
        raise box[0]
    return box[0]


class _CappedBuffer(SocketBuffer):
    def read(self, length: int, *args: Any, **kwargs: Any) -> bytes:
        if length < 0 or (_limits.deadline is not None and length > _limits.budget):  # before reading any of it
            raise RemoteReplyError("a command", f"announces a bulk string of {length} bytes; this call may read "
                                   f"{_limits.budget} more")
        return super().read(length, *args, **kwargs)


class _CappedParser(_RESP2Parser):
    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)
        self._buffer = _CappedBuffer(self._sock, self.socket_read_size, connection.socket_timeout)


class _Limited:
    """Mixed into redis-py's connection classes: the socket redis-py gets is a `_LimitedSocket`."""

    def _connect(self) -> _LimitedSocket:
        return _LimitedSocket(super()._connect())


class _TcpConnect(redis.Connection):
    def _connect(self) -> socket.socket:
        """redis-py's TCP connect, with name resolution and the connect inside the call's deadline."""
        err: OSError = OSError(f"no address for {self.host!r}")
        for family, kind, proto, _, address in _resolve(self.host, self.port, self.socket_type,
                                                          _left(self.socket_connect_timeout)):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.socket_keepalive:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    for option, value in self.socket_keepalive_options.items():
                        sock.setsockopt(socket.IPPROTO_TCP, option, value)
                sock.settimeout(_left(self.socket_connect_timeout))
                sock.connect(address)
                sock.settimeout(_left(self.socket_timeout))
                return sock
            except OSError as failed:
                err = failed
                sock.close()
        raise err


class TcpConnection(_Limited, _TcpConnect):
    pass


class TlsConnection(_Limited, redis.SSLConnection, _TcpConnect):  # SSLConnection wraps what _TcpConnect connects
    pass


class UnixConnection(_Limited, redis.UnixDomainSocketConnection):
    pass


_CLASSES = {redis.Connection: TcpConnection, redis.SSLConnection: TlsConnection,
            redis.UnixDomainSocketConnection: UnixConnection}


def client(url: str, timeout: float) -> redis.Redis:
    """A client for `url` whose connections keep to `limits()`. ValueError or TypeError for a URL redis-py
    refuses (a bad scheme, port or option), raised here rather than on the first call."""
    options = parse_url(url)
    kind = _CLASSES[options.pop("connection_class", redis.Connection)]
    options.update(socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=0,
                   parser_class=_CappedParser, retry=Retry(NoBackoff(), 1),
                   protocol=2)  # RESP2 only: redis-py would swap a RESP3 parser in for ours
    kind(**options)  # an unknown option in the URL raises TypeError now; nothing connects yet
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=kind, **options))
