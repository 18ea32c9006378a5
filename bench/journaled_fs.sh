#!/usr/bin/env bash
# A fresh journaled ext4 file system for benchmark state, loop-mounted (root).
#
#   bench/journaled_fs.sh mount DIR [SIZE_MB]   make DIR an empty journaled ext4 (default 1024 MB)
#   bench/journaled_fs.sh umount DIR            unmount it and delete its image
#
# Why: this development host's root file system is ext4 without a journal, where a file
# creation passes over every inode freed in the last 60-300 s (docs/operations.md, "The
# state directory's file system"); after a test suite or an earlier bench round deleted its
# temporary directories, every job's files cost several times more for minutes. Run a
# bench with its state here (TMPDIR=DIR python bench/throughput.py) and mount another one
# over the peers' output directory (/tmp/motor-peers/tsp/out) to compare on equal terms;
# docs/performance.md says which figures were taken how.
set -euo pipefail
cmd=${1:?mount or umount}; dir=${2:?directory}; size=${3:-1024}
image="/var/tmp/motor-bench-fs-$(echo "$dir" | tr / _).img"
case $cmd in
mount)
    mkdir -p "$dir"
    if mountpoint -q "$dir"; then umount "$dir"; fi
    rm -f "$image"
    truncate -s "${size}M" "$image"
    mkfs.ext4 -q -F "$image"
    mount -o loop "$image" "$dir"
    chmod 1777 "$dir"
    echo "$dir: journaled ext4, ${size} MB ($image)"
    ;;
umount)
    if mountpoint -q "$dir"; then umount "$dir"; fi
    rm -f "$image"
    ;;
*) echo "usage: $0 mount|umount DIR [SIZE_MB]" >&2; exit 2 ;;
esac
