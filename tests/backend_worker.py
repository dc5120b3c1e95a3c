"""Run in a subprocess with its own KERAS_BACKEND (Keras fixes the backend at import).

    python backend_worker.py predict MODEL.keras INPUTS.npz OUTPUT.npz
    python backend_worker.py train_save OUTPUT_DIR      # compile, fit and save a small model
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tfm  # noqa: E402


def predict(model_path, inputs_path, output_path):
    # compile=False: a file compiled with jit_compile=True under JAX or TensorFlow would make
    # torch run `predict` through torch.compile (a minute of compilation for nothing here).
    model = keras.models.load_model(model_path, compile=False)
    data = np.load(inputs_path)
    np.savez(output_path, logits=np.asarray(model.predict([data["src"], data["tgt"]], verbose=0)))


def small_model():
    model = keras_tfm.build_transformer(12, 12, d_model=16, num_heads=2, ff_dim=32,
                                        num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
    model.compile(optimizer=keras.optimizers.Adam(keras_tfm.TransformerSchedule(16, 20)),
                  loss=keras_tfm.MaskedSparseCategoricalCrossentropy(),
                  metrics=[keras_tfm.MaskedAccuracy()])
    return model


def train_save(output_dir):
    from reverse_task_data import reverse_task

    keras.utils.set_random_seed(0)
    src, dec_in, tgt = reverse_task(64, seed=1)
    model = small_model()
    model.fit([src, dec_in], tgt, batch_size=16, epochs=1, verbose=0)
    model.save(os.path.join(output_dir, "trained.keras"))
    np.savez(os.path.join(output_dir, "trained.npz"), src=src, dec_in=dec_in, tgt=tgt,
             iterations=int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
             logits=np.asarray(model.predict([src, dec_in], verbose=0)))


if __name__ == "__main__":
    {"predict": predict, "train_save": train_save}[sys.argv[1]](*sys.argv[2:])
