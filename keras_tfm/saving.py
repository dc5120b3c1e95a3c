"""Loading `.keras` files across backends, training state included."""

import inspect

import keras


def _optimizer_classes():
    """Every public Keras optimizer class, as the current backend implements it."""
    return {
        name: obj for name, obj in vars(keras.optimizers).items()
        if inspect.isclass(obj) and issubclass(obj, keras.optimizers.Optimizer)
    }


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True):
    """`keras.models.load_model` that resumes training of a file saved under another backend.

    Keras records the optimizer of a model compiled under PyTorch by its torch-only class
    (`keras.src.backend.torch.optimizers.torch_adam.Adam`, ...). Such a file loads under JAX or
    TensorFlow, but `fit` then fails inside the torch optimizer. This function maps every Keras
    optimizer name to the current backend's own class, so the optimizer is rebuilt natively
    and its saved state (iteration count, moments, learning-rate schedule) is restored: training
    continues where it stopped. Everything else is `keras.models.load_model` (no
    `custom_objects` needed for keras_tfm layers; `safe_mode` stays on).

    Args:
        filepath: path of the `.keras` file.
        custom_objects: more custom objects; they take precedence over the optimizer mapping.
        compile: whether to restore the compiled state (optimizer, loss, metrics).
        safe_mode: as in `keras.models.load_model`.

    Returns:
        The loaded `keras.Model`.
    """
    objects = _optimizer_classes() | dict(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects, compile=compile,
                                   safe_mode=safe_mode)
