"""A job that makes cgroups inside its own, through `motor serve` with the cgroup backend."""

from __future__ import annotations

import glob
import os

import pytest

from tests.isolation.isolation_helpers import needs_cgroups
from polling import wait_for
from private_cgroup import private_parent_name, remove_private_parent

pytestmark = [pytest.mark.e2e, needs_cgroups]

#: the job makes child/grand in each of its v1 groups (or its v2 group), and moves a
#: process of its own into the deepest cpuset one
NEST = r"""
for line in $(cut -d: -f2,3 /proc/self/cgroup); do
  ctl=${line%%:*}; path=${line#*:}
  case $ctl in *cpuset*) d=/sys/fs/cgroup/cpuset$path ;; *memory*) d=/sys/fs/cgroup/memory$path ;;
    "") d=/sys/fs/cgroup$path ;; *) continue ;; esac
  mkdir -p "$d/child/grand" || exit 3
  if [ -e "$d/cpuset.cpus" ] && [ -z "$ctl" -o "$ctl" != "${ctl#*cpuset}" ]; then
    for k in cpuset.cpus cpuset.mems; do cat "$d/$k" > "$d/child/$k"; cat "$d/$k" > "$d/child/grand/$k"; done
    sh -c "echo \$\$ > $d/child/grand/cgroup.procs; exec sleep 0.2"
  fi
done
echo nested
"""


def test_a_job_that_made_groups_inside_its_own_leaves_none_behind(serve_factory, tmp_path):
    """Before stop 57 each `rmdir` of the job's groups failed EBUSY on the groups it made,
    and they stayed for good (the start-up sweep's `rmdir` failed the same way): on a v1
    host each such job left three groups behind."""
    parent = private_parent_name()
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", parent).start()
    try:
        result = serve.cli("run", "--weight", "1", "--", "sh", "-c", NEST, timeout=60)
        assert (result.returncode, result.stdout) == (0, b"nested\n"), result
        groups = glob.glob(f"/sys/fs/cgroup/*/{parent}/job-*") + glob.glob(
            f"/sys/fs/cgroup/{parent}/job-*")

        def gone():
            return not any(os.path.exists(g) for g in groups + glob.glob(
                f"/sys/fs/cgroup/*/{parent}/job-*") + glob.glob(f"/sys/fs/cgroup/{parent}/job-*"))

        wait_for(gone, what="the job's groups (and the ones it made) to be removed", timeout=20)
        assert serve.cli_json("health")["status"] == "ok"
    finally:
        serve.stop()
        remove_private_parent(parent)
