#!/usr/bin/env bash
# Every row of issue 14's table, each script with its peers in one invocation, one after
# another, into one log (docs/performance.md, "How the rows are measured").
#
#   bench/rows.sh [--check] [--no-systemd] [LOG]
#
# Before: ../shared/bench/peers/setup.sh (task-spooler, for the peers' lines), and, on a
# host whose /tmp is ext4 without a journal, a journaled file system for the runners' state
# and task-spooler's output (bench/journaled_fs.sh; then run with TMPDIR=that directory).
# PYTHON picks the interpreter (default: python on PATH, with motor installed). The walk's
# tree of 200,000 files goes under WALK_DIR (default /tmp: it does not fit the inodes of
# journaled_fs.sh's 1 GB image).
# LOG (default rows-<UTC time>.log) gets every line; each row's medians are printed as
# they come. `--check` runs nothing: it checks that each script takes the flags given
# here (tests/test_bench_probes.py runs it). `--no-systemd` leaves out the systemd row
# (root and a cgroup v1 host: it boots systemd in a namespace; about 2 minutes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
check=0 systemd=1 log=""
for arg in "$@"; do
    case $arg in
    --check) check=1 ;;
    --no-systemd) systemd=0 ;;
    -*) echo "rows.sh: unknown option $arg" >&2; exit 2 ;;
    *) log=$arg ;;
    esac
done

# script and arguments, one row each (the table's order, but the pure core first: right
# after scale.py's 10,000 jobs every figure of the core, ready() and finished() as well as
# decide(), read about twice what it read a minute later, in stops 75, 77 and 78)
rows=(
    "scheduler.py --only core --sizes 10000 --rounds 11"    # the pure core at 10,000 queued
    "throughput.py --rounds 3 --isolation cgroup"           # 200 true, cgroup (motor serve's default here)
    "throughput.py --rounds 3 --isolation affinity"         # the same, affinity
    "latency.py --rounds 3 --samples 20"                    # submit -> running; motor run wall
    "latency.py --rounds 3 --samples 20 --isolation cgroup" # submit -> running, cgroup
    "walk.py --runs 5 --dir ${WALK_DIR:-/tmp}"              # a walk of 200,000 files, du -s
    "scale.py --tries 15 --drain-limit 30"                  # 10,000 queued over 2,000 workspaces
    "work_counts.py --isolation cgroup"                     # calls per job: steadier than times
)
if [ "$systemd" = 1 ]; then
    rows+=("throughput.py --backend-pairs 40 --n 100")     # systemd backend against cgroup
fi

if [ "$check" = 1 ]; then
    for row in "${rows[@]}"; do
        read -r script args <<<"$row"
        help=$(cd "$here" && "$py" "$script" --help)
        for flag in $args; do
            case $flag in
            --*) grep -qE -- "(^|[ ,])$flag([ =,]|\$)" <<<"$help" \
                    || { echo "rows.sh: $script has no $flag" >&2; exit 1; } ;;
            esac
        done
        echo "ok: $row"
    done
    exit 0
fi

log=${log:-rows-$(date -u +%Y%m%dT%H%M%S).log}
log=$(cd "$(dirname "$log")" && pwd)/$(basename "$log")
{
    echo "# bench/rows.sh $(date -u +%FT%TZ) tree $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo ?)"
    echo "# TMPDIR=${TMPDIR:-/tmp} load: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$log"
for row in "${rows[@]}"; do
    read -r script args <<<"$row"
    echo "## $row ($(date -u +%T), load $(cut -d' ' -f1 /proc/loadavg))" | tee -a "$log"
    out=$(mktemp)
    # shellcheck disable=SC2086  # the arguments are words
    (cd "$here" && "$py" $script $args) >"$out" 2>&1 || echo "## $script failed ($?)" >>"$out"
    cat "$out" >>"$log"
    case $script in  # the medians and summaries (every line is in the log)
    scale.py | work_counts.py) cat "$out" ;;  # one line per figure, no medians
    *) grep -v '^peer=' "$out" || true ;;
    esac
    rm -f "$out"
done
echo "# done $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg); every line in $log"
