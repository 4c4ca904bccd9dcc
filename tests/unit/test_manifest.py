"""Manifest and seal: msgpack round trip, validation naming the field, group-version fencing."""

from __future__ import annotations

import msgpack
import pytest

from ftstate.core.errors import ManifestError, StaleGroupVersion, TransportError
from ftstate.transport.buckets import plan_layout
from ftstate.transport.manifest import (
    WIRE_FORMAT,
    Manifest,
    Seal,
    decode_manifest,
    decode_seal,
    encode_manifest,
    encode_seal,
)

BUCKET = 4096


def make_manifest(group_version: int = 3) -> Manifest:
    specs = [("w", "float32", (3000,)), ("b", "bfloat16", (7,)), ("step", "int64", ())]
    entries, windows, total = plan_layout(specs, BUCKET)
    return Manifest("weights", group_version, 12, BUCKET, total, entries, windows)


def tampered(**changes) -> bytes:
    obj = msgpack.unpackb(encode_manifest(make_manifest()))
    for key, value in changes.items():
        if value is KeyError:
            del obj[key]
        else:
            obj[key] = value
    return msgpack.packb(obj)


def with_tensor(index: int, field: int, value) -> bytes:
    obj = msgpack.unpackb(encode_manifest(make_manifest()))
    obj["tensors"][index][field] = value
    return msgpack.packb(obj)


class TestRoundTrip:
    def test_manifest_survives_encode_and_decode(self):
        m = make_manifest()
        assert decode_manifest(encode_manifest(m), group="weights", group_version=3) == m

    def test_seal_survives_encode_and_decode(self):
        m = make_manifest()
        s = Seal("weights", 3, 12, tuple(range(m.num_buckets)), (1, 2, (1 << 64) - 1), 99)
        assert decode_seal(encode_seal(s), m) == s

    def test_the_checksum_function_travels_and_a_host_manifest_does_not_name_it(self):
        import dataclasses

        m = make_manifest()
        assert "digest" not in msgpack.unpackb(encode_manifest(m))  # xxh3: the bytes of before
        nh = dataclasses.replace(m, digest="nh64")
        assert decode_manifest(encode_manifest(nh), group="weights", group_version=3).digest == "nh64"

    def test_an_unknown_checksum_function_is_refused_naming_the_field(self):
        with pytest.raises(ManifestError, match="checksum function") as info:
            decode_manifest(tampered(digest="crc32"), group="weights", group_version=3)
        assert info.value.field == "digest"

    def test_the_wire_is_msgpack_never_pickle(self):
        data = encode_manifest(make_manifest())
        assert not data.startswith(b"\x80")  # pickle protocol marker
        assert msgpack.unpackb(data)["kind"] == "manifest"


class TestFencing:
    def test_a_manifest_from_an_older_group_version_is_rejected_as_stale(self):
        with pytest.raises(StaleGroupVersion, match="version 3; current version is 4") as info:
            decode_manifest(encode_manifest(make_manifest(group_version=3)), group="weights", group_version=4)
        assert (info.value.got, info.value.current, info.value.group) == (3, 4, "weights")

    def test_a_manifest_from_a_newer_version_or_another_group_is_malformed(self):
        with pytest.raises(ManifestError, match="'group_version'"):
            decode_manifest(encode_manifest(make_manifest(group_version=5)), group="weights", group_version=4)
        with pytest.raises(ManifestError, match="'group'"):
            decode_manifest(encode_manifest(make_manifest()), group="other", group_version=3)

    def test_a_stale_seal_is_rejected_too(self):
        m = make_manifest(group_version=4)
        stale = Seal("weights", 3, 12, (0,) * m.num_buckets, (0, 0, 0), 0)
        with pytest.raises(StaleGroupVersion):
            decode_seal(encode_seal(stale), m)


class TestValidationNamesTheField:
    @pytest.mark.parametrize(
        ("data", "field"),
        [
            (b"\xc1garbage", None),
            (msgpack.packb([1, 2]), None),
            (tampered(kind="seal"), "kind"),
            (tampered(format=WIRE_FORMAT + 1), "format"),
            (tampered(weights_version=KeyError), "weights_version"),
            (tampered(weights_version=-1), "weights_version"),
            (tampered(weights_version="12"), "weights_version"),
            (tampered(bucket_size=10), "bucket_size"),
            (tampered(tensors="nope"), "tensors"),
            (tampered(total_bytes=100), "tensors[0].offset"),
            (with_tensor(1, 0, ""), "tensors[1].name"),
            (with_tensor(1, 0, "w"), "tensors[1].name"),
            (with_tensor(0, 1, "float128"), "tensors[0].dtype"),
            (with_tensor(0, 2, [3000, -1]), "tensors[0].shape"),
            (with_tensor(0, 4, 11), "tensors[0].nbytes"),
            (with_tensor(1, 3, 1), "tensors[1].offset"),
            (with_tensor(1, 3, 64), "tensors"),
            (tampered(buckets=[[0, 5000]]), "buckets[0]"),
            (tampered(buckets=[[0, 10]]), "buckets"),
            (tampered(buckets=[[0, 100], [50, 200]]), "buckets[1]"),
        ],
    )
    def test_malformed_manifest(self, data, field):
        with pytest.raises(ManifestError) as info:
            decode_manifest(data, group="weights", group_version=3)
        if field is not None:
            assert f"field {field!r}" in str(info.value)
        assert info.value.field == field
        assert isinstance(info.value, TransportError)

    def test_seal_with_the_wrong_number_of_checksums(self):
        m = make_manifest()
        bad = Seal("weights", 3, 12, (1,), (1, 2, 3), 4)
        with pytest.raises(ManifestError, match="'bucket_checksums'"):
            decode_seal(encode_seal(bad), m)

    def test_a_seal_of_another_transfer_is_refused_even_for_the_same_weights_version(self):
        """Within one group version the transfer id tells transfers apart: a genuine seal
        recorded in one transfer cannot close another (its checksums would bless other bytes)."""
        import dataclasses

        m = dataclasses.replace(make_manifest(), transfer=0xABCD)
        decoded = decode_manifest(encode_manifest(m), group="weights", group_version=3)
        assert decoded.transfer == 0xABCD
        recorded = Seal("weights", 3, 12, (0,) * m.num_buckets, (1, 2, 3), 4, transfer=0x1234)
        with pytest.raises(ManifestError, match="'transfer'"):
            decode_seal(encode_seal(recorded), decoded)
        assert decode_seal(encode_seal(dataclasses.replace(recorded, transfer=0xABCD)), decoded).transfer == 0xABCD

    def test_seal_for_another_weights_version(self):
        m = make_manifest()
        bad = Seal("weights", 3, 13, (0,) * m.num_buckets, (1, 2, 3), 4)
        with pytest.raises(ManifestError, match="'weights_version'"):
            decode_seal(encode_seal(bad), m)
