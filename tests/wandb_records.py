"""What an offline wandb run recorded, read back from its log file (`run-ID.wandb`: a 7-byte
header, then leveldb-log chunks of protobuf `Record`s in 32 KiB blocks), as `wandb sync` would
upload it: the run record (entity, project, group, job type, config) and the logged history."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path


def records(offline_run: Path, timeout_s: float = 60) -> list:
    """Every protobuf Record of the offline run directory `offline_run` (offline-run-*), once
    the file is whole: wandb's service may still be writing it after `finish()` returned, and
    its last record is the `exit` one."""
    deadline = time.monotonic() + timeout_s
    while not (found := _read(offline_run)) or found[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, f"{offline_run}: no exit record"
        time.sleep(0.2)
    return found


def _read(offline_run: Path) -> list:
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(offline_run.glob("run-*.wandb")).read_bytes()
    pos, block, chunk, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zeros: the end of what was written so far
            break
        if pos + 7 + length > len(data):  # the file ends inside this chunk: still being written
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            parsed = pb.Record()
            try:
                parsed.ParseFromString(chunk)
            except DecodeError:  # its header is written, its body not yet (still zeros)
                break              # `records` reads the file again until its exit record
            out.append(parsed)
            chunk = b""
    return out


def run_record(offline_run: Path):
    """The run record: entity, project, run_group, job_type, display_name, config."""
    found = [r.run for r in records(offline_run) if r.WhichOneof("record_type") == "run"]
    assert found, f"no run record in {offline_run}"
    return found[0]


def config(run) -> dict:
    """A run record's config as a dict of values (wandb stores each as {"value": ...})."""
    out = {}
    for item in run.config.update:
        value = json.loads(item.value_json)
        out[item.key] = value.get("value", value) if isinstance(value, dict) else value
    return out


def history(offline_run: Path) -> dict:
    """Every key logged to the run's history, with its last value (parsed JSON; a media value,
    which wandb records field by field, as its dict: _type, path, caption, ...)."""
    out: dict = {}
    for r in records(offline_run):
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                *parents, leaf = [item.key] if item.key else list(item.nested_key)
                where = out
                for key in parents:
                    where = where.setdefault(key, {})
                where[leaf] = json.loads(item.value_json)
    return out
