"""Shared test set-up. The backend is fixed by KERAS_BACKEND before keras is imported;
the README's test command runs this suite once per backend, each in its own process."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {BACKEND}"


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from float32, a known seed and a clean Keras session."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
