"""Greedy decoding speed: keras_tfm's KV cache against full recomputation.

    python benchmarks/decode.py                 # every backend, each in its own process
    python benchmarks/decode.py --backend jax   # one backend

The toy translation model (d_model 64, 4 heads, ff 128, 2+2 layers, vocabularies of 10), 32
sources of length 22, and 32, 64 and 128 new tokens; the end id is the padding id, which is
never generated, so every run makes exactly that many. *cached*:
`keras_tfm.generate(method="greedy")`; *recompute*: the keras.io example's loop (the whole model
on the padded prefix at every step), its forward pass compiled once (`predict_on_batch`).
Reported: new tokens per second (median of several runs after a warm-up) and the speed-up.
Results: benchmarks/README.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BACKENDS = ("jax", "tensorflow", "torch")
NEW_TOKENS = (32, 64, 128)
BATCH, SOURCE_LENGTH, REPEATS = 32, 22, 5


def measure(fn, repeats=REPEATS):
    fn()  # warm-up: compilation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_backend():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_tfm

    keras.utils.set_random_seed(0)
    model = keras_tfm.build_transformer(10, 10, d_model=64, num_heads=4, ff_dim=128,
                                        num_encoder_layers=2, num_decoder_layers=2, dropout=0.0)
    rng = np.random.default_rng(0)
    source = rng.integers(3, 10, (BATCH, SOURCE_LENGTH)).astype("int32")
    results = []
    for new_tokens in NEW_TOKENS:
        def cached():
            return keras_tfm.generate(model, source, start_id=1, end_id=None, max_length=new_tokens)

        def recompute():
            target = np.zeros((BATCH, new_tokens), "int32")
            target[:, 0] = 1
            for i in range(new_tokens):
                logits = model.predict_on_batch([source, target])
                next_token = np.asarray(logits)[:, i, 1:].argmax(-1) + 1  # padding excluded
                if i + 1 < new_tokens:
                    target[:, i + 1] = next_token
            return target

        assert cached().shape == (BATCH, new_tokens)
        t_cached, t_recompute = measure(cached), measure(recompute, repeats=3)
        results.append({"backend": keras.backend.backend(), "new_tokens": new_tokens,
                        "cached_tokens_per_s": BATCH * new_tokens / t_cached,
                        "recompute_tokens_per_s": BATCH * new_tokens / t_recompute,
                        "cached_s": t_cached, "recompute_s": t_recompute,
                        "speedup": t_recompute / t_cached})
    return results


def main():
    parser = argparse.ArgumentParser(description="Greedy decoding: KV cache vs recomputation")
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--json", action="store_true", help="print JSON lines (internal)")
    args = parser.parse_args()
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
        results = run_backend()
        if args.json:
            print("RESULTS " + json.dumps(results))
            return
    else:
        results = []
        for backend in BACKENDS:
            out = subprocess.run([sys.executable, __file__, "--backend", backend, "--json"],
                                 capture_output=True, text=True, check=True).stdout
            line = [l for l in out.splitlines() if l.startswith("RESULTS ")][-1]
            results += json.loads(line[len("RESULTS "):])
    print("| backend | new tokens | cached tokens/s | recompute tokens/s | cached s | "
          "recompute s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['backend']} | {r['new_tokens']} | {r['cached_tokens_per_s']:,.0f} | "
              f"{r['recompute_tokens_per_s']:,.0f} | {r['cached_s']:.3f} | "
              f"{r['recompute_s']:.3f} | {r['speedup']:.1f}× |")


if __name__ == "__main__":
    main()
