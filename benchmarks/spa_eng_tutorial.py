"""The keras.io tutorial "English-to-Spanish translation with a sequence-to-sequence Transformer"
(fchollet), as published, on a work directory written by `spa_eng.py`; TensorFlow backend.

    python benchmarks/spa_eng_tutorial.py train WORK --minutes 15  # WORK/train.tsv -> WORK/tutorial
    python benchmarks/spa_eng_tutorial.py translate WORK  # WORK/test.src -> WORK/hyp_tutorial.txt

The tutorial's recipe: word-level `TextVectorization` (vocabulary 15,000, length 20; Spanish
wrapped in `[start] ... [end]`, length 21, lower-cased and stripped of punctuation and "¿"),
learned token + position embeddings, one post-LN encoder and one decoder block with
`MultiHeadAttention(num_heads=8, key_dim=256)`, feed-forward 2048, `Dropout(0.5)` before the
softmax, RMSprop, batch 64, its tf.data pipeline; greedy decoding that re-runs the whole model
on the decoded prefix each step (at most 20 tokens, until `[end]`), here 100 sentences at a time
(the same tokens as one at a time: padding is masked). Training stops after
`--minutes` of training, counted from the first batch. Each command writes what it measured to
WORK/tutorial/train.json or translate.json.
"""

import argparse
import json
import os
import re
import string
import sys
import time

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402

VOCAB_SIZE, SEQUENCE_LENGTH, BATCH_SIZE = 15000, 20, 64
EMBED_DIM, LATENT_DIM, NUM_HEADS = 256, 2048, 8
MAX_DECODED_LENGTH = 20
STRIP_CHARS = (string.punctuation + "¿").replace("[", "").replace("]", "")


def custom_standardization(text):
    return tf.strings.regex_replace(tf.strings.lower(text), f"[{re.escape(STRIP_CHARS)}]", "")


def vectorizers(eng_vocabulary=None, spa_vocabulary=None):
    eng = layers.TextVectorization(max_tokens=VOCAB_SIZE, output_mode="int",
                                   output_sequence_length=SEQUENCE_LENGTH,
                                   vocabulary=eng_vocabulary)
    spa = layers.TextVectorization(max_tokens=VOCAB_SIZE, output_mode="int",
                                   output_sequence_length=SEQUENCE_LENGTH + 1,
                                   standardize=custom_standardization,
                                   vocabulary=spa_vocabulary)
    return eng, spa


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.dense_dim, self.num_heads = embed_dim, dense_dim, num_heads
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = None if mask is None else ops.cast(mask[:, None, :], "int32")
        attention_output = self.attention(query=inputs, value=inputs, key=inputs,
                                          attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        return self.layernorm_2(proj_input + self.dense_proj(proj_input))

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim,
                "dense_dim": self.dense_dim, "num_heads": self.num_heads}


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(input_dim=sequence_length,
                                                    output_dim=embed_dim)
        self.sequence_length, self.vocab_size, self.embed_dim = (sequence_length, vocab_size,
                                                                 embed_dim)

    def call(self, inputs):
        positions = ops.arange(0, ops.shape(inputs)[-1], 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length,
                "vocab_size": self.vocab_size, "embed_dim": self.embed_dim}


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.latent_dim, self.num_heads = embed_dim, latent_dim, num_heads
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        causal_mask = self.get_causal_attention_mask(inputs)
        inputs_padding_mask, encoder_outputs_padding_mask = (None, None) if mask is None else mask
        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs,
                                              attention_mask=causal_mask,
                                              query_mask=inputs_padding_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(query=out_1, value=encoder_outputs,
                                              key=encoder_outputs,
                                              query_mask=inputs_padding_mask,
                                              key_mask=encoder_outputs_padding_mask)
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        return self.layernorm_3(out_2 + self.dense_proj(out_2))

    def get_causal_attention_mask(self, inputs):
        batch_size, length = ops.shape(inputs)[0], ops.shape(inputs)[1]
        mask = ops.cast(ops.arange(length)[:, None] >= ops.arange(length), "int32")
        return ops.tile(ops.reshape(mask, (1, length, length)), (batch_size, 1, 1))

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim,
                "latent_dim": self.latent_dim, "num_heads": self.num_heads}


def build_transformer():
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(SEQUENCE_LENGTH, VOCAB_SIZE, EMBED_DIM)(encoder_inputs)
    encoder_outputs = TransformerEncoder(EMBED_DIM, LATENT_DIM, NUM_HEADS)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(SEQUENCE_LENGTH, VOCAB_SIZE, EMBED_DIM)(decoder_inputs)
    x = TransformerDecoder(EMBED_DIM, LATENT_DIM, NUM_HEADS)([x, encoder_outputs])
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(VOCAB_SIZE, activation="softmax")(x)
    return keras.Model({"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
                       decoder_outputs, name="transformer")


class WallClockBudget(keras.callbacks.Callback):
    """Stops training once `seconds` have passed since the first batch began."""

    def __init__(self, seconds):
        super().__init__()
        self.budget, self.start, self.steps, self.seconds = seconds, None, 0, 0.0

    def on_train_batch_begin(self, batch, logs=None):
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        self.seconds = time.perf_counter() - self.start
        if self.seconds >= self.budget:
            self.model.stop_training = True


def train(work, minutes):
    with open(os.path.join(work, "train.tsv"), encoding="utf-8") as f:
        pairs = [line.rstrip("\n").split("\t") for line in f]
    eng_texts = [eng for eng, _ in pairs]
    spa_texts = [f"[start] {spa} [end]" for _, spa in pairs]
    eng_vectorization, spa_vectorization = vectorizers()
    eng_vectorization.adapt(eng_texts)
    spa_vectorization.adapt(spa_texts)

    def format_dataset(eng, spa):
        eng, spa = eng_vectorization(eng), spa_vectorization(spa)
        return {"encoder_inputs": eng, "decoder_inputs": spa[:, :-1]}, spa[:, 1:]

    dataset = tf.data.Dataset.from_tensor_slices((eng_texts, spa_texts)).batch(BATCH_SIZE)
    dataset = dataset.map(format_dataset).cache().shuffle(2048).prefetch(16)
    transformer = build_transformer()
    transformer.compile("rmsprop", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    budget = WallClockBudget(60 * minutes)
    history = transformer.fit(dataset, epochs=10_000, callbacks=[budget], verbose=2)
    out = os.path.join(work, "tutorial")
    os.makedirs(out, exist_ok=True)
    transformer.save_weights(os.path.join(out, "model.weights.h5"))
    with open(os.path.join(out, "vocabulary.json"), "w", encoding="utf-8") as f:
        json.dump({"eng": [str(t) for t in eng_vectorization.get_vocabulary()],
                   "spa": [str(t) for t in spa_vectorization.get_vocabulary()]}, f)
    record = {"steps": budget.steps, "fit_s": budget.seconds,
              "s_per_step": budget.seconds / budget.steps,
              "epochs": len(history.history["loss"]), "params": transformer.count_params(),
              "train_pairs": len(pairs), "loss": history.history["loss"][-1],
              "accuracy": history.history["accuracy"][-1]}
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def translate(work):
    out = os.path.join(work, "tutorial")
    with open(os.path.join(out, "vocabulary.json"), encoding="utf-8") as f:
        vocabulary = json.load(f)
    eng_vectorization, spa_vectorization = vectorizers(vocabulary["eng"], vocabulary["spa"])
    transformer = build_transformer()
    transformer.load_weights(os.path.join(out, "model.weights.h5"))
    spa_index_lookup = dict(enumerate(vocabulary["spa"]))
    start_id, end_id = vocabulary["spa"].index("[start]"), vocabulary["spa"].index("[end]")

    @tf.function(reduce_retracing=True)
    def next_tokens(encoder_inputs, decoder_inputs, i):
        predictions = transformer({"encoder_inputs": encoder_inputs,
                                   "decoder_inputs": decoder_inputs}, training=False)
        return tf.argmax(predictions[:, i, :], axis=-1, output_type=tf.int64)

    def decode_batch(input_sentences):
        """The tutorial's `decode_sequence` (re-run the model on the decoded prefix, take the
        argmax at position i, stop at "[end]" or 20 tokens) for many sentences at once: the
        prefix is kept as ids, which is what re-vectorizing the decoded string gives."""
        encoder_inputs = eng_vectorization(input_sentences)
        decoded = np.zeros((len(input_sentences), SEQUENCE_LENGTH), "int64")
        decoded[:, 0] = start_id
        done = np.zeros(len(input_sentences), bool)
        words = [[] for _ in input_sentences]
        for i in range(MAX_DECODED_LENGTH):
            tokens = next_tokens(encoder_inputs, tf.constant(decoded), tf.constant(i)).numpy()
            for row, token in enumerate(tokens):
                if not done[row]:
                    if token == end_id:
                        done[row] = True
                    else:
                        words[row].append(spa_index_lookup[int(token)])
            if done.all() or i + 1 == SEQUENCE_LENGTH:
                break
            decoded[:, i + 1] = np.where(done, 0, tokens)
        return [" ".join(w) for w in words]

    with open(os.path.join(work, "test.src"), encoding="utf-8") as f:
        sources = [line.rstrip("\n") for line in f]
    start = time.perf_counter()
    hypotheses = []
    for first in range(0, len(sources), 100):
        hypotheses.extend(decode_batch(sources[first:first + 100]))
    record = {"decode_loop_s": time.perf_counter() - start, "sentences": len(sources)}
    with open(os.path.join(work, "hyp_tutorial.txt"), "w", encoding="utf-8") as f:
        f.write("".join(h + "\n" for h in hypotheses))
    with open(os.path.join(out, "translate.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("train", "translate"))
    parser.add_argument("work", help="the work directory of spa_eng.py")
    parser.add_argument("--minutes", type=float, default=15.0, help="training budget")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    record = train(args.work, args.minutes) if args.command == "train" else translate(args.work)
    print(json.dumps(record), file=sys.stderr)


if __name__ == "__main__":
    main()
