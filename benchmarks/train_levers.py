"""Training-speed levers of issue #47, each on and off in one process, steps in turns.

    python benchmarks/train_levers.py --engine jax|tensorflow|torch [--rounds 12] [--plain-pytorch]

text_lm.py's model of nanoGPT's run (`train_peers.py`'s gpt shape) is built once per variant,
from the same seed, and trained on the same nanoGPT windows: 10 warm-up steps each, then
`--rounds` rounds in which every variant takes the same 10 batches in turn (the order reversed
every other round). On a shared 2-core VM the step time drifts by 15-25 % between processes
minutes apart, so only variants timed in turns within one process are compared. A variant's
setting is active around each of its steps (eager torch) and when its step is traced (JAX and
TensorFlow compile each variant's step once). Prints the median ms a step of each variant, its
ratio to the default, round by round (median and quartiles), and the largest difference of its
first 10 losses from the default's (same weights, same batches: float32 noise).

Variants (the library's default first; each other one is the lever off, or another way):
- `default`: as text_lm.py builds and compiles it;
- `causal mask built`: a causal-only self-attention builds its (T, T) mask and the guards for
  rows with no key, as before the kernel's own causal masking was used;
- `explicit attention`: the attention's two products and softmax instead of the fused kernel;
- `keras loss`: `keras.losses.SparseCategoricalCrossentropy(from_logits=True)` instead of
  keras_tfm's masked loss (no ignored class, no out-of-vocabulary guard);
- `sublayers called` (torch): the blocks call their sublayers through Keras's `Layer.__call__`
  (its bookkeeping at every call), as before they called plain sublayers' `call` directly;
- `plain PyTorch` (`--plain-pytorch`): torch_gpt.py's step (nanoGPT's model, `torch.optim.AdamW`,
  clipping) on the same batches, in the same turns: the issue's ratio without the drift between
  processes.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]


@contextlib.contextmanager
def patched(*replacements):
    """Within the scope, `setattr(owner, name, value)` for each `(owner, name, value)`."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def variants(backend):
    """{name: (a context manager factory, loss or None)} of the variants on `backend`."""
    import keras

    from keras_tfm import _backend, attention, masks

    sdpa = attention.scaled_dot_product_attention

    table = {
        "default": (contextlib.nullcontext, None),
        "causal mask built": (lambda: patched((masks, "same_length", lambda q, k: False)), None),
        "explicit attention": (lambda: patched((attention, "scaled_dot_product_attention",
                                                lambda *a, **k: sdpa(*a, **k, fused=False))),
                               None),
        "keras loss": (contextlib.nullcontext,
                       keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
    }
    if backend == "torch":
        table["sublayers called"] = (
            lambda: patched((_backend, "_plain", lambda layer: False)), None)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("jax", "tensorflow", "torch"), required=True)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--plain-pytorch", action="store_true",
                        help="also time torch_gpt.py's step in the turns (the ratio of the issue)")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.engine
    import numpy as np

    import text_lm
    import train_profile

    batches, vocab_size = train_profile.windows(20)
    options = text_lm.parse_args(["train", "--text", "-", "--out", "-"])
    models, losses = {}, {}
    for name, (setting, loss) in variants(args.engine).items():
        with setting():
            model = text_lm.build_model(options, vocab_size)
            if loss is not None:
                model.compile(optimizer=model.optimizer, loss=loss, jit_compile=model.jit_compile)
            losses[name] = [float(model.train_on_batch(x, y)) for x, y in batches[:10]]
        models[name] = (model.train_on_batch, setting)
    if args.plain_pytorch:  # torch_gpt's step among the variants (its losses are its own)
        models["plain PyTorch"] = (train_profile.torch_gpt_step(vocab_size),
                                   contextlib.nullcontext)
        for x, y in batches[:10]:
            models["plain PyTorch"][0](x, y)
    seconds = {name: [] for name in models}  # per round: the median of its 10 steps
    for round_ in range(args.rounds):
        names = list(models) if round_ % 2 == 0 else list(models)[::-1]
        for name in names:
            step, setting = models[name]
            with setting():
                times = []
                for x, y in batches[10:]:
                    start = time.perf_counter()
                    step(x, y)
                    times.append(time.perf_counter() - start)
            seconds[name].append(statistics.median(times))
    print(f"{args.engine}: ms a step (median of the rounds' medians) and the ratio to the "
          f"default (median and quartiles of {args.rounds} rounds' ratios, 10 steps in turns)")
    for name, times in seconds.items():
        ratios = np.divide(times, seconds["default"])
        low, mid, high = np.percentile(ratios, [25, 50, 75])
        gap = (f"  loss gap {np.max(np.abs(np.subtract(losses[name], losses['default']))):.1e}"
               if name in losses else "")
        print(f"{name:20s} {1000 * statistics.median(times):7.1f} ms  {mid:5.3f}x "
              f"({low:.3f}-{high:.3f}){gap}")


if __name__ == "__main__":
    main()
