"""Driver for the Ray elastic Keras test: ``python elastic_keras_ray.py CONFIG_JSON`` prints a JSON verdict.

Config keys (besides elastic_keras_train's): ``workers`` (3), ``keras_backend``
(``torch``: the actors' ``KERAS_BACKEND``; the replay here runs on
Keras-torch whatever it is, so it matches exactly only for ``torch``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    config = json.loads(sys.argv[1])
    keras_backend = config.get("keras_backend", "torch")
    os.environ["KERAS_BACKEND"] = "torch"  # the replay's, before keras is imported

    import ray

    import elastic_keras_train as train_mod
    import shardwise.ray

    workers = config.get("workers", 3)
    config["stamp"] = os.path.join(tempfile.mkdtemp(), "killed_at")
    ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=bool(os.environ.get("ELASTIC_DEBUG")),
             runtime_env={"env_vars": {"PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"}})
    executor = shardwise.ray.RayExecutor(workers, elastic=True, min_workers=2, max_workers=workers,
                                         discovery_interval=1.0, cpus_per_worker=1, timeout=300,
                                         env={"KERAS_BACKEND": keras_backend, "TF_CPP_MIN_LOG_LEVEL": "2"})
    executor.start()
    started = time.monotonic()
    results = executor.run(train_mod.train, [config])
    elapsed = time.monotonic() - started
    executor.shutdown()
    ray.shutdown()
    log = results[0]["log"]
    reference = train_mod.replay(log)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(results[0]["weights"], reference))
    agree = all(all(np.array_equal(a, b) for a, b in zip(r["weights"], results[0]["weights"])) for r in results)
    train_mod.check_epochs(log)
    sizes = [w for _, w, _ in log]
    recovery = None
    if os.path.exists(config["stamp"]):
        killed_at = float(open(config["stamp"]).read())
        survivors = [r["recovered_at"] for r in results if r["recovered_at"] is not None and r["resets"]]
        recovery = max(survivors) - killed_at if survivors else None
    print(json.dumps({"history": executor.history,
                      "size_changes": [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s],
                      "max_diff": worst, "ranks_agree": agree, "final_size": results[0]["size"],
                      "steps": len(log), "seconds": elapsed, "recovery_seconds": recovery,
                      "resets": [r["resets"] for r in results], "overlapped": [r["overlapped"] for r in results],
                      "rolled_back": [r["executed"] - len(log) for r in results if r["resets"]],
                      "weights_dtype": str(results[0]["weights"][0].dtype)}))


if __name__ == "__main__":
    main()
