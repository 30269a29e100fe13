"""Reading checkpoint bytes fast: threads read a safetensors file's byte ranges into pinned host buffers while
the GPU copies the buffer filled before into the parameters, on a stream of its own.

Most checkpoint tensors are stored in the parameter's dtype and read whole; for them loading is a byte copy
from the file to the device (``ByteReader``). With two pinned buffers the reads of one part overlap the
host-to-device copy of the part before, and parallel ``preadv`` calls (which release the GIL) read several
pieces at once, from the page cache or the disk. Tensors that need more (this rank's part of a tensor, FP8
block scales, a dtype conversion) go through safetensors' own reader in ``moeserve.weights``.
"""
from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CHUNK_BYTES = 128 << 20  # one pinned buffer; two of them
PIECE_BYTES = 8 << 20  # one read call


class ReadError(ValueError):
    """A file that does not hold the bytes its header promises."""


@dataclass(frozen=True)
class Span:
    """One tensor of a safetensors file: its dtype (None when moeserve does not know the name), shape, and
    byte range in the file."""
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | Path) -> dict[str, Span]:
    """The tensors of a safetensors file, by name, with absolute byte offsets (8-byte length, JSON header,
    then the data)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ReadError(f"{path} is too short to be a safetensors file")
        n = struct.unpack("<Q", head)[0]
        raw = f.read(n)
        size = os.fstat(f.fileno()).st_size
    if len(raw) < n:
        raise ReadError(f"{path}: the header is cut short")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReadError(f"{path}: the header is not JSON ({e})") from None
    base = 8 + n
    spans = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        if base + b > size:
            raise ReadError(f"{path}: tensor {name!r} ends at byte {base + b} but the file has {size}")
        spans[name] = Span(SAFETENSORS_DTYPES.get(info["dtype"]), tuple(info["shape"]), base + a, base + b)
    return spans


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view)."""
    return t.reshape(-1).view(torch.uint8)


class ByteReader:
    """Copies byte ranges of files into tensors: ``add`` queues one range of the current file, ``read_file``
    runs the queue of one file, ``finish`` waits for the last copies. On a CUDA device the bytes go through
    two pinned buffers of ``chunk_bytes`` and a copy stream; on the CPU through one plain buffer."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES, threads: int | None = None,
                 piece_bytes: int = PIECE_BYTES):
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        self.pool = ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1),
                                       thread_name_prefix="moeserve-read")
        self.buffers: list[torch.Tensor] = []
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.next = 0
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.bytes_read = 0
        self.queue: list[tuple[int, int, torch.Tensor]] = []

    def add(self, name: str, begin: int, end: int, dest: torch.Tensor) -> None:
        """Queue tensor ``name``: the bytes ``[begin, end)`` of the next file read, into contiguous ``dest``
        (as many bytes)."""
        flat = flat_bytes(dest)
        if flat.numel() != end - begin:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes in the file for a parameter of {flat.numel()}")
        self.queue.append((begin, end, flat))

    def read_file(self, path: str | Path) -> None:
        queue, self.queue = sorted(self.queue, key=lambda q: q[0]), []
        if not queue:
            return
        if self.cuda:  # parameters written on the default stream (their initial values) before these copies
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        fd = os.open(path, os.O_RDONLY)
        try:
            part, used = [], 0
            for begin, end, flat in queue:
                done, n = 0, end - begin
                while done < n:
                    take = min(n - done, self.chunk_bytes - used)
                    part.append((begin + done, take, flat, done, used))
                    used += take
                    done += take
                    if used == self.chunk_bytes:
                        self._flush(fd, path, part, used)
                        part, used = [], 0
            if part:
                self._flush(fd, path, part, used)
        finally:
            os.close(fd)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()
        self.pool.shutdown(wait=True)
        self.buffers.clear()

    def _buffer(self, i: int) -> torch.Tensor:
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda))
        return self.buffers[i]

    def _flush(self, fd: int, path, part: list, used: int) -> None:
        """Read the segments of ``part`` (file offset, bytes, destination, offset there, offset in the buffer)
        into a free buffer, then copy each to its destination."""
        i = self.next if self.cuda else 0
        self.next ^= 1
        if self.events[i] is not None:
            self.events[i].synchronize()  # the copies out of this buffer are done
        buf = self._buffer(i)
        view = memoryview(buf.numpy())
        runs = []  # file ranges adjacent in the file and in the buffer read as one
        for file_off, n, _, _, buf_off in part:
            if runs and runs[-1][0] + runs[-1][1] == file_off and runs[-1][2] + runs[-1][1] == buf_off:
                runs[-1][1] += n
            else:
                runs.append([file_off, n, buf_off])
        jobs = [(f + a, min(self.piece_bytes, n - a), b + a) for f, n, b in runs for a in range(0, n, self.piece_bytes)]
        for _ in self.pool.map(lambda j: _pread_into(fd, path, view, *j), jobs):
            pass
        self.bytes_read += used
        if self.cuda:
            with torch.cuda.stream(self.stream):
                for _, n, flat, dest_off, buf_off in part:
                    flat[dest_off:dest_off + n].copy_(buf[buf_off:buf_off + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event
        else:
            for _, n, flat, dest_off, buf_off in part:
                flat[dest_off:dest_off + n].copy_(buf[buf_off:buf_off + n])


def _pread_into(fd: int, path, view: memoryview, file_off: int, n: int, buf_off: int) -> None:
    done = 0
    while done < n:
        got = os.preadv(fd, [view[buf_off + done:buf_off + n]], file_off + done)
        if got <= 0:
            raise ReadError(f"{path}: the file ends at byte {file_off + done}, before the data its header names")
        done += got
