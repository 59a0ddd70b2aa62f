"""The settings of seed 000's switches: deep gradient compression (``--dgc`` and its
options), the overlap of the step with the reductions (``--overlap-backward-and-step``)
and their gradient clipping, read from ``PERSEUS_DGC*``,
``PERSEUS_OVERLAP_BACKWARD_AND_STEP`` and ``PERSEUS_CLIP_GRAD_*`` without any framework,
so perseusrun checks them before it starts a rank; and the epoch DGC's warm-up follows.
DGC itself is in perseus.torch.dgc (docs/dgc.md), the overlap in
perseus.torch.horovod.optimizer (docs/optimizers.md)."""

from perseus.common.knobs import get

__all__ = ["Settings", "current_epoch", "epoch_heard", "set_epoch"]

_epoch = [0]
_epoch_heard = [False]


def set_epoch(epoch):
    """Tells DGC's warm-up which epoch training is in (counted from 0). Called for you
    by ``DistributedSampler.set_epoch`` once a DGC optimizer exists."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"DGC: the epoch must be an integer >= 0, got {epoch!r}")
    _epoch[0] = epoch
    _epoch_heard[0] = True


def epoch_heard():
    """Whether anything has told DGC the epoch since the process started."""
    return _epoch_heard[0]


def current_epoch():
    """The epoch DGC's warm-up last heard of (0 before any)."""
    return _epoch[0]


# Each setting's variable (perseus.common.knobs declares them).
_VARIABLES = {
    "on": "PERSEUS_DGC", "compress_ratio": "PERSEUS_DGC_COMPRESS_RATIO",
    "sample_ratio": "PERSEUS_DGC_SAMPLE_RATIO", "strided_sample": "PERSEUS_DGC_STRIDED_SAMPLE",
    "compress_upper_bound": "PERSEUS_DGC_COMPRESS_UPPER_BOUND",
    "compress_lower_bound": "PERSEUS_DGC_COMPRESS_LOWER_BOUND",
    "max_adaptation_iters": "PERSEUS_DGC_MAX_ADAPTATION_ITERS",
    "resample": "PERSEUS_DGC_RESAMPLE", "fp16_values": "PERSEUS_DGC_FP16_VALUES",
    "int32_indices": "PERSEUS_DGC_INT32_INDICES", "warmup_epochs": "PERSEUS_DGC_WARMUP_EPOCHS",
    "warmup_coeff": "PERSEUS_DGC_WARMUP_COEFF",
    "momentum_masking": "PERSEUS_DGC_MOMENTUM_MASKING",
    "clip_grad_func": "PERSEUS_CLIP_GRAD_FUNC", "clip_grad_param": "PERSEUS_CLIP_GRAD_FUNC_PARAMS",
    "overlap": "PERSEUS_OVERLAP_BACKWARD_AND_STEP",
}


class Settings:
    """The settings of seed 000's switches: DGC's, the overlap of the step with the
    reductions (``overlap``) and the clipping both use; read and checked from the
    environment by :meth:`from_env`."""

    def __init__(self, on=False, compress_ratio=0.001, sample_ratio=0.01, strided_sample=True,
                 compress_upper_bound=1.3, compress_lower_bound=0.8, max_adaptation_iters=10,
                 resample=True, fp16_values=False, int32_indices=False, warmup_epochs=0,
                 warmup_coeff=None, momentum_masking=True, clip_grad_func=None,
                 clip_grad_param=None, overlap=False):
        self.on = on
        self.compress_ratio = compress_ratio
        self.sample_ratio = sample_ratio
        self.strided_sample = strided_sample
        self.compress_upper_bound = compress_upper_bound
        self.compress_lower_bound = compress_lower_bound
        self.max_adaptation_iters = max_adaptation_iters
        self.resample = resample
        self.fp16_values = fp16_values
        self.int32_indices = int32_indices
        self.warmup_epochs = warmup_epochs
        self.warmup_coeff = warmup_coeff
        self.momentum_masking = momentum_masking
        self.clip_grad_func = clip_grad_func
        self.clip_grad_param = clip_grad_param
        self.overlap = overlap

    @classmethod
    def from_env(cls, env=None):
        """The settings the ``PERSEUS_DGC*`` and ``PERSEUS_CLIP_GRAD_*`` variables of
        ``env`` (default: this process's environment) give."""
        s = cls(**{field: get(name, env) for field, name in _VARIABLES.items()})
        if s.warmup_coeff is not None and len(s.warmup_coeff) != s.warmup_epochs:
            raise ValueError(
                f"PERSEUS_DGC_WARMUP_COEFF has {len(s.warmup_coeff)} ratios but "
                f"PERSEUS_DGC_WARMUP_EPOCHS is {s.warmup_epochs}: give one per warm-up "
                "epoch")
        if s.clip_grad_func and s.clip_grad_param is None:
            raise ValueError(f"PERSEUS_CLIP_GRAD_FUNC={s.clip_grad_func} needs "
                             "PERSEUS_CLIP_GRAD_FUNC_PARAMS (the norm or value to clip at)")
        return s

    def ratio(self, epoch):
        """The compress ratio of ``epoch``: during the warm-up, ``warmup_coeff[epoch]``,
        or without it ``compress_ratio ** ((epoch + 1) / (warmup_epochs + 1))``, which
        rises from near 1 towards ``compress_ratio``."""
        if epoch >= self.warmup_epochs:
            return self.compress_ratio
        if self.warmup_coeff:
            return self.warmup_coeff[epoch]
        return self.compress_ratio ** ((epoch + 1) / (self.warmup_epochs + 1))
