"""Graceful stop: SIGINT (Ctrl-C) and SIGTERM (how clusters pre-empt jobs).

While `train` runs, the first SIGINT or SIGTERM asks it to stop after the
current step: `AtomicBackupAndRestore` checkpoints that step (as it does an
epoch cut short), and `train` raises `TrainingInterrupted`, which the
command line reports in one line with status 128 + the signal number (130,
143). The same call resumes from there. A second signal stops at once (the
checkpoint before it is intact, as after a kill).
"""

import signal
import threading

import keras

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """`train` stopped on SIGINT or SIGTERM after checkpointing its current step.

    A `KeyboardInterrupt` (as Ctrl-C is in Python), with the signal and the
    exit status a command line should end with.

    Args:
        signum: the signal number.
        message: what was saved and how to resume.

    Example:

    >>> import signal
    >>> stop = TrainingInterrupted(signal.SIGTERM, "checkpoint saved")
    >>> stop.exit_status, str(stop)
    (143, 'checkpoint saved')
    """

    def __init__(self, signum, message):
        super().__init__(message)
        self.signum = int(signum)
        self.exit_status = 128 + self.signum


class _StopOnSignal(keras.callbacks.Callback):
    """Installs SIGINT/SIGTERM handlers (main thread only) while it is entered;
    as a `fit` callback, stops training after the step during which one came.

    A handler only records the signal; `stop_training` then ends `fit` after
    the current step, and the checkpoint callback saves that step at the
    epoch's end. A signal whose handler was `SIG_IGN` (a background job's
    SIGINT) stays ignored. A second signal restores the previous handlers and
    delivers itself again: stop at once.
    """

    def __init__(self):
        super().__init__()
        self.signum = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = previous
                    signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        self._restore()

    def _restore(self):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            self._restore()
            signal.raise_signal(signum)  # the previous behaviour: stop now
            return
        self.signum = signum

    @property
    def signal_name(self):
        return signal.Signals(self.signum).name if self.signum is not None else None

    def on_train_batch_end(self, batch, logs=None):
        if self.signum is not None:
            self.model.stop_training = True
