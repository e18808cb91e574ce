"""Staged files kept once their blob is gone and written over by the next blob
(shared.wire.staged): the next blob reads back as itself, whatever was in the file before,
the folder keeps no more than its bounds, and nothing is kept where no store keeps files."""

from __future__ import annotations

import gc
import hashlib
import os
import time
from pathlib import Path

import pytest
import torch

from shared.transport.blob_fetcher import FileSink
from shared.transport.blobs import STAGING_DIR, BlobStore
from shared.wire import staged
from shared.wire.codec import (
    MappedBlob,
    decode_tensors,
    encode_tensors,
    encode_tensors_to_file,
    sha256_hex,
)
from shared.wire.staged import StagedFiles

SPILL = 1 << 16


def _store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "cache", spill_bytes=SPILL)


def _tensors(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(5, dtype=torch.int64)}


def test_a_finished_staged_file_is_written_over_by_the_next_blob(tmp_path: Path) -> None:
    """A map's staged file is kept when the map goes; the store hands it out again, and a
    shorter blob encoded over it, then a longer one, each read back as exactly itself."""
    store = _store(tmp_path)
    big, small, bigger = _tensors(40_000, 0), _tensors(20_000, 1), _tensors(60_000, 2)
    path = store.staging(SPILL * 4)
    assert path is not None and path.parent == tmp_path / "cache" / STAGING_DIR
    blob = encode_tensors_to_file(big, path)
    del blob
    gc.collect()
    assert path.is_file()  # kept, not removed

    for tensors in (small, bigger):
        again = store.staging(SPILL * 4)
        assert again == path  # the kept file, written over
        blob = encode_tensors_to_file(tensors, again)
        assert blob[:] == encode_tensors(tensors)
        assert blob.sha256 == sha256_hex(blob[:]) and len(blob) == path.stat().st_size
        got = decode_tensors(blob, copy=False)
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)
        del blob, got
        gc.collect()
    assert store.staging(SPILL * 4) == path
    assert store.staging(SPILL * 4) != path  # taken: the next one is a new file


def test_a_blob_received_over_a_kept_file_is_what_arrived(tmp_path: Path) -> None:
    """A fetch's FileSink writing over a kept longer file ends the file where its bytes end."""
    store = _store(tmp_path)
    path = store.staging(SPILL * 4)
    assert path is not None
    path.write_bytes(b"x" * (SPILL * 8))
    StagedFiles.of(path.parent).give_back(path)
    kept = store.staging(SPILL * 4)
    assert kept == path
    payload = bytes(range(256)) * (SPILL // 64)
    sink = FileSink(kept)
    for i in range(0, len(payload), 10_000):
        sink.write(payload[i : i + 10_000])
    blob = sink.finish(hashlib.sha256(payload).hexdigest())
    assert isinstance(blob, MappedBlob) and blob[:] == payload
    assert path.stat().st_size == len(payload)
    # a store that keeps the blob adopts the file: it is no longer a staged file to keep
    store.put(blob)
    assert not path.exists() and store.get(blob.sha256) is not None
    del blob
    gc.collect()
    assert not path.exists() and StagedFiles.of(path.parent).kept_bytes == 0


def test_a_folder_keeps_no_more_files_or_bytes_than_its_bounds(tmp_path: Path) -> None:
    """Files given back beyond the count or the bytes a folder keeps are removed."""
    folder = tmp_path / "staging"
    folder.mkdir()
    kept = StagedFiles(folder, max_files=2, max_bytes=300)
    paths = []
    for i, size in enumerate((100, 100, 50, 250)):
        p = folder / f"{i}.part"
        p.write_bytes(b"a" * size)
        paths.append(p)
        kept.give_back(p)
    assert [p.exists() for p in paths] == [True, True, False, False]
    assert kept.kept_bytes == 200
    assert kept.take() == paths[1] and kept.take() == paths[0] and kept.take() is None
    kept.give_back(folder / "gone.part")  # adopted (renamed) already: nothing to keep
    assert kept.kept_bytes == 0


def test_a_staged_file_outside_any_store_goes_with_its_map(tmp_path: Path) -> None:
    """Where no store keeps staged files, a finished one is removed, as before."""
    path = tmp_path / "lone.part"
    blob = encode_tensors_to_file(_tensors(1000, 3), path)
    del blob
    gc.collect()
    assert not path.exists()
    staged.finished(tmp_path / "never.part")  # nothing there: nothing happens


def test_a_store_without_a_disk_stages_nothing(tmp_path: Path) -> None:
    """A memory-only store builds blobs in memory: no staged file to keep or take."""
    store = BlobStore(None)
    assert store.staging(1 << 30) is None


def _put_spilled(store: BlobStore, seed: int) -> tuple[str, bytes]:
    path = store.staging(SPILL * 4)
    assert path is not None
    blob = encode_tensors_to_file(_tensors(40_000, seed), path)
    data = blob[:]
    sha = store.put(blob)
    del blob
    gc.collect()
    return sha, data


def test_a_retired_blob_is_missing_and_its_file_takes_the_next_blob(tmp_path: Path) -> None:
    """retire() takes a blob out of the store, its disk copy's file becoming the staged
    file the next blob is written over; a chunk of it is then missing, never other bytes."""
    store = _store(tmp_path)
    sha, data = _put_spilled(store, 4)
    assert store.chunk(sha, 0, 4096) == data[:4096]
    assert store.retire(sha)
    assert store.get(sha) is None and store.chunk(sha, 0, 4096) is None and not store.has(sha)
    assert not store.retire(sha)  # gone already
    reused = store.staging(SPILL * 4)
    assert reused is not None and reused.is_file() and reused.stat().st_size == len(data)
    other = encode_tensors_to_file(_tensors(30_000, 5), reused)
    assert other[:] == encode_tensors(_tensors(30_000, 5))


def test_a_blob_mapped_by_a_reader_is_retired_without_touching_its_bytes(
    tmp_path: Path,
) -> None:
    """A disk copy someone holds a map of is removed, not kept to be written over: the
    map reads the blob's bytes to the end."""
    store = _store(tmp_path)
    sha, data = _put_spilled(store, 6)
    store.release(sha)
    mapped = store.get(sha)
    assert isinstance(mapped, MappedBlob) and mapped[:] == data
    assert store.retire(sha)
    assert StagedFiles.of(tmp_path / "cache" / STAGING_DIR).kept_bytes == 0
    assert mapped[:] == data


def test_a_chunk_read_while_its_file_is_written_over_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk read from a disk copy that is retired and written over as it is read (the
    blob server's thread against the role's) is never served: the read answers nothing,
    then the blob is missing."""
    store = _store(tmp_path)
    sha, _ = _put_spilled(store, 7)
    store.release(sha)
    real_pread = os.pread

    def racing_pread(fd: int, n: int, offset: int) -> bytes:
        part = real_pread(fd, n, offset)
        store.retire(sha)  # the role retires the blob and writes the next one over it
        reused = store.staging(SPILL * 4)
        assert reused is not None
        time.sleep(0.02)  # a later tick of the file's clock
        encode_tensors_to_file(_tensors(40_000, 8), reused)
        return part

    monkeypatch.setattr(os, "pread", racing_pread)
    assert store.chunk(sha, 1, 4096) is None
    monkeypatch.setattr(os, "pread", real_pread)
    assert store.chunk(sha, 1, 4096) is None


def test_a_map_of_another_stores_copy_is_linked_not_copied(tmp_path: Path) -> None:
    """A store keeping a map of another store's disk copy (an edge keeping its own model,
    served from its private store, as the global) links the file: one file, two names; a
    retire of either name removes that name and keeps the other's bytes intact."""
    main = _store(tmp_path)
    private = BlobStore(tmp_path / "cache" / "private", spill_bytes=SPILL, staged_with=main)
    sha, data = _put_spilled(private, 9)
    private.release(sha)
    mapped = private.get(sha)
    assert isinstance(mapped, MappedBlob) and mapped.origin is not None
    main.put(mapped, sha)
    ours = main.directory / sha[:2] / sha  # type: ignore[operator]
    theirs = private.directory / sha[:2] / sha  # type: ignore[operator]
    assert ours.stat().st_ino == theirs.stat().st_ino and ours.stat().st_nlink == 2
    assert not main._pending  # nothing to write: no second copy
    del mapped
    gc.collect()
    assert main.retire(sha)  # its other name is read elsewhere: removed, not kept
    assert StagedFiles.of(tmp_path / "cache" / STAGING_DIR).kept_bytes == 0
    assert private.chunk(sha, 0, len(data)) == data
    assert private.retire(sha)  # the last name: kept, in the store's staging folder
    assert StagedFiles.of(tmp_path / "cache" / STAGING_DIR).kept_bytes == len(data)


def test_a_retired_blob_too_small_to_spill_is_removed_not_kept(tmp_path: Path) -> None:
    """A small blob's disk copy is removed when it is retired (such blobs are built in
    memory: no staged file would be written over it)."""
    store = _store(tmp_path)
    small = b"s" * 1000
    sha = store.put(small)
    assert store.flush(10) and store.has(sha)
    assert store.retire(sha)
    assert not store.has(sha) and store.get(sha) is None
    assert StagedFiles.of(tmp_path / "cache" / STAGING_DIR).kept_bytes == 0
    assert not list((tmp_path / "cache" / STAGING_DIR).iterdir())
