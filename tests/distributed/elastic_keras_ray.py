"""Driver for the Ray elastic Keras test: ``python elastic_keras_ray.py CONFIG_JSON`` prints a JSON verdict.

Config keys (besides elastic_keras_train's): ``workers`` (3), ``keras_backend``
(``torch``: the actors' ``KERAS_BACKEND``; the replay here runs on
Keras-torch whatever it is, so it matches exactly only for ``torch``).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    config = json.loads(sys.argv[1])
    keras_backend = config.get("keras_backend", "torch")
    os.environ["KERAS_BACKEND"] = "torch"  # the replay's, before keras is imported

    import elastic_keras_train as train_mod
    from elastic_ray import run_job, verdict

    executor, results, elapsed, _ = run_job(train_mod.train, config,
                                            env={"KERAS_BACKEND": keras_backend, "TF_CPP_MIN_LOG_LEVEL": "2"})
    log = results[0]["log"]
    train_mod.check_epochs(log)
    out = verdict(executor, results, "weights", train_mod.replay(log), config["stamp"], elapsed)
    print(json.dumps({**out, "overlapped": [r["overlapped"] for r in results],
                      "rolled_back": [r["executed"] - len(log) for r in results if r["resets"]],
                      "weights_dtype": str(results[0]["weights"][0].dtype)}))

if __name__ == "__main__":
    main()
