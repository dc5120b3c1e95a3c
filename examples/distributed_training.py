"""The toy translation model trained across several devices with the backend's own engine.

    KERAS_BACKEND=jax python examples/distributed_training.py [--devices N] [--model-parallel M]
    KERAS_BACKEND=tensorflow python examples/distributed_training.py [--devices N]
        [--epochs E] [--num-samples S] [--batch-size B] [--output-dir DIR] [--quick]
    KERAS_BACKEND=torch torchrun --nproc-per-node 8 examples/distributed_training.py

JAX: one device, `keras.distribution.DataParallel` over N devices, and `ModelParallel` on a
(N / M) x M mesh with `keras_tfm.distribution.get_layout_map`; translates held-out sentences
with each and reloads the model-parallel one without a distribution. TensorFlow: one device,
then `tf.distribute.MirroredStrategy`. PyTorch: one process, then N processes under
`DistributedDataParallel` with a torch loop (NCCL on GPUs, else Gloo; under `torchrun` it joins
torchrun's group). Without accelerators the CPU is split into N virtual devices. See
docs/scaling.md; results in benchmarks/README.md.
"""

import argparse
import contextlib
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2,
                        help="virtual CPU devices when there is no accelerator")
    parser.add_argument("--model-parallel", type=int, default=2,
                        help="JAX ModelParallel: devices each weight is split over")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-samples", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--output-dir", default="outputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run (for tests): few samples, one epoch, small model")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.num_samples, args.batch_size = 1, 512, 32
    return args


def set_up_devices(count):
    """Split the CPU into `count` devices, before the backend is imported (no-op with GPUs)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend == "jax":
        flag = f"--xla_force_host_platform_device_count={count}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    elif backend == "tensorflow":
        import tensorflow as tf

        if not tf.config.list_physical_devices("GPU"):
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])


def torch_train(rank, world_size, args, result_path=None):
    """One process of the torch run: the toy model in DistributedDataParallel, a torch loop.

    `rank` / `world_size` are this process's place in the group (world_size 1: no group, no
    DDP). Each global batch of `args.batch_size` rows is dealt out row by row to the ranks;
    DDP averages the ranks' gradients, so each step follows the mean of the ranks' losses.
    """
    import json

    import keras
    import numpy as np
    import torch
    import torch.distributed as dist
    import toy_data
    import toy_translation
    from torch.nn.parallel import DistributedDataParallel

    import keras_tfm

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local_rank)  # before the model: Keras puts weights on "cuda"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    keras_tfm.distribution.check_batch_size(args.batch_size, replicas=world_size)

    keras.utils.set_random_seed(args.seed)  # DDP also broadcasts rank 0's weights
    source, target = toy_data.make_dataset(args.num_samples, seed=args.seed)
    split = int(0.9 * len(source))  # the training rows of the Keras runs (no validation here)
    source, target = source[:split], target[:split]
    steps = len(source) // args.batch_size  # full global batches only
    model = toy_translation.build_model(args.quick)  # its Keras optimizer stays unused
    trained = DistributedDataParallel(model) if world_size > 1 else model
    schedule = keras_tfm.TransformerSchedule(d_model=model.get_layer("logits").kernel.shape[0],
                                             warmup_steps=200, scale=0.25)
    optimizer = torch.optim.Adam(trained.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: float(schedule(i)))
    loss_fn = keras_tfm.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    def tensor(array):
        return torch.as_tensor(np.ascontiguousarray(array), device=device)

    start = time.perf_counter()
    losses = []
    for _ in range(args.epochs):
        total = torch.zeros((), device=device)
        for step in range(steps):
            rows = slice(step * args.batch_size + rank, (step + 1) * args.batch_size, world_size)
            logits = trained([tensor(source[rows]), tensor(target[rows, :-1])], training=True)
            loss = loss_fn(tensor(target[rows, 1:]), logits)
            optimizer.zero_grad()
            loss.backward()
            for parameter in trained.parameters():  # per weight, as Keras's clipnorm=1.0
                torch.nn.utils.clip_grad_norm_(parameter, 1.0)
            optimizer.step()
            lr_schedule.step()
            total += loss.detach()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(float(total) / steps / world_size)
    seconds = time.perf_counter() - start
    result = {"losses": losses, "seconds": seconds}
    if rank == 0:
        test_source, test_target = toy_data.make_dataset(500, seed=args.seed + 10_000)
        with torch.no_grad():
            predicted = toy_translation.translate(model, test_source)
        result["exact"] = float(toy_translation.accuracies(predicted, test_target)[1])
        if world_size > 1:
            path = os.path.join(args.output_dir, "ddp.keras")
            keras_tfm.saving.save_model(model, path)  # the Keras model inside DDP, rank 0 only
            result["saved"] = path
        if result_path:
            with open(result_path, "w") as f:
                json.dump(result, f)
    if world_size > 1:
        if rank == 0 and "RANK" in os.environ:  # under torchrun: report before leaving
            print(f"DDP over {world_size} processes: loss per epoch "
                  f"{' '.join(f'{v:.4f}' for v in losses)}, exact {result['exact']:.2%}")
        sys.stdout.flush()
        # End the rank without tearing the process group down: that can deadlock (seen here:
        # ~ProcessGroupGloo, run while the DDP reducer is freed, joins a Gloo thread waiting for
        # the GIL). Every collective has completed and rank 0 has written its results.
        os._exit(0)
    return result


def run_torch(args):
    """One process, then DDP over `args.devices` processes (or join torchrun's group)."""
    import json
    import socket

    import torch

    if "RANK" in os.environ:  # started by torchrun: this process is one rank of the group
        return torch_train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    single = torch_train(0, 1, args)
    report("one process", 1, single["losses"], single["exact"], single["seconds"])
    world_size = torch.cuda.device_count() or args.devices
    with socket.socket() as probe:  # a free port for the rendezvous on this host
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    result_path = os.path.join(args.output_dir, "ddp_result.json")
    torch.multiprocessing.spawn(torch_train, args=(world_size, args, result_path),
                                nprocs=world_size)
    with open(result_path) as f:
        ddp = json.load(f)
    report(f"DistributedDataParallel over {world_size}", world_size, ddp["losses"],
           ddp["exact"], ddp["seconds"])
    print(f"\nrank 0 saved {ddp['saved']}")
    return {"single": single["losses"], "DistributedDataParallel": ddp["losses"]}


def report(name, replicas, losses, exact, seconds, val_accuracy=None):
    val = f"  val token accuracy {val_accuracy:.2%}" if val_accuracy is not None else ""
    print(f"{name:38s} replicas {replicas}  loss per epoch "
          f"{' '.join(f'{v:.4f}' for v in losses)}{val}  exact {exact:.2%}  ({seconds:.1f} s)")


def compare(single, curves):
    for name, curve in curves.items():
        gap = max(abs(a - b) for a, b in zip(curve, single))
        print(f"{name}: largest loss difference from one device {gap:.1e}")


def main(argv=None):
    args = parse_args(argv)
    set_up_devices(args.devices)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import keras
    import numpy as np
    import toy_data
    import toy_translation

    import keras_tfm

    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    backend = keras.backend.backend()
    if backend == "torch":
        if "RANK" not in os.environ or os.environ["RANK"] == "0":
            print(f"keras {keras.__version__}, backend {backend}")
        curves = run_torch(args)
        if "single" in curves:
            compare(curves["single"], {"DistributedDataParallel": curves["DistributedDataParallel"]})
        return curves
    source, target = toy_data.make_dataset(args.num_samples, seed=args.seed)
    split = int(0.9 * len(source))
    train = ([source[:split], target[:split, :-1]], target[:split, 1:])
    val = ([source[split:], target[split:, :-1]], target[split:, 1:])
    test_source, test_target = toy_data.make_dataset(500, seed=args.seed + 10_000)

    def run(name, scope=None, distribution=None):
        """Build, train and evaluate the toy model under a strategy scope / distribution."""
        keras.utils.set_random_seed(args.seed)  # the same initial weights for every run
        if distribution is not None:
            scope = distribution.scope()
        with scope or contextlib.nullcontext():
            replicas = keras_tfm.distribution.check_batch_size(args.batch_size, len(train[1]))
            keras_tfm.distribution.check_batch_size(args.batch_size, len(val[1]))
            model = toy_translation.build_model(args.quick)
            start = time.perf_counter()
            history = model.fit(*train, validation_data=val, batch_size=args.batch_size,
                                epochs=args.epochs, shuffle=False, verbose=0)
            seconds = time.perf_counter() - start
            predicted = toy_translation.translate(model, test_source)
        _, exact = toy_translation.accuracies(predicted, test_target)
        losses = history.history["loss"]
        report(name, replicas, losses, exact, seconds, history.history["val_masked_accuracy"][-1])
        return model, losses

    print(f"keras {keras.__version__}, backend {backend}")
    _, single = run("one device")
    if backend == "jax":
        devices = keras.distribution.list_devices()
        print(f"devices: {devices}")
        _, data_parallel = run(f"DataParallel over {len(devices)}",
                               distribution=keras.distribution.DataParallel(devices=devices))
        model_axis = args.model_parallel
        if model_axis < 1 or len(devices) % model_axis:
            raise SystemExit(f"--model-parallel {model_axis} does not divide the {len(devices)} "
                             "devices.")
        mesh = keras.distribution.DeviceMesh((len(devices) // model_axis, model_axis),
                                             ("batch", "model"), devices)
        layout_map = keras_tfm.distribution.get_layout_map(mesh)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                        batch_dim_name="batch")
        model, model_parallel = run(f"ModelParallel on a {mesh.shape} mesh",
                                    distribution=distribution)
        kernel = model.get_layer("encoder_block_0").feed_forward.intermediate_dense.kernel
        shard = kernel.value.addressable_shards[0].data
        print(f"\n{kernel.path}: {tuple(kernel.shape)}, sharding "
              f"{kernel.value.sharding.spec}, one shard {tuple(shard.shape)}")
        path = os.path.join(args.output_dir, "model_parallel.keras")
        keras_tfm.saving.save_model(model, path)  # atomic: a temporary file, then a rename
        reloaded = keras_tfm.saving.load_model(path)  # no distribution: one device
        gap = np.abs(np.asarray(reloaded.predict(val[0], verbose=0))
                     - np.asarray(model.predict(val[0], verbose=0))).max()
        print(f"saved {path}; reloaded without a distribution, max logit difference {gap:.1e}")
        curves = {"DataParallel": data_parallel, "ModelParallel": model_parallel}
    else:
        import tensorflow as tf

        devices = [d.name for d in tf.config.list_logical_devices(
            "GPU" if tf.config.list_physical_devices("GPU") else "CPU")]
        strategy = tf.distribute.MirroredStrategy(devices)
        model, mirrored = run(f"MirroredStrategy over {len(devices)}", scope=strategy.scope())
        kernel = model.get_layer("logits").kernel
        print(f"\n{kernel.path}: {type(kernel.value).__name__} on "
              f"{[v.device.split('/')[-1] for v in kernel.value.values]}")
        curves = {"MirroredStrategy": mirrored}
    compare(single, curves)
    return {"single": single, **curves}


if __name__ == "__main__":
    main()
