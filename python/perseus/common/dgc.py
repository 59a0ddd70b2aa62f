"""The settings of seed 000's switches: deep gradient compression (``--dgc`` and its
options), the overlap of the step with the reductions (``--overlap-backward-and-step``)
and their gradient clipping, read from ``PERSEUS_DGC*``,
``PERSEUS_OVERLAP_BACKWARD_AND_STEP`` and ``PERSEUS_CLIP_GRAD_*`` without any framework,
so perseusrun checks them before it starts a rank; and the epoch DGC's warm-up follows.
DGC itself is in perseus.torch.dgc (docs/dgc.md), the overlap in
perseus.torch.horovod.optimizer (docs/optimizers.md)."""

import math
import os

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


def _text(name, env=None):
    return (os.environ if env is None else env).get(name, "").strip()


def _bool_var(env, name, default):
    text = _text(name, env).lower()
    if not text:
        return default
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be 0 or 1 (or true/false), got {_text(name, env)!r}")


def _number(env, name, default, kind, ok, allowed):
    text = _text(name, env)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {text!r}")
    return value


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
        ratio = (lambda v: 0 < v <= 1, "a number greater than 0 and at most 1")
        s = cls(
            on=_bool_var(env, "PERSEUS_DGC", False),
            compress_ratio=_number(env, "PERSEUS_DGC_COMPRESS_RATIO", 0.001, float, *ratio),
            sample_ratio=_number(env, "PERSEUS_DGC_SAMPLE_RATIO", 0.01, float, *ratio),
            strided_sample=_bool_var(env, "PERSEUS_DGC_STRIDED_SAMPLE", True),
            compress_upper_bound=_number(env, "PERSEUS_DGC_COMPRESS_UPPER_BOUND", 1.3, float,
                                         lambda v: 1 <= v <= 100, "a number from 1 to 100"),
            compress_lower_bound=_number(env, "PERSEUS_DGC_COMPRESS_LOWER_BOUND", 0.8, float,
                                         lambda v: 0 < v <= 1,
                                         "a number greater than 0 and at most 1"),
            max_adaptation_iters=_number(env, "PERSEUS_DGC_MAX_ADAPTATION_ITERS", 10, int,
                                         lambda v: 0 <= v <= 1000,
                                         "an integer from 0 to 1000"),
            resample=_bool_var(env, "PERSEUS_DGC_RESAMPLE", True),
            fp16_values=_bool_var(env, "PERSEUS_DGC_FP16_VALUES", False),
            int32_indices=_bool_var(env, "PERSEUS_DGC_INT32_INDICES", False),
            warmup_epochs=_number(env, "PERSEUS_DGC_WARMUP_EPOCHS", 0, int,
                                  lambda v: 0 <= v <= 10000, "an integer from 0 to 10000"),
            momentum_masking=_bool_var(env, "PERSEUS_DGC_MOMENTUM_MASKING", True),
            overlap=_bool_var(env, "PERSEUS_OVERLAP_BACKWARD_AND_STEP", False),
        )
        coeff = _text("PERSEUS_DGC_WARMUP_COEFF", env)
        if coeff:
            try:
                s.warmup_coeff = [float(c) for c in coeff.replace(",", " ").split()]
            except ValueError:
                s.warmup_coeff = None
            if not s.warmup_coeff or not all(0 < c <= 1 for c in s.warmup_coeff):
                raise ValueError("PERSEUS_DGC_WARMUP_COEFF must be compress ratios greater "
                                 f"than 0 and at most 1, separated by spaces, got {coeff!r}")
            if len(s.warmup_coeff) != s.warmup_epochs:
                raise ValueError(
                    f"PERSEUS_DGC_WARMUP_COEFF has {len(s.warmup_coeff)} ratios but "
                    f"PERSEUS_DGC_WARMUP_EPOCHS is {s.warmup_epochs}: give one per warm-up "
                    "epoch")
        func = _text("PERSEUS_CLIP_GRAD_FUNC", env).lower()
        if func and func not in ("norm", "value"):
            raise ValueError(f"PERSEUS_CLIP_GRAD_FUNC must be norm or value, got {func!r}")
        s.clip_grad_func = func or None
        s.clip_grad_param = _number(env, "PERSEUS_CLIP_GRAD_FUNC_PARAMS", None, float,
                                    lambda v: v > 0 and math.isfinite(v),
                                    "a number greater than 0")
        if s.clip_grad_func and s.clip_grad_param is None:
            raise ValueError(f"PERSEUS_CLIP_GRAD_FUNC={func} needs PERSEUS_CLIP_GRAD_FUNC_PARAMS "
                             "(the norm or value to clip at)")
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
