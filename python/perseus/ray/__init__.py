"""``perseus.ray``: Horovod 0.28's ``horovod.ray`` API on Perseus.

    from perseus.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=4, use_gpu=False)
    executor.start()
    results = executor.run(train)      # train() calls hvd.init(); one result per rank
    executor.shutdown()

Ray is optional: it is imported by this package only. Workers are Ray actors; rank 0's
address and the job's secret reach them through Ray (no ssh). ``min_workers`` and
``max_workers`` make the job elastic (perseus.ray.elastic); ``ray_logger.log`` sends a
worker's values to the driver's ``callbacks``. ``ElasticRayExecutor`` is Horovod's older
elastic API, on the same elastic mode.
"""

from perseus.ray import ray_logger
from perseus.ray.elastic_executor import ElasticRayExecutor
from perseus.ray.executor import RayExecutor, RaySettings

__all__ = ["ElasticRayExecutor", "RayExecutor", "RaySettings", "ray_logger"]
