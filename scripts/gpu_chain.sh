#!/usr/bin/env bash
# GPU work longer than one device call (< 10 min), in one background job that outlives the calls: the 300-reload
# stress, then suite parts, back to back, with no idle GPU between them. Start it in one call, poll from the next ones
# (the machine stays warm only while calls follow each other):
#
#   scripts/gpu_chain.sh start "run stress --reloads 300 ..." "suite 3" "suite 1" "suite 2"    # there, after `source .gpu-bundle/activate`
#   scripts/gpu_chain.sh poll OUT [SECS]     # each next call: wait up to SECS (default 560) or to the chain's end
#
# "run STEP" is a gpu_run.sh step, "suite N" a gpu_suite.sh part (SUITE_LIMIT_S defaults to 900 s here: no call
# limit applies to the job). The job runs from its own copy of the scripts and of .gpu-bake in /tmp/gpu-chain, so a
# later call's copy of the working tree cannot change what it runs; its files go to /tmp/gpu-chain/out (a folder per
# step: 1-run-stress, 2-suite-3, ...) and chain.log, and `poll` copies them to OUT every 10 s, so a call cut short still brings back what ended.
set -uo pipefail
here=$(realpath "$(dirname "$0")")
dir=/tmp/gpu-chain
case ${1:-} in
start)
  shift
  [[ ! -f $dir/pid ]] || ! kill -0 "$(cat "$dir/pid")" 2>/dev/null || { echo "a chain is running" >&2; exit 1; }
  rm -rf "$dir" && mkdir -p "$dir/scripts" "$dir/out"
  cp "$here"/gpu_run.sh "$here"/gpu_suite.sh "$dir/scripts/" && cp -r "$here/../.gpu-bake" "$dir/.gpu-bake"
  printf '%s\n' "$@" >"$dir/steps"
  setsid bash -c '
    dir=$1
    export SUITE_LIMIT_S=${SUITE_LIMIT_S:-900}
    n=0
    while IFS= read -r step; do
      n=$((n + 1)) && read -r kind what _ <<<"$step" && out="$dir/out/$n-$kind-$what" && mkdir -p "$out"
      echo "=== $(date -u +%T) step $n: $step"
      case $step in
        run\ *) bash "$dir/scripts/gpu_run.sh" "$out" "${step#run }" ;;
        suite\ *) bash "$dir/scripts/gpu_suite.sh" "$out" ${step#suite } ;;
        *) echo "unknown step: $step" ;;
      esac
      echo "=== $(date -u +%T) step $n ended: $?"
    done <"$dir/steps"
    touch "$dir/done"
  ' chain "$dir" >"$dir/chain.log" 2>&1 </dev/null &
  echo $! >"$dir/pid"
  echo "chain $(cat "$dir/pid") started: $(paste -sd '|' "$dir/steps")"
  ;;
poll)
  out=$(realpath "$2") && limit=${3:-560}
  while :; do
    cp -r "$dir/chain.log" "$dir/out" "$out/" 2>/dev/null
    [[ -f $dir/done || $SECONDS -ge $limit ]] && break
    sleep 10
  done
  [[ -f $dir/done ]] && echo "chain done" || echo "chain still running after ${limit} s"
  tail -n 5 "$dir/chain.log"
  for log in "$dir"/out/*/log.txt; do [[ -f $log ]] && grep -E "^reload [0-9]+/|reached|aborts" "$log" | tail -n 2; done
  ;;
*)
  echo "usage: $0 start STEP... | poll OUT [SECS]" >&2
  exit 2
  ;;
esac
