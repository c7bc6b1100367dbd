"""A JSON object's file of two slots written in place (``store/slots.py``): the newest whole
version is served, across restarts, torn writes, growth, the earlier format and readers that
race the writes."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from tenplex_jax._src.multihost.store import slots, tiers
from tenplex_jax._src.multihost.store.updates import Store
from tenplex_jax.errors import StoreError


def _obj(value) -> np.ndarray:
    return np.frombuffer(json.dumps(value).encode(), np.uint8)


def _value(store: Store, path: str):
    header, data = store.get_json(path)
    return header["version"], json.loads(data.tobytes())


def _file(store: Store, path: str):
    return store.json_dir / f"{tiers._key('json', path)}.obj"


def test_a_json_object_alternates_its_two_slots_in_place_and_survives_a_restart(tmp_path):
    store = Store(tmp_path, 1 << 20, shm=None)
    version, file = None, _file(store, "led")
    for n in range(5):
        sync = bool(n % 2)
        _, version, _ = store.cas_json("led", version, _obj({"n": n}), rid=f"r{n}", sync=sync)
        assert store.json_slots["led"] == (n % 2, slots.MIN_SLOT_BYTES)
        assert _value(store, "led") == (version, {"n": n})
        if n == 0:
            inode = file.stat().st_ino
    store.close()
    assert file.stat().st_ino == inode  # written in place, never replaced
    assert file.stat().st_size == 2 * slots.MIN_SLOT_BYTES
    again = Store(tmp_path, 1 << 20, shm=None)
    assert _value(again, "led") == (version, {"n": 4}) and again.json_slots["led"][0] == 0
    assert again.written_by("led", "r3") is not None  # the ids of its writes came back too
    swapped, newer, _ = again.cas_json("led", version, _obj({"n": 5}))
    assert swapped and newer > version and _value(again, "led") == (newer, {"n": 5})
    again.close()


def test_a_write_torn_by_a_crash_leaves_the_version_before_it(tmp_path):
    """A crash of the machine within a write leaves its slot torn: the header's or the data's
    checksum fails, and the restarted store serves the other slot's version (the write was not
    acknowledged, or was acknowledged without ``sync``). A file with no whole slot is set aside."""
    store = Store(tmp_path, 1 << 20, shm=None)
    first = store.put_json("led", _obj({"n": 1}))
    store.put_json("led", _obj({"n": 2}))  # slot 1
    store.close()
    file, size = _file(store, "led"), slots.MIN_SLOT_BYTES
    raw = bytearray(file.read_bytes())
    for at in (size + 20, size + raw[size:].index(b'{"n": 2}')):  # the header, then the data
        torn = bytearray(raw)
        torn[at] ^= 0xFF
        file.write_bytes(torn)
        again = Store(tmp_path, 1 << 20, shm=None)
        assert _value(again, "led") == (first, {"n": 1})
        again.close()
    file.write_bytes(bytes(2 * size))
    again = Store(tmp_path, 1 << 20, shm=None)
    with pytest.raises(StoreError, match="no JSON object"):
        again.get_json("led")
    assert len(list((tmp_path / "corrupt").iterdir())) == 1
    again.close()


def test_a_damaged_slot_of_a_running_store_is_never_served(tmp_path):
    store = Store(tmp_path, 1 << 20, shm=None)
    store.put_json("led", _obj({"n": 1}))
    store.put_json("led", _obj({"n": 2}))
    file = _file(store, "led")
    raw = bytearray(file.read_bytes())
    raw[raw.index(b'{"n": 2}') + 6] ^= 0x01
    file.write_bytes(raw)
    with pytest.raises(StoreError, match="'led' is corrupt") as error:
        store.get_json("led")
    assert error.value.reason == "corrupt"
    with pytest.raises(StoreError, match="no JSON object"):
        store.get_json("led")
    store.close()


def test_a_record_that_outgrows_its_slot_moves_to_a_file_of_larger_slots(tmp_path):
    store = Store(tmp_path, 1 << 20, shm=None)
    store.put_json("m", _obj({"n": 1}))
    big = {"names": ["x" * 100] * 100}  # ~10 KiB: more than a 4 KiB slot
    version = store.put_json("m", _obj(big))
    slot, size = store.json_slots["m"]
    assert slot == 0 and size >= 2 * len(_obj(big)) and _file(store, "m").stat().st_size == 2 * size
    assert _value(store, "m") == (version, big)
    store.put_json("m", _obj({"n": 3}))  # back into the larger file, in place
    assert store.json_slots["m"] == (1, size) and _value(store, "m")[1] == {"n": 3}
    store.close()


def test_a_file_of_the_earlier_format_is_read_then_rewritten_as_slots(tmp_path):
    store = Store(tmp_path, 1 << 20, shm=None)
    store.close()
    data = _obj({"n": 7})
    header = {"path": "led", "nbytes": len(data), "checksum": tiers.wire.checksum(data)}
    tmp = store._write_tmp({**header, "version": 5, "rids": [["r", 5]]}, data)
    tmp.rename(_file(store, "led"))
    again = Store(tmp_path, 1 << 20, shm=None)
    assert "led" not in again.json_slots and _value(again, "led") == (5, {"n": 7})
    assert again.written_by("led", "r") == 5
    swapped, version, _ = again.cas_json("led", 5, _obj({"n": 8}))
    assert swapped and again.json_slots["led"] == (0, slots.MIN_SLOT_BYTES)
    assert _value(again, "led") == (version, {"n": 8})
    again.close()


def test_a_reader_racing_the_writes_never_sees_an_older_version_or_a_fault(tmp_path):
    """Every read returns a whole version no older than the last one acknowledged before the
    read began: a read that met its slot being rewritten reads again."""
    store = Store(tmp_path, 1 << 20, shm=None)
    acked = [store.put_json("led", _obj({"n": 0, "pad": "x" * 2000}))]
    done, faults = threading.Event(), []

    def write() -> None:
        for n in range(1, 600):
            acked.append(store.cas_json("led", acked[-1], _obj({"n": n, "pad": "y" * 2000}))[1])
        done.set()

    def read() -> None:
        while not done.is_set():
            floor = acked[-1]
            try:
                version, value = _value(store, "led")
            except StoreError as error:
                faults.append(repr(error))
                return
            if version < floor or (version in acked and acked.index(version) != value["n"]):
                faults.append(f"read version {version} ({value['n']}) after {floor}")
                return

    threads = [threading.Thread(target=write), *(threading.Thread(target=read) for _ in range(2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert done.is_set() and not faults
    store.close()


def test_a_read_torn_by_a_write_reads_again_and_a_damaged_one_does_not(tmp_path, monkeypatch):
    """A read whose slot fails its checks because a write landed on it meanwhile (the version
    moved on) reads again; one whose version did not move is damage: set aside, never served."""
    store = Store(tmp_path, 1 << 20, shm=None)
    store.put_json("led", _obj({"n": 1}))
    parse, calls = Store._json_of, []

    def torn(f, slot=None):
        calls.append(slot)
        if len(calls) == 1:  # two writes land while this read was under way: its slot is torn
            store.put_json("led", _obj({"n": 2}))
            store.put_json("led", _obj({"n": 3}))
            raise ValueError("the header fails its checksum (a torn or damaged write)")
        return parse(f, slot)

    def damaged(f, slot=None):
        raise ValueError("the header fails its checksum (a torn or damaged write)")

    monkeypatch.setattr(Store, "_json_of", staticmethod(torn))
    assert _value(store, "led")[1] == {"n": 3} and calls == [0, 0]
    monkeypatch.setattr(Store, "_json_of", staticmethod(damaged))
    with pytest.raises(StoreError, match="corrupt"):
        store.get_json("led")
    assert "led" not in store.json
    store.close()


def test_a_read_reads_its_record_not_its_slot(tmp_path, monkeypatch):
    """A large JSON object's slots are twice its size or more: a read takes the record's bytes
    (prefix, header, data) and never the slot's unused tail."""
    store = Store(tmp_path, 1 << 20, shm=None)
    big = {"names": ["x" * 1000] * 1000}  # ~1 MiB: slots of 4 MiB
    store.put_json("m", _obj(big))
    store.put_json("m", _obj({"n": 1}))
    read = []
    pread = slots.os.pread
    monkeypatch.setattr(slots.os, "pread", lambda fd, n, at: read.append(n) or pread(fd, n, at))
    assert _value(store, "m")[1] == {"n": 1} and sum(read) < 1024
    store.close()
