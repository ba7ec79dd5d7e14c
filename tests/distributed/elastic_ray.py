"""Driver for the Ray elastic test: ``python elastic_ray.py CONFIG_JSON`` prints a JSON verdict.

Config keys (besides elastic_train's): ``workers`` (3), ``intruder`` (connect a
client without the job's secret to the rendezvous store while the job trains).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import elastic_train  # noqa: E402


def intrude(executor: object, outcome: dict) -> None:
    """Wait for the job's store, then knock on it without the secret (twice: a wrong one and garbage)."""
    import socket

    from shardwise.core.errors import RendezvousError
    from shardwise.backends.rendezvous.store import StoreClient, new_secret

    deadline = time.monotonic() + 60
    while getattr(executor, "membership", None) is None or executor.membership.generation < 0:
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    server = executor.server
    try:
        StoreClient(executor._host, server.port, new_secret(), connect_timeout=5).get("latest", timeout=1)
        outcome["wrong_secret"] = "admitted"
    except RendezvousError as exc:
        outcome["wrong_secret"] = f"refused: {exc}"
    with socket.create_connection((executor._host, server.port), timeout=5) as raw:
        raw.recv(32)
        raw.sendall(b"\x00" * 32)  # a bad proof
        outcome["garbage_reply"] = raw.recv(1).hex()  # empty: the server closed the connection
    outcome["refused_count"] = server.refused


def run_job(train: Any, config: dict, env: Optional[dict] = None) -> tuple[Any, list, float, dict]:
    """Start Ray and an elastic executor of ``config["workers"]`` actors, run ``train(config)``.

    Returns the executor, the final workers' results, the wall time and what the
    intruder (``config["intruder"]``) saw. ``config["stamp"]`` receives the kill time.
    """
    import ray

    import shardwise.ray

    workers = config.get("workers", 3)
    config["stamp"] = os.path.join(tempfile.mkdtemp(), "killed_at")
    ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=bool(os.environ.get("ELASTIC_DEBUG")),
             runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
                                       "OMP_NUM_THREADS": "1"}})
    executor = shardwise.ray.RayExecutor(workers, elastic=True, min_workers=2, max_workers=workers,
                                         discovery_interval=1.0, cpus_per_worker=1, timeout=300, env=env)
    executor.start()
    intrusion: dict = {}
    if config.get("intruder"):
        threading.Thread(target=intrude, args=(executor, intrusion), daemon=True).start()
    started = time.monotonic()
    results = executor.run(train, [config])
    elapsed = time.monotonic() - started
    executor.shutdown()
    ray.shutdown()
    return executor, results, elapsed, intrusion


def verdict(executor: Any, results: list, key: str, reference: list, stamp: str, elapsed: float) -> dict:
    """What the tests check: generations, world sizes per step, replay error, agreement, recovery time."""
    log = results[0]["log"]
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(results[0][key], reference))
    agree = all(all(np.array_equal(a, b) for a, b in zip(r[key], results[0][key])) for r in results)
    sizes = [w for _, w, _ in log]
    recovery = None
    if os.path.exists(stamp):
        killed_at = float(open(stamp).read())
        survivors = [r["recovered_at"] for r in results if r["recovered_at"] is not None and r["resets"]]
        recovery = max(survivors) - killed_at if survivors else None
    return {"history": executor.history,
            "size_changes": [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s],
            "max_diff": worst, "ranks_agree": agree, "final_size": results[0]["size"],
            "steps": len(log), "seconds": elapsed, "recovery_seconds": recovery,
            "resets": [r["resets"] for r in results]}


def main() -> None:
    config = json.loads(sys.argv[1])
    executor, results, elapsed, intrusion = run_job(elastic_train.train, config)
    elastic_train.check_epochs(results[0]["log"])
    out = verdict(executor, results, "params", elastic_train.replay(results[0]["log"]), config["stamp"], elapsed)
    print(json.dumps({**out, "intrusion": intrusion}))


if __name__ == "__main__":
    main()
