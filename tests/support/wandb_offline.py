"""The history rows of an offline W&B run, read from its ``run-*.wandb`` file with W&B's own record schema
(``wandb.proto``): the file is a LevelDB-style log (a 7-byte header, 32 KiB blocks of records, each with a
checksum, a length and a type: full, or first/middle/last piece of a longer one)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7


def history(path: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pieces, rows = path.read_bytes(), _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the rest of a block too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk, pos = data[pos + _HEADER : pos + _HEADER + length], pos + _HEADER + length
        if kind == 0 and length == 0:
            break
        pieces = chunk if kind in (1, 2) else pieces + chunk
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pieces)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows
