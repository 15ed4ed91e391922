"""`make bench-cluster [QUICK=1]` -> bench/results/cluster.json: spectrain on the real two-node
cluster (scripts/cluster, the images from the project's Dockerfiles, the chart by helm) against
`spectrain run` of the same job on the same machine, measured side by side in one run.

Keys:
- cluster_up_s: `cluster.sh up` with everything built (down first when it is up);
- images_build_s: {"warm": `scripts/images/build.sh all` with its cache, "cold": the same into an empty
  cache in a temporary directory (base, operator and workloads images from scratch; QUICK: null)};
- workloads_image_mb, operator_image_mb: the image archives' sizes (their uncompressed layers);
- apply_to_running_s: examples/demo.yaml applied until every container of every pod runs;
- demo_wall_cluster_over_local: apply -> Succeeded in the cluster over the wall time of
  `spectrain run` of the same manifest (goal <= 1.15); pairs interleaved, medians;
- effective_harvest_cluster_over_local: `spectrain report`'s effective harvest seconds (drafter work
  that reached the exported drafter) read from the cluster's run volume and the local run's (goal
  >= 0.9);
- leader_failover_s: the Lease holder's container SIGKILLed until another replica holds the Lease.
Needs root (namespaces, cgroups, buildah).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import parse_args, print_table, write_results
from spectrain_workloads.report import harvest, load
from tests.cluster.realcluster import CLUSTER_SH, real_cluster
from tests.cluster.stack import IMAGES_SH, ROOT, Stack, build_images, installed
from tests.waiting import wait_for

GOALS = {"demo_wall_cluster_over_local": 1.15, "effective_harvest_cluster_over_local": 0.9}
JOB_TIMEOUT_S = 900.0


def _timed(*args: str, env: dict[str, str] | None = None) -> float:
    t0 = time.monotonic()
    subprocess.run(args, check=True, capture_output=True, env=env, timeout=7200)
    return time.monotonic() - t0


def images_build_s(cold: bool) -> dict[str, float | None]:
    build_images()
    out: dict[str, float | None] = {"warm": _timed("bash", str(IMAGES_SH), "all"), "cold": None}
    if cold:
        with tempfile.TemporaryDirectory(prefix="spectrain-images-cold-") as d:
            out["cold"] = _timed("bash", str(IMAGES_SH), "all", env={**os.environ, "SPECTRAIN_IMAGES_CACHE": d})
            subprocess.run(["buildah", "--root", f"{d}/storage", "rm", "--all"], capture_output=True)
    return out


def _cluster_up() -> bool:
    return subprocess.run(["bash", str(CLUSTER_SH), "status"], capture_output=True).returncode == 0


def cluster_up_s() -> float:
    """Warm: everything built and the images imported (a first `up` builds what is missing)."""
    subprocess.run(["bash", str(CLUSTER_SH), "up"], check=True, capture_output=True, timeout=7200)
    subprocess.run(["bash", str(CLUSTER_SH), "down"], check=True, capture_output=True, timeout=600)
    return _timed("bash", str(CLUSTER_SH), "up")


def local_demo(tmp: Path, i: int) -> tuple[float, float]:
    run_dir = tmp / f"local-{i}"
    wall = _timed(str(Path(sys.executable).parent / "spectrain"), "run", str(ROOT / "examples" / "demo.yaml"),
                  "--run-dir", str(run_dir))
    effective = float(harvest(load(run_dir / "pvc" / "demo-run"))["effective_harvest_s"])
    shutil.rmtree(run_dir)
    return wall, effective


def _all_running(stack: Stack, name: str) -> bool:
    pods = stack.pods(name)
    statuses = [c for p in pods for c in (p.status.container_statuses or []) + (p.status.init_container_statuses or [])]
    return len(pods) == 2 and len(statuses) == 4 and all(c.state.running for c in statuses)


def cluster_demo(stack: Stack, i: int) -> tuple[float, float, float]:
    m = stack.example("demo.yaml")
    name = m["metadata"]["name"] = f"demo-{i}"
    claim = m["spec"]["target"]["checkpoint"]["claimName"] = f"demo-{i}-run"
    volume = stack.claim(claim)
    t0 = time.monotonic()
    stack.apply(m)
    wait_for(lambda: _all_running(stack, name), 300, 0.1, f"{name}'s containers running")
    running = time.monotonic() - t0
    wait_for(lambda: stack.status(name).get("phase") in ("Succeeded", "Failed"), JOB_TIMEOUT_S, 0.2, f"{name} done")
    wall = time.monotonic() - t0
    assert stack.status(name)["phase"] == "Succeeded", stack.describe(name)
    effective = float(harvest(load(volume))["effective_harvest_s"])
    stack.custom.delete_namespaced_custom_object("spectrain.io", "v1alpha1", stack.ns, "spectrainjobs", name)
    return running, wall, effective


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if os.geteuid() != 0:
        raise SystemExit("bench-cluster needs root (network namespaces, cgroups, buildah)")
    pairs = 1 if args.quick else 3
    res: dict[str, Any] = {"images_build_s": images_build_s(cold=not args.quick)}
    archives = build_images()
    res["operator_image_mb"] = round(archives["operator"].stat().st_size / 1e6, 1)
    res["workloads_image_mb"] = round(archives["workloads"].stat().st_size / 1e6, 1)
    was_up = _cluster_up()
    res["cluster_up_s"] = cluster_up_s()
    local: list[tuple[float, float]] = []
    remote: list[tuple[float, float, float]] = []
    with real_cluster() as cluster, tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp, \
            installed(cluster, Path(tmp) / "stack") as stack:
        for i in range(pairs):      # interleaved: the machine's load drifts over minutes
            local.append(local_demo(Path(tmp), i))
            remote.append(cluster_demo(stack, i))
        _, res["leader_failover_s"] = stack.kill_leader()
    if not was_up:
        subprocess.run(["bash", str(CLUSTER_SH), "down"], check=True, capture_output=True, timeout=600)
    res["apply_to_running_s"] = statistics.median(r[0] for r in remote)
    res["demo_wall_cluster_s"] = statistics.median(r[1] for r in remote)
    res["demo_wall_local_s"] = statistics.median(w for w, _ in local)
    res["demo_wall_cluster_over_local"] = res["demo_wall_cluster_s"] / res["demo_wall_local_s"]
    res["effective_harvest_cluster_s"] = statistics.median(r[2] for r in remote)
    res["effective_harvest_local_s"] = statistics.median(e for _, e in local)
    res["effective_harvest_cluster_over_local"] = res["effective_harvest_cluster_s"] / res["effective_harvest_local_s"]
    res["pairs"] = pairs
    res["goals"] = {k: {"goal": g, "met": (res[k] <= g) if k.startswith("demo_wall") else (res[k] >= g)}
                    for k, g in GOALS.items()}
    res["load_avg_1m_at_end"] = os.getloadavg()[0]
    path = write_results("cluster", res, args.quick)
    print_table("bench-cluster (real two-node cluster vs spectrain run, same run)",
                {k: v for k, v in res.items() if not isinstance(v, dict)})
    print(f"goals: {res['goals']}\n-> {path}")


if __name__ == "__main__":
    main()
