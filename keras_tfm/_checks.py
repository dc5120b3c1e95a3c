"""Validation of hyper-parameters and input shapes, and other small helpers shared by every layer."""

import keras


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
