"""Small hostile RESP servers on loopback for the remote-tier tests: a proxy or another RESP service that
answers in the wrong shape, a server that trickles its replies, one that sends a fake huge bulk header.

`FakeServer(reply)` answers each command a client sends (a list of bytes, e.g. [b"GET", b"name"]) with what
`reply(command)` returns: bytes, or an iterable of byte chunks (a generator may sleep between chunks to
trickle). `CLIENT ...` (redis-py's handshake) is answered +OK. The server stops by itself after `lifetime`
seconds, and at `close()`; `sent` counts the bytes the client was sent."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Iterable


def _parse(buf: bytes) -> tuple[list[bytes] | None, bytes]:
    """One command (a RESP array of bulk strings) off the front of `buf`, or None while incomplete."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None, buf
    head, rest = buf.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None, buf
        size, tail = rest.split(b"\r\n", 1)
        length = int(size[1:])
        if len(tail) < length + 2:
            return None, buf
        args.append(tail[:length])
        rest = tail[length + 2:]
    return args, rest


class FakeServer:
    def __init__(self, reply: Callable[[list[bytes]], bytes | Iterable[bytes]], *, lifetime: float = 5.0):
        self.reply, self.sent, self.commands = reply, 0, []
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._until = time.monotonic() + lifetime
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _alive(self) -> bool:
        return time.monotonic() < self._until

    def _accept(self) -> None:
        while self._alive():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            worker = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(worker)
            worker.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        buf = b""
        with conn:
            while self._alive():
                command, buf = _parse(buf)
                if command is None:
                    try:
                        data = conn.recv(65536)
                    except socket.timeout:
                        continue
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                    continue
                self.commands.append(command)
                if not self._answer(conn, command):
                    return

    def _answer(self, conn: socket.socket, command: list[bytes]) -> bool:
        out = b"+OK\r\n" if command[0].upper() == b"CLIENT" else self.reply(command)
        for chunk in [out] if isinstance(out, bytes) else out:
            if not self._alive():
                return False
            try:
                conn.settimeout(1.0)
                conn.sendall(chunk)
            except OSError:  # the client hung up: what it refused to read is not counted
                return False
            self.sent += len(chunk)
        return True

    def close(self) -> None:
        self._until = 0.0
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()


def trickle(data: bytes, pause: float) -> Iterable[bytes]:
    """`data` one byte at a time, `pause` seconds apart: each read gets a byte long before any per-read timeout."""
    for i in range(len(data)):
        time.sleep(pause)
        yield data[i:i + 1]
