#!/usr/bin/env bash
# Sharded bake timings on one machine (docs/benchmarks.md, "Sharded bakes"): the whole grid in
# one `kiln bake` vs N `kiln bake --shard I/N` processes at once, then `kiln merge` of the shards.
#   scripts/bench-shards.sh SPEC [N=3] [RUNS=3]      (run from the repository root, as root)
# Shards of one spec on one machine take turns on the bake's workdir ($TMPDIR/kiln-bake-UID/NAME,
# a lock): as on N machines, each shard here runs in its own mount namespace where that path is
# a private folder (unshare -m, hence root). The one-process bake runs the same way.
set -euo pipefail
SPEC=${1:?usage: $0 SPEC [N] [RUNS]}
N=${2:-3}
RUNS=${3:-3}
PY=${PYTHON:-python}
KILN="$PY -m kiln"
OUT=$(mktemp -d /tmp/kiln-bench-shards.XXXXXX)
BASE="${TMPDIR:-/tmp}/kiln-bake-$(id -u)"
mkdir -p "$BASE"
trap 'rm -rf "$OUT"' EXIT

isolated() {  # isolated ROOT CMD...: CMD with $BASE bind-mounted from ROOT
    local root=$1
    shift
    mkdir -p "$root"
    unshare --mount --propagation private sh -c 'mount --bind "$0" "$1" && shift && exec "$@"' \
        "$root" "$BASE" "$@"
}

now() { date +%s.%N; }

for run in $(seq 1 "$RUNS"); do
    t0=$(now)
    isolated "$OUT/root-one" $KILN bake "$SPEC" -o "$OUT/one.kiln.tar.zst" -q --json >/dev/null
    t1=$(now)
    pids=()
    for i in $(seq 0 $((N - 1))); do
        isolated "$OUT/root-$i" $KILN bake "$SPEC" --shard "$i/$N" -o "$OUT/shard-$i.kiln.tar.zst" \
            -q --json >"$OUT/shard-$i.json" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    t2=$(now)
    $KILN merge "$OUT"/shard-*.kiln.tar.zst -o "$OUT/merged.kiln.tar.zst" -q --json >"$OUT/merge.json"
    t3=$(now)
    printf 'run %d: one process %.1f s, %d shards in parallel %.1f s, merge %.2f s\n' "$run" \
        "$(echo "$t1 - $t0" | bc)" "$N" "$(echo "$t2 - $t1" | bc)" "$(echo "$t3 - $t2" | bc)"
done
