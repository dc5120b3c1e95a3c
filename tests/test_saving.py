"""`.keras` files: same-backend round trip, loading under the other backends, resuming training."""

import os
import subprocess
import sys

import keras
import numpy as np

from helpers import BACKEND, jit_options, to_np
from keras_tfm import (MaskedAccuracy, MaskedSparseCategoricalCrossentropy, TransformerSchedule,
                       build_transformer, saving)
from reverse_task_data import reverse_task

WORKER = os.path.join(os.path.dirname(__file__), "backend_worker.py")
OTHER_BACKENDS = [b for b in ("jax", "tensorflow", "torch") if b != BACKEND]


def run_worker(backend, *args):
    env = dict(os.environ, KERAS_BACKEND=backend)
    result = subprocess.run([sys.executable, WORKER, *map(str, args)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def compiled_model(dropout=0.1, **kwargs):
    model = build_transformer(12, 12, d_model=16, num_heads=2, ff_dim=32, num_encoder_layers=1,
                              num_decoder_layers=1, dropout=dropout, **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(TransformerSchedule(16, warmup_steps=20)),
                  loss=MaskedSparseCategoricalCrossentropy(label_smoothing=0.1),
                  metrics=[MaskedAccuracy()], **jit_options())
    return model


def test_round_trip_is_bit_identical_with_optimizer_state(tmp_path):
    src, dec_in, tgt = reverse_task(64, seed=2)
    model = compiled_model(dropout=0.0, positional="learned", max_length=16, tie_embeddings=True)
    model.fit([src, dec_in], tgt, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects, safe_mode on
    np.testing.assert_array_equal(loaded.predict([src, dec_in], verbose=0),
                                  model.predict([src, dec_in], verbose=0))
    assert int(to_np(loaded.optimizer.iterations)) == 4
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    assert isinstance(loaded.optimizer._learning_rate, TransformerSchedule)
    assert isinstance(loaded.loss, MaskedSparseCategoricalCrossentropy)
    # Training continues from the restored state on both copies identically.
    model.train_on_batch([src[:16], dec_in[:16]], tgt[:16])
    loaded.train_on_batch([src[:16], dec_in[:16]], tgt[:16])
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_allclose(to_np(a), to_np(b), atol=1e-6)


def test_file_loads_under_the_other_backends(tmp_path):
    src, dec_in, _ = reverse_task(8, seed=3)
    model = compiled_model(norm_first=True)
    model_path, inputs_path = tmp_path / "model.keras", tmp_path / "inputs.npz"
    model.save(model_path)
    np.savez(inputs_path, src=src, tgt=dec_in)
    expected = model.predict([src, dec_in], verbose=0)
    for backend in OTHER_BACKENDS:
        out_path = tmp_path / f"out_{backend}.npz"
        run_worker(backend, "predict", model_path, inputs_path, out_path)
        np.testing.assert_allclose(np.load(out_path)["logits"], expected, atol=1e-5,
                                   err_msg=f"saved under {BACKEND}, loaded under {backend}")


def test_torch_saved_model_resumes_training_here(tmp_path):
    """keras_tfm.saving.load_model rebuilds a torch-saved optimizer natively, state included."""
    run_worker("torch", "train_save", tmp_path)
    saved = np.load(tmp_path / "trained.npz")
    model = saving.load_model(tmp_path / "trained.keras")
    assert type(model.optimizer).__module__.split(".")[-1] == "adam" or BACKEND == "torch"
    assert int(to_np(model.optimizer.iterations)) == int(saved["iterations"]) == 4
    assert any(np.abs(to_np(v)).sum() > 0 for v in model.optimizer.variables[1:])  # moments
    np.testing.assert_allclose(model.predict([saved["src"], saved["dec_in"]], verbose=0),
                               saved["logits"], atol=1e-5)
    history = model.fit([saved["src"], saved["dec_in"]], saved["tgt"], batch_size=16, epochs=1,
                        verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert int(to_np(model.optimizer.iterations)) == 8  # continued from the saved step count
