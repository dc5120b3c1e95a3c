"""Saving and loading `.keras` files: atomic saves, clear errors, training resumed across backends.

`save_model` writes to a temporary name and renames, so an interrupted save never replaces a good
file with a broken one. `load_model` says what is wrong with a file that is not a `.keras` archive
or names keras_tfm layers this version does not know, rebuilds a torch-saved optimizer natively,
and re-resolves `jit_compile="auto"` for the loading backend.
"""

import inspect
import json
import os
import tempfile
import zipfile

import keras

_PACKAGE = "keras_tfm"


def _optimizer_classes():
    """Every public Keras optimizer class, as the current backend implements it."""
    return {
        name: obj for name, obj in vars(keras.optimizers).items()
        if inspect.isclass(obj) and issubclass(obj, keras.optimizers.Optimizer)
    }


def save_model(model, filepath, overwrite=True, **kwargs):
    """`model.save(filepath)`, atomically: a temporary file in the same folder, then a rename.

    A save that fails or is killed half-way leaves `filepath` as it was (a killed one may leave
    its temporary `.<name>.*.tmp.keras` file behind).

    Args:
        model: the `keras.Model`.
        filepath: the target path, ending in `.keras`.
        overwrite: whether an existing file may be replaced.
        **kwargs: passed to `model.save`.

    Raises:
        ValueError: when `filepath` does not end in `.keras`.
        FileExistsError: when the file exists and `overwrite=False`.

    Example:

    >>> keras_tfm.saving.save_model(model, "model.keras")  # doctest: +SKIP
    """
    path = os.fspath(filepath)
    if not path.endswith(".keras"):
        raise ValueError(f"`filepath` must end in .keras; received {path!r}.")
    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"{path} exists and overwrite=False.")
    directory, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp.keras", dir=directory)
    os.close(handle)
    try:
        model.save(temporary, overwrite=True, **kwargs)
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _registered_names(config):
    """Every `registered_name` of a keras_tfm object in a serialized config."""
    if isinstance(config, dict):
        name = config.get("registered_name")
        if isinstance(name, str) and name.startswith(_PACKAGE + ">"):
            yield name
        for value in config.values():
            yield from _registered_names(value)
    elif isinstance(config, list):
        for value in config:
            yield from _registered_names(value)


def check_archive(filepath):
    """Raise a ValueError when an existing file is not a `.keras` archive keras_tfm can read.

    Checks that the file is a zip archive holding `config.json` and that every keras_tfm class
    it names is registered in this version of keras_tfm. A path that does not exist, a folder,
    or another format Keras reads (`.h5`) is left to Keras.
    """
    path = os.fspath(filepath)
    if not os.path.isfile(path) or path.endswith((".h5", ".hdf5")):
        return
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path} exists but is not a .keras archive (a zip file holding config.json and the "
            f"weights); its first bytes are {_head(path)!r}. It may be a save that was cut "
            "short, or a file of another format renamed; save with keras_tfm.saving.save_model "
            "(atomic) or model.save('name.keras')."
        )
    with zipfile.ZipFile(path) as archive:
        if "config.json" not in archive.namelist():
            raise ValueError(f"{path} is a zip archive but not a .keras file: it holds no "
                             f"config.json (it holds {archive.namelist()[:5]}).")
        config = json.loads(archive.read("config.json"))
        metadata = {}
        if "metadata.json" in archive.namelist():
            metadata = json.loads(archive.read("metadata.json"))
    from keras_tfm import __version__

    unknown = sorted({name for name in _registered_names(config)
                      if keras.saving.get_registered_object(name) is None})
    if unknown:
        raise ValueError(
            f"{path} uses keras_tfm classes that keras_tfm {__version__} does not know: "
            f"{unknown}. The file was probably written by a newer keras_tfm (saved with Keras "
            f"{metadata.get('keras_version', '?')}); upgrade keras_tfm to load it."
        )


def _head(path):
    with open(path, "rb") as file:
        return file.read(16)


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True, jit_compile="auto"):
    """`keras.models.load_model` with clear errors, that resumes training under any backend.

    * A file that exists but is not a `.keras` archive, or that names keras_tfm layers this
      version does not know (a newer keras_tfm), is a ValueError saying so.
    * Keras records the optimizer of a model compiled under PyTorch by its torch-only class;
      every Keras optimizer name is mapped to the current backend's own class, so the optimizer
      is rebuilt natively and its saved state (iteration count, moments, schedule) restored.
    * A file stores the `jit_compile` that "auto" resolved to where it was saved (False under
      torch, or TensorFlow on a CPU), indistinguishable from a value the user chose; by default
      it is re-resolved here, so the model trains at this backend's compiled speed.

    Args:
        filepath: path of the `.keras` file.
        custom_objects: more custom objects; they take precedence over the optimizer mapping.
        compile: whether to restore the compiled state (optimizer, loss, metrics).
        safe_mode: as in `keras.models.load_model`.
        jit_compile: `"auto"` (what `compile()` would pick on this backend), True or False to
            set it, or None to keep the file's value.

    Returns:
        The loaded `keras.Model`.

    Raises:
        ValueError: for a file that is not a `.keras` archive or uses unknown keras_tfm layers.

    Example:

    >>> model = keras_tfm.saving.load_model("model.keras")  # doctest: +SKIP
    """
    check_archive(filepath)
    objects = _optimizer_classes() | dict(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects, compile=compile,
                                    safe_mode=safe_mode)
    if compile and jit_compile is not None and getattr(model, "compiled", False):
        _set_jit_compile(model, jit_compile)
    return model


def _set_jit_compile(model, jit_compile):
    if jit_compile == "auto":
        # What `compile(jit_compile="auto")` resolves to here; Keras keeps the rule private.
        jit_compile = False if model.run_eagerly else model._resolve_auto_jit_compile()
    model.jit_compile = bool(jit_compile)
    model.train_function = model.test_function = model.predict_function = None
    compile_config = getattr(model, "_compile_config", None)
    if compile_config is not None and "jit_compile" in getattr(compile_config, "config", {}):
        compile_config.config["jit_compile"] = model.jit_compile
