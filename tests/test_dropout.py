"""keras_tfm.Dropout: cheaper random bits (Threefry under JAX, four elements per 64-bit draw
under torch and TensorFlow on the CPU), the same statistics as inverted dropout."""

import math

import keras
import numpy as np
import pytest

from helpers import BACKEND, to_np
from keras_tfm.dropout import Dropout, _split_draws_suit, effective_rate, threefry2x32

ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
SPLIT = BACKEND in ("torch", "tensorflow")  # four 16-bit fields per 64-bit draw (on the CPU)
# Under TensorFlow with a GPU or TPU present the layer takes Keras's dropout instead; the
# tests that pin the split draws' rate and bits are for the CPU machines that run the suite.
# (TensorFlow's rule is per process, so it needs no tensor; its other side is tested below.)
cpu_draws = pytest.mark.skipif(BACKEND == "tensorflow" and not _split_draws_suit(None),
                               reason="TensorFlow sees an accelerator: Keras's dropout")


@pytest.fixture(autouse=True)
def _torch_tensors_on_cpu():
    """Under torch the split draws are the CPU path (CUDA tensors take Keras's dropout,
    `test_torch_takes_keras_dropout_off_cpu_and_under_compile`): on a GPU machine these tests
    still check them, on CPU tensors."""
    if BACKEND != "torch":
        yield
        return
    with keras.device("cpu"):
        yield


def np_threefry2x32(key, x0, x1):
    """Threefry-2x32, 20 rounds, in NumPy uint32 (the Random123 reference algorithm)."""
    with np.errstate(over="ignore"):
        k = [np.uint32(key[0]), np.uint32(key[1])]
        k.append(k[0] ^ k[1] ^ np.uint32(0x1BD11BDA))
        x0, x1 = x0.astype(np.uint32) + k[0], x1.astype(np.uint32) + k[1]
        for i in range(5):
            for r in ROTATIONS[i % 2]:
                x0 = x0 + x1
                x1 = ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))) ^ x0
            x0 = x0 + k[(i + 1) % 3]
            x1 = x1 + k[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def test_effective_rate_per_backend():
    # Threefry words (JAX): 32 bits; one 64-bit integer per four elements (torch, TensorFlow):
    # 16 bits each.
    assert effective_rate(0.1, "jax") == math.ceil(0.1 * 2**32) / 2**32
    assert effective_rate(0.1, "torch") == effective_rate(0.1, "tensorflow") == 6554 / 2**16
    assert effective_rate(0.5, "torch") == effective_rate(0.5, "tensorflow") == 0.5
    assert effective_rate(0.0) == 0.0


KNOWN_ANSWERS = [  # Random123's known-answer tests for threefry2x32_20: key, counter, output
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.skipif(BACKEND == "torch", reason="torch has no uint32 addition; keras_tfm.Dropout "
                    "uses Threefry under JAX only (and it runs under TensorFlow: tested there)")
def test_threefry_known_answers():
    u32 = lambda v: keras.ops.convert_to_tensor(np.asarray(v, "uint32"))
    for key, counter, expected in KNOWN_ANSWERS:
        out = threefry2x32(u32(key[0]), u32(key[1]), u32([counter[0]]), u32([counter[1]]))
        assert tuple(int(to_np(o)[0]) for o in out) == expected
        reference = np_threefry2x32(key, np.array([counter[0]]), np.array([counter[1]]))
        assert tuple(int(r[0]) for r in reference) == expected


@cpu_draws
def test_mask_is_the_documented_function_of_the_seed():
    """The layer's mask, recomputed in NumPy from the same seed: under JAX, word `e mod 2` of
    Threefry(key, (0, e // 2)) for flat index e with the seed generator's key; under torch and
    TensorFlow, 16-bit field e of the 64-bit integers Keras draws for that seed (a size that
    is not a multiple of four: the last integer's last fields go unused; ~1M elements, so that
    every 16-bit value, the threshold's neighbours included, comes up ~16 times)."""
    rate, shape = 0.3, (63, 127, 131)
    y = to_np(Dropout(rate, seed=7)(np.ones(shape, "float32"), training=True))
    p = effective_rate(rate)
    if BACKEND == "jax":
        key = to_np(keras.random.SeedGenerator(7).next())  # the key of the layer's first call
        index = np.arange(math.prod(shape), dtype=np.uint32)
        high, low = np_threefry2x32(key, np.zeros_like(index // 2), index // 2)
        bits = np.where(index % 2 == 0, high, low).reshape(shape)
        keep = bits >= np.uint32(p * 2**32)
    else:
        size = math.prod(shape)
        words = to_np(keras.random.randint((-(-size // 4), 1), -(2**63), 2**63 - 1,
                                           dtype="int64", seed=keras.random.SeedGenerator(7)))
        assert size % 4 and words.dtype == np.int64
        fields = words.view(np.int16).ravel()[:size].reshape(shape)  # [-2**15, 2**15)
        threshold = p * 2**16 - 2**15  # the lowest p * 2**16 values drop
        keep = fields >= threshold
        # An off-by-one threshold would show: both neighbours of the boundary occur.
        assert (fields == threshold).any() and (fields == threshold - 1).any()
    np.testing.assert_array_equal(y != 0, keep)
    np.testing.assert_allclose(y[keep], 1 / (1 - p), rtol=1e-6)


@cpu_draws
@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_drop_probability_scale_and_independence(rate):
    layer = Dropout(rate, seed=3)
    x = np.ones((64, 128, 256), "float32")  # 2M elements
    y = to_np(layer(x, training=True))
    dropped = y == 0
    p = effective_rate(rate)
    sigma = np.sqrt(p * (1 - p) / dropped.size)
    assert abs(dropped.mean() - p) < 5 * sigma
    # All numbers taken from one draw drop at that rate, and independently of each other:
    # elements 2j and 2j + 1 under JAX (the two words of one Threefry counter), 4j to 4j + 3
    # under torch and TensorFlow (the four 16-bit fields of one 64-bit integer).
    group = 4 if SPLIT else 2
    fields = [dropped[..., i::group] for i in range(group)]
    for i, first in enumerate(fields):
        assert abs(first.mean() - p) < 5 * sigma * np.sqrt(group)
        for second in fields[i + 1:]:
            both = (first & second).mean()
            assert abs(both - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / first.size)
    # Kept elements are scaled so that the expectation is unchanged.
    np.testing.assert_allclose(y[~dropped], 1 / (1 - p), rtol=1e-6)
    assert abs(y.mean() - 1.0) < 5 * sigma / (1 - p)
    # Nor are elements of different draws, nor the same element along other axes.
    np.testing.assert_allclose(
        (dropped[..., group - 1:-1:group] & dropped[..., group::group]).mean(), p * p,
        atol=5 * sigma * np.sqrt(group))
    np.testing.assert_allclose((dropped[:, :-1] & dropped[:, 1:]).mean(), p * p,
                               atol=5 * sigma)


def test_new_mask_per_call_identity_without_training_and_config():
    layer = Dropout(0.2, seed=1)
    x = np.ones((4, 8, 16), "float32")
    a, b = to_np(layer(x, training=True)), to_np(layer(x, training=True))
    assert not np.array_equal(a == 0, b == 0)
    np.testing.assert_array_equal(to_np(layer(x, training=False)), x)
    np.testing.assert_array_equal(to_np(Dropout(0.0)(x, training=True)), x)
    clone = Dropout.from_config(layer.get_config())
    assert (clone.rate, clone.seed) == (0.2, 1)
    with pytest.raises(ValueError, match="rate"):
        Dropout(1.0)


@cpu_draws
def test_odd_sizes():
    # 65 * 63 * 33 elements: odd, so not a multiple of four (torch's and TensorFlow's draws)
    # nor of two (JAX's). The scale is that of our own draws' rate (Keras's dropout would be
    # 7e-6 off under torch and TensorFlow).
    x = np.ones((65, 63, 33), "float32")
    y = to_np(Dropout(0.1, seed=2)(x, training=True))
    p = effective_rate(0.1)
    assert abs((y == 0).mean() - p) < 0.005
    np.testing.assert_allclose(y[y != 0], 1 / (1 - p), rtol=1e-6)


@cpu_draws
def test_gradient_is_the_mask_times_the_scale():
    layer = Dropout(0.3, seed=5)
    x = keras.ops.convert_to_tensor(np.random.default_rng(0).random((8, 16, 32), "float32"))
    if BACKEND == "jax":
        import jax

        state = [v.value for v in layer.non_trainable_variables]  # the seed generator's
        grad = jax.grad(lambda v: keras.ops.sum(
            layer.stateless_call([], state, v, training=True)[0]))(x)
        y = layer.stateless_call([], state, x, training=True)[0]
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            total = keras.ops.sum(y)
        grad = tape.gradient(total, x)
    else:
        x.requires_grad_(True)
        y = layer(x, training=True)
        keras.ops.sum(y).backward()
        grad = x.grad
    y, grad = to_np(y), to_np(grad)
    p = effective_rate(0.3)
    np.testing.assert_allclose(grad, np.where(y != 0, 1 / (1 - p), 0.0), rtol=1e-6)


@cpu_draws
@pytest.mark.parametrize("floatx", ["float16", "bfloat16"])
def test_random_bits_do_not_depend_on_floatx(floatx):
    keras.config.set_floatx(floatx)
    try:
        x = np.ones((64, 64, 256), floatx if floatx == "float16" else "float32")
        y = to_np(Dropout(0.1, seed=4)(keras.ops.cast(x, floatx), training=True))
    finally:
        keras.config.set_floatx("float32")
    dropped = y == 0
    p = effective_rate(0.1)
    group = 4 if SPLIT else 2  # the numbers of one draw (see above)
    for field in range(group):
        assert abs(dropped[..., field::group].mean() - p) < 0.01


def test_rates_that_rounding_would_move_use_keras_dropout():
    x = np.ones((64, 64, 256), "float32")
    # torch and TensorFlow: 0.0001 would become 7 / 2**16 (+7%), 0.99999 would become 1 (no
    # kept element), so Keras's dropout applies the rate itself; its scale tells them apart
    # (the rounded rate's is 7e-6 off at 0.0001). JAX rounds to 2**-32, which moves neither
    # rate by 1%.
    for rate in (0.0001, 0.99999):
        y = to_np(Dropout(rate, seed=6)(x, training=True))
        np.testing.assert_allclose((y == 0).mean(), rate, atol=0.003)
        applied = effective_rate(rate) if BACKEND == "jax" else rate
        np.testing.assert_allclose(y[y != 0], 1 / (1 - applied), rtol=1e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="the split draws' device rule is torch's")
def test_torch_takes_keras_dropout_off_cpu_and_under_compile():
    """torch's split draws serve CPU tensors outside torch.compile; anything else takes
    Keras's dropout (on CUDA torch's fused dropout was faster, benchmarks/README.md)."""
    import torch

    from keras_tfm.dropout import _split_draws_suit

    assert _split_draws_suit(torch.ones(2, 4))
    # Any other device (CUDA, or the meta device Keras traces shapes on).
    assert not _split_draws_suit(torch.ones(2, 4, device="meta"))
    if torch.cuda.is_available():  # a GPU machine checks CUDA itself
        assert not _split_draws_suit(torch.ones(2, 4, device="cuda"))
    y = Dropout(0.1)(torch.ones(2, 4, device="meta"), training=True)
    assert y.device.type == "meta" and tuple(y.shape) == (2, 4)
    # A CPU tensor while Keras's device is another (CUDA on a GPU machine; here the meta
    # device stands in for it, the layer built before: its seed state cannot live there).
    # The split draws are made on the CPU, next to the tensor.
    layer = Dropout(0.1)
    with keras.device("meta"):
        y = to_np(layer(torch.ones(64, 64, 256), training=True))
    p = effective_rate(0.1)
    np.testing.assert_allclose((y == 0).mean(), p, atol=0.005)
    np.testing.assert_allclose(y[y != 0], 1 / (1 - p), rtol=1e-6)
    # Under torch.compile (Keras's `jit_compile=True` on torch): Keras's unseeded dropout,
    # which dynamo traces; `fullgraph=True` raises on any graph break.
    layer = Dropout(0.1)
    compiled = torch.compile(lambda x: layer(x, training=True), fullgraph=True, backend="eager")
    y = to_np(compiled(torch.ones(64, 64, 256)))
    np.testing.assert_allclose((y == 0).mean(), 0.1, atol=0.005)
    # Keras's rate, not the split draws' 6554/2**16: the scale tells them apart (7e-6).
    np.testing.assert_allclose(y[y != 0], 1 / 0.9, rtol=1e-6)


@cpu_draws
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graphs: unknown dimensions "
                    "and XLA (torch's eager tensors are always concrete; JAX: static shapes)")
def test_tensorflow_graphs_with_unknown_shapes_and_under_xla():
    """In a `tf.function` whose batch and length are unknown when traced (as Keras's `fit`
    traces a dataset's batches), and compiled by XLA (`jit_compile=True`), the split draws run:
    their rate's scale (Keras's dropout would be 7e-6 off); traced, the same mask as eagerly."""
    import tensorflow as tf

    p = effective_rate(0.1)
    x = np.ones((63, 31, 131), "float32")  # not a multiple of four
    layer = Dropout(0.1, seed=8)
    unknown = [tf.TensorSpec([None, None, 131], tf.float32)]
    traced = tf.function(lambda v: layer(v, training=True), input_signature=unknown)
    compiled = tf.function(lambda v: layer(v, training=True), input_signature=unknown,
                           jit_compile=True)
    for function in (traced, compiled):
        assert function.get_concrete_function().structured_outputs.shape.as_list() == [
            None, None, 131]
    y = to_np(traced(x))
    np.testing.assert_array_equal(y != 0, to_np(Dropout(0.1, seed=8)(x, training=True)) != 0)
    for y in (y, to_np(compiled(x))):
        np.testing.assert_allclose((y == 0).mean(), p, atol=0.005)
        np.testing.assert_allclose(y[y != 0], 1 / (1 - p), rtol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's device rule")
def test_tensorflow_with_an_accelerator_takes_keras_dropout(monkeypatch):
    """Where TensorFlow sees a GPU or TPU (stood in for by a device list that names one), the
    layer applies Keras's dropout at the rate itself: its scale is 1 / 0.9, not the split
    draws' 1 / (1 - 6554 / 2**16) (7e-6 apart)."""
    monkeypatch.setattr(keras.distribution, "list_devices", lambda *_: ["gpu:0", "cpu:0"])
    assert not _split_draws_suit(None)
    y = to_np(Dropout(0.1, seed=9)(np.ones((64, 64, 256), "float32"), training=True))
    np.testing.assert_allclose((y == 0).mean(), 0.1, atol=0.005)
    np.testing.assert_allclose(y[y != 0], 1 / 0.9, rtol=1e-6)
