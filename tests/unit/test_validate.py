"""What user code hands the transport is checked at the door (no Ray, no processes).

``check_state_dict`` refuses, with a :class:`StateDictError` naming the member, the tensor,
what it is and what was expected, every state the transport cannot send, and accepts
everything it can (each accepted case is proven to travel through the transport's own byte
views and plan). The Sender and the Receiver's initial weights refuse before anything moves,
and a malformed manifest on the receive side names the tensor it is about.
"""

from __future__ import annotations

import pickle
import re
import types
import warnings

import msgpack
import pytest
import torch

import ftstate
from ftstate.core.errors import FTError, ManifestError, StateDictError, TransportError
from ftstate.transport import Receiver, Sender, check_state_dict
from ftstate.transport.buckets import DTYPE_ITEMSIZE, plan_layout
from ftstate.transport.checksum import byte_view, dtype_name, state_checksum
from ftstate.transport.manifest import Manifest, decode_manifest, encode_manifest


def good() -> dict[str, torch.Tensor]:
    return {"layer.w": torch.randn(4, 3), "layer.b": torch.zeros(4), "step": torch.tensor(3)}


def check(state, **kw):
    kw.setdefault("device_type", "cpu")
    kw.setdefault("member", "trainer-0")
    return check_state_dict(state, **kw)


def travels(state: dict[str, torch.Tensor]) -> None:
    """What the sender does with an accepted state before the wire: byte views, plan, checksum."""
    for t in state.values():
        assert byte_view(t).numel() == t.numel() * t.element_size()
    plan_layout(((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()), 4096)
    state_checksum(state)


class _Sub(torch.Tensor):
    pass


class DTensor(torch.Tensor):  # a stand-in with the name the hint looks for
    pass


class TestAccepted:
    def test_a_plain_state_comes_back_as_a_new_dict_of_the_same_tensors(self):
        state = good()
        out = check(state)
        assert out == state and out is not state
        assert all(out[k] is state[k] for k in state)
        travels(out)

    def test_any_mapping_is_accepted_and_kept_in_order(self):
        state = types.MappingProxyType(good())
        assert list(check(state)) == ["layer.w", "layer.b", "step"]

    @pytest.mark.parametrize("dtype", list(DTYPE_ITEMSIZE))
    def test_every_dtype_the_manifest_knows(self, dtype):
        t = torch.zeros(3, 2, dtype=getattr(torch, dtype))
        out = check({"t": t})
        assert t.element_size() == DTYPE_ITEMSIZE[dtype]
        travels(out)

    def test_what_the_transport_handles_itself(self):
        base = torch.randn(6, 5)
        state = {
            "transposed": base.t(),  # non-contiguous: sent from a contiguous copy
            "strided": torch.randn(40)[::3],
            "expanded": torch.randn(1, 5).expand(4, 5),  # stride 0
            "empty": torch.zeros(0, 16),  # no elements: travels as name, dtype, shape
            "scalar": torch.tensor(1.5),
            "param": torch.nn.Parameter(torch.randn(3)),  # requires_grad: detached
            "tied.a": base,
            "tied.b": base,  # one tensor under two names
            "conj.noncontig": torch.ones(2, 2, dtype=torch.complex64).t().conj().resolve_conj(),
        }
        travels(check(state))

    def test_an_empty_state_only_where_allowed(self):
        assert check({}, allow_empty=True) == {}

    def test_no_device_asked_accepts_any_device_but_meta(self):
        assert check(good(), device_type=None)
        with pytest.raises(StateDictError, match="meta tensor"):
            check({"m": torch.empty(2, device="meta")}, device_type=None)

    def test_a_state_of_20000_tensors_is_checked_without_a_copy(self):
        # what it costs per tensor (~1 us measured) is measured by benchmarks/validate.py, not asserted here
        state = {f"layers.{i}.w": torch.zeros(2) for i in range(20_000)}
        checked = check(state)
        assert list(checked) == list(state) and all(checked[n] is t for n, t in state.items())


_SPARSE = torch.zeros(3, 3).to_sparse()
with warnings.catch_warnings():  # torch's "beta" / "deprecated" notices for these layouts and dtypes
    warnings.simplefilter("ignore")
    _CSR = torch.eye(3).to_sparse_csr()
    _QUANTIZED = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.quint8)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's nested-tensor prototype warning
class TestRefused:
    @pytest.mark.parametrize(
        ("state", "tensor", "got", "expected"),
        [
            pytest.param({**good(), "layer.w": "oops"}, "layer.w", "str", "a torch.Tensor", id="str value"),
            pytest.param({"w": None}, "w", "NoneType", "a torch.Tensor", id="None value"),
            pytest.param({"w": [1.0, 2.0]}, "w", "list", "a torch.Tensor", id="list value"),
            pytest.param({"w": _SPARSE}, "w", "torch.sparse_coo tensor", "a dense (strided) tensor on cpu",
                         id="sparse"),
            pytest.param({"w": _CSR}, "w", "torch.sparse_csr tensor", "a dense (strided) tensor on cpu", id="csr"),
            pytest.param({"w": torch.empty(2, 3, device="meta")}, "w", "a meta tensor (a shape without data)",
                         "a tensor with data on cpu", id="meta"),
            pytest.param({"q": _QUANTIZED}, "q",
                         "dtype torch.quint8", "one of the dtypes that can travel: bool, uint8", id="quantized"),
            pytest.param({"c": torch.randn(3, dtype=torch.complex64).conj()}, "c",
                         "a tensor with its conjugate bit set (a lazy .conj() view)",
                         "a resolved tensor (call .resolve_conj())", id="conj bit"),
            pytest.param({"n": torch._neg_view(torch.ones(3))}, "n", "a tensor with its negative bit set (a lazy view)",
                         "a resolved tensor (call .resolve_neg())", id="neg bit"),
            pytest.param({"s": torch.zeros(2).as_subclass(_Sub)}, "s",
                         "tests.unit.test_validate._Sub (a torch.Tensor subclass)",
                         "a plain torch.Tensor or nn.Parameter", id="subclass"),
            pytest.param({"d": torch.zeros(2).as_subclass(DTensor)}, "d",
                         "tests.unit.test_validate.DTensor (a torch.Tensor subclass)",
                         "a plain torch.Tensor or nn.Parameter (gather a DTensor with .full_tensor())",
                         id="DTensor"),
            pytest.param({"lazy": torch.nn.UninitializedParameter()}, "lazy",
                         "torch.nn.parameter.UninitializedParameter (a torch.Tensor subclass)",
                         "a plain torch.Tensor or nn.Parameter", id="lazy parameter"),
            pytest.param({"": torch.zeros(1)}, "", "an empty name", "a non-empty str", id="empty name"),
            pytest.param({"bad\ud800": torch.zeros(1)}, "bad\ud800", "a name that is not valid UTF-8 text",
                         "a name that encodes as UTF-8", id="surrogate name"),
            pytest.param({0: torch.zeros(1)}, None, "key 0 of type int", "str keys (tensor names)", id="int key"),
            pytest.param({("a", 1): torch.zeros(1)}, None, "key ('a', 1) of type tuple", "str keys (tensor names)",
                         id="tuple key"),
            pytest.param([("w", torch.zeros(1))], None, "list",
                         "a Mapping[str, torch.Tensor] such as a dict; for a sequence of (name, tensor) pairs, "
                         "return dict(pairs)", id="list of pairs"),
            pytest.param(torch.nn.Linear(2, 2), None, "torch.nn.modules.linear.Linear",
                         "a Mapping[str, torch.Tensor] such as a dict; return the module's state_dict()",
                         id="module"),
            pytest.param(None, None, "NoneType", "a Mapping[str, torch.Tensor] such as a dict", id="None"),
            pytest.param(torch.zeros(3), None, "torch.Tensor", "a Mapping[str, torch.Tensor] such as a dict",
                         id="a bare tensor"),
            pytest.param({}, None, "an empty dict", "at least one tensor", id="empty dict"),
        ],
    )
    def test_names_the_member_the_tensor_what_it_is_and_what_was_expected(self, state, tensor, got, expected):
        with pytest.raises(StateDictError) as info:
            check(state)
        e = info.value
        assert (e.member, e.tensor, e.what) == ("trainer-0", tensor, "state_dict()")
        assert e.got == got
        assert e.expected.startswith(expected)
        where = "state_dict()" if tensor is None else f"state_dict()[{tensor!r}]"
        assert str(e) == f"trainer-0: {where}: got {e.got}, expected {e.expected}"

    def test_a_nested_tensor(self):
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
        with pytest.raises(StateDictError, match=r"\['n'\]: got a nested tensor, expected a dense"):
            check({"n": nested})
        jagged = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
        with pytest.raises(StateDictError, match=r"\['j'\]: got .*NestedTensor \(a torch.Tensor subclass\)"):
            check({"j": jagged})

    def test_a_numpy_array_gets_a_hint(self):
        np = pytest.importorskip("numpy")
        with pytest.raises(StateDictError, match=re.escape("got numpy.ndarray, expected a torch.Tensor (convert it "
                                                           "with torch.from_numpy)")):
            check({"a": np.zeros(2)})

    def test_a_generator_of_pairs_is_not_a_mapping(self):
        with pytest.raises(StateDictError, match="got generator, expected a Mapping"):
            check(((k, v) for k, v in good().items()))

    def test_the_first_bad_tensor_is_named_not_a_later_one(self):
        state = {"ok": torch.zeros(1), "first": "x", "second": _SPARSE}
        with pytest.raises(StateDictError) as info:
            check(state)
        assert info.value.tensor == "first"

    def test_a_long_key_is_shortened_in_the_message(self):
        with pytest.raises(StateDictError) as info:
            check({("x" * 200,): torch.zeros(1)})
        assert len(info.value.got) < 100 and info.value.got.endswith("... of type tuple")


class TestDevice:
    """gloo sends from cpu memory, nccl from cuda memory; no GPU here, so the mismatch that
    can be built is cpu tensors for nccl."""

    def test_cpu_tensors_for_nccl_are_refused_naming_the_backend(self):
        with pytest.raises(StateDictError) as info:
            check(good(), device_type="cuda", backend="nccl", member="trainer-0")
        e = info.value
        assert (e.tensor, e.got) == ("layer.w", "a tensor on cpu")
        assert str(e) == ("trainer-0: state_dict()['layer.w']: got a tensor on cpu, expected a tensor on cuda "
                          "(the nccl backend sends from cuda memory)")

    def test_without_a_backend_name_the_device_alone_is_expected(self):
        with pytest.raises(StateDictError, match=r"got a tensor on cpu, expected a tensor on cuda$"):
            check(good(), device_type="cuda")

    def test_the_backend_device_table(self):
        from ftstate.transport.validate import BACKEND_DEVICE_TYPE

        assert BACKEND_DEVICE_TYPE == {"gloo": "cpu", "nccl": "cuda"}


class TestTheError:
    def test_it_is_an_ftstate_error_and_a_type_error_but_not_a_transport_error(self):
        e = StateDictError("trainer-0", "w", "str", "a torch.Tensor")
        assert isinstance(e, FTError) and isinstance(e, TypeError) and not isinstance(e, TransportError)
        assert ftstate.StateDictError is StateDictError

    def test_member_and_what_are_optional_in_the_message(self):
        assert str(StateDictError("", None, "list", "a Mapping", what="weights")) == "weights: got list, expected a Mapping"

    def test_it_crosses_a_process_boundary_with_its_fields(self):
        with pytest.raises(StateDictError) as info:
            check({"w": _SPARSE})
        back = pickle.loads(pickle.dumps(info.value))
        assert type(back) is StateDictError and str(back) == str(info.value) and vars(back) == vars(info.value)


class _NoWire:
    """A communicator stand-in: a sender that got past the check would touch it and fail."""

    group, version, rank, world_size = "weights", 1, 0, 2
    device = torch.device("cpu")

    def check_usable(self):
        raise AssertionError("the sender went past the check")


class TestAtTheTransport:
    @pytest.mark.parametrize("how", ["broadcast", "send_to"])
    def test_the_sender_refuses_before_anything_moves(self, how):
        sender = Sender(bucket_size=4096)
        args = (_NoWire(),) if how == "broadcast" else (_NoWire(), 1)
        with pytest.raises(StateDictError) as info:
            getattr(sender, how)(*args, {"w": _SPARSE}, weights_version=1, timeout_s=1)
        assert str(info.value) == ("rank 0: weights['w']: got torch.sparse_coo tensor, "
                                   "expected a dense (strided) tensor on cpu")

    def test_an_empty_state_still_reaches_the_wire(self):
        with pytest.raises(AssertionError, match="went past the check"):
            Sender(bucket_size=4096).broadcast(_NoWire(), {}, weights_version=1, timeout_s=1)

    def test_initial_weights_of_a_receiver_are_checked(self):
        with pytest.raises(StateDictError, match=r"^initial weights\['w'\]: got str"):
            Receiver({"w": "x"}, weights_version=1)
        assert Receiver({}, weights_version=0).committed.tensors == {}


class TestReceiveSideNamesTheTensor:
    """The wire is checked by the manifest; each complaint about one tensor names it."""

    @staticmethod
    def wire(index: int, field: int, value) -> bytes:
        specs = [("layer.w", "float32", (3000,)), ("layer.b", "bfloat16", (7,))]
        entries, windows, total = plan_layout(specs, 4096)
        obj = msgpack.unpackb(encode_manifest(Manifest("weights", 3, 1, 4096, total, entries, windows)))
        obj["tensors"][index][field] = value
        return msgpack.packb(obj)

    @pytest.mark.parametrize(
        ("index", "field", "value", "where"),
        [
            (0, 1, "float128", "tensors[0].dtype"),
            (0, 2, [3000, -1], "tensors[0].shape"),
            (1, 3, -64, "tensors[1].offset"),
            (1, 3, 1, "tensors[1].offset"),
            (0, 4, 11, "tensors[0].nbytes"),
            (1, 3, 1 << 40, "tensors[1].offset"),
        ],
    )
    def test_a_malformed_entry_names_its_tensor(self, index, field, value, where):
        with pytest.raises(ManifestError) as info:
            decode_manifest(self.wire(index, field, value), group="weights", group_version=3)
        name = ["layer.w", "layer.b"][index]
        assert info.value.field == where
        assert f"field {where!r}: tensor {name!r}: " in str(info.value)
