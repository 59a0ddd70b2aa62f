"""``cluster_training.train`` (the function of ``ray_pytorch_mnist.py``) run by
perseus.spark.run, one Spark task per rank, as a ``horovod.spark.run`` program does (only its import differs):

    python examples/spark_pytorch_mnist.py --num-proc 2                  # local[2] Spark
    python examples/spark_pytorch_mnist.py --master spark://HOST:7077   # a cluster

A barrier stage needs a free core for every rank at once. The driver gets every rank's
final loss, by rank.
"""

import argparse
import os
import sys

from perseus.spark import run
from pyspark.sql import SparkSession

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--master", default=None, help="default: local[NUM_PROC]")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args()
    sys.path.insert(0, HERE)
    from cluster_training import train  # this directory, as the executors see it

    path = os.pathsep.join(x for x in (HERE, os.environ.get("PYTHONPATH")) if x)
    spark = (SparkSession.builder.master(a.master or f"local[{a.num_proc}]")
             .appName("perseus-spark-example")
             .config("spark.executorEnv.PYTHONPATH", path)
             .getOrCreate())
    os.environ["PYTHONPATH"] = path  # local mode's Python workers inherit the driver's
    losses = run(train, kwargs={"epochs": a.epochs, "batch_size": a.batch_size},
                 num_proc=a.num_proc)
    spark.stop()
    print(f"final loss, averaged over the ranks, as each rank saw it: {losses}")


if __name__ == "__main__":
    main()
