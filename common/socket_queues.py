"""What a socket's kernel queues hold, for the servers that decide on it (which connection
makes room, which one lingers, which answer is stuck): bytes the client sent that nobody
read yet (FIONREAD), and bytes sent that the client has not acknowledged (TIOCOUTQ, Linux).
0 (or False) wherever the kernel cannot say."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios
from typing import Any


def _ioctl_int(fd: int, request: int) -> int:
    try:
        return struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0]
    except (OSError, AttributeError, ValueError, TypeError):
        return 0


def unread_bytes(fd: int) -> int:
    """Bytes the client sent on this socket that were not read yet."""
    return _ioctl_int(fd, termios.FIONREAD)


def unsent_bytes(fd: int) -> int:
    """Bytes in a TCP socket's send queue not yet acknowledged by the client."""
    return _ioctl_int(fd, termios.TIOCOUTQ)


def has_bytes_waiting(transport: Any) -> bool:
    """Has the client of an asyncio transport (or stream writer) sent bytes not read yet?"""
    try:
        fd = transport.get_extra_info("socket").fileno()
    except (OSError, AttributeError, ValueError):
        return False
    return unread_bytes(fd) > 0


def waiting_bytes(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes the client sent that nobody read yet, left in place (MSG_PEEK on
    a duplicate of the descriptor: closing it leaves the connection open)."""
    try:
        peek = socket.socket(fileno=os.dup(fd))
    except OSError:
        return b""
    try:
        return peek.recv(limit, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return b""
    finally:
        peek.close()


def peek(sock: socket.socket, limit: int) -> bytes | None:
    """Up to ``limit`` bytes waiting on a non-blocking socket, left there: None when nothing
    yet, b"" when its client closed or reset it."""
    try:
        return sock.recv(limit, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


TCP_CLOSE = 7        # linux/tcp_states.h: reset (or closed both ways)
TCP_CLOSE_WAIT = 8   # linux/tcp_states.h: the peer's FIN is in


def tcp_state(sock: socket.socket) -> int:
    """The TCP state (linux/tcp_states.h), the first byte of TCP_INFO; 0 where that cannot be
    read (not Linux, not TCP)."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except (OSError, AttributeError, IndexError):
        return 0


def peer_closed(sock: socket.socket) -> bool:
    """Has the peer closed its side (its FIN is in)? False where that cannot be read (not Linux)."""
    return tcp_state(sock) == TCP_CLOSE_WAIT
