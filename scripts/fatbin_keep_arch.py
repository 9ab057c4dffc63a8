"""Zero the device code a CUDA shared library carries for GPUs other than one architecture.

Used only by scripts/bundle-vllm-gpu.sh to make vLLM's kernels small enough to carry to a machine
with one kind of GPU (an H200: sm_90): the zeroed payloads compress to nothing, and the fat binary's
headers are left as they are, so the CUDA runtime still parses every container and picks the
sm_90 machine code it would have picked anyway.

Layout of `.nv_fatbin` [read: CUDA's fatbinary.h, the `fatBinaryHeader` / `fatBinData_t` structs]:
containers back to back (8-byte aligned), each a 16-byte header (magic 0xBA55ED50, u16 version,
u16 header size, u64 size of its entries), then entries, each a header (u16 kind: 1 PTX, 2 ELF;
u16 version; u32 header size; u64 payload size; ...; u32 SM architecture at byte 28) and its payload.

In a container that holds an ELF for the kept architecture every other entry is zeroed; a
container without one keeps its PTX (the driver compiles it for the GPU) and loses its ELFs for
other GPUs, which could not run there.

Usage: python fatbin_keep_arch.py LIB.so 90   (rewrites LIB.so in place)
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys

CONTAINER_MAGIC = 0xBA55ED50
PTX, ELF = 1, 2


def fatbin_section(path: str) -> tuple[int, int]:
    """(file offset, size) of `.nv_fatbin` in the ELF at `path`, read with binutils' readelf."""
    done = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{path}: readelf cannot read it: {done.stderr.strip()}")
    listing = done.stdout
    for line in listing.splitlines():
        if " .nv_fatbin " in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path}: no .nv_fatbin section")


def entries(data: bytearray, start: int, size: int):
    """Yield (container offset, payload offset, payload size, kind, arch) for every entry."""
    position, end = start, start + size
    while position + 16 <= end:
        magic, _version, header_size, entries_size = struct.unpack_from("<IHHQ", data, position)
        if magic != CONTAINER_MAGIC:
            position += 8  # containers are 8-byte aligned; padding between them is skipped
            continue
        if header_size == 0 or position + header_size + entries_size > end:
            raise SystemExit(f"fat binary container at byte {position}: sizes {header_size}, {entries_size} do not fit")
        entry = position + header_size
        while entry < position + header_size + entries_size:
            kind, _entry_version, entry_header_size, payload_size = struct.unpack_from("<HHIQ", data, entry)
            if kind not in (PTX, ELF) or entry_header_size == 0:
                raise SystemExit(f"fat binary entry at byte {entry}: unknown kind {kind} or empty header")
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            yield position, entry + entry_header_size, payload_size, kind, arch
            entry += entry_header_size + payload_size
        position += header_size + entries_size


def keep_arch(path: str, arch: int) -> tuple[int, int]:
    """Zero in place every payload the rule above drops; returns (bytes zeroed, bytes kept)."""
    offset, size = fatbin_section(path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    containers: dict[int, list[tuple[int, int, int, int]]] = {}
    for container, payload, length, kind, entry_arch in entries(data, offset, size):
        containers.setdefault(container, []).append((payload, length, kind, entry_arch))
    zeroed = kept = 0
    for found in containers.values():
        has_elf = any(kind == ELF and a == arch for _, _, kind, a in found)
        for payload, length, kind, entry_arch in found:
            keep = (kind == ELF and entry_arch == arch) or (not has_elf and kind == PTX and entry_arch <= arch)
            if keep:
                kept += length
            else:
                data[payload:payload + length] = bytes(length)
                zeroed += length
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    return zeroed, kept


if __name__ == "__main__":
    zeroed, kept = keep_arch(sys.argv[1], int(sys.argv[2]))
    print(f"{sys.argv[1]}: zeroed {zeroed / 1e6:.1f} MB of device code, kept {kept / 1e6:.1f} MB")
