"""A TCP proxy on 127.0.0.1 that turns a healthy OTLP backend into a faulty one.

Real sockets, real gRPC/HTTP bytes: the exporter under test talks to the proxy's
port and sees what it would see from a real backend in trouble.

Modes (switch at any time with :meth:`FaultProxy.set_mode`):

* ``down``: nothing listens on the port (connection refused);
* ``forward``: bytes pass both ways; ``delay_s`` delays every chunk coming back
  from the backend (a slow backend that accepts and answers late);
* ``blackhole``: connections are accepted and everything sent is read and
  discarded, nothing ever comes back (a hung backend or a black-holed route).

Leaving ``forward`` closes the connections in progress, as an outage would.

The port is the proxy's for its whole life, ``down`` included: a socket bound
to it that never listens keeps it out of the kernel's choice of ports
(``bind`` to port 0, a connection's source port: so neither a server that
asks for any port nor one of the exporter's own connection attempts,
connecting to itself, can take it) and out of any bind without SO_REUSEADDR
(``services.free_port``'s probe), while a connection to it is still refused.
The listener binds beside it with SO_REUSEADDR, which Linux allows next to a
socket that does not listen.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

DOWN, FORWARD, BLACKHOLE = "down", "forward", "blackhole"


class FaultProxy:
    def __init__(self, upstream_port: int, port: int = 0) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = DOWN
        self.delay_s = 0.0
        self.accepted = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._reservation = self._bound(port)
        self.port = int(self._reservation.getsockname()[1])

    @staticmethod
    def _bound(port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        return sock

    # -- control -----------------------------------------------------------
    def set_mode(self, mode: str, delay_s: float = 0.0) -> None:
        with self._lock:
            old = self.mode
            self.mode, self.delay_s = mode, delay_s
            if old != mode:
                self._close_conns()
            if mode == DOWN:
                self._close_listener()
            elif self._listener is None:
                self._open_listener()

    def close(self) -> None:
        with self._lock:
            self._close_conns()
            self._close_listener()
            self._reservation.close()

    # -- internals ---------------------------------------------------------
    def _open_listener(self) -> None:
        sock = self._bound(self.port)
        sock.listen(64)
        self._listener = sock
        threading.Thread(target=self._accept_loop, args=(sock,), daemon=True).start()

    def _close_listener(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None

    def _close_conns(self) -> None:
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        self._conns.clear()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                self.accepted += 1
                mode = self.mode
                self._conns.append(client)
                if mode == FORWARD:
                    try:
                        upstream = socket.create_connection(self.upstream, timeout=5)
                    except OSError:
                        client.close()
                        continue
                    self._conns.append(upstream)
            if mode == FORWARD:
                threading.Thread(
                    target=self._pump, args=(client, upstream, 0.0), daemon=True
                ).start()
                threading.Thread(
                    target=self._pump, args=(upstream, client, None), daemon=True
                ).start()
            else:
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float | None) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                wait = self.delay_s if delay is None else delay
                if wait:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _swallow(conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                pass
        except OSError:
            pass
