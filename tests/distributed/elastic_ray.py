"""Driver for the Ray elastic test: ``python elastic_ray.py CONFIG_JSON`` prints a JSON verdict."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import elastic_train  # noqa: E402


def main() -> None:
    import ray

    import shardwise.ray

    config = json.loads(sys.argv[1])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=bool(os.environ.get("ELASTIC_DEBUG")),
             runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
                                       "OMP_NUM_THREADS": "1"}})
    executor = shardwise.ray.RayExecutor(config.get("workers", 3), elastic=True, min_workers=2,
                                         max_workers=config.get("workers", 3), discovery_interval=1.0,
                                         cpus_per_worker=1, timeout=300)
    executor.start()
    started = time.monotonic()
    results = executor.run(elastic_train.train, [config])
    elapsed = time.monotonic() - started
    executor.shutdown()
    ray.shutdown()
    log = results[0]["log"]
    reference = elastic_train.replay(log)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(results[0]["params"], reference))
    agree = all(all(np.array_equal(a, b) for a, b in zip(r["params"], results[0]["params"])) for r in results)
    elastic_train.check_epochs(log)
    sizes = [w for _, w, _ in log]
    print(json.dumps({"history": executor.history, "sizes_seen": sorted(set(sizes), key=sizes.index),
                      "size_changes": [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s],
                      "max_diff": worst, "ranks_agree": agree, "final_size": results[0]["size"],
                      "steps": len(log), "seconds": elapsed, "resets": [r["resets"] for r in results]}))


if __name__ == "__main__":
    main()
