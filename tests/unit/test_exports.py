"""The public surface: what `ftstate` exports, and that importing it loads no Ray or torch."""

from __future__ import annotations

import subprocess
import sys

import ftstate


def test_all_names_resolve():
    for name in ftstate.__all__:
        assert getattr(ftstate, name) is not None, name


def test_every_error_derives_from_fterror_but_the_usage_error():
    from ftstate.core import errors

    for name in errors.__all__:
        # a programming error is deliberately outside the fault tree (tests/unit/test_error_tree.py)
        assert issubclass(getattr(errors, name), ftstate.FTError) is (name != "UsageError"), name


def test_every_error_is_exported_from_the_package():
    from ftstate.core import errors

    missing = [name for name in errors.__all__ if getattr(ftstate, name, None) is not getattr(errors, name)]
    assert missing == [], missing
    assert set(errors.__all__) <= set(ftstate.__all__)


def test_importing_the_core_loads_neither_ray_nor_torch():
    code = (
        "import sys, ftstate, ftstate.core.spec, ftstate.core.machine, ftstate.core.audit, ftstate.core.config, ftstate.core.deadline;"
        "bad = [m for m in ('ray', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_error_crosses_a_process_boundary_with_its_fields():
    """Workers raise these inside Ray actors; the controller must get the same class, message
    and attributes back (default exception pickling would call __init__ with the message only)."""
    import pickle

    from ftstate.core import errors

    samples = [
        errors.StaleGroupVersion("weights", got=3, current=4, peer="rank 1"),
        errors.CommunicatorAborted("weights", 4, 2, "peer lost during bucket 3/8"),
        errors.PeerLost("rank 2: a peer was lost", group="weights", group_version=4, rank=2, op="seal", peer=0),
        errors.ManifestError("malformed manifest: field 'tensors[0].shape'", field="tensors[0].shape"),
        errors.MemberLost("rollout-1", "process died", group_version=2),
        errors.WorkerInitError(member="trainer-0", role="trainer", cls="MyTrainer", exc_type="RuntimeError",
                               message="cannot open /data/model.pt", where="train.py:12 in __init__",
                               traceback='  File "train.py", line 12, in __init__\n'),
        errors.SyncTimeout("weight sync", key="sync_timeout_s", seconds=5.0, member="rank 1", group_version=2,
                           missing=["rank 2"], arrived=["rank 0"]),
        errors.ConfigError("fault_tolerance.max_failovers", "must be >= 0"),
        errors.ChecksumMismatch("bucket 1/2 does not match"),
        errors.IntegrationUnavailable(framework="verl", extra="verl", cause="No module named 'verl'"),
        errors.OwnershipError("layer.w", [0, 1], "slice 1 of 2 along dim 0 is owned twice"),
        errors.StateDictError("trainer-0", "layer.w", "torch.sparse_coo tensor", "a dense (strided) tensor on cpu"),
        errors.StateDictError("", None, "list", "a Mapping[str, torch.Tensor]", what="weights"),
        errors.PlacementUnsatisfiable(pool="rollout", asked="pool 'rollout': 2 x {CPU=1, gpu_node=1}, SPREAD",
                                      cluster="1 alive node(s): node 01234567 (127.0.0.1): {CPU=2}",
                                      problem="no node can hold even one bundle"),
        errors.ScaleRefused(field="fault_tolerance.min_rollout_workers", expected="at least 2 rollouts left",
                            got="removing 2 of 3"),
        errors.SharedMemoryUnavailable(path="/dev/shm/ftstate-weights-v3-p12-g1-s0", nbytes=4096,
                                       problem="No space left on device (0 bytes free in /dev/shm)"),
    ]
    assert {type(e).__name__ for e in samples} >= {"StaleGroupVersion", "CommunicatorAborted", "PeerLost",
                                                   "StateDictError"}
    for exc in samples:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc)
        assert str(back) == str(exc)
        assert vars(back) == vars(exc), type(exc).__name__
