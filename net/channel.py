"""A framed, metered, mutually authenticated TLS 1.3 channel between two processes.

Design (docs/design.md 4.2):
- TLS runs over an in-memory BIO pair (``ssl.MemoryBIO`` + ``SSLObject``) instead of an
  ``SSLSocket``: OpenSSL forbids using one SSL object from two threads at once, and we
  need a reader thread so that two parties sending large tensors to each other at the
  same time cannot deadlock on full socket buffers. A lock serialises the (CPU-only)
  encrypt/decrypt calls; socket I/O happens outside it.
- Frames are ``kind (1 byte) | length (8 bytes, little endian) | payload``
  (``net.frames``). Tensor payloads are written from the tensor's own memory (no pickling)
  and decrypted straight into the receive buffer, which grows with what arrives instead of
  trusting the declared length (``FrameAssembler``); a port may bound what its channels
  buffer in total (``BufferBudget``).
- Link emulation (``net.link``), applied by the receiver as a FIFO link so the real transfer
  overlaps the emulated one.
- Failure: a closed or reset connection is reported as ``PeerDisconnected`` at once; a
  silent peer as ``PeerTimeout`` after ``timeout`` seconds. Nothing waits forever. An idle
  side polls ``peer_closed``. A dead reader keeps no reference to a partial frame (the
  exception it stores carries no traceback), so the memory is freed at once, not by the
  cycle collector.
- Re-exported for existing imports: the errors (``net.channel_errors``), ``LinkProfile``
  (``net.link``), ``accept_loop`` and ``listen`` (``net.listening``; a port's caps:
  ``net.admission``).
"""

from __future__ import annotations

import queue
import socket
import ssl
import threading
import time
from typing import Callable

from net import tls
from net.channel_errors import ChannelError, HandshakeError, PeerDisconnected, PeerTimeout, ProtocolError
from net.frames import (
    HEADER,
    HEADER_BYTES,
    KIND_HELLO,
    KIND_OBJECT,
    KIND_TENSOR,
    KIND_TICKET,
    MAX_FRAME,
    BufferBudget,
    FrameAssembler,
    FrameRefused,
)
from net.inbox import Ended, Inbox
from net.link import NO_LINK, LinkClock, LinkProfile
from net.listening import accept_loop, listen
from net.metering import Meter

__all__ = ["HEADER_BYTES", "KIND_TENSOR", "KIND_OBJECT", "KIND_HELLO", "KIND_TICKET", "MAX_FRAME",
           "DEFAULT_TIMEOUT", "ChannelError", "PeerDisconnected", "PeerTimeout", "HandshakeError",
           "ProtocolError", "LinkProfile", "NO_LINK", "Channel", "accept_loop", "listen"]

_CHUNK = 1 << 20  # bytes encrypted per lock hold when sending
# The reader's receive buffer: small while frames are small (one per connection, and a server
# holds hundreds), 1 MiB while a large payload streams in (fewer system calls per megabyte).
_RAW_SMALL = 64 << 10
_RAW_LARGE = 1 << 20
DEFAULT_TIMEOUT = 120.0


class Channel:
    """One side of a TLS connection, carrying frames. Use ``connect`` or ``accept``."""

    def __init__(
        self,
        sock: socket.socket,
        sslobj: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        *,
        kind: str,
        meter: Meter | None,
        link: LinkProfile,
        timeout: float,
        label: str,
        max_frame: int = MAX_FRAME,
        budget: BufferBudget | None = None,
    ):
        self.kind = kind
        self._asm = FrameAssembler(max_frame, budget=budget)
        self.meter = meter
        self.link = link
        self.timeout = timeout
        self.label = label
        self.peer = ""
        self.peer_cert: dict | None = None
        self._sock = sock
        self._send_sock = sock.dup()  # own timeout for sends; the reader blocks freely
        self._send_sock.settimeout(timeout)
        self._ssl = sslobj
        self._in = incoming
        self._out = outgoing
        self._ssl_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._inbox = Inbox(self._asm.release)
        self._closed: Ended | None = None
        self._reader_stopped = threading.Event()
        self._round_open = False
        self._round_epoch = -1
        self._rx_link = LinkClock()
        self.wire_sent = 0
        self.wire_received = 0
        self._reader: threading.Thread | None = None

    @property
    def max_frame(self) -> int:
        return self._asm.max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._asm.max_frame = value  # read by the reader at each header: may change in flight

    # ----------------------------------------------------------------- construction
    @classmethod
    def connect(
        cls,
        address: tuple[str, int],
        ctx: ssl.SSLContext,
        expected_peer: str,
        *,
        kind: str = "online",
        meter: Meter | None = None,
        link: LinkProfile = NO_LINK,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = 30.0,
        max_frame: int = MAX_FRAME,
        handshake_timeout: float | None = None,
        budget: BufferBudget | None = None,
    ) -> "Channel":
        """Connect to ``address`` and require the server to prove identity ``expected_peer``.
        ``connect_timeout`` bounds TCP and TLS; ``handshake_timeout`` the hello (default ``timeout``)."""
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                sock = socket.create_connection(address, timeout=connect_timeout)
                break
            except (ConnectionRefusedError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise PeerDisconnected(f"cannot connect to {expected_peer} at {address}: {exc}") from exc
                time.sleep(0.05)
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        sslobj = ctx.wrap_bio(inc, out, server_side=False, server_hostname=expected_peer)
        ch = cls(sock, sslobj, inc, out, kind=kind, meter=meter, link=link, timeout=timeout,
                 label=f"{kind} channel to {expected_peer}", max_frame=max_frame, budget=budget)
        ch._establish(lambda name: name == expected_peer, expected_peer, handshake_timeout or timeout)
        return ch

    @classmethod
    def accept(cls, listener: socket.socket, ctx: ssl.SSLContext, allowed_peer: Callable[[str], bool] | str,
               *, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> "Channel":
        """Accept the oldest queued connection; the client's certificate must name an allowed
        peer. A stray makes this fail: 2PC sessions use ``net.peer_accept.accept_peer``."""
        listener.settimeout(timeout)
        try:
            sock, _addr = listener.accept()
        except socket.timeout as exc:
            raise PeerTimeout(f"no peer connected within {timeout:.0f}s") from exc
        return cls.wrap_accepted(sock, ctx, allowed_peer, timeout=timeout, **kwargs)

    @classmethod
    def wrap_accepted(
        cls,
        sock: socket.socket,
        ctx: ssl.SSLContext,
        allowed_peer: Callable[[str], bool] | str,
        *,
        kind: str = "online",
        meter: Meter | None = None,
        link: LinkProfile = NO_LINK,
        timeout: float = DEFAULT_TIMEOUT,
        max_frame: int = MAX_FRAME,
        handshake_timeout: float | None = None,
        budget: BufferBudget | None = None,
    ) -> "Channel":
        """Run the server side of the handshake on a socket an accept loop already took;
        ``handshake_timeout`` (default ``timeout``) bounds each wait of TLS and the hello (the
        whole handshake's deadline is the accept loop's, ``net.admission``). ``budget``: the
        port's bound on bytes buffered by frames in flight, keyed by the peer's identity."""
        check = (lambda n: n == allowed_peer) if isinstance(allowed_peer, str) else allowed_peer
        sock.settimeout(handshake_timeout or timeout)
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        sslobj = ctx.wrap_bio(inc, out, server_side=True)
        ch = cls(sock, sslobj, inc, out, kind=kind, meter=meter, link=link, timeout=timeout,
                 label=f"{kind} channel (accepted)", max_frame=max_frame, budget=budget)
        ch._establish(check, str(allowed_peer) if isinstance(allowed_peer, str) else "an allowed peer",
                      handshake_timeout or timeout)
        return ch

    def _establish(self, check: Callable[[str], bool], wanted: str, hello_wait: float) -> None:
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._handshake()
            cert = self._ssl.getpeercert()
            name = tls.peer_name(cert)
            if not check(name):
                raise tls.IdentityError(f"peer identified as {name!r}, expected {wanted}")
        except (ssl.SSLError, OSError, PeerDisconnected) as exc:
            self._sock.close()
            self._send_sock.close()
            raise HandshakeError(f"{self.label}: TLS handshake failed: {exc}") from exc
        self.peer = name
        self.peer_cert = cert   # the verified certificate (its serial: revocation of open channels)
        self._asm.key = name  # the budget is kept per identity
        self.label = f"{self.kind} channel to {name}"
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_loop, name=self.label, daemon=True)
        self._reader.start()
        # In TLS 1.3 the client finishes its handshake before the server has checked the
        # client's certificate; exchanging a hello frame surfaces a rejection here, at
        # connect time, instead of at the first protocol message.
        session_wait, self.timeout = self.timeout, hello_wait
        try:
            self.send_frame(KIND_HELLO, b"starfish/1")
            kind, payload = self._next_frame()
        except ChannelError as exc:
            self.close()
            raise HandshakeError(f"{self.label}: peer rejected the connection: {exc}") from exc
        if kind != KIND_HELLO or bytes(payload) != b"starfish/1":
            self.close()
            raise HandshakeError(f"{self.label}: peer speaks another protocol")
        self.timeout = session_wait

    def _handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush_raw()
                data = self._sock.recv(65536)
                if not data:
                    raise PeerDisconnected("connection closed during the TLS handshake")
                self.wire_received += len(data)
                self._meter_wire(received=len(data))
                self._in.write(data)
        self._flush_raw()
        if self._ssl.version() != "TLSv1.3":
            raise HandshakeError(f"negotiated {self._ssl.version()}, TLS 1.3 required")

    def _flush_raw(self) -> None:
        data = self._out.read()
        if data:
            self._sock.sendall(data)
            self.wire_sent += len(data)
            self._meter_wire(sent=len(data))

    def _meter_wire(self, sent: int = 0, received: int = 0) -> None:
        if self.meter is not None:
            self.meter.wire(self.kind, sent=sent, received=received)

    # ----------------------------------------------------------------------- sending
    def send_frame(self, kind: int, *parts) -> None:
        """Send one frame whose payload is the concatenation of the buffers ``parts``."""
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(v.nbytes for v in views)
        self._check_open()
        with self._send_lock:
            self._write(memoryview(HEADER.pack(kind, length)))
            for v in views:
                for off in range(0, v.nbytes, _CHUNK):
                    self._write(v[off : off + _CHUNK])
        if self.meter is not None and kind != KIND_HELLO:
            if not self._round_open or self._round_epoch != self.meter.epoch:
                self.meter.round(self.kind)
                self._round_open = True
                self._round_epoch = self.meter.epoch
            self.meter.sent(self.kind, length + HEADER_BYTES)

    def _write(self, view: memoryview) -> None:
        with self._ssl_lock:
            self._ssl.write(view)
            data = self._out.read()
        try:
            self._send_sock.sendall(data)
        except socket.timeout as exc:
            raise PeerTimeout(f"{self.label}: peer did not take our data within {self.timeout:.0f}s") from exc
        except OSError as exc:
            # a fresh error: ``exc``'s traceback would pin this frame and the data being sent
            self._closed = self._closed or Ended(PeerDisconnected(f"connection lost while sending: {exc}"))
            raise PeerDisconnected(f"{self.label}: connection lost while sending: {exc}") from exc
        self.wire_sent += len(data)
        self._meter_wire(sent=len(data))

    # --------------------------------------------------------------------- receiving
    def _read_loop(self) -> None:
        asm = self._asm
        raw = bytearray(_RAW_SMALL)
        raw_view = memoryview(raw)
        # The handshake's last recv may have brought the peer's first records (its hello) too:
        # decrypt those before waiting for more, or a peer that then waits for us waits forever.
        leftover = True
        try:
            while True:
                if not leftover:
                    n = self._sock.recv_into(raw)
                    if n == 0:
                        raise PeerDisconnected("peer closed the connection")
                    self.wire_received += n
                    self._meter_wire(received=n)
                with self._ssl_lock:
                    if not leftover:
                        self._in.write(raw_view[:n])
                    leftover = False
                    while True:
                        dest = asm.space()
                        try:
                            got = self._ssl.read(len(dest), dest)
                        except ssl.SSLWantReadError:
                            break
                        finally:
                            dest.release()  # the payload may have to grow: no export may remain
                        if got == 0:
                            raise PeerDisconnected("peer closed the TLS session")
                        frame = asm.advance(got)
                        if frame is not None:
                            self._inbox.put(*frame)
                            del frame  # the consumer owns it now
                    flush = self._out.pending > 0
                if len(raw) < _RAW_LARGE and asm.remaining() > _RAW_SMALL:
                    raw = bytearray(_RAW_LARGE)  # a large payload is streaming in
                    raw_view = memoryview(raw)
                if flush:  # e.g. a TLS key update the peer asked us to answer
                    with self._send_lock, self._ssl_lock:
                        data = self._out.read()
                    if data:
                        self._send_sock.sendall(data)
        except BaseException as exc:  # noqa: BLE001 - any failure ends the channel
            asm.discard()  # the partial payload goes now, with its budget
            cause = ProtocolError(str(exc)) if isinstance(exc, FrameRefused) else exc
            self._reader_stopped.set()
            self._inbox.end(cause)

    def _next_frame(self) -> tuple[int, bytearray]:
        try:
            item = self._inbox.take(self.timeout)
        except queue.Empty:
            raise PeerTimeout(f"{self.label}: no message from the peer within {self.timeout:.0f}s") from None
        if isinstance(item, Ended):
            self._closed = item
            cause = item.cause
            if isinstance(cause, ChannelError):
                raise type(cause)(f"{self.label}: {cause}") from cause
            raise PeerDisconnected(f"{self.label}: connection lost: {cause!r}") from cause
        kind, payload, first_byte_at, arrived = item
        self._rx_link.deliver(self.link, len(payload) + HEADER_BYTES, first_byte_at, arrived)
        return kind, payload

    def recv_frame(self, expected_kind: int, expected_bytes: int | None = None) -> bytearray:
        kind, payload = self._next_frame()
        if kind != expected_kind:
            raise ProtocolError(f"{self.label}: expected frame kind {expected_kind}, got {kind}")
        if expected_bytes is not None and len(payload) != expected_bytes:
            raise ProtocolError(
                f"{self.label}: expected {expected_bytes} payload bytes, got {len(payload)}"
            )
        if self.meter is not None:
            self.meter.received(self.kind, len(payload) + HEADER_BYTES)
        self._round_open = False
        return payload

    @property
    def peer_closed(self) -> bool:
        """True once the connection is gone (EOF, reset, TLS error, or a failed send); cheap and
        thread-safe, so a side that is not receiving can still poll for a dead peer."""
        return self._reader_stopped.is_set() or self._closed is not None

    @property
    def hosts(self) -> tuple[str, str]:
        """(this side's address, the peer's address) of the connection: where a second link
        between the same two hosts (the two-party engine's) can listen and be reached."""
        return self._sock.getsockname()[0], self._sock.getpeername()[0]

    def _check_open(self) -> None:
        if self._closed is not None:
            raise PeerDisconnected(f"{self.label}: connection already lost: {self._closed.cause!r}")

    def close(self) -> None:
        for s in (self._send_sock, self._sock):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._inbox.close()  # frames nobody will take give their budget back

