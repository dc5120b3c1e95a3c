"""Run by test_distribution.py in a subprocess: the backend's own multi-device engine.

    KERAS_BACKEND=jax python distribution_worker.py OUTPUT_DIR          # 2 virtual CPU devices
    KERAS_BACKEND=tensorflow python distribution_worker.py OUTPUT_DIR   # 2 logical CPUs
    KERAS_BACKEND=torch python distribution_worker.py OUTPUT_DIR        # 2 Gloo processes

The device count must be fixed before jax / tensorflow is imported, hence the subprocess. The
worker trains, records what the test asserts on (loss curves, outputs, shardings, errors) and
writes OUTPUT_DIR/result.json; the assertions are in the test.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
BACKEND = os.environ["KERAS_BACKEND"]
DEVICES = 2
if BACKEND == "jax":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
elif BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration() for _ in range(DEVICES)])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tfm  # noqa: E402
from reverse_task_data import reverse_task  # noqa: E402

BATCH, EPOCHS = 16, 3


def data(equal_lengths=False):
    """48 rows; with equal_lengths every row has as many real target tokens."""
    length = dict(min_len=5, max_len=5) if equal_lengths else {}
    src, dec_in, tgt = reverse_task(48, vocab_size=20, seed=3, **length)
    return [src, dec_in], tgt


def model(dropout=0.0, **kwargs):
    keras.utils.set_random_seed(7)  # the same initial weights in every run
    m = keras_tfm.build_transformer(20, 20, d_model=16, num_heads=2, ff_dim=32,
                                    num_encoder_layers=1, num_decoder_layers=1, dropout=dropout,
                                    **kwargs)
    m.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras_tfm.MaskedSparseCategoricalCrossentropy())
    return m


def fit(m, x, y, batch_size=BATCH):
    return m.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False,
                 verbose=0).history["loss"]


def error_of(call):
    try:
        call()
    except Exception as error:  # what the engine raises is what the test records
        return type(error).__name__ + ": " + str(error).splitlines()[0][:300]
    return None


def jax_checks(output_dir):
    x, y = data()
    devices = keras.distribution.list_devices()
    single = model()
    single_before = single.predict(x, verbose=0)
    single_losses = fit(single, x, y)
    single_after = single.predict(x, verbose=0)

    data_parallel = keras.distribution.DataParallel(devices=devices)
    with data_parallel.scope():
        dp = model()
        dp_losses = fit(dp, x, y)
        dp_after = dp.predict(x, verbose=0)
        dp_specs = sorted({str(list(v.value.sharding.spec)) for v in dp.weights})
        dp_replicas = keras_tfm.distribution.num_replicas()
        dp_batch_error = error_of(lambda: keras_tfm.distribution.check_batch_size(5, 48))
        dp_last_batch_error = error_of(lambda: keras_tfm.distribution.check_batch_size(16, 45))
        # Last use of `dp`: JAX's fit stops mid-epoch, and the model's variables are left
        # without values (Keras detaches them for the compiled loop), so it is unusable after.
        jax_batch_error = error_of(lambda: dp.fit(x, y, batch_size=5, epochs=1, verbose=0))

    mesh = keras.distribution.DeviceMesh((1, DEVICES), ("batch", "model"), devices)
    model_parallel = keras.distribution.ModelParallel(
        layout_map=keras_tfm.distribution.get_layout_map(mesh), batch_dim_name="batch")
    kwargs = dict(norm_first=True, positional="learned", max_length=8)
    reference = model(**kwargs)
    reference_before = reference.predict(x, verbose=0)
    reference_losses = fit(reference, x, y)
    reference_after = reference.predict(x, verbose=0)
    with model_parallel.scope():
        mp = model(**kwargs)
        mp_before = mp.predict(x, verbose=0)
        specs = {v.path: [axis for axis in v.value.sharding.spec] for v in mp.weights}
        shard_shapes = {v.path: list(v.value.addressable_shards[0].data.shape)
                        for v in mp.weights}
        mp_losses = fit(mp, x, y)
        mp_after = mp.predict(x, verbose=0)
        optimizer_specs = {v.path: [axis for axis in v.value.sharding.spec]
                           for v in mp.optimizer.variables}
    path = os.path.join(output_dir, "model_parallel.keras")
    mp.save(path)
    keras.distribution.set_distribution(None)
    reloaded = keras.models.load_model(path)
    return {
        "devices": len(devices),
        "single_losses": single_losses, "dp_losses": dp_losses,
        "dp_output_gap": float(np.abs(single_after - dp_after).max()),
        "dp_specs": dp_specs,
        "dp_replicas": dp_replicas,
        "dp_batch_error": dp_batch_error, "dp_last_batch_error": dp_last_batch_error,
        "jax_batch_error": jax_batch_error,
        "shapes": {v.path: list(v.shape) for v in mp.weights},
        "mp_specs": specs, "mp_shard_shapes": shard_shapes,
        "mp_optimizer_specs": optimizer_specs,
        "mp_replicas": model_parallel.num_model_replicas,
        "reference_losses": reference_losses, "mp_losses": mp_losses,
        "mp_before_gap": float(np.abs(reference_before - mp_before).max()),
        "mp_after_gap": float(np.abs(reference_after - mp_after).max()),
        "reloaded_gap": float(np.abs(reloaded.predict(x, verbose=0) - mp_after).max()),
        "reloaded_devices": sorted({str(d) for v in reloaded.weights
                                    for d in v.value.sharding.device_set}),
    }


def tensorflow_checks(output_dir):
    import tensorflow as tf

    x, y = data(equal_lengths=True)
    single = model()
    single_losses = fit(single, x, y)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(DEVICES)])
    with strategy.scope():
        mirrored = model()
        replicas = keras_tfm.distribution.num_replicas()
        batch_error = error_of(lambda: keras_tfm.distribution.check_batch_size(5, 48))
    mirrored_losses = fit(mirrored, x, y)
    output_gap = float(np.abs(single.predict(x, verbose=0) - mirrored.predict(x, verbose=0)).max())
    x_ragged, y_ragged = data()
    ragged_losses = fit(mirrored, x_ragged, y_ragged)  # unequal tokens per replica: it runs
    tf_batch_error = error_of(lambda: mirrored.fit(x, y, batch_size=5, epochs=1, verbose=0))
    # Dropout on: keras_tfm's split draws inside each replica (on its own CPU device).
    with strategy.scope():
        dropping = model(dropout=0.1)
        layer = keras_tfm.Dropout(0.1)
    dropout_losses = fit(dropping, x, y)
    ones = tf.ones((64, 64, 256))
    per_replica = strategy.experimental_local_results(
        tf.function(lambda: strategy.run(lambda: layer(ones, training=True)))())
    return {
        "dropout_losses": dropout_losses,
        "replica_drop_fractions": [float(np.mean(r.numpy() == 0)) for r in per_replica],
        "replica_scales": [np.unique(r.numpy()[r.numpy() != 0]).tolist() for r in per_replica],
        "replicas": replicas,
        "single_losses": single_losses, "mirrored_losses": mirrored_losses,
        "output_gap": output_gap,
        "ragged_losses": ragged_losses,
        "variable_types": sorted({type(v.value).__name__ for v in mirrored.weights}),
        "variable_devices": sorted({d.split("/")[-1] for v in mirrored.weights
                                    for d in [c.device for c in v.value.values]}),
        "batch_error": batch_error, "tf_batch_error": tf_batch_error,
    }


def torch_rank(rank, world_size, output_dir):
    """One process: the same model in DistributedDataParallel, a torch SGD loop.

    SGD, so that the averaged gradients of DDP must give the single process's weights (Adam
    divides by sqrt(v) and turns rounding noise in near-zero gradients into full steps)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    x, y = data(equal_lengths=True)
    m = model()
    trained = DistributedDataParallel(m) if world_size > 1 else m
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
    loss_fn = keras_tfm.MaskedSparseCategoricalCrossentropy()
    losses = []
    for _ in range(EPOCHS):
        total = torch.zeros(())
        for start in range(0, len(y), BATCH):
            rows = slice(start + rank, start + BATCH, world_size)  # this rank's share
            logits = trained([torch.as_tensor(x[0][rows]), torch.as_tensor(x[1][rows])])
            loss = loss_fn(torch.as_tensor(y[rows]), logits)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(float(total) / (len(y) // BATCH) / world_size)
    weights = {v.path: keras.ops.convert_to_numpy(v.value) for v in m.weights}
    np.savez(os.path.join(output_dir, f"rank{rank}_of{world_size}.npz"), **weights)
    with open(os.path.join(output_dir, f"rank{rank}_of{world_size}.json"), "w") as f:
        json.dump({"losses": losses, "ddp": world_size > 1}, f)
    if world_size > 1:
        # End the rank here, without tearing the process group down: tearing it down can
        # deadlock (seen in CI: ~ProcessGroupGloo, run while the DDP reducer is freed, joins a
        # Gloo thread that waits for the GIL to free a finished all-reduce's tensors). Every
        # collective has completed and the results are on disk.
        os._exit(0)


def torch_checks(output_dir):
    import socket

    import torch

    torch_rank(0, 1, output_dir)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    torch.multiprocessing.spawn(torch_rank, args=(DEVICES, output_dir), nprocs=DEVICES)
    runs = {}
    for name in ["rank0_of1", *(f"rank{r}_of{DEVICES}" for r in range(DEVICES))]:
        with open(os.path.join(output_dir, name + ".json")) as f:
            runs[name] = json.load(f)
        weights = np.load(os.path.join(output_dir, name + ".npz"))
        runs[name]["weights"] = {k: weights[k] for k in weights.files}
    single = runs["rank0_of1"]["weights"]
    ranks = [runs[f"rank{r}_of{DEVICES}"]["weights"] for r in range(DEVICES)]
    return {
        "single_losses": runs["rank0_of1"]["losses"],
        "ddp_losses": runs[f"rank0_of{DEVICES}"]["losses"],
        "ddp_flags": [runs[f"rank{r}_of{DEVICES}"]["ddp"] for r in range(DEVICES)],
        "ranks_gap": max(float(np.abs(ranks[0][k] - w[k]).max()) for w in ranks for k in w),
        "single_gap": max(float(np.abs(ranks[0][k] - single[k]).max()) for k in single),
        "num_weights": len(single),
    }


if __name__ == "__main__":
    out = sys.argv[1]
    checks = {"jax": jax_checks, "tensorflow": tensorflow_checks, "torch": torch_checks}
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(checks[BACKEND](out), f)
