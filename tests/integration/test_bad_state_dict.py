"""A trainer whose ``state_dict()`` the transport cannot send, on a real local Ray cluster.

For each bad state (a str value, a sparse or meta tensor, a list of pairs, an empty dict, a
non-str key, a dtype that cannot travel, a lazy conjugate), with fault tolerance off and on:
``sync()`` raises :class:`StateDictError` itself (not Ray's wrapper) naming the trainer and
the tensor, within seconds and without a retry or a failover; every rollout keeps the
previous weights version, bit for bit; the next good sync goes through. One Runtime serves
every case of a fault-tolerance setting. (A device the backend cannot send from needs a
GPU to build for gloo; tests/unit/test_validate.py checks the validator for it directly.)
"""

from __future__ import annotations

import time

import pytest

import ftstate
from ftstate.core.audit_check import check_trail
from ftstate.core.errors import StateDictError
from tests.integration._bad_state_workers import BAD, BadStateTrainer
from tests.integration.workers import TinyRollout

pytestmark = pytest.mark.ray

#: mode → (the tensor named, None for the whole state; what the message says)
CASES: dict[str, tuple[str | None, str]] = {
    "str": ("layer.bias", r"trainer-0: state_dict\(\)\['layer\.bias'\]: got str, expected a torch\.Tensor$"),
    "sparse": ("layer.weight", r"trainer-0: state_dict\(\)\['layer\.weight'\]: got torch\.sparse_coo tensor, "
                               r"expected a dense \(strided\) tensor on cpu$"),
    "meta": ("layer.bias", r"trainer-0: state_dict\(\)\['layer\.bias'\]: got a meta tensor \(a shape without "
                           r"data\), expected a tensor with data on cpu$"),
    "pairs": (None, r"trainer-0: state_dict\(\): got list, expected a Mapping\[str, torch\.Tensor\] such as a "
                    r"dict; for a sequence of \(name, tensor\) pairs, return dict\(pairs\)$"),
    "empty": (None, r"trainer-0: state_dict\(\): got an empty dict, expected at least one tensor$"),
    "int key": (None, r"trainer-0: state_dict\(\): got key 7 of type int, expected str keys \(tensor names\)$"),
    "quantized": ("layer.bias", r"trainer-0: state_dict\(\)\['layer\.bias'\]: got dtype torch\.quint8, "
                                r"expected one of the dtypes that can travel: bool, "),
    "conj": ("rotary", r"trainer-0: state_dict\(\)\['rotary'\]: got a tensor with its conjugate bit set"),
}


def test_every_bad_mode_has_a_case():
    assert set(CASES) == set(BAD)


def config(tmp_path, ft: bool) -> ftstate.RuntimeConfig:
    return ftstate.RuntimeConfig.from_dict(
        {
            "rollout_workers": 2,
            "bucket_size_mb": 0.0625,
            "init_timeout_s": 60,
            "sync_timeout_s": 30,
            "failover_timeout_s": 30,
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 1.0,
            "audit_log": str(tmp_path / "audit.jsonl"),
            "fault_tolerance": {"enable": ft, "mode": "cold"},
        },
        environ={},
    )


@pytest.mark.parametrize("ft", [False, True], ids=["ft off", "ft on"])
async def test_a_bad_state_dict_fails_the_sync_naming_the_tensor_and_every_rollout_keeps_its_version(
    ray_cluster, tmp_path, ft
):
    cfg = config(tmp_path, ft)
    async with ftstate.Runtime(cfg, trainer=BadStateTrainer, rollout=TinyRollout) as rt:
        await rt.sync()
        for mode, (tensor, message) in CASES.items():
            version = rt.weights_version
            held = await rt.rollout("checksum")
            assert held == [rt.checksum] * 2
            await rt.trainer("train_step")
            await rt.trainer("set_mode", mode)
            t0 = time.monotonic()
            with pytest.raises(StateDictError, match=message) as info:
                await rt.sync()
            elapsed = time.monotonic() - t0
            assert elapsed < cfg.sync_timeout_s / 2, (mode, elapsed)  # refused before the wire; a wait lasts it out
            err = info.value
            assert type(err) is StateDictError, type(err)  # itself, not RayTaskError(StateDictError)
            assert (err.member, err.tensor) == ("trainer-0", tensor), mode
            # nobody committed: both rollouts still serve the previous version, bit for bit
            assert rt.weights_version == version and rt.state == "READY", mode
            assert await rt.rollout("checksum") == held, mode
            assert await rt.rollout("generate", "p") == [("p", version)] * 2, mode
            # the group is sound: the next good sync goes through
            await rt.trainer("set_mode", "good")
            report = await rt.sync()
            assert report.weights_version == version + 1, mode
            assert await rt.rollout("checksum") == [report.checksum] * 2 == [await rt.trainer("checksum")] * 2
        # tried once each, not retried, nothing failed over; one new group version per failure at most
        events = [r["event"] for r in rt.audit.records]
        assert "sync_retry" not in events and "sync_gave_up" not in events
        assert rt.failovers == []
        assert rt.group_version <= 1 + len(CASES)
        assert {m.member: m.state for m in rt.members() if m.state != "STANDBY"} == {
            "trainer-0": "READY", "rollout-0": "READY", "rollout-1": "READY"}
    assert check_trail(tmp_path / "audit.jsonl") == []
