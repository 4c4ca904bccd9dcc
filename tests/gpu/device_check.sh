#!/usr/bin/env bash
# The checks a lent GPU machine runs, in order of value, each bounded and each recorded even
# when an earlier one failed:
#   0. env     what the machine is (GPU, driver, python, torch, cupy, NCCL) and that ftstate's
#              pieces under test import without Ray;
#   1. gpu     pytest tests/gpu, but the NCCL file: CUDA IPC between processes on one GPU
#              (test_cuda_ipc.py) and device buckets measured by torch's allocator
#              (test_device_buckets.py);
#   2. nccl    pytest tests/gpu/test_nccl_one_gpu.py: the nccl backend through the real cupy at
#              a world of one (communicator through the store, primitives, the transfer code,
#              abort and a new version, fencing, an init that never completes);
#   3. bench   benchmarks/device_buckets.py: device memory and time of a load through buckets
#              (issue 24 item 3), figures to $OUT/device_buckets.json;
#   4. digest  pytest tests/gpu/test_digest_gpu.py: nh64's bits on the GPU (torch form and the
#              fused Triton kernel) equal to the CPU's on random and adversarial bytes, a GPU
#              state and its CPU copy with one whole-state checksum, no byte to the host (issue 45);
#   5. sync    benchmarks/device_sync.py: two processes on the GPU through CUDA IPC, ftstate's
#              sync of 1, 4 and 16 GiB proved with nh64 against a raw device-to-device copy, the
#              digest alone against the copy bandwidth, a GPU engine's held-weights proof against
#              its update; figures to $OUT/device_sync.json; it fails (rc 1) when a proof disagrees
#              or a weight byte reached the host.
# Everything goes to $OUT: log.txt (this whole output), summary.json (each part's rc and
# seconds, test counts, the benchmarks' rows), junit_gpu.xml, junit_nccl.xml, junit_digest.xml,
# device_buckets.json, device_sync.json. The parts' limits add up to 570 s (within 10 minutes).
#
#   OUT=/some/dir bash tests/gpu/device_check.sh        (from the repository root)
#
# PY: the python to use (python3); missing packages must already be importable (PYTHONPATH).
# On a machine without a GPU every part runs and its tests skip, naming what is missing, but
# part sync, which fails (rc 1, "FAILED: ... no GPU"): a device benchmark that measured nothing
# must not read as a pass.
# Exit status: 0 when every part's rc is 0, else 1.

set -u
OUT=${OUT:-/tmp/ftstate-device-check}
PY=${PY:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

PARTS_FILE=$OUT/.parts
: >"$PARTS_FILE"

part() { # name limit_s command...: run it under `timeout`, record rc and seconds
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== part $name (limit ${limit} s): $*"
    local t0=$EPOCHREALTIME
    timeout -k 10 "$limit" "$@"
    local rc=$?
    local secs
    secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "=== part $name: TIMED OUT after ${limit} s"
    echo "=== part $name: rc=$rc in ${secs} s"
    echo "$name $rc $secs $limit" >>"$PARTS_FILE"
}

env_report() {
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $(nproc)  cwd: $PWD"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv
    else
        echo "nvidia-smi: not on this machine"
    fi
    "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "numpy", "cupy", "msgpack", "xxhash", "yaml", "transitions", "structlog", "zmq", "blake3",
             "pytest", "pytest_timeout", "psutil"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}  ({m.__file__})")
    except Exception as exc:  # report, go on
        print(f"  {name}: NOT importable: {type(exc).__name__}: {exc}")
import torch
print("torch.cuda.is_available():", torch.cuda.is_available(), " torch CUDA:", torch.version.cuda,
      " torch NCCL:", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"  device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs")
try:
    from cupy.cuda import nccl
    ok = getattr(nccl, "available", True)
    print("cupy.cuda.nccl available:", ok, " NCCL", nccl.get_version() if ok else "-",
          " unique id type:", type(nccl.get_unique_id()).__name__ if ok else "-")
except Exception as exc:
    print(f"cupy.cuda.nccl: {type(exc).__name__}: {exc}")
# what the tests import, without Ray (there is none on the GPU machine)
sys.modules["ray"] = None
import ftstate, ftstate.transport.cudaipc, ftstate.transport.devicebuckets, ftstate.transport.nccl  # noqa: E401
import ftstate.transport.samehost, tests.integration._transport_workers, tests.integration.test_transport_shm  # noqa: E401
import ftstate.transport.digest, tests.integration.test_transport_cudaipc  # noqa: E401
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print(f"triton: NOT importable: {type(exc).__name__}: {exc}")
print("ftstate's pieces under test import without Ray")
EOF
}

summary() {
    "$PY" - "$OUT" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
parts = []
for line in open(os.path.join(out, ".parts")):
    name, rc, secs, limit = line.split()
    parts.append({"part": name, "rc": int(rc), "seconds": float(secs), "limit_s": int(limit),
                  "timed_out": rc in ("124", "137")})
tests = {}
for name in ("junit_gpu.xml", "junit_nccl.xml", "junit_digest.xml"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = (el.get("message") or "")[:300]
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), **({"reason": reason} if outcome != "passed" else {})})
    tests[name] = cases
bench = {}
for name in ("device_buckets", "device_sync"):
    path = os.path.join(out, name + ".json")
    bench[name] = json.load(open(path)) if os.path.exists(path) else None
result = {"ok": all(p["rc"] == 0 for p in parts), "parts": parts, "tests": tests, **bench}
json.dump(result, open(os.path.join(out, "summary.json"), "w"), indent=1)
print()
for p in parts:
    print(f"part {p['part']:6} rc={p['rc']:<4} {p['seconds']:7.1f} s{'  TIMED OUT' if p['timed_out'] else ''}")
for name, cases in tests.items():
    counts = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    print(f"{name}: {counts}")
print("summary.json:", "all parts rc 0" if result["ok"] else "SOME PART FAILED")
EOF
}

main() {
    local t_opt=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        t_opt=(--timeout=90)
    else
        echo "(pytest-timeout is not installed here: no per-test timeout, each part still bounded)"
    fi
    local pytest=("$PY" -m pytest -v -rA -p no:cacheprovider -o faulthandler_timeout=60 "${t_opt[@]}")

    part env 40 bash -c env_report
    part gpu 120 "${pytest[@]}" --junitxml="$OUT/junit_gpu.xml" tests/gpu --ignore=tests/gpu/test_nccl_one_gpu.py \
        --ignore=tests/gpu/test_digest_gpu.py
    part nccl 90 "${pytest[@]}" --junitxml="$OUT/junit_nccl.xml" tests/gpu/test_nccl_one_gpu.py
    part bench 80 "$PY" benchmarks/device_buckets.py --json "$OUT/device_buckets.json" --budget-s 45
    part digest 90 "${pytest[@]}" --junitxml="$OUT/junit_digest.xml" tests/gpu/test_digest_gpu.py
    part sync 150 "$PY" benchmarks/device_sync.py --json "$OUT/device_sync.json" --budget-s 90
    summary
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv
    fi
    awk '$2 != 0 { bad = 1 } END { exit bad }' "$PARTS_FILE"
}

export -f part env_report
export OUT PY PARTS_FILE
set -o pipefail
main 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
rm -f "$PARTS_FILE"
exit "$rc"
