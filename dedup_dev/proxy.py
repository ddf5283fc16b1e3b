"""Network partitions for the tests: a TCP proxy between one process and one service.

A :class:`Proxy` listens on 127.0.0.1 and forwards every connection it accepts
to one upstream port on 127.0.0.1 (Postgres, or a Kafka listener).  A test
gives each process a proxy per service, so it can cut one process off from one
service while everything else goes on.  Its mode:

``PASS``       bytes flow both ways; what was held during a cut flows first, in order
``BLACKHOLE``  nothing moves, and nothing fails: a new connection is accepted and never
               answered (its upstream is not even dialled), an open one stops
               forwarding in both directions (or in one: a request arrives, its
               answer is held), mid-stream, without closing.  A chunk
               read just before the cut is held; nothing more is read, so the
               sender's socket buffers fill as they would with a peer that stopped
               acknowledging.  A close on either side is held too.  On ``PASS``
               everything held is delivered, as TCP delivers what it retransmits
               once a partition heals: a COMMIT queued during the cut arrives late
``RESET``      every open connection is reset (RST to both sides), and each new one
               as soon as it is accepted, as a firewall that rejects with a reset

What a proxy cannot show: the kernel of this machine acknowledges every byte
the client sends to the proxy, and every byte the service sends to it, so TCP
keepalives (and ``tcp_user_timeout``) on either side see a live peer during a
cut.  Only what the processes time out themselves (``handler_timeout``, the
session timeouts of Kafka's group and of Postgres' idle transactions, connect
and request timeouts) ends a wait here; docs/operations.md says which kernel
settings bound the same waits across a real network.

Postgres is reached through a proxy by a DSN on its port (:func:`with_port`).
A Kafka client bootstraps, then connects to the address the broker
*advertises*, which would bypass a proxy on the bootstrap port: the broker
needs a listener that advertises the proxy's port
(``DEDUP_KAFKA_EXTRA_LISTENERS`` of ``compose/local/up``; the chaos broker
has one per proxy slot, :mod:`tests.chaos.services`).

Traffic stays on this machine: a proxy binds 127.0.0.1 only and forwards to
127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

HOST = "127.0.0.1"
CHUNK_BYTES = 65536
"""Most bytes one read takes off a socket: a cut can fall inside a larger message."""


class Mode(enum.Enum):
    """What a proxy does with the bytes of its connections."""

    PASS = enum.auto()
    BLACKHOLE = enum.auto()
    RESET = enum.auto()


@dataclass
class Traffic:
    """What went through a proxy since it started."""

    connections: int = 0
    """Connections accepted."""
    to_service: int = 0
    """Bytes delivered to the service."""
    to_client: int = 0
    """Bytes delivered to the client."""
    resets: int = 0
    """Connections reset (by :meth:`Proxy.reset`, or accepted while resetting)."""
    held: int = 0
    """Chunks read and held by a cut (a request, an answer, a close sent into it)."""


@dataclass(eq=False)
class _Link:
    """One accepted connection and the one it opened upstream."""

    client: asyncio.StreamWriter
    task: asyncio.Task[Any] | None = None
    service: asyncio.StreamWriter | None = None

    def abort(self, *, rst: bool) -> None:
        """Close both sides now; with ``rst``, each with a reset instead of a FIN."""
        for writer in (self.client, self.service):
            if writer is None:
                continue
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
            writer.transport.abort()


class Proxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``127.0.0.1:upstream_port``, cut on command."""

    def __init__(self, name: str, upstream_port: int, *, port: int = 0) -> None:
        self.name = name
        self.upstream_port = upstream_port
        self.port = port
        """Where it listens (0 until started when asked for any free port)."""
        self.mode = Mode.PASS
        self.traffic = Traffic()
        self.changes: list[tuple[float, Mode]] = []
        """(monotonic time, mode) of every change of mode, for the run's story."""
        # One gate per direction, by the Traffic counter it feeds: set while bytes may pass.
        self._gates = {"to_service": asyncio.Event(), "to_client": asyncio.Event()}
        for gate in self._gates.values():
            gate.set()
        self._trip: bytes | None = None
        self.tripped = asyncio.Event()
        """Set when a :meth:`cut_after` cut the answers."""
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> Proxy:
        """Listen; return itself."""
        self._server = await asyncio.start_server(self._serve, HOST, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening and close every connection (reset)."""
        if self._server is not None:
            self._server.close()
        self._reset_all()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Proxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._links)

    # --------------------------------------------------------------- modes --

    def cut(self, *, to_service: bool = True, to_client: bool = True) -> None:
        """``BLACKHOLE``: nothing moves, nothing fails, until :meth:`heal`.

        With ``to_service=False`` the client's bytes still reach the service and only
        its answers are held (``to_client=False``: the other way round): a request
        arrives and is carried out, its answer does not come back.
        """
        self._set(Mode.BLACKHOLE)
        for direction, cut in (("to_service", to_service), ("to_client", to_client)):
            if cut:
                self._gates[direction].clear()
            else:
                self._gates[direction].set()

    def cut_after(self, marker: bytes) -> None:
        """Cut the answers (``cut(to_service=False)``) right after the next chunk sent to
        the service that holds ``marker``: a request (``b"COMMIT"``, say) arrives and is
        carried out, its answer does not come back.  :attr:`tripped` is set then.  A
        marker split across two reads is missed."""
        self._trip = marker
        self.tripped.clear()

    def heal(self) -> None:
        """``PASS``: what was held flows, then everything else (a :meth:`cut_after` not
        yet tripped is off)."""
        self._trip = None
        self._set(Mode.PASS)
        for gate in self._gates.values():
            gate.set()

    def reset(self) -> None:
        """``RESET``: every open connection reset now, and every new one, until :meth:`heal`."""
        self._set(Mode.RESET)
        for gate in self._gates.values():
            gate.clear()
        self._reset_all()

    def _set(self, mode: Mode) -> None:
        if mode is not self.mode:
            self.mode = mode
            self.changes.append((time.monotonic(), mode))

    def _reset_all(self) -> None:
        for link in list(self._links):
            self.traffic.resets += 1
            link.abort(rst=True)
            if link.task is not None:
                link.task.cancel()
        self._links.clear()

    # ---------------------------------------------------------- forwarding --

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer, task=asyncio.current_task())
        self.traffic.connections += 1
        if self.mode is Mode.RESET:
            self.traffic.resets += 1
            link.abort(rst=True)
            return
        self._links.add(link)
        try:
            await self._gates["to_service"].wait()  # a blackhole: accepted, never answered
            try:
                up_reader, link.service = await asyncio.open_connection(HOST, self.upstream_port)
            except OSError:
                link.abort(rst=True)  # the service is down: the client sees a reset
                return
            await asyncio.gather(
                self._pump(reader, link.service, "to_service", link),
                self._pump(up_reader, writer, "to_client", link),
            )
        except asyncio.CancelledError:
            pass  # reset or closed: the link was aborted already
        finally:
            self._links.discard(link)
            link.abort(rst=False)

    async def _pump(
        self,
        source: asyncio.StreamReader,
        target: asyncio.StreamWriter,
        counter: str,
        link: _Link,
    ) -> None:
        """Forward ``source`` to ``target`` while ``counter``'s direction passes; a close is
        forwarded too."""
        gate = self._gates[counter]
        try:
            while True:
                await gate.wait()
                data = await source.read(CHUNK_BYTES)
                if not gate.is_set():
                    self.traffic.held += 1
                await gate.wait()  # a chunk read as the cut fell is held, not sent
                if not data:
                    if target.can_write_eof():
                        target.write_eof()
                    return
                target.write(data)
                if counter == "to_service" and self._trip is not None and self._trip in data:
                    # Before anything else runs: the answer can't get out ahead of the cut.
                    self._trip = None
                    self.cut(to_service=False)
                    self.tripped.set()
                await target.drain()
                setattr(self.traffic, counter, getattr(self.traffic, counter) + len(data))
        except OSError:
            link.abort(rst=True)  # one side reset: so is the other


def with_port(dsn: str, port: int) -> str:
    """``dsn`` (a ``postgresql://user@127.0.0.1:PORT/db...`` URL) on ``port`` instead."""
    head, sep, rest = dsn.partition("@")
    if not sep or not rest.startswith(f"{HOST}:"):
        raise ValueError(f"not a URL on {HOST}: {dsn}")
    _, slash, tail = rest.partition("/")
    return f"{head}@{HOST}:{port}{slash}{tail}"
