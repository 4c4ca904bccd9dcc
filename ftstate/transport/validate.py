"""The check at the door: what user code hands the transport, refused with a typed error."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ftstate.core.errors import StateDictError
from ftstate.transport.buckets import DTYPE_ITEMSIZE

#: The device type each backend sends from.
BACKEND_DEVICE_TYPE: dict[str, str] = {"gloo": "cpu", "nccl": "cuda"}

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DTYPES = ", ".join(DTYPE_ITEMSIZE)


def check_state_dict(
    state: Any,
    *,
    device_type: str | None,
    member: str = "",
    what: str = "state_dict()",
    backend: str = "",
    allow_empty: bool = False,
) -> dict[str, torch.Tensor]:
    """``state`` as a new ``dict`` of name → tensor (the tensors themselves are not copied),
    once it is something the transport can send; :class:`StateDictError` otherwise.
    """

    def fail(tensor: str | None, got: str, expected: str) -> StateDictError:
        return StateDictError(member, tensor, got, expected, what=what)

    if not isinstance(state, Mapping):
        hint = ""
        if isinstance(state, (list, tuple)):
            hint = "; for a sequence of (name, tensor) pairs, return dict(pairs)"
        elif isinstance(state, torch.nn.Module):
            hint = "; return the module's state_dict()"
        raise fail(None, _type_name(state), f"a Mapping[str, torch.Tensor] such as a dict{hint}")
    out: dict[str, torch.Tensor] = {}
    on = f" on {device_type}" if device_type else ""
    for name, value in state.items():
        if not isinstance(name, str):
            raise fail(None, f"key {_short(name)} of type {_type_name(name)}", "str keys (tensor names)")
        if not name:
            raise fail(name, "an empty name", "a non-empty str")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise fail(name, "a name that is not valid UTF-8 text", "a name that encodes as UTF-8") from None
        if not isinstance(value, torch.Tensor):
            hint = " (convert it with torch.from_numpy)" if _type_name(value) == "numpy.ndarray" else ""
            raise fail(name, _type_name(value), f"a torch.Tensor{hint}")
        if type(value) not in _PLAIN:
            hint = " (gather a DTensor with .full_tensor())" if type(value).__name__ == "DTensor" else ""
            raise fail(name, f"{_type_name(value)} (a torch.Tensor subclass)",
                       f"a plain torch.Tensor or nn.Parameter{hint}")
        if value.layout is not torch.strided:
            raise fail(name, f"{value.layout} tensor", f"a dense (strided) tensor{on}")
        if value.is_nested:
            raise fail(name, "a nested tensor", f"a dense (strided) tensor{on}")
        device = value.device
        if device.type == "meta":
            raise fail(name, "a meta tensor (a shape without data)", f"a tensor with data{on}")
        if device_type is not None and device.type != device_type:
            why = f" (the {backend} backend sends from {device_type} memory)" if backend else ""
            raise fail(name, f"a tensor on {device}", f"a tensor on {device_type}{why}")
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in DTYPE_ITEMSIZE:
            raise fail(name, f"dtype {value.dtype}", f"one of the dtypes that can travel: {_DTYPES}")
        if value.is_conj():
            raise fail(name, "a tensor with its conjugate bit set (a lazy .conj() view)",
                       "a resolved tensor (call .resolve_conj())")
        if value.is_neg():
            raise fail(name, "a tensor with its negative bit set (a lazy view)",
                       "a resolved tensor (call .resolve_neg())")
        out[name] = value
    if not out and not allow_empty:
        raise fail(None, f"an empty {_type_name(state)}", "at least one tensor")
    return out


def _type_name(obj: object) -> str:
    t = type(obj)
    module = t.__module__
    return t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"


def _short(obj: object, limit: int = 60) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["BACKEND_DEVICE_TYPE", "check_state_dict"]
