"""``perseus.spark``: Horovod 0.28's ``horovod.spark.run`` on Perseus.

    from perseus.spark import run      # was: from horovod.spark import run

    def train(lr):
        import perseus.torch.horovod as hvd
        hvd.init()
        ...
        return hvd.rank(), final_loss

    results = run(train, args=(0.1,), num_proc=4)   # one result per rank, by rank

``run_elastic`` runs an elastic job (``hvd.elastic.run``) whose workers Spark tasks
start (perseus.spark.elastic). pyspark is optional: it is imported by this package only. Horovod's Spark estimators
(``horovod.spark.torch.TorchEstimator`` and the others, built on Petastorm) are not part
of Perseus.
"""

from perseus.spark.elastic import run_elastic
from perseus.spark.runner import run

__all__ = ["run", "run_elastic"]
