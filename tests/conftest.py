"""Shared test set-up. The backend is fixed by KERAS_BACKEND before keras is imported;
the README's test command runs this suite once per backend, each in its own process."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()

if BACKEND == "jax":
    import jax

    # The oracles compare float32 to float32 (NumPy, torch.nn). On NVIDIA GPUs JAX's default
    # matmul precision rounds float32 inputs to TF32 (~1e-3 relative: seen on an H200, where the
    # attention checks failed by 7e-4 and passed with this); on CPUs it changes nothing.
    jax.config.update("jax_default_matmul_precision", "highest")


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
