"""A TCP relay to a server (the API server) that tests can cut, listener and open connections, and restore."""

from __future__ import annotations

import socket
import threading


class Relay:
    """Forwards 127.0.0.1:``port`` to ``upstream`` (TLS passes through untouched) on threads of its own, so it
    keeps forwarding while the test's event loop waits on calls through it. ``start`` listens (again), ``cut``
    closes the listener and every open connection: the server is gone for the client."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        probe = socket.create_server(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.listener: socket.socket | None = None

    def start(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port), reuse_port=True)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def cut(self) -> None:
        with self.lock:
            doomed, self.sockets = [*self.sockets, self.listener], []
        for sock in doomed:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                down, _ = listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                down.close()
                continue
            with self.lock:
                self.sockets += [down, up]
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass
