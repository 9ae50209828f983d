"""`EpochMeans`: a resumed epoch's logs cover the whole epoch, not only its resumed part.

Keras resets its metrics when `fit` starts, so after a resume in the middle
of an epoch the epoch's `loss`, `nelbo`, `kl`, ... would be means over the
steps run since the resume alone: `history.csv`, TensorBoard and the
progress bar would show another number than an uninterrupted run. The
mid-epoch checkpoint records the means so far and their step count; at the
end of the resumed epoch they are merged, weighted by steps (every step is
one full global batch), into the logs the loggers read.
"""

import keras
import numpy as np


class EpochMeans(keras.callbacks.Callback):
    """Tracks the epoch's running means; completes a resumed epoch's logs in place.

    It must run before the loggers (`train` puts it there). Only the
    model's `keras.metrics.Mean` metrics are merged; values that are not
    means over steps (the learning rate, the KL weight) are left as they are.

    Args:
        resumed: `(epoch, {"steps": n, "means": {name: value}})` from the
            checkpoint the run resumed from, or `None`.

    Example:

    >>> means = EpochMeans(resumed=(3, {"steps": 120, "means": {"loss": 95.2}}))
    """

    def __init__(self, resumed=None):
        super().__init__()
        self.resumed = resumed
        self._carried = None
        self._steps = 0
        self._latest = {}

    def on_epoch_begin(self, epoch, logs=None):
        resumed_epoch, carried = self.resumed or (None, None)
        self._carried = carried if epoch == resumed_epoch else None
        self._steps, self._latest = 0, {}

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        self._latest = dict(logs or {})

    def partial(self):
        """The epoch so far, `{"steps": n, "means": {...}}`: what a mid-epoch checkpoint records."""
        return _merge(self._carried, self._steps, self._latest, self._mean_names())

    def on_epoch_end(self, epoch, logs=None):
        if self._carried is None or logs is None:
            return
        merged = _merge(self._carried, self._steps, logs, self._mean_names())
        logs.update(merged["means"])

    def _mean_names(self):
        return {m.name for m in self.model.metrics if isinstance(m, keras.metrics.Mean)}


def _merge(carried, steps, logs, names):
    """Step-weighted means of the carried part and of `steps` steps whose means are `logs`."""
    means = {name: float(np.asarray(logs[name])) for name in names if name in logs}
    if not carried:
        return {"steps": steps, "means": means}
    before = carried["steps"]
    total = before + steps
    merged = dict(carried["means"])
    for name, value in means.items():
        merged[name] = (before * merged[name] + steps * value) / total if name in merged else value
    return {"steps": total, "means": merged}
