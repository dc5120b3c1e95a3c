"""What keras_tfm's in-graph token-id checks cost, alone: forward + backward of one token
lookup through `embed_or_nan` and of the masked loss, with and without the checks, at the small
training config's shapes (B=64, T=32, d=128, V=1000), compiled as Keras compiles a training
step (jax.jit; tf.function; torch eager on one thread), timed in turns.

    KERAS_BACKEND=torch python benchmarks/id_checks.py

A training step runs two lookups (source, target) and one loss: compare 2 x the lookup's
difference + the loss's with the step time of benchmarks/train_throughput.py (which also runs
`--models keras_tfm keras_tfm_unchecked`, the whole step, where a quiet machine is needed to
resolve a 2% difference).
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_tfm  # noqa: E402
from keras_tfm import _checks  # noqa: E402
from train_throughput import unchecked_ids  # noqa: E402

B, T, D, V = 64, 32, 128, 1000


def step_functions():
    """{(part, checked): f(table, logits) -> gradients}, compiled for this backend."""
    rng = np.random.default_rng(0)
    ids = ops.convert_to_tensor(rng.integers(0, V, (B, T)).astype("int32"))
    loss = keras_tfm.MaskedSparseCategoricalCrossentropy()

    def lookup_sum(table, logits, checked):
        lookup = lambda i: ops.take(table, i, axis=0)  # noqa: E731
        return ops.sum(_checks.embed_or_nan(lookup, ids, V) if checked else lookup(ids))

    def loss_value(table, logits, checked):
        if checked:
            return loss(ids, logits)
        with unchecked_ids():
            return loss(ids, logits)

    table = rng.normal(size=(V, D)).astype("float32")
    logits = rng.normal(size=(B, T, V)).astype("float32")
    backend = keras.backend.backend()
    functions = {}
    for part, f in (("lookup", lookup_sum), ("loss", loss_value)):
        for checked in (True, False):
            if backend == "jax":
                import jax

                grad = jax.jit(jax.grad(lambda a, b, f=f, c=checked: f(a, b, c), (0, 1)))
                functions[part, checked] = lambda g=grad: jax.block_until_ready(
                    g(table, logits))
            elif backend == "tensorflow":
                import tensorflow as tf

                a, b = tf.constant(table), tf.constant(logits)

                @tf.function
                def grad(f=f, c=checked):
                    with tf.GradientTape() as tape:
                        tape.watch([a, b])
                        y = f(a, b, c)
                    return [tf.convert_to_tensor(g) for g in tape.gradient(y, [a, b])
                            if g is not None]

                functions[part, checked] = lambda g=grad: [t.numpy() for t in g()]
            else:
                import torch

                torch.set_num_threads(1)  # steadier on a shared machine
                a = torch.tensor(table, requires_grad=True)
                b = torch.tensor(logits, requires_grad=True)
                functions[part, checked] = lambda f=f, c=checked: f(a, b, c).backward()
    return functions


def main(rounds=30, inner=10):
    functions = step_functions()
    for f in functions.values():
        f()
        f()
    times = {key: [] for key in functions}
    for _ in range(rounds):
        for key, f in functions.items():
            start = time.perf_counter()
            for _ in range(inner):
                f()
            times[key].append((time.perf_counter() - start) / inner)
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    for part in ("lookup", "loss"):
        on, off = times[part, True], times[part, False]
        paired = statistics.median(a - b for a, b in zip(on, off))
        print(f"{part:6s}: {statistics.median(on) * 1e3:.3f} ms with the checks, "
              f"{statistics.median(off) * 1e3:.3f} ms without; paired difference "
              f"{paired * 1e3:+.3f} ms")


if __name__ == "__main__":
    main()
