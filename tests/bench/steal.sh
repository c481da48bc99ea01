# Steal time: the share of a run during which this VM's CPUs were runnable but the
# hypervisor ran something else. A run with much of it measures the neighbours, not
# the code, so the benchmarks report it and run again a run above MAX_STEAL.
#
# Sourced by the benchmark scripts. Settings (environment):
#   MAX_STEAL  percent of CPU time stolen above which a run is repeated (10)
#   TRIES      most runs of one measurement, the last kept whatever its steal (3)

MAX_STEAL=${MAX_STEAL:-10}
TRIES=${TRIES:-3}
[[ $MAX_STEAL =~ ^[0-9]+$ ]] || { echo "MAX_STEAL must be a whole percentage" >&2; exit 1; }
[[ $TRIES =~ ^[1-9][0-9]*$ ]] || { echo "TRIES must be a positive integer" >&2; exit 1; }

# cpu_stat: "STEAL TOTAL" in clock ticks, all CPUs, from /proc/stat.
cpu_stat() { awk '$1 == "cpu" { t = 0; for (i = 2; i <= NF; i++) t += $i; print $9, t; exit }' /proc/stat; }

# steal_pct BEFORE AFTER: the percentage of CPU time stolen between two cpu_stat.
steal_pct() {
  awk -v a="$1" -v b="$2" 'BEGIN {
    split(a, x, " "); split(b, y, " ")
    total = y[2] - x[2]
    printf "%.0f", (total > 0 ? 100 * (y[1] - x[1]) / total : 0)
  }'
}

# too_stolen STEAL TRY: true if a run with STEAL percent stolen, its TRY-th, is to be
# run again.
too_stolen() { [ "$1" -gt "$MAX_STEAL" ] && [ "$2" -lt "$TRIES" ]; }
