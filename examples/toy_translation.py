"""Toy translation with keras_tfm, end to end (seed 003's "Data Generation Strategy").

    KERAS_BACKEND=jax python examples/toy_translation.py [--epochs N] [--num-samples N]
        [--output-dir DIR] [--seed S] [--quick]

Builds the encoder-decoder transformer, trains it with `model.fit` (masked loss and token
accuracy, a validation split, the TransformerSchedule), translates 1,000 held-out sentences with
KV-cached greedy decoding, prints token and exact-sequence accuracy and five samples, saves and
reloads the `.keras` file, and writes a heat map of the cross-attention of one example.
Only the public API of keras_tfm is used.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tfm  # noqa: E402
import toy_data  # noqa: E402

HELD_OUT = 1000


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--num-samples", type=int, default=20000,
                        help="training sentences (10%% of them for validation)")
    parser.add_argument("--output-dir", default="outputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run (for tests): few samples, one epoch, small model")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.num_samples = 1, 512
    return args


def build_model(quick):
    width = 32 if quick else 64
    model = keras_tfm.build_transformer(
        src_vocab_size=len(toy_data.SOURCE_VOCAB), tgt_vocab_size=len(toy_data.TARGET_VOCAB),
        d_model=width, num_heads=4, ff_dim=2 * width, num_encoder_layers=1 if quick else 2,
        num_decoder_layers=1 if quick else 2, dropout=0.0, name="toy_translator")
    # The paper's schedule at a quarter scale (a peak learning rate of 2.2e-3 after 200 steps),
    # its label smoothing of 0.1 and clipped gradients: larger rates train as fast but spike.
    schedule = keras_tfm.TransformerSchedule(d_model=width, warmup_steps=200, scale=0.25)
    model.compile(optimizer=keras.optimizers.Adam(schedule, beta_1=0.9, beta_2=0.98,
                                                  epsilon=1e-9, clipnorm=1.0),
                  loss=keras_tfm.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1),
                  metrics=[keras_tfm.MaskedAccuracy()])
    return model


def translate(model, source):
    return keras_tfm.generate(model, source, start_id=toy_data.SOS, end_id=toy_data.EOS,
                              max_length=toy_data.TARGET_LENGTH - 1, batch_size=500)


def accuracies(predicted, target):
    """Token accuracy over the expected tokens (<EOS> included) and exact-sequence accuracy."""
    expected = target[:, 1:]  # drop <SOS>
    width = expected.shape[1]
    predicted = np.pad(predicted, ((0, 0), (0, width - predicted.shape[1])))
    real = expected != toy_data.PAD
    correct = (predicted == expected) | ~real
    return (predicted == expected)[real].mean(), correct.all(axis=1).mean()


def words(tokens, vocab):
    return " ".join(toy_data.decode(tokens, vocab))


def plot_cross_attention(model, source, predicted, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no heat map (pip install matplotlib)")
        return None
    parts = keras_tfm.Seq2SeqParts.from_model(model)
    generated = list(predicted[:np.flatnonzero(predicted == toy_data.EOS)[0] + 1]) if (
        toy_data.EOS in predicted) else list(predicted[predicted != 0])
    decoder_tokens = np.array([[toy_data.SOS] + generated[:-1]], "int32")
    weights = parts.cross_attention_weights(source[None], decoder_tokens)[-1]
    weights = np.asarray(keras.ops.convert_to_numpy(weights))[0].mean(axis=0)
    source_labels = [toy_data.SOURCE_VOCAB[t] for t in source if t != toy_data.PAD]
    target_labels = [toy_data.TARGET_VOCAB[t] for t in generated]
    weights = weights[:len(target_labels), :len(source_labels)]
    fig, ax = plt.subplots(figsize=(0.35 * len(source_labels) + 2, 0.35 * len(target_labels) + 2))
    ax.imshow(weights, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(source_labels)), source_labels)
    ax.set_yticks(range(len(target_labels)), target_labels)
    ax.set_xlabel("source tokens")
    ax.set_ylabel("generated tokens")
    ax.set_title(f"cross-attention, last decoder block ({keras.backend.backend()})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")

    source, target = toy_data.make_dataset(args.num_samples, seed=args.seed)
    test_source, test_target = toy_data.make_dataset(HELD_OUT, seed=args.seed + 10_000)
    model = build_model(args.quick)

    start = time.perf_counter()
    model.fit([source, target[:, :-1]], target[:, 1:], batch_size=64, epochs=args.epochs,
              validation_split=0.1, verbose=1 if sys.stdout.isatty() else 2)
    trained = time.perf_counter()
    predicted = translate(model, test_source)
    elapsed = time.perf_counter() - start

    token_accuracy, exact_accuracy = accuracies(predicted, test_target)
    print(f"\nheld-out sentences: {HELD_OUT}, greedy decoding with a KV cache")
    print(f"token accuracy: {token_accuracy:.2%}")
    print(f"exact-sequence accuracy: {exact_accuracy:.2%}")
    print(f"elapsed: {elapsed:.1f} s (training {trained - start:.1f} s, "
          f"translation {elapsed - (trained - start):.1f} s)")
    print("\nsamples (source | expected | predicted):")
    for i in range(5):
        print(f"  {words(test_source[i], toy_data.SOURCE_VOCAB):40s} | "
              f"{words(test_target[i], toy_data.TARGET_VOCAB):42s} | "
              f"{words(predicted[i], toy_data.TARGET_VOCAB)}")

    path = os.path.join(args.output_dir, "toy_translation.keras")
    keras_tfm.saving.save_model(model, path)  # atomic: a temporary file, then a rename
    reloaded = keras_tfm.saving.load_model(path)
    again = translate(reloaded, test_source[:100])
    same = np.array_equal(again, predicted[:100, :again.shape[1]])
    logits_gap = np.abs(reloaded.predict([test_source[:8], test_target[:8, :-1]], verbose=0)
                        - model.predict([test_source[:8], test_target[:8, :-1]], verbose=0)).max()
    print(f"\nsaved {path}; reloaded model translates the same: {same} "
          f"(max logit difference {logits_gap:.1e})")

    heat_map = plot_cross_attention(model, test_source[0], predicted[0],
                                    os.path.join(args.output_dir, "cross_attention.png"))
    if heat_map:
        print(f"cross-attention heat map: {heat_map}")
    return {"token_accuracy": token_accuracy, "exact_accuracy": exact_accuracy,
            "elapsed": elapsed, "reloaded_same": same}


if __name__ == "__main__":
    main()
