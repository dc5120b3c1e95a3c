"""Warm `generate` calls of keras_tfm on an opus-mt-base-shaped MarianMT, to compare two commits.

    KERAS_BACKEND=torch PYTHONPATH=/path/to/other/checkout python benchmarks/decode_warm.py
    KERAS_BACKEND=torch python benchmarks/decode_warm.py

One process per commit and backend (PYTHONPATH picks the keras_tfm checkout); the model of
`decode_peers.py` (random weights, written once to --model-dir); 32 new tokens forced; cells
`b1` (one 24-token source), `b16` (16 of them) and `s16` (32 sources of 5-60 tokens,
`batch_size=16`); each the median of 3 calls after a warm-up (compilation excluded). Prints
seconds per cell.
"""

import argparse
import os
import statistics
import time

import numpy as np

import decode_peers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="/tmp/decode_warm_model")
    parser.add_argument("cells", nargs="*", default=["b1", "b16", "s16"])
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        decode_peers.write_model(args.model_dir, decode_peers.SHAPES["base"])
    import keras
    import keras_tfm

    model = keras_tfm.from_marian(args.model_dir)
    pad, rng = model.special_ids["pad_id"], np.random.default_rng(0)

    def sources(n, longest):
        batch = np.full((n, longest), pad, "int32")
        for row in batch:
            length = longest if n <= 16 else rng.integers(5, longest + 1)
            row[:length - 1] = rng.integers(2, pad, length - 1)
            row[length - 1] = 0  # </s>
        return batch

    cases = {"b1": (sources(1, 24), None), "b16": (sources(16, 24), None),
             "s16": (sources(32, 60), 16)}
    print(keras_tfm.__file__, keras.backend.backend())
    for name in args.cells:
        batch, chunk = cases[name]

        def call():
            start = time.perf_counter()
            keras_tfm.generate(model, batch, max_length=32, end_id=None, batch_size=chunk)
            return time.perf_counter() - start

        call()
        print(f"{name} {statistics.median(call() for _ in range(3)):.3f} s", flush=True)


if __name__ == "__main__":
    main()
