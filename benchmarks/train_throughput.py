"""Training throughput side by side: keras_tfm against keras_hub, Keras MultiHeadAttention and
torch.nn.Transformer, on the same random padded batches, in one process per backend.

    python benchmarks/train_throughput.py --backend jax --config small [--json out.json]
    python benchmarks/train_throughput.py --all [--output-dir benchmarks/results]   # 3 x 2 runs
    python benchmarks/train_throughput.py --report   # tables + train_throughput.png from those
    python benchmarks/train_throughput.py --backend jax --dropout 0   # the models without dropout
    python benchmarks/train_throughput.py --backend jax --models keras_tfm keras_tfm_unchecked \
        keras_tfm_reloaded   # the cost of the token-id checks; a file saved under torch

The same post-LN encoder-decoder (dropout 0.1 where keras_hub puts it) built as
`keras_tfm.build_transformer`, from keras_hub's `TransformerEncoder` / `TransformerDecoder`,
from `keras.layers.MultiHeadAttention`, and (under torch) as `torch.nn.Transformer` with a plain
Adam loop. Reported: training tokens/s (median over repeats timed in turns), keras_tfm's ratio
to each peer and to the faster Keras peer (also per round), and the matmul FLOP/s and bound.
Method and results: benchmarks/README.md.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

DROPOUT = 0.1  # the configs' rate; --dropout runs another
CONFIGS = {
    "small": dict(d_model=128, num_heads=4, ff_dim=512, layers=2, length=32, batch=64,
                  vocab=1000, warmup=3, steps=6, repeats=7, dropout=DROPOUT),
    "base": dict(d_model=512, num_heads=8, ff_dim=2048, layers=2, length=64, batch=16,
                 vocab=1000, warmup=2, steps=3, repeats=5, dropout=DROPOUT),
    # the paper's base model on short sentences, 4,096-token batches (train_peers.py)
    "paper_base": dict(d_model=512, num_heads=8, ff_dim=2048, layers=6, length=32, batch=128,
                       vocab=8000, warmup=1, steps=2, repeats=3, dropout=DROPOUT),
}
BACKENDS = ("jax", "tensorflow", "torch")
POOL = 8  # distinct batches, cycled


def make_batches(cfg, seed=0):
    """`POOL` batches of source tokens, decoder inputs and targets, each row padded (0) after a
    random length between half and the full length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n, length, vocab = POOL * cfg["batch"], cfg["length"], cfg["vocab"]

    def padded(lengths):
        tokens = rng.integers(1, vocab, (n, length))
        tokens[np.arange(length)[None] >= lengths[:, None]] = 0
        return tokens.astype("int32")

    src = padded(rng.integers(length // 2, length + 1, n))
    # length + 1 target tokens: decoder inputs are the first `length`, targets the last.
    length += 1
    tgt = padded(rng.integers(length // 2, length + 1, n))
    from keras_tfm import check_token_ids  # (imports Keras: KERAS_BACKEND is set by now)

    src, tgt = (check_token_ids(ids, vocab, name=name) for ids, name in ((src, "src"),
                                                                         (tgt, "tgt")))
    return src, tgt[:, :-1], tgt[:, 1:]


def matmul_flops(cfg):
    """Forward matmul FLOPs of one batch, and the GEMM shapes (M, K, N, batch, flops)."""
    b, s, d, f, v, h = (cfg[k] for k in ("batch", "length", "d_model", "ff_dim", "vocab",
                                         "num_heads"))
    t, n, dk = s, cfg["layers"], cfg["d_model"] // cfg["num_heads"]
    shapes = []

    def gemm(m, k, n_, count=1, batch=1):
        shapes.append((m, k, n_, batch, count * 2 * m * k * n_ * batch))

    rows = b * s
    for _ in range(n):  # encoder blocks
        gemm(rows, d, d, count=4)          # q, k, v, output projections
        gemm(s, dk, s, batch=b * h)       # scores
        gemm(s, s, dk, batch=b * h)       # weights @ values
        gemm(rows, d, f)                   # feed-forward in
        gemm(rows, f, d)                   # feed-forward out
    for _ in range(n):  # decoder blocks
        gemm(b * t, d, d, count=4)         # self-attention projections
        gemm(t, dk, t, batch=b * h)
        gemm(t, t, dk, batch=b * h)
        gemm(b * t, d, d, count=2)         # cross-attention q and output
        gemm(rows, d, d, count=2)          # cross-attention k, v (encoder side)
        gemm(t, dk, s, batch=b * h)
        gemm(t, s, dk, batch=b * h)
        gemm(b * t, d, f)
        gemm(b * t, f, d)
    gemm(b * t, d, v)                      # logits
    return sum(x[-1] for x in shapes), shapes


# ---------------------------------------------------------------------------------------------
# Models


def sinusoidal_table(length, d_model):
    import numpy as np

    position = np.arange(length)[:, None]
    rates = 1.0 / 10000 ** (np.arange(0, d_model, 2) / d_model)
    table = np.zeros((length, d_model), "float32")
    table[:, 0::2], table[:, 1::2] = np.sin(position * rates), np.cos(position * rates)
    return table


def build_keras_tfm(cfg):
    import keras_tfm

    return keras_tfm.build_transformer(
        cfg["vocab"], cfg["vocab"], d_model=cfg["d_model"], num_heads=cfg["num_heads"],
        ff_dim=cfg["ff_dim"], num_encoder_layers=cfg["layers"],
        num_decoder_layers=cfg["layers"], dropout=cfg["dropout"], activation_dropout=0.0)


def _inputs():
    import keras

    return (keras.Input((None,), dtype="int32", name="encoder_tokens"),
            keras.Input((None,), dtype="int32", name="decoder_tokens"))


def build_keras_hub(cfg):
    import keras
    import keras_hub
    from keras import ops

    d = cfg["d_model"]
    enc_tokens, dec_tokens = _inputs()

    def embed(tokens):
        x = keras.layers.Embedding(cfg["vocab"], d)(tokens) * (d ** 0.5)
        x = x + keras_hub.layers.SinePositionEncoding()(x)
        return keras.layers.Dropout(cfg["dropout"])(x)

    enc_mask, dec_mask = ops.not_equal(enc_tokens, 0), ops.not_equal(dec_tokens, 0)
    x = embed(enc_tokens)
    for _ in range(cfg["layers"]):
        x = keras_hub.layers.TransformerEncoder(cfg["ff_dim"], cfg["num_heads"],
                                                dropout=cfg["dropout"])(x, padding_mask=enc_mask)
    y = embed(dec_tokens)
    for _ in range(cfg["layers"]):
        y = keras_hub.layers.TransformerDecoder(cfg["ff_dim"], cfg["num_heads"],
                                                dropout=cfg["dropout"])(
            y, x, decoder_padding_mask=dec_mask, encoder_padding_mask=enc_mask)
    logits = keras.layers.Dense(cfg["vocab"])(y)
    return keras.Model([enc_tokens, dec_tokens], logits)


def build_keras_mha(cfg):
    import keras
    from keras import ops

    d, heads = cfg["d_model"], cfg["num_heads"]
    enc_tokens, dec_tokens = _inputs()
    table = sinusoidal_table(cfg["length"], d)

    def embed(tokens):
        x = keras.layers.Embedding(cfg["vocab"], d)(tokens) * (d ** 0.5)
        x = x + table[None, : cfg["length"]]
        return keras.layers.Dropout(cfg["dropout"])(x)

    def residual(x, sublayer_output):
        return keras.layers.LayerNormalization(epsilon=1e-5)(
            x + keras.layers.Dropout(cfg["dropout"])(sublayer_output))

    def feed_forward(x):
        return keras.layers.Dense(d)(keras.layers.Dense(cfg["ff_dim"], activation="relu")(x))

    def attention():
        return keras.layers.MultiHeadAttention(heads, d // heads, dropout=cfg["dropout"])

    enc_mask, dec_mask = ops.not_equal(enc_tokens, 0), ops.not_equal(dec_tokens, 0)
    x = embed(enc_tokens)
    for _ in range(cfg["layers"]):
        x = residual(x, attention()(x, x, query_mask=enc_mask, value_mask=enc_mask))
        x = residual(x, feed_forward(x))
    y = embed(dec_tokens)
    for _ in range(cfg["layers"]):
        y = residual(y, attention()(y, y, query_mask=dec_mask, value_mask=dec_mask,
                                    use_causal_mask=True))
        y = residual(y, attention()(y, x, query_mask=dec_mask, value_mask=enc_mask))
        y = residual(y, feed_forward(y))
    logits = keras.layers.Dense(cfg["vocab"])(y)
    return keras.Model([enc_tokens, dec_tokens], logits)


KERAS_MODELS = {"keras_tfm": build_keras_tfm, "keras_hub": build_keras_hub,
                "keras_mha": build_keras_mha}
KERAS_PEERS = ("keras_hub", "keras_mha")  # keras_tfm ÷ the faster of these is the bar


@contextlib.contextmanager
def unchecked_ids():
    """keras_tfm without its in-graph token-id checks (a plain lookup, every target valid), to
    measure what they cost: `keras_tfm_unchecked` is built, traced and run inside this."""
    import keras
    import keras_tfm.embedding
    import keras_tfm.losses

    saved = keras_tfm.embedding.embed_or_nan, keras_tfm.losses.in_vocabulary
    keras_tfm.embedding.embed_or_nan = lambda embedding, ids, vocab_size: embedding(ids)
    keras_tfm.losses.in_vocabulary = lambda ids, vocab_size: keras.ops.ones_like(ids, "bool")
    try:
        yield
    finally:
        keras_tfm.embedding.embed_or_nan, keras_tfm.losses.in_vocabulary = saved


def save_under_torch(cfg, path):
    """Build and compile keras_tfm as `keras_runner` does, under torch, and save it to `path`
    (its file then carries jit_compile=False, what "auto" resolves to under torch)."""
    env = dict(os.environ, KERAS_BACKEND="torch")
    subprocess.run([sys.executable, __file__, "--save-torch-model", path, "--cfg",
                    json.dumps(cfg)], check=True, env=env)


def _save_torch_model(path, cfg):
    import keras

    import keras_tfm

    keras.utils.set_random_seed(0)
    model = build_keras_tfm(cfg)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras_tfm.MaskedSparseCategoricalCrossentropy())
    keras_tfm.saving.save_model(model, path)


def build_keras_tfm_reloaded(cfg):
    """keras_tfm saved under torch, loaded here with keras_tfm.saving.load_model (compiled)."""
    import tempfile

    import keras_tfm

    path = os.path.join(tempfile.mkdtemp(), "torch_saved.keras")
    save_under_torch(cfg, path)
    return keras_tfm.saving.load_model(path)


# Not in the default runs: `--models keras_tfm keras_tfm_unchecked keras_tfm_reloaded
# keras_tfm_xla` (the last: compiled with `jit_compile=True`, XLA, which "auto" leaves off for
# TensorFlow on a CPU).
EXTRA_MODELS = {"keras_tfm_unchecked": build_keras_tfm, "keras_tfm_reloaded":
                build_keras_tfm_reloaded, "keras_tfm_xla": build_keras_tfm}


def unautotuned_dataset(x, y, batch_size):
    """The same batches as a `tf.data.Dataset` with tf.data's autotuning off.

    Given NumPy arrays, Keras's TensorFlow trainer builds an autotuned tf.data pipeline, whose
    speed changed at random from one `fit` call to the next on a small CPU machine
    (benchmarks/README.md)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(batch_size)
    return dataset.with_options(options)


def keras_runner(build, cfg, batches, jit_compile="auto"):
    """A compiled, warmed-up Keras model; returns `run(offset)` (cfg["steps"] training steps
    of `model.fit`) and the parameter count."""
    import keras

    import keras_tfm

    keras.utils.set_random_seed(0)
    model = build(cfg)
    if not model.compiled:  # (keras_tfm_reloaded comes compiled from its file)
        model.compile(optimizer=keras.optimizers.Adam(1e-4),
                      loss=keras_tfm.MaskedSparseCategoricalCrossentropy(),
                      jit_compile=jit_compile)
    src, dec_in, tgt = batches
    b = cfg["batch"]

    def fit(steps, offset=0):
        rows = [(offset + i) % POOL for i in range(steps)]
        idx = [r * b + j for r in rows for j in range(b)]
        x, y = [src[idx], dec_in[idx]], tgt[idx]
        if keras.backend.backend() == "tensorflow":
            model.fit(unautotuned_dataset(x, y, b), epochs=1, shuffle=False, verbose=0)
        else:
            model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)

    fit(cfg["warmup"])
    print(f"{build.__name__}: jit_compile={model.jit_compile}", flush=True)
    return (lambda offset: fit(cfg["steps"], offset)), model.count_params()


def unchecked_runner(cfg, batches):
    """`keras_runner` of keras_tfm built, traced and run with `unchecked_ids`."""
    with unchecked_ids():
        run, params = keras_runner(build_keras_tfm, cfg, batches)

    def run_unchecked(offset):
        with unchecked_ids():  # (torch runs eagerly: the Python code runs at every step)
            run(offset)

    return run_unchecked, params


def torch_native_runner(cfg, batches):
    """torch.nn.Transformer with a plain Adam loop; returns `run(offset)` and the parameters."""
    import numpy as np
    import torch

    torch.manual_seed(0)
    d, v = cfg["d_model"], cfg["vocab"]

    class Seq2Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.src_embedding = torch.nn.Embedding(v, d)
            self.tgt_embedding = torch.nn.Embedding(v, d)
            self.register_buffer("positions", torch.as_tensor(
                sinusoidal_table(cfg["length"], d)))
            self.dropout = torch.nn.Dropout(cfg["dropout"])
            self.transformer = torch.nn.Transformer(
                d, cfg["num_heads"], cfg["layers"], cfg["layers"], cfg["ff_dim"], cfg["dropout"],
                batch_first=True)
            self.logits = torch.nn.Linear(d, v)

        def embed(self, embedding, tokens):
            x = embedding(tokens) * d ** 0.5 + self.positions[: tokens.shape[1]]
            return self.dropout(x)

        def forward(self, src, tgt):
            t = tgt.shape[1]
            causal = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=torch.bool)
            src_pad, tgt_pad = src == 0, tgt == 0
            h = self.transformer(self.embed(self.src_embedding, src),
                                 self.embed(self.tgt_embedding, tgt), tgt_mask=causal,
                                 src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                                 memory_key_padding_mask=src_pad, tgt_is_causal=True)
            return self.logits(h)

    model = Seq2Seq().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=0)
    src, dec_in, tgt = (torch.as_tensor(np.asarray(a, "int64")) for a in batches)
    b = cfg["batch"]

    def step(i):
        rows = slice((i % POOL) * b, (i % POOL + 1) * b)
        logits = model(src[rows], dec_in[rows])
        loss = loss_fn(logits.reshape(-1, v), tgt[rows].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for i in range(cfg["warmup"]):
        step(i)

    def run(offset):
        for i in range(cfg["steps"]):
            step(offset + i)

    return run, sum(p.numel() for p in model.parameters())


def time_interleaved(runners, cfg):
    """Seconds per step of each runner: the repeats go round the runners in turn, so a slow
    spell of the machine falls on all of them alike; median per runner. One untimed round
    first, once every runner is built: under TensorFlow the first call of each model but the
    last one built was slower than its later calls."""
    for run in runners.values():
        run(0)
    times = {name: [] for name in runners}
    for r in range(cfg["repeats"]):
        for name, run in runners.items():
            start = time.perf_counter()
            run(r)
            times[name].append((time.perf_counter() - start) / cfg["steps"])
    return {name: statistics.median(t) for name, t in times.items()}, times


def paired_ratio(times, ours="keras_tfm", peers=None):
    """Median over the timed rounds of (that round's faster peer's time ÷ ours), from the
    per-round times `time_interleaved` returns: a slow spell over one round moves every model
    of it alike, so it cancels here but not in the ratio of the medians. `peers`: default the
    Keras peers. None without peers."""
    peers = [name for name in peers or KERAS_PEERS if name in times]
    if ours not in times or not peers:
        return None
    return statistics.median(min(times[name][r] for name in peers) / t
                             for r, t in enumerate(times[ours]))


# ---------------------------------------------------------------------------------------------
# Matmul rates on this backend


def matmul_rate(m, k, n, batch=1, repeats=5):
    """FLOP/s of a (batch,) m x k @ k x n fp32 matmul through keras.ops, compiled as Keras
    compiles the models (jax.jit; tf.function, with XLA only on a GPU; torch eager), median of
    repeats."""
    import keras
    import numpy as np

    backend = keras.backend.backend()
    shape_a = (batch, m, k) if batch > 1 else (m, k)
    shape_b = (batch, k, n) if batch > 1 else (k, n)
    a = keras.ops.convert_to_tensor(np.random.default_rng(0).random(shape_a, "float32"))
    b = keras.ops.convert_to_tensor(np.random.default_rng(1).random(shape_b, "float32"))
    if backend == "jax":
        import jax

        f = jax.jit(keras.ops.matmul)

        def run():
            f(a, b).block_until_ready()
    elif backend == "tensorflow":
        import tensorflow as tf

        # As Keras compiles the models: XLA only with a GPU (jit_compile="auto").
        f = tf.function(keras.ops.matmul,
                        jit_compile=bool(tf.config.list_physical_devices("GPU")))

        def run():
            f(a, b)  # eager calls return when done on the CPU; .numpy() would add a copy
    else:
        import torch

        def run():
            with torch.no_grad():
                keras.ops.matmul(a, b)
    flops = 2 * m * k * n * batch
    run()
    times = []
    inner = max(1, int(2e8 // flops))  # ~0.1 s per timing at least for tiny shapes
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            run()
        times.append((time.perf_counter() - start) / inner)
    return flops / statistics.median(times)


def matmul_bound(cfg):
    """Seconds per training step if every matmul ran at the rate this backend reaches at its
    shape (forward shapes measured, x 3 for forward + two backward matmuls); and the peak."""
    flops, shapes = matmul_flops(cfg)
    rates = {}
    seconds = 0.0
    for m, k, n, batch, f in shapes:
        key = (m, k, n, batch)
        if key not in rates:
            rates[key] = matmul_rate(m, k, n, batch)
        seconds += 3 * f / rates[key]
    peak = max(matmul_rate(2048, 2048, 2048), max(rates.values()))
    return 3 * flops, seconds, peak, {f"{m}x{k}@{k}x{n}" + (f" x{b}" if b > 1 else ""): r
                                      for (m, k, n, b), r in rates.items()}


# ---------------------------------------------------------------------------------------------


def run(backend, config, models=None, dropout=DROPOUT, repeats=None):
    os.environ["KERAS_BACKEND"] = backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    cfg = dict(CONFIGS[config], dropout=dropout)
    if repeats:
        cfg["repeats"] = repeats
    batches = make_batches(cfg)
    tokens = cfg["batch"] * 2 * cfg["length"]
    results = {"backend": backend, "config": config, "cfg": cfg, "dropout": dropout,
               "models": {}, "keras": keras.__version__, "date": time.strftime("%Y-%m-%d")}
    names = models or [*KERAS_MODELS, *(["torch_native"] if backend == "torch" else [])]
    runners, params = {}, {}
    for name in names:  # built, compiled and warmed up first; timed together below
        if name == "torch_native":
            runners[name], params[name] = torch_native_runner(cfg, batches)
        elif name == "keras_tfm_unchecked":
            runners[name], params[name] = unchecked_runner(cfg, batches)
        else:
            runners[name], params[name] = keras_runner(
                (KERAS_MODELS | EXTRA_MODELS)[name], cfg, batches,
                jit_compile=True if name == "keras_tfm_xla" else "auto")
    summary, calls = time_interleaved(runners, cfg)
    for name, seconds in summary.items():
        results["models"][name] = {"step_s": seconds, "tokens_per_s": tokens / seconds,
                                   "params": params[name], "calls_step_s": calls[name]}
        print(f"{backend:10s} {config:5s} {name:12s} {tokens / seconds:10,.0f} tokens/s  "
              f"{seconds * 1000:8.1f} ms/step  {params[name]:,} params", flush=True)
    train_flops, bound_s, peak, rates = matmul_bound(cfg)
    results.update(train_flops=train_flops, bound_s=bound_s, peak_flops=peak, rates=rates)
    ours = results["models"].get("keras_tfm")
    if ours:
        for name, r in results["models"].items():
            r["keras_tfm_speedup"] = ours["tokens_per_s"] / r["tokens_per_s"]
            if name != "keras_tfm":
                print(f"keras_tfm / {name}: {r['keras_tfm_speedup']:.2f}x")
        for extra in EXTRA_MODELS:  # its step time ÷ keras_tfm's, median over the rounds
            if extra in calls:
                ratio = statistics.median(ours_s / theirs for ours_s, theirs in
                                          zip(calls["keras_tfm"], calls[extra]))
                results[f"keras_tfm_vs_{extra}_per_round"] = ratio
                print(f"keras_tfm step / {extra} step, per round: {ratio:.3f}")
        peers = [results["models"][n]["tokens_per_s"] for n in KERAS_PEERS
                 if n in results["models"]]
        if peers:
            results["vs_faster_keras_peer"] = ours["tokens_per_s"] / max(peers)
            results["vs_faster_keras_peer_per_round"] = paired_ratio(calls)
        results["achieved_flops"] = train_flops / ours["step_s"]
        results["fraction_of_peak"] = results["achieved_flops"] / peak
        results["step_over_bound"] = ours["step_s"] / bound_s
        print(f"keras_tfm / faster Keras peer: {results.get('vs_faster_keras_peer', 0):.2f}x "
              f"(per round: {results.get('vs_faster_keras_peer_per_round') or 0:.2f}x); "
              f"{train_flops / 1e9:.1f} GFLOP/step, {results['achieved_flops'] / 1e9:.1f} "
              f"GFLOP/s = {results['fraction_of_peak']:.0%} of the {peak / 1e9:.1f} GFLOP/s "
              f"matmul peak; matmul bound {bound_s * 1000:.1f} ms/step, keras_tfm step = "
              f"{results['step_over_bound']:.2f}x bound", flush=True)
    return results


def report(output_dir):
    """Markdown tables of every results file in `output_dir` and a PNG of the throughputs."""
    import glob

    results = {}
    for path in sorted(glob.glob(os.path.join(output_dir, "train_*_*.json"))):
        with open(path) as f:
            r = json.load(f)
        if r.get("dropout", DROPOUT) != DROPOUT:  # a --dropout run written under that name
            print(f"skipped {path}: dropout {r['dropout']}, not the reported {DROPOUT}")
            continue
        results[(r["config"], r["backend"])] = r
    if not results:
        print(f"no train_*_*.json results in {output_dir}")
        return
    names = ["keras_tfm", "keras_hub", "keras_mha", "torch_native"]
    peers = names[1:]
    lines = ["| config | backend | " + " | ".join(names) + " | "
             + " | ".join(f"keras_tfm ÷ {n}" for n in peers) + " | keras_tfm ÷ faster Keras peer |"
             " same, per round |",
             "|---|---|" + "---|" * (len(names) + len(peers) + 2)]
    bound = [("| config | backend | matmul GFLOP/step | matmul peak GFLOP/s | keras_tfm GFLOP/s "
              "(% of peak) | matmul bound ms/step | keras_tfm ms/step | step ÷ bound |"),
             "|---|---|---|---|---|---|---|---|"]
    for (config, backend), r in sorted(results.items(), key=lambda kv: (kv[0][0] != "small",
                                                                         kv[0][1])):
        cells = [f"{r['models'][n]['tokens_per_s']:,.0f}" if n in r["models"] else "–"
                 for n in names]
        ratios = [f"{r['models'][n]['keras_tfm_speedup']:.2f}×" if n in r["models"] else "–"
                  for n in peers]
        per_round = paired_ratio({n: m["calls_step_s"] for n, m in r["models"].items()
                                  if "calls_step_s" in m})  # (not in the oldest files)
        lines.append(f"| {config} | {backend} | " + " | ".join(cells) + " | "
                     + " | ".join(ratios) + f" | {r['vs_faster_keras_peer']:.2f}× | "
                     + ("–" if per_round is None else f"{per_round:.2f}×") + " |")
        ours = r["models"]["keras_tfm"]
        bound.append(f"| {config} | {backend} | {r['train_flops'] / 1e9:.1f} | "
                     f"{r['peak_flops'] / 1e9:.0f} | {r['achieved_flops'] / 1e9:.0f} "
                     f"({r['fraction_of_peak']:.0%}) | {r['bound_s'] * 1000:.0f} | "
                     f"{ours['step_s'] * 1000:.0f} | {r['step_over_bound']:.2f}× |")
    print("\n".join(lines) + "\n\n" + "\n".join(bound))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    configs = [c for c in ("small", "base") if any(k[0] == c for k in results)]
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        width = 0.2
        for i, name in enumerate(names):
            values = [results[(config, b)]["models"].get(name, {}).get("tokens_per_s", 0)
                      if (config, b) in results else 0 for b in BACKENDS]
            ax.bar([j + (i - 1.5) * width for j in range(len(BACKENDS))], values, width,
                   label=name)
        ax.set_xticks(range(len(BACKENDS)), BACKENDS)
        ax.set_ylabel("training tokens/s (source + target)")
        ax.set_title(f"{config} config")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(names))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path = os.path.join(output_dir, "train_throughput.png")
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--models", nargs="*", help="a subset of " + ", ".join(
        [*KERAS_MODELS, "torch_native", *EXTRA_MODELS]))
    parser.add_argument("--repeats", type=int, help="timed rounds (default: the config's)")
    parser.add_argument("--save-torch-model", help=argparse.SUPPRESS)  # save_under_torch
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dropout", type=float, default=DROPOUT,
                        help=f"the models' dropout rate (default {DROPOUT}; 0 compares the "
                        "models without it; not with --all, whose files --report reads)")
    parser.add_argument("--all", action="store_true",
                        help="every backend and config, each in its own process")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__),
                                                             "results"))
    parser.add_argument("--report", action="store_true",
                        help="tables and a PNG plot from the results in --output-dir")
    args = parser.parse_args()
    if args.save_torch_model:
        _save_torch_model(args.save_torch_model, json.loads(args.cfg))
        return
    if args.all and args.dropout != DROPOUT:
        parser.error(f"--all runs the reported comparison, at dropout {DROPOUT}; run one "
                     "--backend with --dropout instead")
    if args.report:
        report(args.output_dir)
        return
    if args.all:
        os.makedirs(args.output_dir, exist_ok=True)
        for config in ("small", "base"):
            for backend in BACKENDS:
                out = os.path.join(args.output_dir, f"train_{backend}_{config}.json")
                subprocess.run([sys.executable, __file__, "--backend", backend, "--config",
                                config, "--json", out], check=True)
        return
    if not args.backend:
        parser.error("--backend (or --all) is required")
    results = run(args.backend, args.config, args.models, args.dropout, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
