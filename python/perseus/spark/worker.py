"""One worker process of ``perseus.spark.run_elastic``, started by a Spark task (its
agent): ``python -m perseus.spark.worker PAYLOAD RESULT``.

It loads ``(fn, args, kwargs)`` from the file PAYLOAD, runs the function (whose
``hvd.elastic.run`` takes its place in the job's rounds), and writes
``("ok", rank, value)`` or ``("error", -1, traceback)`` to the file RESULT, the rank
being the one it had last. Exits 0 when the function returned, 1 when it raised.
"""

import os
import pickle
import sys
import traceback

from perseus.common import knobs


def main(payload, result):
    with open(payload, "rb") as f:
        fn, args, kwargs = pickle.load(f)
    try:
        value = fn(*args, **kwargs)
        # The rank after the function: an elastic worker's rank changes with the rounds.
        outcome, code = ("ok", int(knobs.text("PERSEUS_RANK") or -1), value), 0
    except BaseException:  # noqa: BLE001 - every failure goes back to the driver
        outcome, code = ("error", -1, traceback.format_exc()), 1
    from pyspark import cloudpickle

    partial = result + ".part"
    with open(partial, "wb") as f:
        f.write(cloudpickle.dumps(outcome))
    os.replace(partial, result)
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
