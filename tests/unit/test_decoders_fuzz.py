"""Property-based fuzzing of every decoder of what arrives from outside the process.

Manifests, seals and offers (gloo), bucket signals (zmq), store values (the rendezvous
TCPStore) and config files are all input a hostile or broken peer controls. For each, three
kinds of case: a valid message with one field replaced by an arbitrary msgpack value, an
arbitrary msgpack value, and arbitrary bytes. The property: the decoder returns or raises one
of ftstate's own typed errors (never TypeError, ValueError, OverflowError, MemoryError...),
and each case finishes within hypothesis' deadline (:data:`DEADLINE_MS`). A case that decodes
must moreover satisfy the decoder's own invariants (:func:`manifest_holds`, :func:`seal_holds`,
:func:`offer_holds`: sizes add up, counts within their caps, names unique, every tensor byte in
a bucket and every bucket inside the stream): "a valid manifest" is checked, not assumed, so a
validation rule that is dropped lets hostile input through here and fails the property.

``FTSTATE_FUZZ_EXAMPLES`` sets the cases per property (default :data:`DEFAULT_EXAMPLES`, kept
small for the 2-core machine); the number of cases that ran is printed at the end of the module
(``pytest -s``) and checked to be at least what was asked.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftstate.core.config import RuntimeConfig
from ftstate.core.errors import ConfigError, FTError, ManifestError
from ftstate.transport.buckets import DTYPE_ITEMSIZE, MIN_BUCKET_SIZE, plan_layout
from ftstate.transport.manifest import (
    MAX_BUCKET_SIZE,
    MAX_BUCKETS,
    MAX_NAME_CHARS,
    MAX_NDIM,
    MAX_TENSORS,
    MAX_TOTAL_BYTES,
    Manifest,
    Seal,
    decode_manifest,
    decode_seal,
    encode_manifest,
    encode_seal,
)
from ftstate.transport.nodecopy import is_copy
from ftstate.transport.offer import MAX_HANDLE_BYTES, MAX_PID, MAX_RANK, Offer, decode_offer, encode_offer
from ftstate.transport.signals import _decode
from ftstate.transport.store import parse_int, parse_registration

DEFAULT_EXAMPLES = 150
EXAMPLES = int(os.environ.get("FTSTATE_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
#: Bound on one case, milliseconds (the slowest valid decode here takes well under 10 ms).
DEADLINE_MS = 2000

FUZZ = settings(max_examples=EXAMPLES, deadline=DEADLINE_MS, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: Cases run, per decoder (reported at the end of the module).
RAN: collections.Counter[str] = collections.Counter()

# Hostile values: the edges of every type msgpack can carry, nested.
leaf = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**64 - 1, 2**44, 2**44 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.binary(max_size=40),
    st.sampled_from(["float32", "bfloat16", "weights", "manifest", "offer", "seal", "", "ready", "hello"]),
)
value = st.recursive(
    leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=8), st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=30,
)


def packs(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def valid_manifest() -> Manifest:
    specs = [("w", "float32", (3000,)), ("b", "bfloat16", (7,)), ("step", "int64", ()), ("e", "float32", (0, 3))]
    entries, windows, total = plan_layout(specs, 4096)
    return Manifest("weights", 3, 12, 4096, total, entries, windows)


MANIFEST = valid_manifest()
MANIFEST_OBJ = msgpack.unpackb(encode_manifest(MANIFEST))
SEAL_OBJ = msgpack.unpackb(encode_seal(Seal("weights", 3, 12, tuple(range(MANIFEST.num_buckets)),
                                            (1, 2, 3, 4), 99)))


def replace_path(obj, path: list[int], new):
    """``obj`` with the element reached by following ``path`` (indices modulo the sizes) replaced."""
    if not path or not isinstance(obj, (dict, list)) or not obj:
        return new
    if isinstance(obj, dict):
        keys = sorted(obj)
        key = keys[path[0] % len(keys)]
        return {**obj, key: replace_path(obj[key], path[1:], new)}
    i = path[0] % len(obj)
    return [*obj[:i], replace_path(obj[i], path[1:], new), *obj[i + 1 :]]


def only_typed(decode, data: bytes, name: str, holds=None) -> None:
    """``decode(data)`` raises one of ftstate's errors or returns what ``holds`` accepts."""
    RAN[name] += 1
    # its time is bounded by hypothesis' deadline (DEADLINE_MS, in FUZZ), which every caller runs under
    with contextlib.suppress(FTError):
        result = decode(data)
        if holds is not None:
            holds(result)


# -- what a decoded message guarantees (each line is a rule of its decoder) ------------------


def manifest_holds(m: Manifest, group: str = "weights", group_version: int = 3) -> None:
    assert (m.group, m.group_version) == (group, group_version)
    assert MIN_BUCKET_SIZE <= m.bucket_size <= MAX_BUCKET_SIZE, m.bucket_size
    assert 0 <= m.total_bytes <= MAX_TOTAL_BYTES, m.total_bytes
    assert len(m.tensors) <= MAX_TENSORS and len(m.buckets) <= MAX_BUCKETS
    names = [e.name for e in m.tensors]
    assert len(set(names)) == len(names), "duplicate tensor names accepted"
    for e in m.tensors:
        assert isinstance(e.name, str) and 0 < len(e.name) <= MAX_NAME_CHARS
        assert e.dtype in DTYPE_ITEMSIZE and len(e.shape) <= MAX_NDIM
        count = 1
        for d in e.shape:
            count *= d
        assert e.nbytes == count * DTYPE_ITEMSIZE[e.dtype], f"{e.name}: nbytes does not match its shape"
        assert e.offset % DTYPE_ITEMSIZE[e.dtype] == 0, f"{e.name}: unaligned offset"
        assert e.end <= m.total_bytes, f"{e.name}: ends past total_bytes"
    spans = sorted((e.offset, e.end) for e in m.tensors if e.nbytes)
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans)), "overlapping tensors accepted"
    # the stream is exactly its tensors: no bytes a receiver would allocate and never fill
    assert m.total_bytes == max((end for _, end in spans), default=0), "total_bytes is not where the tensors end"
    prev = 0
    for start, stop in m.buckets:
        assert prev <= start < stop <= m.total_bytes, f"bucket [{start}, {stop}) out of order or out of the stream"
        assert stop - start <= m.bucket_size, "bucket larger than bucket_size"
        prev = stop
    for start, end in spans:  # every tensor byte lies in a bucket
        pos = start
        for b_start, b_stop in m.buckets:
            if b_start <= pos < b_stop:
                pos = min(end, b_stop)
            if pos >= end:
                break
        assert pos >= end, f"byte {pos} of a tensor is in no bucket"


def seal_holds(s: Seal, m: Manifest = MANIFEST) -> None:
    assert (s.group, s.group_version, s.weights_version, s.transfer) == \
        (m.group, m.group_version, m.weights_version, m.transfer)
    assert len(s.bucket_checksums) == m.num_buckets and len(s.tensor_checksums) == len(m.tensors)
    for v in (*s.bucket_checksums, *s.tensor_checksums, s.state_checksum):
        assert not isinstance(v, bool) and isinstance(v, int) and 0 <= v < 2**64


def offer_holds(o: Offer) -> None:
    assert (o.group, o.group_version) == ("weights", 3)
    assert 1 <= o.pid <= MAX_PID
    assert o.endpoint == "" or (o.endpoint.startswith("tcp://127.0.0.1:")
                                and 0 < int(o.endpoint.rsplit(":", 1)[1]) < 65536), o.endpoint
    assert len(o.segments) <= 2 and all(isinstance(x, str) and 0 < len(x) <= 255 for x in o.segments)
    ranks = [*o.shm, *o.collective, *(r for r, _ in o.relays), *(p for _, peers in o.relays for p in peers)]
    assert all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANK for r in ranks)
    assert 0 <= o.chunk <= MAX_BUCKET_SIZE
    assert len(o.handles) in (0, len(o.segments)) and all(isinstance(h, bytes) and len(h) <= MAX_HANDLE_BYTES
                                                          for h in o.handles)
    assert o.fallback is None or (isinstance(o.fallback, str) and len(o.fallback) <= 4096)
    if o.node_copy:
        assert is_copy(o.node_copy) and 1 <= o.owner <= MAX_PID and not o.segments
    assert all(isinstance(b, bool) for b in (o.fresh, o.require, o.recycled))


mutation = st.tuples(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=4), value)
messages = st.one_of(value.map(packs), st.binary(max_size=200))


class TestManifest:
    @FUZZ
    @given(mutation)
    def test_a_manifest_with_any_field_replaced_gives_a_typed_error_or_a_valid_manifest(self, case):
        path, new = case
        only_typed(lambda d: decode_manifest(d, group="weights", group_version=3),
                   packs(replace_path(MANIFEST_OBJ, path, new)), "manifest", manifest_holds)

    @FUZZ
    @given(messages)
    def test_any_bytes_as_a_manifest_give_a_typed_error(self, data):
        only_typed(lambda d: decode_manifest(d, group="weights", group_version=3), data, "manifest", manifest_holds)

    @FUZZ
    @given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=400))
    def test_any_shape_is_refused_or_accepted_in_bounded_time(self, shape):
        obj = {**MANIFEST_OBJ, "tensors": [["x", "float32", shape, 0, 4 * len(shape)], *MANIFEST_OBJ["tensors"][1:]]}
        only_typed(lambda d: decode_manifest(d, group="weights", group_version=3), packs(obj), "manifest",
                   manifest_holds)

    def test_the_reported_attacks_are_typed_errors(self):
        cases = {
            "tensors[0].name": {**MANIFEST_OBJ, "tensors": [[["w"], "float32", [3000], 0, 12000]]},
            "tensors[0].dtype": {**MANIFEST_OBJ, "tensors": [["w", ["float32"], [3000], 0, 12000]]},
            "tensors[0].shape": {**MANIFEST_OBJ, "tensors": [["w", "float32", [2**64 - 1] * 300, 0, 12000]]},
            "total_bytes": {**MANIFEST_OBJ, "total_bytes": 2**64 - 1},
            # past its tensors and buckets: each receiver would allocate 1 GiB it never fills
            "total_bytes ": {**MANIFEST_OBJ, "total_bytes": MANIFEST_OBJ["total_bytes"] + (1 << 30)},
            "tensors[1].name": {**MANIFEST_OBJ, "tensors": [MANIFEST_OBJ["tensors"][0], MANIFEST_OBJ["tensors"][0]]},
        }
        for field, obj in cases.items():
            with pytest.raises(ManifestError) as info:
                decode_manifest(packs(obj), group="weights", group_version=3)
            assert info.value.field == field.strip() and len(str(info.value)) < 400, str(info.value)[:500]
        # 80,000 dimensions are refused on their count, before any is multiplied out (the message
        # says which rule), not by a clock on a shared machine
        with pytest.raises(ManifestError, match=rf"tensors\[0\]\.shape.*at most {MAX_NDIM} integers"):
            decode_manifest(packs({**MANIFEST_OBJ, "tensors": [["w", "float32", [2] * 80_000, 0, 4]]}),
                            group="weights", group_version=3)


class TestTheInvariantsHaveTeeth:
    """The acceptance properties pass what the senders build and fail what a dropped rule lets in."""

    def test_what_the_senders_encode_decodes_and_holds(self):
        manifest_holds(decode_manifest(encode_manifest(MANIFEST), group="weights", group_version=3))
        seal_holds(decode_seal(packs(SEAL_OBJ), MANIFEST))
        offer_holds(decode_offer(packs(TestOffer.offer_obj()), group="weights", group_version=3))

    def test_a_manifest_past_its_tensors_a_duplicate_name_or_a_byte_in_no_bucket_fails_them(self):
        bad = (
            dataclasses.replace(MANIFEST, total_bytes=MANIFEST.total_bytes + 4096),
            dataclasses.replace(MANIFEST, tensors=(MANIFEST.tensors[0], MANIFEST.tensors[0])),
            dataclasses.replace(MANIFEST, buckets=MANIFEST.buckets[1:]),
        )
        for m in bad:
            with pytest.raises(AssertionError):
                manifest_holds(m)

    def test_a_seal_of_the_wrong_count_and_an_offer_off_loopback_fail_them(self):
        with pytest.raises(AssertionError):
            seal_holds(Seal("weights", 3, 12, (1,), (1, 2, 3, 4), 99))
        offer = decode_offer(packs(TestOffer.offer_obj()), group="weights", group_version=3)
        with pytest.raises(AssertionError):
            offer_holds(dataclasses.replace(offer, endpoint="tcp://0.0.0.0:1"))


class TestSeal:
    @FUZZ
    @given(mutation)
    def test_a_seal_with_any_field_replaced_gives_a_typed_error_or_a_valid_seal(self, case):
        path, new = case
        only_typed(lambda d: decode_seal(d, MANIFEST), packs(replace_path(SEAL_OBJ, path, new)), "seal", seal_holds)

    @FUZZ
    @given(messages)
    def test_any_bytes_as_a_seal_give_a_typed_error(self, data):
        only_typed(lambda d: decode_seal(d, MANIFEST), data, "seal", seal_holds)


class TestOffer:
    @staticmethod
    def offer_obj():
        return msgpack.unpackb(encode_offer(Offer("weights", 3, os.getpid(), "tcp://127.0.0.1:5555",
                                                  ("a", "b"), True, (1, 2), (3,), None, ((3, (4, 5)),),
                                                  False, 8 << 20, ())), raw=False)

    @FUZZ
    @given(mutation)
    def test_an_offer_with_any_field_replaced_gives_a_typed_error_or_a_valid_offer(self, case):
        path, new = case
        only_typed(lambda d: decode_offer(d, group="weights", group_version=3),
                   packs(replace_path(self.offer_obj(), path, new)), "offer", offer_holds)

    @FUZZ
    @given(messages)
    def test_any_bytes_as_an_offer_give_a_typed_error(self, data):
        only_typed(lambda d: decode_offer(d, group="weights", group_version=3), data, "offer", offer_holds)

    def test_pids_endpoints_and_ranks_out_of_range_are_refused_by_name(self):
        for field, bad in (("pid", 0), ("pid", -1), ("pid", 2**63), ("endpoint", "tcp://0.0.0.0:1"),
                           ("endpoint", "tcp://127.0.0.1:99999"), ("shm", [-1]), ("collective", [True]),
                           ("segments", ["a", "b", "c"]), ("chunk", 2**62)):
            with pytest.raises(ManifestError) as info:
                decode_offer(packs({**self.offer_obj(), field: bad}), group="weights", group_version=3)
            assert info.value.field == field


class TestSignals:
    @FUZZ
    @given(messages)
    def test_any_signal_frame_is_a_map_with_a_kind_or_a_typed_error(self, data):
        RAN["signal"] += 1
        try:
            msg = _decode(data)
        except ManifestError:
            return
        assert isinstance(msg, dict) and isinstance(msg["kind"], str)

    def test_extra_frames_and_unknown_identities_are_typed_errors_at_the_router(self):
        import zmq

        from ftstate.transport.signals import Channel

        router = Channel.bind()
        try:
            for ident, frames in ((b"r1", [b"a", b"b"]), (b"intruder", [packs({"kind": "failed"})]),
                                  (b"r-5", [packs({"kind": "failed"})])):
                dealer = zmq.Context.instance().socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.IDENTITY, ident)
                dealer.connect(router.endpoint)
                dealer.send_multipart(frames)
                with pytest.raises(ManifestError, match="signal"):
                    for _ in range(50):
                        if router.recv(0.1) is not None:
                            break
                dealer.close(linger=0)
        finally:
            router.close()


class TestStoreValues:
    @FUZZ
    @given(st.binary(max_size=40))
    def test_any_planted_integer_value_is_an_integer_in_range_or_a_typed_error(self, raw):
        RAN["store value"] += 1
        try:
            v = parse_int("weights/current_version", raw)
        except ManifestError as exc:
            assert exc.field == "weights/current_version"
            return
        assert 0 <= v < 2**63

    @FUZZ
    @given(messages)
    def test_any_planted_registration_is_a_map_or_a_typed_error(self, raw):
        RAN["store value"] += 1
        with contextlib.suppress(ManifestError):
            assert isinstance(parse_registration("weights/v1/joined/0", raw), dict)

    def test_planted_values_in_a_live_store_are_typed_errors_naming_the_key(self):
        from ftstate.transport.store import (
            StoreServer,
            connect_store,
            join_version,
            read_current_version,
            roster,
        )

        with StoreServer("127.0.0.1") as server:
            store = connect_store(server.address, 5.0)
            store.set("g/current_version", b"not a number")
            with pytest.raises(ManifestError) as info:
                read_current_version(store, "g")
            assert info.value.field == "g/current_version"
            with pytest.raises(ManifestError):
                join_version(store, "g", 1, 0, 1, 1.0)
            store.set("h/v1/roster", b"0,x,")
            with pytest.raises(ManifestError) as info:
                roster(store, "h", 1)
            assert info.value.field == "h/v1/roster"
            store.set("k/v1/joined/0", b"\xc1garbage")
            with pytest.raises(ManifestError) as info:
                join_version(store, "k", 1, 0, 1, 1.0)
            assert info.value.field == "k/v1/joined/0"


class TestConfig:
    @FUZZ
    @given(st.dictionaries(st.sampled_from(["trainer_workers", "rollout_workers", "sync_timeout_s", "bucket_size_mb",
                                            "fault_tolerance", "placement", "security", "shared_memory", "x"]),
                           value, max_size=5))
    def test_any_data_is_a_config_or_a_config_error(self, data):
        RAN["config"] += 1
        try:
            RuntimeConfig.from_dict(data, environ={})
        except ConfigError as exc:
            assert len(str(exc)) < 2000

    @FUZZ
    @given(st.text(max_size=300))
    def test_any_text_as_a_config_file_is_a_config_or_a_config_error(self, tmp_path_factory, text):
        RAN["config file"] += 1
        path = tmp_path_factory.mktemp("cfg") / "c.yaml"
        path.write_text(text)
        try:
            RuntimeConfig.from_yaml(path, environ={})
        except ConfigError as exc:
            assert len(str(exc)) < 2000

    def test_a_yaml_alias_bomb_is_refused_by_its_aliases(self, tmp_path):
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
        lines.append("rollout_workers: *a8")
        path = tmp_path / "bomb.yaml"
        path.write_text("\n".join(lines))
        # refused for its aliases (the message), before anything of it is expanded
        with pytest.raises(ConfigError, match="aliases are not accepted"):
            RuntimeConfig.from_yaml(path, environ={})

    def test_deep_nesting_and_huge_files_are_refused(self, tmp_path):
        deep = tmp_path / "deep.yaml"
        deep.write_text("rollout_workers: " + "[" * 5000 + "]" * 5000)
        with pytest.raises(ConfigError, match="nested deeper"):
            RuntimeConfig.from_yaml(deep, environ={})
        huge = tmp_path / "huge.yaml"
        huge.write_text("#" * (2 * 1024 * 1024))
        with pytest.raises(ConfigError, match="larger than"):
            RuntimeConfig.from_yaml(huge, environ={})

    def test_non_finite_numbers_are_refused(self):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ConfigError, match="finite"):
                RuntimeConfig.from_dict({"sync_timeout_s": bad}, environ={})


def test_every_property_ran_the_cases_asked(capsys):
    # runs last in the module: the count of cases each decoder took (pytest -s shows it)
    with capsys.disabled():
        print(f"\nfuzz cases run ({EXAMPLES} per property): {dict(RAN)}")
    if not RAN:
        pytest.skip("no fuzz property ran in this session (a -k selection)")
    asked = {"manifest": 3, "seal": 2, "offer": 2, "signal": 1, "store value": 2,
             "config": 1, "config file": 1}
    short = {name: RAN[name] for name, n in asked.items() if name in RAN and RAN[name] < n * EXAMPLES}
    assert not short, f"fewer cases than asked: {short}"
