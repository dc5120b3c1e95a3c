"""Processes that get SIGKILL half-way (run by test_interruptions.py, one backend each).

    python interrupt_worker.py fit BACKUP_DIR KILL_AT_STEP OUT.npz   # KILL_AT_STEP -1: no kill
    python interrupt_worker.py save TARGET.keras atomic|plain       # killed while saving
    python interrupt_worker.py save_here TARGET.keras               # a model saved here
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tfm  # noqa: E402

EPOCHS, BATCH = 3, 16


def fit_model(seed=0, jit_compile=None):
    """The small model and data of the BackupAndRestore test: dropout 0, a fixed seed."""
    from reverse_task_data import reverse_task

    keras.utils.set_random_seed(seed)
    src, dec_in, tgt = reverse_task(64, seed=1)
    model = keras_tfm.build_transformer(12, 12, d_model=16, num_heads=2, ff_dim=32,
                                        num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras_tfm.MaskedSparseCategoricalCrossentropy(),
                  jit_compile="auto" if jit_compile is None else jit_compile)
    model([src[:1], dec_in[:1]])  # BackupAndRestore needs a built model
    return model, (src, dec_in, tgt)


def fit_result(model):
    return {"iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
            **{f"w{i}": np.asarray(keras.ops.convert_to_numpy(w))
               for i, w in enumerate(model.weights)}}


class KillAt(keras.callbacks.Callback):
    """SIGKILL this process after the `step`-th training batch (counted from 0 over epochs)."""

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, -1

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(backup_dir, kill_at, out_path):
    model, (src, dec_in, tgt) = fit_model(jit_compile=keras.backend.backend() != "torch")
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir), KillAt(int(kill_at))]
    model.fit([src, dec_in], tgt, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
              callbacks=callbacks, verbose=0)
    np.savez(out_path, **fit_result(model))


class KillOnSave(keras.layers.Layer):
    """Identity; its `save_own_variables` SIGKILLs the process (a save cut off half-way)."""

    kill = False

    def call(self, inputs):
        return inputs

    def save_own_variables(self, store):
        if KillOnSave.kill:
            os.kill(os.getpid(), signal.SIGKILL)


def save(target, how):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, KillOnSave()(keras.layers.Dense(3)(inputs)))
    KillOnSave.kill = True
    if how == "atomic":
        keras_tfm.saving.save_model(model, target)
    else:
        model.save(target)


def save_here(target):
    model, _ = fit_model()  # jit_compile="auto", resolved on this backend
    model.save(target)


if __name__ == "__main__":
    {"fit": fit, "save": save, "save_here": save_here}[sys.argv[1]](*sys.argv[2:])
