"""Layouts for `keras.distribution` (model parallelism on JAX).

keras_tfm brings no distribution engine of its own: models built from its layers are handed to
the engine the backend already has.

- JAX: `keras.distribution.DataParallel`, or `keras.distribution.ModelParallel` with the
  `LayoutMap` of `get_layout_map` below (tensor parallelism, Megatron style).
- TensorFlow: `keras.distribution` is a no-op there; build and compile the model inside a
  `tf.distribute.MirroredStrategy().scope()` (or another `tf.distribute` strategy) and `fit`.
- PyTorch: `keras.distribution` is absent in the Keras release; wrap the model in
  `torch.nn.parallel.DistributedDataParallel` as in the Keras guide for torch.

docs/scaling.md shows all three.
"""

import keras

# Every keras_tfm weight is found by the stable names of the layers that own it. A prefix
# `(?:.*/)?` lets the layers sit at any depth (a block inside a model, a model inside a model);
# each pattern covers a whole path (`get_layout_map` anchors them).
_ANY_PARENT = r"(?:.*/)?"
# Attention layers: `self_attention` / `cross_attention` inside the blocks, and the default
# names of stand-alone `MultiHeadSelfAttention` / `CrossAttention` layers.
_ATTENTION = r"(?:self_attention|cross_attention(?:_\d+)?|multi_head_self_attention(?:_\d+)?)"
_FEED_FORWARD = r"feed_forward(?:_\d+)?"


def layout_rules(model_dim="model"):
    """The (regex, axes) pairs behind `get_layout_map`, in the map's order.

    Axes are per weight dimension; `None` means replicated along that dimension. Weights that
    match no pattern (biases, layer norms, anything not from keras_tfm) are replicated.
    """
    return [
        # Column parallel: (d_model, heads, head_dim) split over heads.
        (_ANY_PARENT + _ATTENTION + r"/(?:query|key|value)/kernel", (None, model_dim, None)),
        # Row parallel: (heads, head_dim, d_model) split over heads, its input axis.
        (_ANY_PARENT + _ATTENTION + r"/attention_output/kernel", (model_dim, None, None)),
        # Column parallel: (d_model, ff_dim) split over the ff units.
        (_ANY_PARENT + _FEED_FORWARD + r"/intermediate_dense/kernel", (None, model_dim)),
        # Row parallel: (ff_dim, d_model) split over the ff units, its input axis.
        (_ANY_PARENT + _FEED_FORWARD + r"/output_dense/kernel", (model_dim, None)),
        # Embeddings (vocab or max_length, d_model) split over the width: d_model divides by
        # the model axis whenever the heads do, a vocabulary often does not (JAX refuses
        # uneven shards). The tied output projection (`reverse=True`) uses the same matrix.
        (_ANY_PARENT + r"(?:token_embedding|position_embedding(?:_\d+)?)/embeddings",
         (None, model_dim)),
        # build_transformer's output projection (d_model, vocab): split over its input axis,
        # for the same reason and to match the width-split embeddings.
        (_ANY_PARENT + r"logits/kernel", (model_dim, None)),
    ]


def get_layout_map(device_mesh, model_dim="model", data_dim="batch"):
    """A `keras.distribution.LayoutMap` that shards every keras_tfm kernel over `model_dim`.

    Megatron-style tensor parallelism: the query/key/value kernels and the feed-forward input
    kernel are split over heads / ff units (column parallel), the attention output and
    feed-forward output kernels over their input axis (row parallel), so each attention or
    feed-forward sublayer needs one all-reduce. Token and position embeddings and the output
    projection (`logits`) are split over the `d_model` axis. Biases and layer norms are
    replicated. Weights are not split over `data_dim`: each data-parallel replica (a row of
    the mesh) holds one tensor-parallel copy of the model.

    `num_heads`, `ff_dim` and `d_model` must divide by the size of the `model_dim` axis (JAX
    refuses uneven shards when the model is built).

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` with axes `data_dim` and `model_dim`.
        model_dim: the mesh axis the weights are split over.
        data_dim: the mesh axis the batch is split over (pass it to `ModelParallel` as
            `batch_dim_name`).

    Returns:
        A `LayoutMap` for `keras.distribution.ModelParallel(layout_map=...,
        batch_dim_name=data_dim)`.

    Example:

    >>> mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"),
    ...                                      keras.distribution.list_devices())
    >>> layout_map = get_layout_map(mesh)
    >>> keras.distribution.set_distribution(
    ...     keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    >>> model = build_transformer(...)  # weights are created sharded
    """
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            "device_mesh must be a keras.distribution.DeviceMesh. "
            f"Received: device_mesh={device_mesh!r}")
    names = tuple(device_mesh.axis_names)
    for arg, value in (("model_dim", model_dim), ("data_dim", data_dim)):
        if value not in names:
            raise ValueError(
                f"{arg}={value!r} is not an axis of the device mesh (axis names {names}).")
    if model_dim == data_dim:
        raise ValueError(f"model_dim and data_dim must differ; both are {model_dim!r}.")
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in layout_rules(model_dim):
        # Anchored: Keras >= 3.14 matches keys with re.fullmatch, older releases with re.search.
        layout_map["^" + pattern + "$"] = axes
    return layout_map


def num_replicas():
    """How many data-parallel replicas the current distribution splits each batch into.

    JAX: the size of the batch axis of the `keras.distribution` in effect (`DataParallel`:
    every device; `ModelParallel`: the mesh's `batch_dim_name` axis). TensorFlow: the
    `num_replicas_in_sync` of the `tf.distribute` strategy in scope. 1 when none is set (and
    under torch, where DistributedDataParallel gives each process its own batches).
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.distribute.get_strategy().num_replicas_in_sync
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    return mesh.shape[list(mesh.axis_names).index(distribution.batch_dim_name)]


def check_batch_size(batch_size, num_samples=None, replicas=None):
    """Raise a clear `ValueError` unless every batch of `fit` splits evenly across replicas.

    Neither engine pads a batch that does not divide: JAX stops with an `IndivisibleError`
    and `tf.distribute` with an `InvalidArgumentError` from deep inside the step, and only
    when that batch comes, which for the last partial batch is after a whole epoch of
    training. Call this before `fit` / `evaluate` / `predict` with the number of samples you
    pass; it checks the full batches and the last partial one.

    Args:
        batch_size: the global batch size given to `fit`.
        num_samples: the number of samples given to `fit` (optional).
        replicas: the number of data-parallel replicas; defaults to `num_replicas()`.

    Returns:
        The number of replicas (so that `batch_size // replicas` is each one's share).
    """
    replicas = num_replicas() if replicas is None else int(replicas)
    if batch_size % replicas:
        raise ValueError(
            f"batch_size={batch_size} does not split across {replicas} data-parallel "
            f"replicas; use a multiple of {replicas}.")
    last = num_samples % batch_size if num_samples is not None else 0
    if last % replicas:
        raise ValueError(
            f"{num_samples} samples in batches of {batch_size} leave a last batch of {last}, "
            f"which does not split across {replicas} data-parallel replicas; drop "
            f"{last % replicas} sample(s) (pass the first {num_samples - last % replicas}), "
            f"add {replicas - last % replicas}, or use a tf.data pipeline with "
            "drop_remainder=True.")
    return replicas
