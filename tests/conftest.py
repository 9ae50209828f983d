import os
import shutil
import tempfile

# One persistent JAX compilation cache for the whole test session, shared
# with the pytest-xdist workers (they inherit the environment) and the
# subprocesses tests start (examples, training helpers): eager JAX compiles
# every new primitive shape, and building a zoo model meets hundreds; with
# the cache a second process builds it in 7 s instead of 30 s (measured,
# 2-layer omniglot-attentive). Set before JAX is imported, as JAX reads these
# at import; a cache the user configured is left alone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jax_cache = tempfile.mkdtemp(prefix="keras-avae-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # No size limit: with one, JAX locks the cache and, at every write,
    # reads the size and access time of every entry (the JAX suite took
    # 39.6 min on 2 processes with a limit). An entry read while another process
    # writes it fails to decompress, and JAX warns and compiles instead.
else:
    _jax_cache = None

# XLA:CPU's LLVM at its lowest optimisation level (XLA's default is 3): the
# tests' XLA programs are small and mostly run once, so compiling them is
# most of their time. Measured idle on 2 cores: a threefry draw for one new
# weight shape (every initialiser on JAX) compiles in 0.16 s instead of
# 0.62 s, the JAX suite runs in 21.5 min instead of 31.8 (same tests pass),
# TensorFlow's `jit_compile=True` test in 50 s instead of 70. Convolutions
# and matmuls are library calls at any level. Subprocesses inherit it; a
# level the user set is kept.
#
# XLA:CPU's older elemental emitters for fusions, not the MLIR fusion
# emitters: each of the hundreds of small programs eager JAX compiles takes
# about a third less time to compile (25 instead of 37 ms per program in a
# loop of 160 small ones; three JAX model tests in 48 s instead of 78 s).
# TensorFlow's XLA accepts the flag. The user's setting is kept here too.
_xla_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in _xla_flags:
        _xla_flags = f"{_xla_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _xla_flags

# One compute thread per PyTorch process (OpenMP). `-n 2` runs two test
# processes on the CI machine's 2 cores, and many tests start more, so
# PyTorch's default of one OpenMP thread per core oversubscribes the cores,
# and its idle threads spin-wait for work, taking the cores from the
# processes doing the work. Measured on 2 cores: the PyTorch suite ran in
# 211 s instead of 441 (same tests pass). Subprocesses inherit it; a setting
# the user made is kept. TensorFlow keeps its own thread counts (one per
# core): one thread in every TensorFlow process gained nothing (full runs of
# its suite on one day: 26:00 with one thread, 26:18 with its own counts) and
# changes the Gumbel cards' figures (another order of the convolution sums
# flips some hard one-hot samples).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import keras  # noqa: E402
import pytest  # noqa: E402

# No Grappler graph optimisation for the traced functions of this process
# (the processes tests start keep it, as users have it): the tests' graphs
# run a few times each, so optimising them costs more than it saves. Measured
# idle on 2 cores: the first `fit` of the tests' 3-layer model took 20 s
# instead of 27 s (mean of 3).
if keras.backend.backend() == "tensorflow":
    import tensorflow as tf  # noqa: E402

    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"


# Tests that share a module- or class-scoped fixture, sent to one pytest-xdist
# worker as one unit so the fixture is built once, not once per worker (the
# report's fixture: about 50 s on JAX). xdist's own `xdist_group` marks do
# nothing under pytest 9 (xdist 3.8 renames `item._nodeid`, which pytest 9
# no longer reads), so the scheduler groups them. A fixture missing from the
# list costs time only: it is built on each worker that runs its tests.
SHARED_FIXTURE_SCOPES = (
    "tests/test_report.py",
    "tests/test_evaluation.py",
    "tests/models/test_hierarchical_vae.py::TestInferenceInputs",
    "tests/models/test_discrete_vae.py::TestInferenceInputs",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's `load` distribution, test by test, except `SHARED_FIXTURE_SCOPES`."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return next((scope for scope in SHARED_FIXTURE_SCOPES if nodeid.startswith(scope + "::")), nodeid)

    return SharedFixtureScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    if _jax_cache is not None:
        shutil.rmtree(_jax_cache, ignore_errors=True)


def _reset_keras_state():
    keras.config.set_dtype_policy("float32")
    # No forced gc.collect(): it walks every live object, and the backends'
    # caches grow test by test (0.2 s after the imports, 0.5-3 s later on,
    # about 500 s of the JAX suite's 2,500 test seconds). Python's own
    # collector still runs.
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts with float32, fresh names and the same global seed.

    Initialisers without their own seed draw from the global generator;
    seeding it makes every test's numbers repeatable run to run.
    """
    _reset_keras_state()
    yield
    keras.config.set_dtype_policy("float32")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Class- and module-scoped fixtures of the tests start from the same fresh state too.

    pytest sets them up before a test's function-scoped fixtures, so without
    this their weights came from whatever the worker ran before: another
    model in each CI run, and a statistical check on them failed in one run.
    """
    if fixturedef.scope in ("class", "module") and fixturedef.baseid.startswith("tests"):
        _reset_keras_state()
    return (yield)
