"""Raw access to the memory of Python objects through ctypes: where a ``bytes``, a compact
ASCII ``str`` or a buffer's bytes lie, fresh uninitialised objects, and copies with the GIL
released (ctypes releases it around every foreign call but the Python API's)."""

from __future__ import annotations

import ctypes
from typing import Any

new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
new_bytes.restype, new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
bytes_address = ctypes.pythonapi.PyBytes_AsString
bytes_address.restype, bytes_address.argtypes = ctypes.c_void_p, (ctypes.py_object,)
new_str = ctypes.pythonapi.PyUnicode_New
new_str.restype, new_str.argtypes = ctypes.py_object, (ctypes.c_ssize_t, ctypes.c_uint32)
str_address = ctypes.pythonapi.PyUnicode_AsUTF8AndSize  # a compact ASCII str's own characters
str_address.restype, str_address.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_void_p)


class _Buffer(ctypes.Structure):
    """Py_buffer (part of the stable ABI since 3.11); `obj` as a plain pointer, so that ctypes
    leaves its reference to PyBuffer_Release."""
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.restype, _get_buffer.argtypes = ctypes.c_int, (ctypes.py_object, ctypes.POINTER(_Buffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.restype, _release_buffer.argtypes = None, (ctypes.POINTER(_Buffer),)
_PYBUF_SIMPLE = 0           # one contiguous run of bytes, or BufferError


def buffer_address(obj: Any) -> tuple[int, int]:
    """(address, size) of an object's bytes: a ``bytes``, a compact ASCII ``str``, or any
    object with one contiguous buffer (bytearray, a C-contiguous numpy array). Valid while
    the object lives unchanged."""
    if isinstance(obj, bytes):
        return bytes_address(obj), len(obj)
    if isinstance(obj, str):
        if not obj.isascii():
            raise ValueError("only an ASCII str's characters are its bytes")
        return str_address(obj, None), len(obj)
    view = _Buffer()
    _get_buffer(obj, ctypes.byref(view), _PYBUF_SIMPLE)
    try:
        return view.buf, view.len
    finally:
        _release_buffer(ctypes.byref(view))


def copy_into(address: int, piece: bytes | bytearray | memoryview) -> None:
    """memmove `piece`'s bytes to `address`, with the GIL released for the copy (ctypes
    releases it around every foreign call but the Python API's). The piece must be one
    contiguous run of bytes (BufferError otherwise)."""
    view = _Buffer()
    _get_buffer(piece, ctypes.byref(view), _PYBUF_SIMPLE)
    try:
        ctypes.memmove(address, view.buf, view.len)
    finally:
        _release_buffer(ctypes.byref(view))
