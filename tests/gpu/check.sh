#!/usr/bin/env bash
# The /hardware sampler against a real NVIDIA driver (issue 17): not part of the test run, for a
# machine with a GPU. In under 5 minutes it installs the project in a fresh virtual environment,
# runs `sidecar watch --hardware-interval 1` into the local ingest (`sidecar receive`) while a
# small CUDA load runs (torch if it is installed, else none), samples `nvidia-smi` at the same
# time, and compares: every key present, values within the tolerances below, the GPM keys on
# Hopper and newer, no ERROR line from the sidecar. It prints a table and exits 0 when all of it
# holds, 1 on a mismatch, 2 when it cannot run (no nvidia-smi, an install that failed).
#
#     tests/gpu/check.sh [SECONDS]      (default 30 s of sampling)
#
# Environment: CHECK_PYTHON=python3 (the interpreter the venv is made from), CHECK_KEEP=1 (keep
# the scratch folder, named at the end), CHECK_PIP_ARGS (extra pip arguments, e.g. an offline
# --find-links folder).
set -euo pipefail

SECONDS_TO_SAMPLE=${1:-30}
PYTHON=${CHECK_PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
RUN_ID=gpu-check
TOKEN=tok-gpu-check-$$

say() { printf '%s check.sh: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
cannot() { say "CANNOT RUN: $*"; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || cannot "nvidia-smi is not on PATH: this check needs a machine with an NVIDIA GPU and its driver"
command -v timeout >/dev/null 2>&1 || cannot "timeout (coreutils) is not on PATH"
command -v "$PYTHON" >/dev/null 2>&1 || cannot "$PYTHON is not on PATH (set CHECK_PYTHON)"
if ! [[ "$SECONDS_TO_SAMPLE" =~ ^[0-9]+$ ]] || (( SECONDS_TO_SAMPLE < 10 || SECONDS_TO_SAMPLE > 120 )); then
    cannot "SECONDS must be a whole number from 10 to 120, not '$SECONDS_TO_SAMPLE'"
fi
timeout 30 nvidia-smi -L >/dev/null 2>&1 || cannot "nvidia-smi -L failed: is the driver loaded? ($(timeout 30 nvidia-smi -L 2>&1 | head -1))"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/sidecar-gpu-check.XXXXXX")
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        timeout 15 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    done
    if [[ "${CHECK_KEEP:-}" == 1 ]]; then say "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

# -- 1. install ------------------------------------------------------------------------------
say "installing the project into $WORK/venv"
timeout 60 "$PYTHON" -m venv --system-site-packages "$WORK/venv" || cannot "python -m venv failed"
# shellcheck disable=SC2086  # CHECK_PIP_ARGS is a list of words on purpose
timeout 180 "$WORK/venv/bin/python" -m pip install -q ${CHECK_PIP_ARGS:-} "$REPO" \
    >"$WORK/pip.log" 2>&1 || { tail -20 "$WORK/pip.log" >&2; cannot "pip install of $REPO failed (log above)"; }
SIDECAR=("$WORK/venv/bin/python" -m sidecar)
(cd "$WORK" && timeout 30 "${SIDECAR[@]}" --version) >/dev/null || cannot "the installed sidecar does not start"

# -- 2. the local ingest ---------------------------------------------------------------------
(cd "$WORK" && exec timeout 300 "${SIDECAR[@]}" receive --port 0 --dir "$WORK/received" \
    --ready-file "$WORK/url" --token "$TOKEN" --run-id "$RUN_ID" --quiet) \
    >"$WORK/receive.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [[ -s "$WORK/url" ]] && break; sleep 0.1; done
[[ -s "$WORK/url" ]] || { cat "$WORK/receive.log" >&2; cannot "sidecar receive did not start"; }
ENDPOINT=$(cat "$WORK/url")

# -- 3. a small CUDA load --------------------------------------------------------------------
LOAD=none
if timeout 60 "$WORK/venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    LOAD=torch
    timeout $((SECONDS_TO_SAMPLE + 60)) "$WORK/venv/bin/python" - "$((SECONDS_TO_SAMPLE + 10))" \
        >"$WORK/load.log" 2>&1 <<'EOF' &
import sys, time
import torch
x = torch.randn(4096, 4096, device="cuda")
hold = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB held: memory.used moves
end = time.monotonic() + float(sys.argv[1])
said = False
while time.monotonic() < end:
    for _ in range(20):
        x = (x @ x).clamp_(-1, 1)
    torch.cuda.synchronize()
    if not said:  # the first batch is done: the GPU is busy from here on
        print("running", flush=True)
        said = True
    time.sleep(0.02)  # about three quarters busy, not saturated: utilisation is neither 0 nor 100
EOF
    PIDS+=($!)
fi
say "CUDA load: $LOAD"
if [[ $LOAD == torch ]]; then  # it runs before the first sample (CUDA starts in seconds)
    for _ in $(seq 600); do grep -qx running "$WORK/load.log" && break; sleep 0.1; done
    grep -qx running "$WORK/load.log" ||
        { cat "$WORK/load.log" >&2; cannot "the CUDA load did not start within 60 s"; }
fi

# -- 4. sidecar watch and nvidia-smi, side by side ---------------------------------------------
# --foreground: a plain timeout passes our SIGTERM on to its whole process group as well, and
# the sidecar takes a second signal as "stop draining now".
env STARFORGE_ENABLED=1 STARFORGE_ENDPOINT="$ENDPOINT" STARFORGE_RUN_ID="$RUN_ID" \
    STARFORGE_TOKEN="$TOKEN" SIDECAR_STATE_DIR="$WORK/state" SIDECAR_STATUS_ADDR=off \
    timeout --foreground $((SECONDS_TO_SAMPLE + 60)) "${SIDECAR[@]}" watch --hardware-interval 1 \
    >"$WORK/watch.out" 2>"$WORK/watch.err" &
WATCH=$!
PIDS+=("$WATCH")
timeout $((SECONDS_TO_SAMPLE + 30)) nvidia-smi \
    --query-gpu=index,timestamp,utilization.gpu,memory.used,power.draw,temperature.gpu,clocks.sm \
    --format=csv,noheader,nounits -lms 500 >"$WORK/smi.csv" 2>"$WORK/smi.err" &
SMI=$!
PIDS+=("$SMI")
say "sampling for $SECONDS_TO_SAMPLE s"
sleep "$SECONDS_TO_SAMPLE"
kill -TERM "$SMI" 2>/dev/null || true
kill -TERM "$WATCH" 2>/dev/null || true
WATCH_STATUS=0
timeout 60 tail --pid="$WATCH" -f /dev/null || WATCH_STATUS=124
wait "$WATCH" || WATCH_STATUS=$?
COMPUTE=$(timeout 30 nvidia-smi --query-gpu=index,compute_cap,name --format=csv,noheader 2>/dev/null || true)

# -- 5. compare ------------------------------------------------------------------------------
timeout 60 "$WORK/venv/bin/python" - "$WORK" "$WATCH_STATUS" "$LOAD" "$COMPUTE" <<'EOF'
"""Compare what reached /hardware with nvidia-smi's samples of the same seconds."""
import json, statistics, sys
from datetime import datetime
from pathlib import Path

work, watch_status, load, compute = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
problems = []

# Keys every whole GPU sends with this driver (docs/ingest.md#nodes-and-ranks; nvml/queries.py's
# QUERIES), GPM's on Hopper+.
KEYS = ["utilization_percent", "memory_utilization_percent", "memory_used_bytes",
        "memory_total_bytes", "temperature_celsius", "power_watts", "power_limit_watts",
        "energy_joules", "sm_clock_hertz", "memory_clock_hertz", "pcie_tx_bytes_per_second",
        "pcie_rx_bytes_per_second", "ecc_corrected_count", "ecc_uncorrected_count",
        "remapped_rows_correctable_count", "remapped_rows_uncorrectable_count",
        "row_remap_pending_flag", "row_remap_failure_flag"]
KEYS += [f"clock_event/{name}_flag" for name in (
    "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
    "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
    "display_clock_setting")]
GPM = ["sm_active_percent", "sm_occupancy_percent", "tensor_active_percent",
       "dram_bandwidth_percent"]
# (our key, nvidia-smi column, our value -> smi's unit, tolerance: absolute, relative)
COMPARED = [("utilization_percent", 2, 1.0, 25.0, 0.0, "%"),
            ("memory_used_bytes", 3, 1 / 2**20, 512.0, 0.05, "MiB"),
            ("power_watts", 4, 1.0, 40.0, 0.15, "W"),
            ("temperature_celsius", 5, 1.0, 4.0, 0.0, "C"),
            ("sm_clock_hertz", 6, 1e-6, 150.0, 0.10, "MHz")]


def stamp(text):
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


ours = {}  # key -> [(ts, value)]
hardware = work / "received" / "hardware.jsonl"
for line in (hardware.read_text().splitlines() if hardware.exists() else []):
    for point in json.loads(line)["points"]:
        ours.setdefault(point["key"], []).append((stamp(point["ts"]), point["value"]))
if not ours:
    problems.append("no /hardware sample arrived")

smi = {}  # gpu index -> [(ts, [columns])]
for row in (work / "smi.csv").read_text().splitlines():
    cells = [c.strip() for c in row.split(",")]
    if len(cells) != 7:
        continue
    try:
        at = datetime.strptime(cells[1], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        continue
    smi.setdefault(int(cells[0]), []).append((at, cells))
if not smi:
    problems.append("nvidia-smi gave no sample")

hopper = {}  # GPM exists from Hopper (compute capability 9.0) on
for row in compute.splitlines():
    cells = [c.strip() for c in row.split(",")]
    if len(cells) >= 3 and cells[0].isdigit():
        try:
            hopper[int(cells[0])] = float(cells[1]) >= 9.0
        except ValueError:
            hopper[int(cells[0])] = any(m in cells[2] for m in ("H100", "H200", "H800", "H20",
                                                                "GH200", "B100", "B200"))

table = [("gpu", "key", "sidecar", "nvidia-smi", "tolerance", "result")]
for gpu in sorted(smi):
    for name in KEYS + (GPM if hopper.get(gpu) else []):
        key = f"gpu/{gpu}/{name}"
        present = key in ours
        table.append((str(gpu), name, f"{len(ours.get(key, []))} points", "", "present",
                      "ok" if present else "MISSING"))
        if not present:
            problems.append(f"{key} never arrived")
    for name, column, scale, absolute, relative, unit in COMPARED:
        key = f"gpu/{gpu}/{name}"
        mine = [(t, v * scale) for t, v in ours.get(key, [])]
        theirs = [(t, float(c[column])) for t, c in smi[gpu] if c[column] not in ("", "[N/A]")]
        if not mine or not theirs:
            table.append((str(gpu), name, "-", "-", "", "NO DATA"))
            problems.append(f"{key}: no values to compare")
            continue
        window = (max(mine[0][0], theirs[0][0]), min(mine[-1][0], theirs[-1][0]))
        a = statistics.median(v for t, v in mine if window[0] - 1 <= t <= window[1] + 1) \
            if window[0] <= window[1] else statistics.median(v for _, v in mine)
        b = statistics.median(v for t, v in theirs if window[0] - 1 <= t <= window[1] + 1) \
            if window[0] <= window[1] else statistics.median(v for _, v in theirs)
        allowed = max(absolute, relative * abs(b))
        ok = abs(a - b) <= allowed
        table.append((str(gpu), name, f"{a:,.1f} {unit}", f"{b:,.1f} {unit}",
                      f"+-{allowed:,.1f} {unit}", "ok" if ok else "MISMATCH"))
        if not ok:
            problems.append(f"{key}: median {a:.1f} {unit}, nvidia-smi {b:.1f} {unit}")

errors = [line for line in (work / "watch.err").read_text(errors="replace").splitlines()
          if " ERROR " in line]
problems += [f"sidecar said: {line[:200]}" for line in errors]
if watch_status != 0:
    problems.append(f"sidecar watch exited {watch_status} after SIGTERM")

widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
for i, row in enumerate(table):
    print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    if i == 0:
        print("  ".join("-" * w for w in widths))
print(f"\nCUDA load: {load}; {sum(len(v) for v in smi.values())} nvidia-smi rows; "
      f"{len(ours)} keys from /hardware; sidecar ERROR lines: {len(errors)}")
for problem in problems:
    print(f"PROBLEM: {problem}")
print("RESULT:", "MISMATCH" if problems else "all keys present, all values within tolerance")
sys.exit(1 if problems else 0)
EOF
