"""keras_avae.training: schedules, KL warm-up, the non-finite guard, PNG
grids, checkpoints that survive SIGKILL, and tf.distribute (2 logical CPUs,
two workers on 127.0.0.1).

Runs that need a fresh interpreter (TensorFlow device set-up, a cluster, a
process to kill) go through `tests/training_helper.py`.
"""

import importlib.util
import csv
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from unittest import mock

import keras
import numpy as np
import PIL.Image
import pytest

from keras_avae import training
from keras_avae import zoo
from tests.test_case import exited_pid
from tests.test_case import free_ports
from tests.training_helper import TINY

BACKEND = keras.backend.backend()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tf_only = pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute needs the TensorFlow backend")


def numpy_of(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


# ---------------------------------------------------------------------- #
# Schedules and recipe
# ---------------------------------------------------------------------- #


def reference_schedule(steps, peak, warmup, decay, start, low, restart=None):
    """DESIGN §5 written out in NumPy, piece by piece."""
    steps = np.asarray(steps, dtype=np.float64)
    out = np.empty_like(steps)
    warm = steps < warmup
    out[warm] = start + (peak - start) * steps[warm] / warmup
    cycles = [(warmup, warmup + decay)] if restart is None else [(warmup, restart), (restart, warmup + decay)]
    for i, (begin, end) in enumerate(cycles):
        last = i == len(cycles) - 1
        inside = (steps >= begin) & ((steps < end) | last)
        fraction = np.clip((steps[inside] - begin) / (end - begin), 0.0, 1.0)
        out[inside] = low + (peak - low) * 0.5 * (1.0 + np.cos(np.pi * fraction))
    return out


@pytest.mark.parametrize("restart", [None, 60])
def test_schedule_matches_numpy_formula(restart):
    schedule = training.WarmupCosineDecay(
        1e-2, warmup_steps=20, decay_steps=100, initial_learning_rate=1e-4, min_learning_rate=2e-4, restart_step=restart
    )
    steps = np.arange(0, 140)
    got = np.array([float(numpy_of(schedule(s))) for s in steps])
    expected = reference_schedule(steps, 1e-2, 20, 100, 1e-4, 2e-4, restart)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-9)
    # Landmarks: start, the peak after the warm-up, the floor at the end.
    assert got[0] == pytest.approx(1e-4)
    assert got[20] == pytest.approx(1e-2)
    assert got[139] == pytest.approx(2e-4)
    if restart is None:
        assert got[70] == pytest.approx((1e-2 + 2e-4) / 2, rel=1e-5)  # half way down
    else:
        assert got[59] < 1e-3 and got[60] == pytest.approx(1e-2)  # the warm restart
    # The schedule is a function of the step tensor too (as the optimizer calls it).
    assert float(numpy_of(schedule(keras.ops.convert_to_tensor(20)))) == pytest.approx(1e-2)


def test_schedule_config_round_trip_and_errors():
    schedule = training.WarmupCosineDecay(1e-2, 5, 10, 1e-4, 1e-4, restart_step=9)
    clone = training.WarmupCosineDecay.from_config(schedule.get_config())
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    for s in range(20):
        assert float(numpy_of(clone(s))) == float(numpy_of(schedule(s))) == float(numpy_of(restored(s)))
    with pytest.raises(ValueError, match="min_learning_rate"):
        training.WarmupCosineDecay(1e-3, 0, 10, min_learning_rate=1e-2)
    with pytest.raises(ValueError, match="restart_step=3"):
        training.WarmupCosineDecay(1e-3, 5, 10, restart_step=3)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        training.WarmupCosineDecay(1e-3, -1, 10)


def test_recipe_schedule_and_optimizer():
    recipe = training.resolve_recipe("cifar10-attentive", epochs=900, restart_epochs=300, global_clipnorm=200.0)
    schedule = training.make_schedule(recipe, steps_per_epoch=10)
    assert (schedule.warmup_steps, schedule.decay_steps, schedule.restart_step) == (50, 8950, 3000)
    assert schedule.initial_learning_rate == schedule.min_learning_rate == 1e-4
    # A smoke run shorter than the warm-up stays in it; a restart past the end is dropped.
    short = training.make_schedule(recipe, steps_per_epoch=10, epochs=2)
    assert (short.warmup_steps, short.decay_steps, short.restart_step) == (50, 0, None)

    optimizer = training.make_optimizer(recipe, steps_per_epoch=10)
    inner = optimizer.inner_optimizer
    assert isinstance(optimizer, training.NonFiniteGuard) and isinstance(inner, keras.optimizers.Adamax)
    assert (inner.beta_1, inner.beta_2, inner.epsilon, inner.global_clipnorm) == (0.9, 0.999, 1e-3, 200.0)
    assert isinstance(inner._learning_rate, training.WarmupCosineDecay)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert isinstance(restored, training.NonFiniteGuard)
    assert restored.inner_optimizer._learning_rate.get_config() == inner._learning_rate.get_config()
    # schedule=False: a plain rate from the schedule's step 0, which a caller sets every step
    # (benchmarks/gpu_train.py); the rest as with the schedule.
    plain = training.make_optimizer(recipe, steps_per_epoch=10, schedule=False)
    assert float(numpy_of(plain.learning_rate)) == pytest.approx(float(numpy_of(schedule(0)))) == pytest.approx(1e-4)
    assert (plain.inner_optimizer.epsilon, plain.inner_optimizer.global_clipnorm) == (1e-3, 200.0)
    plain.learning_rate = float(numpy_of(schedule(50)))
    assert float(numpy_of(plain.inner_optimizer.learning_rate)) == pytest.approx(1e-2)

    # mnist-gumbel: Adam, no warm-up keys: a constant rate.
    gumbel = training.make_optimizer(training.resolve_recipe("mnist-gumbel"), 10, guard=False)
    assert isinstance(gumbel, keras.optimizers.Adam)
    assert float(numpy_of(gumbel._learning_rate(0))) == float(numpy_of(gumbel._learning_rate(10**6))) == pytest.approx(1e-3)

    with pytest.raises(ValueError, match="Unknown training recipe key"):
        training.resolve_recipe("mnist-baseline", learning_rat=1.0)
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        training.make_optimizer(training.resolve_recipe(None, optimizer="sgd"), 10)
    assert training.split_overrides("mnist-baseline", {"num_layers": 2, "epochs": 3, "kl_min": 0.2}) == (
        {"num_layers": 2},
        {"epochs": 3, "kl_min": 0.2},
    )
    with pytest.raises(ValueError, match="Unknown override 'bogus'"):
        training.split_overrides("mnist-baseline", {"bogus": 1})


# ---------------------------------------------------------------------- #
# KL warm-up
# ---------------------------------------------------------------------- #


class KLModel(keras.Model):
    """A regression model with the `kl_weight` variable of ELBO models."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)
        self.kl_weight = self.add_weight(name="kl_weight", shape=(), initializer="ones", trainable=False)

    def call(self, x):
        return self.dense(x)


def test_kl_warmup_values_and_resume():
    warmup = training.KLWarmup(warmup_epochs=16, kl_min=0.1)
    epochs = np.arange(24)
    expected = np.minimum(1.0, 0.1 + 0.9 * epochs / 16)
    np.testing.assert_allclose([warmup.beta(e) for e in epochs], expected, rtol=0, atol=1e-12)
    assert training.KLWarmup(0, 0.1).beta(0) == 1.0

    model = KLModel()
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 2), "float32"), np.zeros((8, 1), "float32")
    values = []

    class PerEpoch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                values.append(float(numpy_of(self.model.kl_weight)))

    model.fit(x, y, batch_size=4, epochs=3, callbacks=[warmup, PerEpoch()], verbose=0)
    np.testing.assert_allclose(values, expected[:3], rtol=1e-6)
    # A run resumed at epoch 5 trains that epoch with beta(5), whatever the
    # variable held before.
    model.kl_weight.assign(0.0)
    values.clear()
    model.fit(x, y, batch_size=4, initial_epoch=5, epochs=7, callbacks=[warmup, PerEpoch()], verbose=0)
    np.testing.assert_allclose(values, expected[5:7], rtol=1e-6)
    with pytest.raises(ValueError, match="kl_min=1.5"):
        training.KLWarmup(16, 1.5)


# ---------------------------------------------------------------------- #
# Non-finite guard
# ---------------------------------------------------------------------- #


def bn_regression_model():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    )
    model.compile(optimizer=training.NonFiniteGuard(keras.optimizers.Adamax(1e-2)), loss="mse")
    return model


def regression_data(nan_rows=(), n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    for row in nan_rows:
        x[row, 1] = np.nan
    return x, y


class RecordState(keras.callbacks.Callback):
    """Every model and optimizer variable after each batch."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        if hasattr(self.model, "jax_state_sync"):
            self.model.jax_state_sync()
        guard = training.find_guard(self.model.optimizer)
        self.states.append(
            {
                "model": [numpy_of(v).copy() for v in self.model.weights],
                "optimizer": [
                    numpy_of(v).copy() for v in self.model.optimizer.variables if v is not guard.nonfinite_steps
                ],
            }
        )


def test_guard_skips_an_injected_nan_batch():
    model = bn_regression_model()
    x, y = regression_data(nan_rows=[2 * 8 + 3])  # batch 2 of 4 holds a NaN
    record = RecordState()
    monitor = training.NonFiniteMonitor(max_nonfinite_steps=5, verbose=False)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[monitor, record], verbose=0)
    before, bad, after = record.states[1:4]
    # The NaN step changed nothing: weights, batch-norm statistics, optimizer
    # moments and iteration count are bit for bit those of the step before.
    for group in ("model", "optimizer"):
        for a, b in zip(before[group], bad[group]):
            np.testing.assert_array_equal(a, b)
    # Training went on: the next (finite) step updated the weights.
    assert any(not np.array_equal(a, b) for a, b in zip(bad["model"], after["model"]))
    guard = model.optimizer
    assert int(numpy_of(guard.nonfinite_steps)) == 1
    assert int(numpy_of(guard.iterations)) == 3
    assert all(np.isfinite(numpy_of(w)).all() for w in model.weights)
    # The epoch's metrics average the finite steps only.
    assert np.isfinite(history.history["loss"][0])


def test_monitor_stops_after_max_nonfinite_steps(capsys):
    model = bn_regression_model()
    x, y = regression_data(nan_rows=[1 * 8, 3 * 8])
    monitor = training.NonFiniteMonitor(max_nonfinite_steps=1)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, callbacks=[monitor], verbose=0)
    assert model.stop_training
    assert "max_nonfinite_steps=1" in monitor.stopped_message and "epoch 1, batch 4" in monitor.stopped_message
    assert int(numpy_of(model.optimizer.nonfinite_steps)) == 2
    assert int(numpy_of(model.optimizer.iterations)) == 2
    out = capsys.readouterr().out
    assert "skipped a training step" in out and "Training stopped" in out
    with pytest.raises(ValueError, match="NonFiniteGuard"):
        plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        plain.compile(optimizer="sgd", loss="mse")
        plain.fit(x[:8], y[:8], callbacks=[training.NonFiniteMonitor()], verbose=0)


def test_guard_state_saves_and_loads(tmp_path):
    model = bn_regression_model()
    x, y = regression_data(nan_rows=[0])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, training.NonFiniteGuard)
    assert int(numpy_of(loaded.optimizer.nonfinite_steps)) == 1
    assert int(numpy_of(loaded.optimizer.iterations)) == 3
    with pytest.raises(ValueError, match="inner optimizer"):
        training.NonFiniteGuard(keras.optimizers.SGD(), global_clipnorm=1.0)


@pytest.mark.parametrize("bad", [None, (1, 2, np.inf), (0, 0, -np.inf), (2, 4, np.nan)], ids=str)
def test_check_finite_flags_any_inf_or_nan_and_leaves_the_gradients(bad):
    rng = np.random.default_rng(0)
    # Mixed dtypes, large finite values and a non-contiguous gradient (on torch).
    arrays = [
        rng.normal(size=(3, 3)).astype("float32"),
        rng.normal(size=(4, 6)).astype("float16"),
        rng.normal(size=(5,)).astype("float32") * 1e30,
    ]
    if bad is not None:
        index, position, value = bad
        arrays[index].flat[position] = value
    grads = [keras.ops.convert_to_tensor(a) for a in arrays]
    if BACKEND == "torch":
        grads[1] = grads[1].T.contiguous().T  # same values, transposed strides
    guard = training.NonFiniteGuard(keras.optimizers.Adamax())
    finite = guard.check_finite([grads[0], None, grads[1], grads[2]])
    assert bool(numpy_of(finite)) == all(np.isfinite(a).all() for a in arrays)
    for grad, array in zip(grads, arrays):
        np.testing.assert_array_equal(numpy_of(grad), array)
    assert bool(numpy_of(guard.check_finite([None]))) is True


# ---------------------------------------------------------------------- #
# Checkpoints
# ---------------------------------------------------------------------- #


def test_history_rows_and_resumed_progress_bar_count_epochs_from_one(tmp_path, capsys):
    """`history.csv` numbers epochs as the progress bar does, with no empty
    `val_*` columns; the bar of a resumed epoch shows the run's epoch count."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    path = tmp_path / "history.csv"
    logger = training.run_folder.HistoryLogger(path)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[logger])
    path.write_text(path.read_text() + "3,0.5")  # a row cut short by a kill
    training.run_folder._truncate_history(path, 1)  # the checkpoint holds epoch 1
    model.fit(x, y, epochs=3, initial_epoch=1, verbose=0, callbacks=[logger])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2", "3"] and set(rows[0]) == {"epoch", "loss"}
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    # Before: a row cut inside its last field has the header's field count and was kept.
    full = path.read_text()
    path.write_text(full + "4,0.12")  # "4,0.1234": the write stopped two digits short
    training.run_folder._truncate_history(path, 4)
    assert path.read_text() == full
    path.write_text("epoch,lo")  # a header cut short: the logger writes it again
    training.run_folder._truncate_history(path, 1)
    assert path.read_text() == ""

    capsys.readouterr()
    model.fit(x, y, epochs=3, initial_epoch=2, verbose=2, callbacks=[training.callbacks._RunProgressBar(8)])
    assert "Epoch 3/8" in capsys.readouterr().out


def test_history_header_is_never_left_cut_short(tmp_path, monkeypatch):
    """A kill while the first epoch's header is written leaves no file (or a
    whole one), never a partial header that later rows would follow."""
    path = tmp_path / "history.csv"
    logger = training.run_folder.HistoryLogger(path)
    real_writer = csv.writer

    class KilledWriter:
        # Writes the first 5 characters of the header, then dies.
        def __init__(self, f):
            self.f = f

        def writerow(self, row):
            self.f.write(",".join(map(str, row))[:5])
            raise KeyboardInterrupt

        def writerows(self, rows):
            self.writerow(rows[0])

    monkeypatch.setattr(csv, "writer", KilledWriter)
    with pytest.raises(KeyboardInterrupt):
        logger.on_epoch_end(0, {"loss": 1.5, "kl": 0.25})
    monkeypatch.setattr(csv, "writer", real_writer)
    assert not path.exists()
    logger.on_epoch_end(0, {"loss": 1.5, "kl": 0.25})
    logger.on_epoch_end(1, {"loss": 1.0, "kl": 0.5})
    with open(path) as f:
        rows = list(csv.reader(f))
    assert rows == [["epoch", "kl", "loss"], ["1", "0.25", "1.5"], ["2", "0.5", "1.0"]]


def test_progress_bar_of_a_stopped_epoch_shows_the_steps_it_ran(capsys):
    # Keras' bar ends a stopped epoch at its full step count ("5/5"), so a
    # log read an interrupted epoch as finished.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((10, 2), "float32"), np.ones((10, 1), "float32")

    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    bar = training.callbacks._RunProgressBar(4)
    capsys.readouterr()
    model.fit(x, y, batch_size=2, epochs=2, verbose=2, callbacks=[StopAfterTwo(), bar])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Epoch 1/4" and lines[1].startswith("2/5 - ") and len(lines) == 2, lines
    model.fit(x, y, batch_size=2, epochs=1, verbose=2, callbacks=[bar])  # not stopped: the full count
    assert capsys.readouterr().out.splitlines()[1].startswith("5/5 - ")


def test_checkpoint_commit_is_atomic(tmp_path):
    model = bn_regression_model()
    x, y = regression_data()
    backup = training.AtomicBackupAndRestore(tmp_path / "backup", save_freq=3, steps_per_epoch=4)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, callbacks=[backup], verbose=0)
    state = backup.read_state()
    assert (state["epoch"], state["step"], state["iterations"]) == (2, 0, 8)
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == [
        "checkpoint.json",
        "ckpt-e000002-s00000000.weights.h5",
    ]
    committed = [numpy_of(w).copy() for w in model.weights]

    # A crash while the next checkpoint is written (here: half a file, then
    # an exception where a SIGKILL would be) leaves the committed one.
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)

    def crash(path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89HDF\r\n half a checkpoint")
        raise KeyboardInterrupt("killed while saving")

    real_save = model.save_weights
    model.save_weights = crash
    with pytest.raises(KeyboardInterrupt):
        backup._save(3, 0)
    model.save_weights = real_save
    assert backup.read_state() == state

    fresh = bn_regression_model()
    restored = training.AtomicBackupAndRestore(tmp_path / "backup").restore(fresh)
    assert restored["iterations"] == 8 and int(numpy_of(fresh.optimizer.iterations)) == 8
    for a, b in zip(committed, fresh.weights):
        np.testing.assert_array_equal(a, numpy_of(b))

    # A mid-epoch checkpoint records the step inside the epoch.
    backup.step_offset = 0
    model.fit(x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, callbacks=[backup], verbose=0)
    assert (backup.read_state()["epoch"], backup.read_state()["step"]) == (0, 3)  # 3 of 4 steps

    # An optimizer that does not match the checkpoint is an error, not a warning.
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    other.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError, match="restore"):
        training.AtomicBackupAndRestore(tmp_path / "backup").restore(other)


# ---------------------------------------------------------------------- #
# PNG
# ---------------------------------------------------------------------- #


def decode_png(data):
    """PNG bytes as a uint8 array `(H, W, C)`, read by Pillow (8-bit grey or RGB only).

    The writer is Pillow too, but its filters (per row, adaptive) are not
    checked here: the pixels are, against the arrays that were written.
    """
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with PIL.Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG" and image.mode in ("L", "RGB"), (image.format, image.mode)
        pixels = np.asarray(image)
    return pixels.reshape(pixels.shape[0], pixels.shape[1], -1)


def test_png_writer_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    for shape in [(5, 7), (5, 7, 1), (4, 6, 3)]:
        image = rng.integers(0, 256, shape).astype("uint8")
        decoded = decode_png(training.encode_png(image))
        np.testing.assert_array_equal(decoded.reshape(image.shape), image)
    rows = [rng.random((3, 4, 4, 1)), rng.random((2, 4, 4, 1))]
    path = tmp_path / "grid.png"
    training.save_image_grid(path, rows, padding=1)
    grid = decode_png(path.read_bytes())
    assert grid.shape == (2 * 5 + 1, 3 * 5 + 1, 1)
    np.testing.assert_array_equal(grid[1:5, 1:5, 0], np.round(rows[0][0, ..., 0] * 255).astype("uint8"))
    assert (grid[0] == 255).all() and (grid[6:10, 11:15] == 255).all()  # padding, missing cell
    # [-1, 1] images (the logistic-mixture models) map onto 0..255 too.
    grid = training.image_grid([-np.ones((1, 2, 2, 3))], padding=0, value_range=(-1.0, 1.0))
    assert (grid == 0).all()
    with pytest.raises(ValueError, match="uint8"):
        training.encode_png(np.zeros((2, 2)))


# ---------------------------------------------------------------------- #
# Strategies
# ---------------------------------------------------------------------- #


def test_make_strategy_arguments():
    with pytest.raises(ValueError, match="kind='ring'"):
        training.make_strategy("ring")
    with pytest.raises(ValueError, match="cpu_devices=0"):
        training.make_strategy("auto", cpu_devices=0)
    if BACKEND == "jax":
        return  # keras.distribution: tests/test_jax_distribution.py
    if BACKEND != "tensorflow":
        with pytest.raises(ValueError, match="TensorFlow backend"):
            training.make_strategy("mirrored")
        assert training.make_strategy("auto") is None
        return
    import tensorflow as tf

    # Before: "auto" with TF_CONFIG became a 1-replica multi-worker strategy, the split ignored.
    tf_config = '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}'
    with mock.patch.dict(os.environ, {"TF_CONFIG": tf_config}):
        for kind in ("auto", "multi-worker"):
            with pytest.raises(ValueError, match=rf"one CPU device per worker.*kind='{kind}'.*cpu_devices=2"):
                training.make_strategy(kind, cpu_devices=2)
    tf.constant(1.0)  # TensorFlow is initialised from here on
    existing = len(tf.config.list_logical_devices("CPU"))
    with pytest.raises(RuntimeError, match="before anything creates a TensorFlow"):
        training.make_strategy("mirrored", cpu_devices=existing + 1)
    strategy = training.make_strategy("one-device")
    assert strategy.num_replicas_in_sync == 1 and training.is_chief(strategy)


def test_train_refuses_a_strategy_make_strategy_does_not_make(tmp_path):
    """Before: on JAX a name, an int or a `ModelParallel` trained on one device without a word
    (`num_replicas` counted 1); on TensorFlow, a raw AttributeError."""
    wanted = {
        "tensorflow": "a tf.distribute.Strategy or None",
        "jax": "a keras.distribution.DataParallel or None",
    }.get(BACKEND, "None")
    strategies = ["mirrored", 2]
    if BACKEND == "jax":
        mesh = keras.distribution.DeviceMesh((1,), ["batch"], keras.distribution.list_devices()[:1])
        strategies.append(keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh)))
    x = np.zeros((8, 8, 8, 1), "float32")
    for strategy in strategies:
        with pytest.raises(ValueError, match=r"`strategy` must be " + wanted) as error:
            training.train("mnist-baseline", x, tmp_path / "run", epochs=1, batch_size=8, strategy=strategy,
                           config_overrides=TINY, verbose=0, tensorboard=False)
        assert f"on the {BACKEND} backend" in str(error.value)
        assert str(error.value).endswith(f"Received: strategy={strategy!r}")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- #
# train() end to end, in process
# ---------------------------------------------------------------------- #


@pytest.mark.slow
def test_train_writes_everything_and_guards_nan(tmp_path):
    rng = np.random.default_rng(0)
    x = (rng.random((24, 8, 8, 1)) > 0.5).astype("float32")
    x[-1, 3, 3, 0] = np.nan  # one bad image: one skipped step per epoch
    out = tmp_path / "run"
    kwargs = dict(batch_size=8, config_overrides=TINY, verbose=0, jit_compile="auto", num_images=4)
    model = training.train("mnist-baseline", x, out, epochs=2, **kwargs)

    guard = model.optimizer
    assert int(numpy_of(guard.nonfinite_steps)) == 2
    assert int(numpy_of(guard.iterations)) == 2 * 3 - 2
    assert float(numpy_of(model.kl_weight)) == pytest.approx(0.1 + 0.9 / 16)
    for name in ("model.keras", "model.weights.h5", "history.csv", "run.json", "samples/epoch_0002.png"):
        assert (out / name).is_file(), name
    rows = (out / "history.csv").read_text().strip().splitlines()
    header = rows[0].split(",")
    assert len(rows) == 3 and {"nelbo", "kl_0", "kl_weight", "learning_rate", "nonfinite_steps"} <= set(header)
    last = dict(zip(header, rows[-1].split(",")))
    assert last["nonfinite_steps"] == "2" and math.isfinite(float(last["nelbo"]))
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((out / "logs" / "train").glob("events.out.tfevents.*"))
    grid = decode_png((out / "samples" / "epoch_0001.png").read_bytes())
    assert grid.shape == (3 * 9 + 1, 4 * 9 + 1, 1)  # samples, images, reconstructions

    # The saved model and weights load, with every state finite (the NaN
    # batches left no trace in the batch-norm statistics).
    loaded = keras.saving.load_model(out / "model.keras")
    assert isinstance(loaded.optimizer, training.NonFiniteGuard)
    reloaded = zoo.load("mnist-baseline", weights=out / "model.weights.h5", **TINY)
    for a, b in zip(model.weights, reloaded.weights):
        np.testing.assert_array_equal(numpy_of(a), numpy_of(b))
        assert np.isfinite(numpy_of(b)).all()
    assert np.isfinite(numpy_of(reloaded.reconstruct(x[:4]))).all()
    import h5py

    with h5py.File(out / "model.weights.h5", "r") as weights_file:
        assert "optimizer" not in weights_file  # weights only: what the zoo ships

    # The same call again is a no-op; more epochs continue the run; other
    # settings are refused.
    again = training.train("mnist-baseline", x, out, epochs=2, **kwargs)
    assert int(numpy_of(again.optimizer.iterations)) == 4
    assert len((out / "history.csv").read_text().strip().splitlines()) == 3
    with pytest.raises(ValueError, match="other settings"):
        training.train("mnist-baseline", x, out, epochs=2, learning_rate=1e-3, **kwargs)
    # Too many bad steps: a clear error; the checkpoint keeps the finite state.
    with pytest.raises(training.NonFiniteTrainingError, match="max_nonfinite_steps=0") as stopped:
        training.train("mnist-baseline", x, tmp_path / "strict", epochs=2, max_nonfinite_steps=0, **kwargs)
    assert not (tmp_path / "strict" / "model.keras").exists()
    state = json.loads((tmp_path / "strict" / "backup" / "checkpoint.json").read_text())
    batch = int(str(stopped.value).split("epoch 1, batch ")[1].split(")")[0])  # where the NaN batch fell
    assert state["epoch"] * 3 + state["step"] == batch  # the steps run before the stop, no more
    assert state["iterations"] == batch - 1
    # A larger limit continues the stopped run (a stop limit, not a training setting).
    resumed = training.train("mnist-baseline", x, tmp_path / "strict", epochs=2, max_nonfinite_steps=5, **kwargs)
    # (Keras reshuffles arrays in the resumed call: the bad image may come
    # again in the rest of the stopped epoch, one more skip.)
    assert 2 <= int(numpy_of(resumed.optimizer.nonfinite_steps)) <= 3
    assert (tmp_path / "strict" / "model.keras").exists()
    assert all(np.isfinite(numpy_of(w)).all() for w in resumed.weights)


# ---------------------------------------------------------------------- #
# Subprocess runs: tf.distribute and SIGKILL
# ---------------------------------------------------------------------- #


@pytest.fixture
def helper():
    """Starts `tests/training_helper.py` runs; kills any left at teardown
    (a worker whose peer died waits for it forever)."""
    started = []

    def start(*args, env=None):
        command = [sys.executable, "-m", "tests.training_helper", *map(str, args)]
        environment = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
        process = subprocess.Popen(
            command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate()


def result_of(process, timeout=900):
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-4000:]
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@tf_only
@pytest.mark.slow
def test_mirrored_step_on_two_cpus_equals_one_device(tmp_path, helper):
    """One step on 2 replicas (4 + 4 images) == one step on one device (8 images).

    Exact up to float32 summation order; the helper's docstring explains why
    latent noise is replaced by common random numbers. Training on half the
    batch must differ, so the comparison can fail. Then a NaN in one
    replica's share must make both replicas skip the step.
    """
    result = result_of(helper("mirrored-step", tmp_path / "state.json"))
    assert result["replicas"] == 2
    data = json.loads((tmp_path / "state.json").read_text())
    assert data["synchronized_batch_norm"] is True
    losses = data["losses"]
    # Not doubled, and equal up to summation order (rel 1e-5, as on JAX); the
    # half batch's loss is ~20x farther off.
    assert losses["mirrored"] == pytest.approx(losses["single"], rel=1e-5)
    assert losses["half"] != pytest.approx(losses["single"], rel=1e-5)
    states = data["states"]
    for group in ("trainable", "non_trainable", "optimizer"):
        pairs = list(zip(states["mirrored"][group], states["single"][group]))
        assert len(pairs) == len(states["single"][group]) > 0
        for (path, a), (_, b) in pairs:
            # atol: near-zero entries (a conv bias ~1e-7 after one step) differ by
            # float32 summation order across replicas; 3.7e-6 was seen in CI.
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=2e-5, err_msg=path)
    differences = [
        np.max(np.abs(np.array(a) - np.array(b)))
        for (_, a), (_, b) in zip(states["mirrored"]["optimizer"], states["half"]["optimizer"])
        if np.size(a)
    ]
    assert max(differences) > 1e-2
    # A NaN in one replica's share: both replicas skipped the step.
    assert data["nan_step"] == {"unchanged": True, "finite": True, "nonfinite_steps": 1, "iterations": 1}


@tf_only
@pytest.mark.slow
def test_mirrored_replicas_draw_their_own_noise(tmp_path, helper):
    """Each replica draws its own latent noise; replica 0 draws what one device draws.

    Before: the mirrored seed state made both replicas draw the same numbers,
    so a model given the same images on both returned the same outputs.
    """
    result_of(helper("replica-noise", tmp_path / "noise.json"))
    data = json.loads((tmp_path / "noise.json").read_text())
    for (replica_0, replica_1), one_device in zip(data["draws"], data["one_device"]):
        assert replica_0 == one_device
        assert np.abs(np.subtract(replica_0, replica_1)).min() > 1e-3
    assert data["states"] == [[7, 2], [7, 2]]  # the state advances as on one device
    first, second = (np.array(v) for v in data["outputs"])
    assert first.shape == second.shape == (4,) and np.abs(first - second).min() > 1e-6
    # Before: a batch split 3 + 2 trained without an error, each replica's
    # mean weighed equally (the JAX check did not run under tf.distribute).
    assert "split evenly over the 2 devices" in data["refusal"] and "unknown size" in data["refusal"]


def test_batches_that_do_not_split_over_the_replicas_are_refused():
    import tensorflow as tf

    check = training.run_settings._check_replica_input
    x = np.zeros((21, 8, 8, 1), "float32")
    with pytest.raises(ValueError, match=r"split evenly over the 2 devices. Received: batch_size=7"):
        check(x, 7, 2, None)
    with pytest.raises(ValueError, match=r"last batch of 5 images.*Received: dataset of 21 images, batch_size=8"):
        check(x, 8, 2, None)
    batches = tf.data.Dataset.from_tensor_slices(x)
    with pytest.raises(ValueError, match=r"drop_remainder=True.*Received: dataset batches of unknown size"):
        check(batches.batch(8), 8, 2, None)
    with pytest.raises(ValueError, match=r"multiple of 4 images.*Received: dataset batches of 6 images"):
        check(batches.batch(6, drop_remainder=True), 8, 4, None)
    check(batches.batch(8, drop_remainder=True), 8, 2, None)
    check(x[:16], 8, 2, None)


@tf_only
def test_run_settings_under_two_replicas(tmp_path):
    import tensorflow as tf

    # A stand-in for a 2-replica tf.distribute strategy: what `_resolve_run` reads of one.
    two = types.SimpleNamespace(num_replicas_in_sync=2, extended=types.SimpleNamespace(should_checkpoint=True))
    x = np.zeros((16, 8, 8, 1), "float32")
    batches = tf.data.Dataset.from_tensor_slices(x).batch(8, drop_remainder=True)

    def resolve(dataset=batches, batch_size=None, validation_data=None, strategy=two, **recipe):
        return training.run_settings._resolve_run(
            "mnist-baseline", dataset, tmp_path, 1, None, strategy, batch_size, recipe, None, validation_data
        )

    # Before: the recipe's 16 per replica x 2 was recorded for a dataset of batches of 8
    # (and a resume with another device count was refused for it).
    assert resolve().batch_size == 8 and resolve(strategy=None).batch_size == 8
    assert resolve().batch_from_dataset and not resolve(batch_size=8).batch_from_dataset
    # A run recorded before (the recipe's number, no marker) still resumes.
    differences = training.run_folder._differences
    assert not list(differences({"batch_size": 32}, {"batch_size": 8, "batch_size_from": "dataset"}))
    assert list(differences({"batch_size": 32}, {"batch_size": 8})) == [("batch_size", 32, 8)]
    with pytest.raises(ValueError, match=r"batches of 8 images.*Received: batch_size=16"):
        resolve(batch_size=16)
    # Before: validation data was not checked; its last batch of 1 failed in `fit` after an epoch.
    with pytest.raises(ValueError, match=r"last batch of 1 images.*Received: validation_data of 9 images"):
        resolve(validation_data=x[:9])
    with pytest.raises(ValueError, match=r"`validation_data` must split evenly.*batches of 3 images"):
        resolve(validation_data=tf.data.Dataset.from_tensor_slices(x[:9]).batch(3, drop_remainder=True))
    resolve(validation_data=(x[:10],))
    resolve(validation_data=tf.data.Dataset.from_tensor_slices(x[:10]).batch(8))  # make_dataset's test split
    # Before: each replica clipped its part of the gradient.
    with pytest.raises(ValueError, match=r"`global_clipnorm` under a multi-replica.*global_clipnorm=1.0, 2 replicas"):
        resolve(global_clipnorm=1.0)
    assert resolve(strategy=None, global_clipnorm=1.0).recipe["global_clipnorm"] == 1.0


@tf_only
@pytest.mark.slow
def test_two_worker_training_on_localhost(tmp_path, helper):
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    out = tmp_path / "run"
    processes = []
    for index in range(2):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        processes.append(
            helper("train", out, 2, "--strategy", "multi-worker", env={"TF_CONFIG": json.dumps(config)})
        )
    results = [result_of(p) for p in processes]
    assert [r["chief"] for r in results] == [True, False]
    for r in results:
        assert r["replicas"] == 2 and r["iterations"] == 2 * 3 and r["finite"]
        assert r["kl_weight"] == pytest.approx(0.1 + 0.9 / 16)
    assert (out / "model.keras").is_file() and (out / "backup" / "checkpoint.json").is_file()
    assert len((out / "history.csv").read_text().strip().splitlines()) == 3
    # The workers train on a distributed dataset, as the CLI's: before, the chief
    # alone read a batch of it for the grid, and the workers' collectives then
    # failed ("Collective instance ... expected type 0 and data_type 1").
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["epoch_0001.png", "epoch_0002.png"]


def history_epochs(out):
    """The epoch column of `history.csv` (from 1), after checking it has one
    header and no `val_*` columns (these runs have no validation data)."""
    lines = (out / "history.csv").read_text().strip().splitlines()
    assert sum(line.startswith("epoch,") for line in lines) == 1 and lines[0].startswith("epoch,"), lines
    assert not any(name.startswith("val_") for name in lines[0].split(",")), lines[0]
    return [line.split(",")[0] for line in lines[1:]]


def wait_for(path, process, timeout=500):
    deadline = time.time() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[0][-4000:]
        assert time.time() < deadline, f"no {path}"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_then_restart_resumes_exactly(tmp_path, helper):
    """Kill -9 after the first checkpoint, run the same command again.

    Epochs of 3 steps, a checkpoint every 2 steps and at each epoch end, so
    the kill can land mid-epoch. The restarted run must train exactly the
    steps the checkpoint did not hold, and end where an uninterrupted run
    ends: same optimizer step count, KL coefficient and learning rate, one
    history row per epoch.
    """
    epochs, steps_per_epoch = 3, 3
    total = epochs * steps_per_epoch
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    pointer = killed / "backup" / "checkpoint.json"

    uninterrupted = helper("train", reference, epochs, "--save-freq", 2)  # runs alongside
    process = helper("train", killed, epochs, "--save-freq", 2, env={"KAVAE_TEST_BATCH_DELAY": "0.5"})
    wait_for(pointer, process)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert json.loads((killed / "run.lock").read_text())["pid"] == process.pid  # stale, left behind
    state = json.loads(pointer.read_text())
    done = state["epoch"] * steps_per_epoch + state["step"]
    assert 0 < done < total and state["iterations"] == done

    resumed = result_of(helper("train", killed, epochs, "--save-freq", 2))
    assert json.loads((killed / "run.lock").read_text())["pid"] != process.pid  # the dead run's lock taken over
    uninterrupted = result_of(uninterrupted)
    assert resumed["batches"] == total - done  # nothing lost, nothing trained twice
    assert resumed["iterations"] == uninterrupted["iterations"] == total
    assert resumed["kl_weight"] == uninterrupted["kl_weight"] == pytest.approx(0.1 + 0.9 * 2 / 16)
    assert resumed["learning_rate"] == pytest.approx(uninterrupted["learning_rate"])
    assert history_epochs(killed) == ["1", "2", "3"]
    assert (killed / "model.keras").is_file() and resumed["finite"]


@pytest.mark.slow
@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="the lock (filelock on run.lock) is taken before any backend work: one backend proves it",
)
def test_second_train_on_a_folder_in_use_is_refused(tmp_path, helper):
    out = tmp_path / "run"
    # 3 s per batch: the first run still holds the folder (4 batches, 12 s
    # left) while the second imports Keras, slow on a loaded machine.
    first = helper("train", out, 2, "--save-freq", 2, env={"KAVAE_TEST_BATCH_DELAY": "3"})
    wait_for(out / "backup" / "checkpoint.json", first)
    second = helper("train", out, 2)
    output, _ = second.communicate(timeout=600)
    assert second.returncode == 2, output[-4000:]
    error = [line for line in output.splitlines() if line.startswith("ERROR ")]
    assert len(error) == 1 and f"in use by process {first.pid} on host" in error[0], output[-2000:]
    assert result_of(first)["iterations"] == 2 * 3
    assert history_epochs(out) == ["1", "2"]


@pytest.mark.slow
@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="the handlers and the stop are Python around the step, the same on every backend; each backend's "
    "mid-epoch checkpoint and exact resume are tested by the SIGKILL test",
)
def test_sigint_and_sigterm_checkpoint_the_step_and_resume(tmp_path, helper):
    """Ctrl-C and SIGTERM: a checkpoint of the current step, one line, status
    130 / 143; the same command resumes and ends as an uninterrupted run."""
    epochs, steps_per_epoch = 3, 3
    total = epochs * steps_per_epoch
    runs = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        out = tmp_path / signum.name
        runs[signum] = out, helper("train", out, epochs, "--save-freq", 2, env={"KAVAE_TEST_BATCH_DELAY": "1"})
    signalled = {}
    for signum, (out, process) in runs.items():
        pointer = out / "backup" / "checkpoint.json"
        wait_for(pointer, process)
        signalled[signum] = json.loads(pointer.read_text())
        process.send_signal(signum)
    for signum, (out, process) in runs.items():
        pointer, before = out / "backup" / "checkpoint.json", signalled[signum]
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 128 + signum, output[-4000:]
        assert "Traceback" not in output
        stopped = [line for line in output.splitlines() if line.startswith("STOPPED ")]
        assert len(stopped) == 1 and f"stopped by {signum.name}" in stopped[0] and "resume" in stopped[0]
        state = json.loads(pointer.read_text())
        done = state["epoch"] * steps_per_epoch + state["step"]
        # The step under way when the signal came is in the checkpoint (the
        # save_freq checkpoint would have waited for the next even step).
        assert before["epoch"] * steps_per_epoch + before["step"] < done < total and state["iterations"] == done
        assert f"epoch {state['epoch'] + 1} of {epochs}, step {state['step']} of {steps_per_epoch}" in stopped[0]
        assert history_epochs(out) == [str(e) for e in range(1, state["epoch"] + 1)]
        runs[signum] = out, done
    # Both resumed runs at once: each is mostly process start-up and tracing.
    resumed_runs = {signum: helper("train", out, epochs, "--save-freq", 2) for signum, (out, _) in runs.items()}
    for signum, (out, done) in runs.items():
        resumed = result_of(resumed_runs[signum])
        assert resumed["batches"] == total - done and resumed["iterations"] == total
        # Where an uninterrupted run ends (the SIGKILL test runs one; here
        # the schedules compute it): the last epoch's KL coefficient and the
        # recorded recipe's learning rate after `total` steps.
        assert resumed["kl_weight"] == pytest.approx(0.1 + 0.9 * (epochs - 1) / 16)
        recipe = json.loads((out / "run.json").read_text())["recipe"]
        optimizer = training.make_optimizer(recipe, steps_per_epoch, epochs)
        assert resumed["learning_rate"] == pytest.approx(float(training._learning_rate_at(optimizer, total)))
        assert history_epochs(out) == ["1", "2", "3"] and (out / "model.keras").is_file()


def test_signal_handlers_are_restored_after_train(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(ValueError, match="steps_per_epoch=4"):
        training.train("mnist-baseline", np.zeros((24, 8, 8, 1), "float32"), tmp_path, epochs=1, steps_per_epoch=4,
                       batch_size=8, config_overrides=TINY)
    stopper = training.interrupts._StopOnSignal()
    with stopper:
        assert signal.getsignal(signal.SIGTERM) == stopper._handle
        signal.raise_signal(signal.SIGTERM)  # recorded, not fatal
    assert stopper.signum == signal.SIGTERM and stopper.signal_name == "SIGTERM"
    assert {s: signal.getsignal(s) for s in before} == before


def test_too_little_data_is_refused_before_training(tmp_path):
    x = np.zeros((20, 8, 8, 1), "float32")
    kwargs = dict(epochs=1, config_overrides=TINY, verbose=0)
    # 20 images in batches of 8: 3 batches (the last one short).
    with pytest.raises(ValueError, match=r"asks for 4 batches .* 20 images in batches of 8 make 3.*steps_per_epoch=4"):
        training.train("mnist-baseline", x, tmp_path / "a", steps_per_epoch=4, batch_size=8, **kwargs)
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(x).batch(8, drop_remainder=True)
    with pytest.raises(ValueError, match="the dataset make 2"):
        training.train("mnist-baseline", dataset, tmp_path / "b", steps_per_epoch=3, **kwargs)
    assert not (tmp_path / "a" / "run.json").exists() and not (tmp_path / "b" / "run.json").exists()


@pytest.mark.slow
def test_resume_checks_each_setting_and_keeps_the_record(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    x = (rng.random((16, 8, 8, 1)) > 0.5).astype("float32")
    out = tmp_path / "run"
    kwargs = dict(config_overrides=TINY, verbose=0, jit_compile="auto", num_images=0, tensorboard=False)
    data = {"dataset": "test", "limit": None, "seed": 0}
    training.train("mnist-baseline", x, out, epochs=1, batch_size=8, data_info=data, **kwargs)
    record = json.loads((out / "run.json").read_text())
    assert record["batch_size"] == 8 and record["data"] == data
    assert record["reproducibility"] == {"seed": None, "deterministic_kernels": False}
    written = (out / "run.json").stat().st_mtime_ns

    builds = []
    build = training.trainer._build_model
    monkeypatch.setattr(training.trainer, "_build_model", lambda *args: builds.append(1) or build(*args))

    def refused(fragments, built=False, **changes):
        call = dict(epochs=1, batch_size=8, data_info=data, **kwargs)
        call.update(changes)
        builds.clear()
        with pytest.raises(ValueError, match="other settings") as error:
            training.train("mnist-baseline", x, out, **call)
        message = str(error.value)
        assert "\n" not in message and "optimizer" not in message  # the differing keys, not the recipe
        for fragment in fragments:
            assert fragment in message, message
        # Settings other than the model's are refused before it is built.
        assert builds == ([1] if built else []), changes

    refused(
        ["batch_size: recorded 8, requested 4", "`train` takes the global batch: batch_size=8)", "steps_per_epoch"],
        batch_size=4,
    )
    refused(["recipe.learning_rate: recorded 0.01, requested 0.002"], learning_rate=2e-3)
    refused(["config.num_layers: recorded 2, requested 3"], built=True, config_overrides=dict(TINY, num_layers=3))
    refused(["data.limit: recorded None, requested 8"], data_info=dict(data, limit=8))
    refused(["reproducibility.seed: recorded None, requested 3"], seed=3, deterministic=False)
    with pytest.raises(ValueError, match="`deterministic` must be a bool. Received: deterministic='no'"):
        training.train("mnist-baseline", x, out, epochs=1, batch_size=8, deterministic="no", **kwargs)
    # Another epoch count changes the schedule of a run under way; more
    # epochs continue a finished one (the checkpoint holds every epoch).
    check = training.run_folder._check_run_record
    other = tmp_path / "other" / "run.json"
    other.parent.mkdir()
    other.write_text(json.dumps(dict(record, epochs=3)))
    with pytest.raises(ValueError, match="epochs: recorded 3, requested 5"):
        check(other, dict(record, epochs=5), finished_epochs=2)
    with pytest.raises(ValueError, match="epochs: recorded 3, requested 2"):
        check(other, dict(record, epochs=2), finished_epochs=3)
    check(other, dict(record, epochs=5), finished_epochs=3)
    # Deterministic kernels asked for by one part of a run and not by another.
    kernels = dict(record, epochs=3, reproducibility={"seed": None, "deterministic_kernels": True})
    with pytest.raises(ValueError, match="reproducibility.deterministic_kernels: recorded False, requested True"):
        check(other, kernels, finished_epochs=2)
    training.train("mnist-baseline", x, out, epochs=1, batch_size=8, data_info=data, **kwargs)  # complete: no-op
    assert (out / "run.json").stat().st_mtime_ns == written and history_epochs(out) == ["1"]

    # A record in the format of earlier versions (no `data`, a config key
    # this version does not know, another compile mode) resumes when the
    # settings are the same.
    old = {k: v for k, v in record.items() if k != "data"}
    old["config"] = dict(old["config"], retired_option=1)
    old["compile_mode"] = "tensorflow, tf.function graph without XLA on CPU"
    (out / "run.json").write_text(json.dumps(old, indent=1))
    model = training.train("mnist-baseline", x, out, epochs=2, batch_size=8, data_info=data, **kwargs)
    assert int(numpy_of(model.optimizer.iterations)) == 4 and history_epochs(out) == ["1", "2"]
    assert json.loads((out / "run.json").read_text())["epochs"] == 2  # what was trained


def test_a_resume_on_another_device_count_names_the_batch_size_train_takes(tmp_path):
    """Before: the hint named `keras-avae train`'s per-replica flag only ("--batch-size 16 gives 32"), so a
    `train` caller who passed batch_size=16 on 2 replicas was refused again: `train` takes the global batch."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"batch_size": 32, "replicas": 1}))  # `train` on one device, the recipe's batch
    with pytest.raises(ValueError) as error:
        training.run_folder._check_run_record(path, {"batch_size": 64, "replicas": 2})  # its default on 2 replicas
    assert str(error.value).endswith(
        "(batch_size: recorded 32, requested 64 (global batches: the per-replica --batch-size of `keras-avae train` "
        "times the replicas, 1 then, 2 now; --batch-size 16 gives 32; `train` takes the global batch: batch_size=32)). "
        "Resume it with the recorded settings, or use a new output folder."
    )
    training.run_folder._check_run_record(path, {"batch_size": 32, "replicas": 2})  # what the hint says resumes
    with pytest.raises(ValueError, match=r"no --batch-size gives 32 on 3, nor does batch_size=32 split over 3\)"):
        training.run_folder._check_run_record(path, {"batch_size": 30, "replicas": 3})


def test_bad_recipe_value_is_refused_before_the_run_is_recorded(tmp_path):
    x = np.zeros((16, 8, 8, 1), "float32")
    kwargs = dict(epochs=1, batch_size=8, config_overrides=TINY, verbose=0, num_images=0, tensorboard=False)
    for bad, match in (({"kl_min": 1.5}, r"kl_min=1.5"), ({"max_nonfinite_steps": -1}, r"max_nonfinite_steps=-1")):
        with pytest.raises(ValueError, match=match):
            training.train("mnist-baseline", x, tmp_path, **kwargs, **bad)
        # Nothing recorded: the corrected value is not refused as a change.
        assert not (tmp_path / "run.json").exists()
    for bad, match in (
        ({"augmentation": ["vertical_flip"]}, r"augmentation=\['vertical_flip'\]"),
        ({"batch_size_per_replica": 0}, r"batch_size_per_replica=0"),
        ({"replicas": 7}, r"replicas=7"),
        # Accepted before (beta_1=1 wrote NaN weights from finite gradients) or refused under another
        # name (`warmup_epochs`, `peak_learning_rate`) or with a TypeError.
        ({"beta_1": 1.0}, r"`beta_1` must be a finite number in \[0, 1\).*beta_1=1.0"),
        ({"beta_2": 1.5}, r"beta_2=1.5"),
        ({"epsilon": -1e-3}, r"`epsilon` must be a finite number > 0.*epsilon=-0.001"),
        ({"kl_warmup_epochs": 2.5}, r"`kl_warmup_epochs` must be a non-negative int.*kl_warmup_epochs=2.5"),
        ({"learning_rate": -1.0}, r"`learning_rate` must be a finite number > 0.*learning_rate=-1.0"),
        ({"warmup_epochs": float("nan")}, r"`warmup_epochs` must be a finite number >= 0.*warmup_epochs=nan"),
        ({"warmup_epochs": "5"}, r"warmup_epochs='5'"),
        ({"kl_min": None}, r"`kl_min` must be a finite number in \[0, 1\].*kl_min=None"),
        ({"restart_epochs": 0}, r"`restart_epochs` must be a finite number > 0 \(or None\).*restart_epochs=0"),
        ({"global_clipnorm": "1.0"}, r"global_clipnorm='1.0'"),
    ):
        with pytest.raises(ValueError, match=match):
            training.resolve_recipe("cifar10-baseline-small", **bad)
    # NumPy numbers are numbers.
    recipe = training.resolve_recipe("mnist-baseline", learning_rate=np.float32(1e-3))
    assert training.make_schedule(recipe, 10).peak_learning_rate == pytest.approx(1e-3)


def test_mixed_float16_is_refused_for_guarded_training(tmp_path):
    # Keras' loss scaling took the non-finite steps before the guard (none
    # counted, NaN batch-norm statistics kept); on JAX the first step failed.
    x = np.zeros((16, 8, 8, 1), "float32")
    overrides = dict(TINY, dtype="mixed_float16")
    with pytest.raises(ValueError, match=r"cannot use the 'mixed_float16' policy.*'mixed_bfloat16'"):
        training.train("mnist-baseline", x, tmp_path, epochs=1, batch_size=8, config_overrides=overrides, verbose=0)
    assert not (tmp_path / "run.json").exists()


def test_a_refused_call_leaves_no_folder_and_no_lock_behind(tmp_path):
    # Before: a call refused once it held the folder left the folders it made
    # and `run.lock` in them (here: an override the entry does not have).
    x = np.zeros((16, 8, 8, 1), "float32")
    kwargs = dict(epochs=1, batch_size=8, config_overrides=dict(TINY, bogus=1), verbose=0)
    with pytest.raises(ValueError, match=r"Unknown config override\(s\) \['bogus'\]"):
        training.train("mnist-baseline", x, tmp_path / "new" / "run", **kwargs)
    assert os.listdir(tmp_path) == []
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="bogus"):
        training.train("mnist-baseline", x, tmp_path / "kept", **kwargs)
    assert sorted(os.listdir(tmp_path / "kept")) == ["notes.txt", "run.lock"]
    (tmp_path / "kept" / "notes.txt").unlink()  # the lock file is not this call's: it stays
    with pytest.raises(ValueError, match="bogus"):
        training.train("mnist-baseline", x, tmp_path / "kept", **kwargs)
    assert os.listdir(tmp_path / "kept") == ["run.lock"]


def test_final_files_older_than_the_checkpoint_are_written_again(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    x = (rng.random((16, 8, 8, 1)) > 0.5).astype("float32")
    out = tmp_path / "run"
    kwargs = dict(batch_size=8, config_overrides=TINY, verbose=0, num_images=0, tensorboard=False)
    training.train("mnist-baseline", x, out, epochs=1, **kwargs)
    one_epoch = zoo.load("mnist-baseline", weights=None, **TINY)
    one_epoch.load_weights(str(out / "model.weights.h5"))
    # More epochs, killed after the last checkpoint, before the final files.
    real_save_final = training.trainer._save_final
    monkeypatch.setattr(training.trainer, "_save_final", lambda *args, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        training.train("mnist-baseline", x, out, epochs=2, **kwargs)
    monkeypatch.setattr(training.trainer, "_save_final", real_save_final)
    model = training.train("mnist-baseline", x, out, epochs=2, **kwargs)  # the same call: nothing to train
    assert int(numpy_of(model.optimizer.iterations)) == 4
    final = zoo.load("mnist-baseline", weights=None, **TINY)
    final.load_weights(str(out / "model.weights.h5"))
    for saved, trained in zip(final.weights, model.weights):
        np.testing.assert_array_equal(numpy_of(saved), numpy_of(trained))
    assert any(not np.array_equal(numpy_of(a), numpy_of(b)) for a, b in zip(final.weights, one_epoch.weights))
    written = (out / "model.weights.h5").stat().st_mtime_ns
    training.train("mnist-baseline", x, out, epochs=2, **kwargs)  # complete and current: nothing rewritten
    assert (out / "model.weights.h5").stat().st_mtime_ns == written

    # Before: final files cut short (a damaged copy) were left as they were, and
    # the run called finished; a kill during a write left its temporary for good.
    for name in ("model.keras", "model.weights.h5"):
        with open(out / name, "r+b") as f:
            f.truncate(4000)
    stale, live = out / f".tmp-{exited_pid()}-model.keras", out / f".tmp-{os.getppid()}-model.keras"
    stale.write_bytes(b"cut"), live.write_bytes(b"being written")
    training.train("mnist-baseline", x, out, epochs=2, **kwargs)
    final.load_weights(str(out / "model.weights.h5"))
    for saved, trained in zip(final.weights, model.weights):
        np.testing.assert_array_equal(numpy_of(saved), numpy_of(trained))
    assert keras.saving.load_model(out / "model.keras").count_params() == model.count_params()
    assert not stale.exists() and live.exists()

    # Before: a run.json that was lost turned every resume check off (and the
    # feature seed fell back to the default); a damaged one failed unnamed.
    record = (out / "run.json").read_text()
    (out / "run.json").unlink()
    with pytest.raises(ValueError, match=r"holds a checkpoint but no run.json"):
        training.train("mnist-baseline", x, out, epochs=2, **kwargs)
    (out / "run.json").write_text(record[: len(record) // 2])
    with pytest.raises(ValueError, match=r"run.json is not a readable run record \(JSONDecodeError"):
        training.train("mnist-baseline", x, out, epochs=2, **kwargs)


def test_epoch_means_merge_by_steps():
    from keras_avae.training.epoch_means import _merge

    carried = {"steps": 2, "means": {"loss": 10.0, "kl": 1.0}}
    merged = _merge(carried, 1, {"loss": 4.0, "kl": 4.0, "learning_rate": 0.5}, {"loss", "kl"})
    assert merged == {"steps": 3, "means": {"loss": 8.0, "kl": 2.0}}
    # A save before any step of the resumed part keeps what was carried.
    assert _merge(carried, 0, {}, {"loss", "kl"}) == carried
    assert _merge(None, 2, {"loss": np.float32(3.0)}, {"loss"}) == {"steps": 2, "means": {"loss": 3.0}}
