import keras
import pytest


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts with float32, fresh names and the same global seed.

    Initialisers without their own seed draw from the global generator;
    seeding it makes every test's numbers repeatable run to run.
    """
    keras.config.set_dtype_policy("float32")
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")
