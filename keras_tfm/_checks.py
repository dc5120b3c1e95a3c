"""Validation of hyper-parameters and input shapes, and other small helpers shared by every layer."""

import keras
import numpy as np
from keras import ops

from keras_tfm._layer_calls import call_layer


def clone_initializer(initializer):
    """A fresh copy of a Keras initializer: a shared seeded instance would give every sublayer
    (query, key, value, ...) the same values."""
    initializer = keras.initializers.get(initializer)
    return initializer.__class__.from_config(initializer.get_config())


def check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer; received {name}={value!r}.")
    return value


def check_dropout(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a float in [0, 1); received {name}={value!r}.")
    return float(value)


def check_rank(layer, name, shape, rank):
    """Raise a ValueError naming the layer and argument when `shape` is not of rank `rank`."""
    if shape is None or len(shape) != rank:
        raise ValueError(
            f"{layer.name}: `{name}` must have rank {rank} (batch, length, features); received "
            f"shape {None if shape is None else tuple(shape)}."
        )


def check_same_batch(layer, first_name, first_shape, second_name, second_shape):
    a, b = first_shape[0], second_shape[0]
    if a is not None and b is not None and a != b:
        raise ValueError(
            f"{layer.name}: `{first_name}` and `{second_name}` must have the same batch size; "
            f"received {tuple(first_shape)} and {tuple(second_shape)}."
        )


def check_key_value_heads(num_heads, num_key_value_heads):
    """`num_key_value_heads` of grouped-query attention: None or a positive divisor of
    `num_heads`."""
    if num_key_value_heads is None:
        return None
    check_positive_int("num_key_value_heads", num_key_value_heads)
    if num_heads % num_key_value_heads:
        raise ValueError(
            "`num_key_value_heads` must divide `num_heads` (each key/value head serves a group "
            f"of query heads); received num_heads={num_heads}, "
            f"num_key_value_heads={num_key_value_heads}."
        )
    return num_key_value_heads


def check_token_ids(token_ids, vocab_size, name="token_ids"):
    """Check token ids in NumPy before anything runs; return them as an int32 array.

    Ids must be integers (an integer array, or whole numbers in a float array) of rank 2
    `(batch, length)`, each in `[0, vocab_size)`. Inside a traced graph ids cannot be checked
    like this: there `TokenAndPositionEmbedding` and the masked loss turn a bad id into NaN.

    Args:
        token_ids: array-like or backend tensor (any device) of shape `(batch, length)`.
        vocab_size: the vocabulary size.
        name: the argument's name, used in the error message.

    Returns:
        The ids as an int32 NumPy array.

    Raises:
        ValueError: naming the first bad value, its (row, column) and the vocabulary size.

    Example:

    >>> check_token_ids([[5, 7, 0]], vocab_size=8)
    array([[5, 7, 0]], dtype=int32)
    """
    if ops.is_tensor(token_ids):  # (np.asarray fails on CUDA torch tensors)
        token_ids = ops.convert_to_numpy(token_ids)
    try:
        ids = np.asarray(token_ids)
    except ValueError as error:  # ragged Python lists
        raise ValueError(f"`{name}` must be a rectangular (batch, length) array of token ids; "
                         f"rows of different lengths could not be stacked ({error}).") from None
    if ids.ndim != 2:
        raise ValueError(f"`{name}` must be token ids of rank 2, shape (batch, length); "
                         f"received shape {ids.shape}.")
    if ids.dtype == bool or not (np.issubdtype(ids.dtype, np.integer)
                                 or np.issubdtype(ids.dtype, np.floating)):
        raise ValueError(f"`{name}` must hold integer token ids; received dtype {ids.dtype}.")
    if np.issubdtype(ids.dtype, np.floating):
        bad = ~np.isfinite(ids) | (ids != np.round(ids))
        if bad.any():
            row, col = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"`{name}` must hold integer token ids; received {ids[row, col]!r} "
                             f"at (row, column) ({row}, {col}).")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"`{name}` has token id {ids[row, col].item()!r} at (row, column) ({row}, {col}), "
            f"outside the vocabulary [0, {vocab_size}) (vocab_size={vocab_size}); "
            f"{int(bad.sum())} id(s) in all are out of range.")
    return ids.astype("int32")


def in_vocabulary(token_ids, vocab_size):
    """bool tensor: True where an (int) id lies in `[0, vocab_size)`; keras.ops, traceable."""
    return ops.logical_and(ops.greater_equal(token_ids, 0), ops.less(token_ids, vocab_size))


def embed_or_nan(embedding, token_ids, vocab_size):
    """`embedding(token_ids)`, with NaN vectors for ids outside `[0, vocab_size)`.

    Backends disagree on an out-of-range lookup (JAX gives NaN, TensorFlow raises on a CPU and
    gives zeros on a GPU, torch raises an IndexError); NaN on every backend makes a bad id in a
    traced `fit` visible as a NaN loss instead of a finite one.
    """
    ids = ops.cast(token_ids, "int32")
    valid = in_vocabulary(ids, vocab_size)
    vectors = call_layer(embedding, ops.where(valid, ids, 0))
    # + 0 or NaN per token: one broadcast add, which the backward pass goes straight through.
    return vectors + ops.cast(ops.where(valid, 0.0, float("nan")), vectors.dtype)[..., None]


def check_token_id(name, value, vocab_size):
    """`value` as an int when it is a token id in `[0, vocab_size)`; else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
            0 <= value < vocab_size):
        raise ValueError(f"`{name}` must be a token id in [0, {vocab_size}); received "
                         f"{name}={value!r}.")
    return int(value)


def check_special_ids(vocab_size, pad_id, start_id=None, end_id=None):
    """The rules of a model's special ids: token ids of the vocabulary (any may be None: a
    language model of packed text has no padding id), and an end id that is not the padding id
    (padding is never generated)."""
    if pad_id is not None:
        check_token_id("pad_id", pad_id, vocab_size)
    for name, value in (("start_id", start_id), ("end_id", end_id)):
        if value is not None:
            check_token_id(name, value, vocab_size)
    if end_id is not None and pad_id is not None and end_id == pad_id:
        raise ValueError(f"`end_id` must not be the padding id {pad_id} (padding is never "
                         f"generated); received end_id={end_id!r} and pad_id={pad_id!r}. Pass "
                         "end_id=None to decode "
                         "exactly max_length tokens.")


def model_dtype_policy(dtype):
    """The dtype policy a functional model gives its layers and records in its config: `dtype`,
    or the global policy (`keras.config.dtype_policy()`) when it is None."""
    return keras.config.dtype_policy() if dtype is None else keras.dtype_policies.get(dtype)


def with_quantized_dtypes(layer, config):
    """`config` whose `dtype` also records the policies of the layer's quantized sublayers.

    `model.quantize(...)` quantizes the Dense, EinsumDense and embedding layers inside a
    keras_tfm layer, but the layer's config only carries its own policy: reloaded, it would
    rebuild float sublayers. A `DTypePolicyMap` keyed by sublayer path (what keras_hub's
    backbones save) makes them rebuild quantized.
    """
    own = config.get("dtype")  # the policy the layer or model was built with
    policy = layer.dtype_policy if own is None else keras.dtype_policies.get(own)
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return config
    quantized = {sub.path: sub.dtype_policy for sub in layer._flatten_layers(include_self=False)
                 if sub.path and sub.quantization_mode is not None}
    if quantized:
        policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=policy,
                                                         policy_map=quantized)
        config["dtype"] = keras.dtype_policies.serialize(policy_map)
    return config


# --- the arguments of generation ------------------------------------------------------------


def resolve_special_ids(model, vocab, start_id, end_id, pad_id, needs_start=True):
    """The start, end and padding ids of one `generate` call: explicit arguments win; "auto"
    takes the model's own (`model.special_ids`; padding defaults to 0). A language model
    (`needs_start=False`) continues its prompts and takes no start id."""
    own = getattr(model, "special_ids", {})
    if pad_id == "auto":
        pad_id = own.get("pad_id", 0)
    asked = (("start_id", start_id, "start_id=..."),) if needs_start else ()
    for name, value, hint in asked + (("end_id", end_id, "end_id=..., or end_id=None to "
                                                         "decode max_length tokens"),):
        if value == "auto" and name not in own:
            raise ValueError(f"`{name}` was not given and model {model.name!r} has no {name} of "
                             f"its own (model.special_ids={own}); pass {hint}.")
    if not needs_start:
        if start_id not in ("auto", None):
            raise ValueError(f"A language model continues its prompts and takes no `start_id` "
                             f"(put a start token in the prompts); received start_id={start_id!r}.")
        start_id = own.get("start_id", pad_id)  # unused; checked as a valid id below
    start_id = own["start_id"] if start_id == "auto" else start_id
    end_id = own["end_id"] if end_id == "auto" else end_id
    check_special_ids(vocab, pad_id, start_id, end_id)
    if needs_start and start_id == pad_id and own.get("start_id") != pad_id:
        raise ValueError(f"`start_id` must not be the padding id {pad_id}, which model "
                         f"{model.name!r} masks; received start_id={start_id!r}. (A model built "
                         "with start_id == pad_id, as from_marian does, attends to it.)")
    return (None if start_id is None else int(start_id), None if end_id is None else int(end_id),
            None if pad_id is None else int(pad_id))


def check_sources(source_tokens, vocab, pad_id):
    """The sources as int32 `(B, S)`, checked: Python lists of different lengths are
    right-padded with `pad_id`; ids must lie in the source vocabulary; a source with padding
    before a real token (left padding) is refused."""
    if isinstance(source_tokens, (list, tuple)) and all(
            isinstance(row, (list, tuple, np.ndarray)) for row in source_tokens):
        rows = [np.asarray(row).reshape(-1) for row in source_tokens]
        width = max((len(row) for row in rows), default=0)
        if any(len(row) != width for row in rows):
            source_tokens = np.full((len(rows), width), pad_id, np.result_type(*rows))
            for i, row in enumerate(rows):
                source_tokens[i, :len(row)] = row
    source_tokens = check_token_ids(source_tokens, vocab, name="source_tokens")
    if source_tokens.shape[0] == 0:
        raise ValueError("`source_tokens` must hold at least one source; received shape "
                         f"{source_tokens.shape}.")
    is_pad = source_tokens == pad_id
    padding_first = is_pad[:, :-1] & ~is_pad[:, 1:]
    if padding_first.any():
        row = int(np.flatnonzero(padding_first.any(axis=1))[0])
        raise ValueError(
            f"`source_tokens` row {row} has padding (id {pad_id}) before a real token: "
            f"{source_tokens[row].tolist()}. keras_tfm sources are right-padded (the padding at "
            "the end); with keras.utils.pad_sequences pass padding='post'.")
    return source_tokens


def check_real_tokens(lengths, what, pad_id):
    """Raise a ValueError naming the first row with no real token (`lengths`: real tokens a
    row; `what`: "source" or "prompt")."""
    if (lengths == 0).any():
        raise ValueError(f"Every {what} needs at least one real token; {what} "
                         f"{int(np.flatnonzero(lengths == 0)[0])} is only padding (id {pad_id}).")


def unpadded_prompts(prompts, vocab, fill):
    """Prompts of a model without padding as int32 `(B, P)` (shorter rows filled with `fill`,
    which the search never attends to) and their lengths `(B,)`: rows of a list keep their own
    lengths, every row of an array is all tokens."""
    if isinstance(prompts, (list, tuple)) and all(
            isinstance(row, (list, tuple, np.ndarray)) for row in prompts):
        rows = [np.asarray(row).reshape(-1) for row in prompts]
    else:
        rows = list(np.asarray(prompts).reshape(-1, np.shape(prompts)[-1]))
    lengths = np.array([len(row) for row in rows], "int32")
    array = np.full((len(rows), max(lengths, default=0)), fill, "int64")
    for i, row in enumerate(rows):
        array[i, :len(row)] = row
    return check_token_ids(array, vocab, name="prompts"), lengths


def check_lengths(max_length, batch_size):
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"`max_length` must be a positive integer; received {max_length!r}.")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size < 1):
        raise ValueError(f"`batch_size` must be a positive integer or None; received "
                         f"{batch_size!r}.")


def check_search_options(method, beam_size, length_penalty, temperature, top_k, top_p):
    """Raise a ValueError naming a bad `generate` search option."""
    if method not in ("greedy", "beam", "sample"):
        raise ValueError(f'`method` must be "greedy", "beam" or "sample"; received {method!r}.')
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature > 0):
        raise ValueError(f"`temperature` must be > 0; received temperature={temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"`top_k` must be a positive integer or None; received top_k={top_k!r}.")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"`top_p` must be in (0, 1]; received top_p={top_p!r}.")
    if not length_penalty >= 0:
        raise ValueError(f"`length_penalty` must be >= 0; received {length_penalty!r}.")
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"`beam_size` must be a positive integer; received {beam_size!r}.")
