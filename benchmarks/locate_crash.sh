#!/usr/bin/env bash
# Locate the CUDA illegal memory access of MTP4 at C8 on the full-size AWQ model with the PLE table in host memory
# (benchmarks/RESULTS.md F3): benchmarks/locate_crash.py once per mode, each in its own process (an illegal access
# leaves the CUDA context unusable), CUDA_LAUNCH_BLOCKING=1, a per-mode time limit (LIMIT, 200 s). One H200: ~2-3
# minutes per mode, the first one longer from a cold Triton cache.
#
#   benchmarks/locate_crash.sh                       # static, then graphs
#   benchmarks/locate_crash.sh static graphs eager "graphs --ple device" "graphs --weights 16bit --ple device"
#   benchmarks/locate_crash.sh "graphs --weights 16bit --experts 64 --ple weight"   # F3's run on the F1 stand-in
#
#   WRAP="compute-sanitizer --tool memcheck --print-limit 20" LIMIT=600 \
#       benchmarks/locate_crash.sh "static --standin-ngram-table --steps 3"   # under memcheck (slow; small table)
#
# A mode is locate_crash.py's --mode and any further arguments. Prints one table row per mode: exit status (3: a
# CUDA error), seconds, the stage that failed and the error, then the failing launch and the last engine event; the
# full logs (traceback, last Triton launches) are in ${OUT:-.}/locate_crash/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export CUDA_LAUNCH_BLOCKING=1
LOGS=${OUT:-.}/locate_crash
LIMIT=${LIMIT:-200}
mkdir -p "$LOGS"
[ $# -gt 0 ] || set -- static graphs
echo "| mode | exit | s | last stage | failing launch / last event |"
echo "| --- | --- | --- | --- | --- |"
i=0
for mode in "$@"; do
  i=$((i + 1))
  read -r -a words <<<"$mode"
  log="$LOGS/$i-${words[0]}.log"
  start=$SECONDS
  # shellcheck disable=SC2086  # WRAP is a command line
  OUT=$LOGS timeout "$LIMIT" ${WRAP:-} python benchmarks/locate_crash.py --mode "${words[@]}" >"$log" 2>&1
  rc=$?
  row=$(grep '^SUMMARY |' "$log" | tail -1 | cut -c 11-)
  [ -n "$row" ] || row="(no summary: killed after ${LIMIT} s or died; see $log) | |"
  printf "| %s | %d | %d | %s |\n" "$mode" "$rc" $((SECONDS - start)) "$row"
done
