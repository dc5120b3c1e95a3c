"""Decoding speed against the engines people deploy: transformers and CTranslate2, same weights.

    python benchmarks/decode_peers.py                   # opus-mt-base shape, every engine
    python benchmarks/decode_peers.py --stream 100 --batch64
    python benchmarks/decode_peers.py --small           # a tiny shape (the tests use it)
    python benchmarks/decode_peers.py --device cuda --engines transformers keras_tfm-jax ...

One MarianMTModel with random weights is saved once to a temporary directory and loaded into
transformers (PyTorch), CTranslate2 (`TransformersConverter`; float32 and int8 compute) and
keras_tfm (`from_marian`) under JAX, TensorFlow and PyTorch (and under JAX after
`model.quantize("int8")`, beside CTranslate2 int8); every engine runs in its own
process, on the same sources (random ids ending with </s>), and each call of a cell is taken
on every engine in turn (the machine's drift falls on all alike). Cells: batch 1 and 16
greedy, batch 16 beam 4 (and 64 greedy with `--batch64`), each exactly 32 new tokens (transformers
`min_new_tokens`, CTranslate2 `min_decoding_length`, keras_tfm `end_id=None`), median of
`--repeats` after a warm-up, and batch 1 greedy with 128 new tokens; decoding time against
the number of new tokens (linear when 128 tokens take at most 4× the time of 32) from
`LINEAR_REPEATS` turns of a batch-1 call of 32 and one of 128 tokens (the median ratio); and the two
stream cells, run first, wall time with compilation: `--stream` sources of
random lengths 5-60, one call each, then the same sources in batches of 16 of mixed lengths
(transformers and CTranslate2 one call per batch; keras_tfm one `generate(...,
batch_size=16)` call, which pads every source to the longest of all; `--no-length-buckets`:
keras_tfm-jax compiles once per source length). Greedy tokens of a
mixed-length batch (natural end) are compared across engines. Results:
results/decode_peers.json and .png.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types

import numpy as np

import per_backend

SHAPES = {  # base: opus-mt's shape and layout (one matrix for both embeddings and the logits)
    "base": dict(d_model=512, heads=8, ff=2048, layers=6, vocab=32000, tied=True),
    # small: untied logits, as random tied weights decode one repeated token; here they vary.
    "small": dict(d_model=16, heads=2, ff=32, layers=2, vocab=64, tied=False),
}
KERAS_ENGINES = ("keras_tfm-jax", "keras_tfm-tensorflow", "keras_tfm-torch")
KERAS_INT8 = ("keras_tfm-jax-int8",)  # model.quantize("int8"), beside CTranslate2's int8
PEERS = ("transformers", "ctranslate2-float32", "ctranslate2-int8")
ENGINES = PEERS + KERAS_ENGINES + KERAS_INT8
NEW_TOKENS, LONG, SOURCE_LENGTH, STREAM_LENGTHS = 32, 128, 24, (5, 60)
EOS = 0  # Marian: </s> = 0, <unk> = 1, <pad> = the last id
# (name, batch, beam): the fixed-shape cells.
CELLS = (("batch 1, greedy", 1, 1), ("batch 16, greedy", 16, 1), ("batch 16, beam 4", 16, 4))
BATCH64 = ("batch 64, greedy", 64, 1)
LONG_CELL = f"batch 1, greedy, {LONG} tokens"
LINEAR_REPEATS = 7  # batch-1 calls of NEW_TOKENS and of LONG tokens, in turns: linear in tokens?
STREAM = "stream, one call each"
STREAM16 = "stream, batches of 16"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def vocabulary(size):
    return ["</s>", "<unk>"] + [f"▁t{i}" for i in range(2, size - 1)] + ["<pad>"]


def write_model(path, shape, seed=0):
    """A MarianMTModel with random weights (std 0.1; the default init decodes one repeated
    token), the padding row of the embeddings zero (CTranslate2 starts the decoder from a
    zero embedding where transformers embeds the padding id), saved to path."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    vocab = shape["vocab"]
    config = MarianConfig(
        vocab_size=vocab, decoder_vocab_size=vocab, d_model=shape["d_model"],
        encoder_layers=shape["layers"], decoder_layers=shape["layers"],
        encoder_attention_heads=shape["heads"], decoder_attention_heads=shape["heads"],
        encoder_ffn_dim=shape["ff"], decoder_ffn_dim=shape["ff"], max_position_embeddings=512,
        pad_token_id=vocab - 1, decoder_start_token_id=vocab - 1, eos_token_id=EOS,
        forced_eos_token_id=None, activation_function="swish", scale_embedding=True,
        dropout=0.0, tie_word_embeddings=shape["tied"])
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" not in name and "embed_positions" not in name:
                parameter.normal_(0.0, 0.1)
        for embedding in (model.model.shared, model.model.encoder.embed_tokens,
                          model.model.decoder.embed_tokens):  # (separate when untied)
            embedding.weight[vocab - 1] = 0.0
        model.final_logits_bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def convert_ctranslate2(model_dir, output_dir):
    """CTranslate2's converter, with the tokenizer it reads replaced by the vocabulary alone
    (it needs `get_vocab`, `eos_token` and `unk_token`; no SentencePiece files here)."""
    import ctranslate2
    from transformers import AutoConfig

    tokens = vocabulary(AutoConfig.from_pretrained(model_dir).vocab_size)
    tokenizer = types.SimpleNamespace(get_vocab=lambda: {t: i for i, t in enumerate(tokens)},
                                      eos_token="</s>", unk_token="<unk>")

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return tokenizer

    Converter(model_dir).convert(output_dir, force=True)
    return output_dir


def sources(vocab, stream):
    """The fixed-shape sources (64 of length 24), the stream (`stream` of random lengths) and a
    mixed-length batch of 16 for the token check; random ids, </s> last."""
    rng = np.random.default_rng(0)

    def source(length):
        return np.append(rng.integers(2, vocab - 1, length - 1), EOS).astype("int32")

    fixed = [source(SOURCE_LENGTH) for _ in range(64)]
    lengths = rng.integers(STREAM_LENGTHS[0], STREAM_LENGTHS[1] + 1, stream)
    return fixed, [source(n) for n in lengths], [source(n) for n in rng.integers(5, 40, 16)]


def pad_batch(batch, pad):
    width = max(len(s) for s in batch)
    return np.stack([np.pad(s, (0, width - len(s)), constant_values=pad) for s in batch])


def cut(rows, pad):
    """Token lists up to and including </s>, padding dropped."""
    out = []
    for row in rows:
        row = [int(t) for t in row if t != pad]
        out.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return out


def count(rows, pad):
    """New tokens in rows of ids (padding not counted)."""
    return sum(sum(1 for t in row if t != pad) for row in rows)


def make_engine(name, model_dir, ct2_dir, length_buckets="auto", device="cpu"):
    """`translate(batch, beam, forced)` -> token lists for one engine (loaded here) that
    computes on `device` ("cpu" or "cuda")."""
    from transformers import AutoConfig

    pad = AutoConfig.from_pretrained(model_dir).pad_token_id
    if name == "transformers":
        import torch
        from transformers import MarianMTModel

        hf = MarianMTModel.from_pretrained(model_dir).eval().to(device)

        def translate(batch, beam, forced, new_tokens=NEW_TOKENS):
            ids = torch.tensor(pad_batch(batch, pad)).to(device)
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=ids != pad, num_beams=beam,
                                  do_sample=False, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens if forced else 0,
                                  suppress_tokens=[pad], forced_eos_token_id=None)
            return out.cpu().numpy()[:, 1:]
    elif name.startswith("ctranslate2"):
        import ctranslate2

        translator = ctranslate2.Translator(ct2_dir, device=device,
                                            compute_type=name.split("-")[1], inter_threads=1,
                                            intra_threads=os.cpu_count())
        tokens = vocabulary(pad + 1)
        ids = {t: i for i, t in enumerate(tokens)}

        def translate(batch, beam, forced, new_tokens=NEW_TOKENS):
            results = translator.translate_batch(
                [[tokens[i] for i in s] for s in batch], beam_size=beam,
                max_decoding_length=new_tokens, min_decoding_length=new_tokens if forced else 1,
                return_end_token=True)
            return [[ids[t] for t in r.hypotheses[0]] for r in results]
    else:
        backend = name.split("-")[1]
        os.environ["KERAS_BACKEND"] = backend
        import keras

        import keras_tfm

        if keras.backend.backend() != backend:
            raise ValueError(f"{name} needs a fresh process (Keras runs {keras.backend.backend()})")
        if device == "cuda" and per_backend.device_name() == "cpu":
            raise RuntimeError(f"{name}: no GPU here for --device cuda")
        if device == "cuda" and backend == "jax":  # float32 products in float32, as the
            import jax  # peers' (JAX's default on NVIDIA GPUs rounds them to TF32)

            jax.config.update("jax_default_matmul_precision", "highest")
        model = keras_tfm.from_marian(model_dir)
        if name in KERAS_INT8:
            model.quantize("int8")

        def translate(batch, beam, forced, new_tokens=NEW_TOKENS, batch_size=None):
            return keras_tfm.generate(model, pad_batch(batch, pad), max_length=new_tokens,
                                      method="beam" if beam > 1 else "greedy", beam_size=beam,
                                      end_id=None if forced else "auto",
                                      length_buckets=length_buckets, batch_size=batch_size)
    return translate, pad


def matmul_floor(shape, cells, repeats=3):
    """Seconds of the matmuls alone of each cell, on this Keras backend: the encoder's and the
    cross-attention keys'/values' projections of batch × 24 source tokens, then 32 decoder steps
    (batch × beam rows: 6 d×d projections and the feed-forward pair per layer, the logits), with
    distinct weights of the model's sizes (they stream from memory as the model's do), compiled
    as generate is (jax.jit, tf.function; torch eager, autograd off). No attention, softmax or
    search."""
    import keras
    from keras import ops

    d, ff, layers = shape["d_model"], shape["ff"], shape["layers"]
    rng = np.random.default_rng(1)

    def weights(shapes):
        return [ops.convert_to_tensor(rng.standard_normal(s, dtype=np.float32) * 0.02)
                for s in shapes]

    source_w = weights(([(d, d)] * 4 + [(d, ff), (ff, d)]) * layers + [(d, d)] * 2 * layers)
    step_w = weights(([(d, d)] * 6 + [(d, ff), (ff, d)]) * layers + [(d, shape["vocab"])])

    def chain(x, ws):
        for w in ws:
            x = ops.matmul(x, w)
        return x

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        chain = jax.jit(chain)
    elif backend == "tensorflow":
        import tensorflow as tf

        chain = tf.function(chain)
    else:
        import torch

        @torch.no_grad()
        def chain(x, ws):  # the products as generate runs them (torch.matmul)
            for w in ws:
                x = x @ w
            return x

    def seconds(rows, ws, calls):
        x = ops.convert_to_tensor(rng.standard_normal((rows, d), dtype=np.float32))
        ops.convert_to_numpy(chain(x, ws))  # warm-up: compilation
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            ops.convert_to_numpy(chain(x, ws))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return {cell: seconds(batch * SOURCE_LENGTH, source_w, repeats)
            + NEW_TOKENS * seconds(batch * beam, step_w, 3 * repeats)
            for cell, batch, beam in cells}


def _serve(conn, name, model_dir, ct2_dir, length_buckets, device):
    """An engine's process: load it, then answer `(task, args)` requests until `None`. Each
    answer is `(ok, value)`: a failure sends its traceback back for the parent to raise."""
    import traceback

    def answer(work, *args):
        try:
            conn.send((True, work(*args)))
        except Exception:  # noqa: BLE001 (sent back and raised in the parent)
            conn.send((False, traceback.format_exc()))

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a GPU machine's CPU run stays on the CPU
    else:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # engines share the GPU
    start = time.perf_counter()
    engine = []

    def load():
        engine.extend(make_engine(name, model_dir, ct2_dir, length_buckets, device))
        return time.perf_counter() - start

    answer(load)
    if not engine:
        return
    translate, pad = engine

    def timed(batch, beam, new_tokens=NEW_TOKENS, batch_size=None):
        """(seconds, new tokens) of one forced call."""
        kwargs = {} if batch_size is None else {"batch_size": batch_size}
        start = time.perf_counter()
        rows = translate(batch, beam, True, new_tokens, **kwargs)
        return time.perf_counter() - start, count(rows, pad)

    def floors(cells, repeats):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        return matmul_floor(dict(d_model=config.d_model, ff=config.encoder_ffn_dim,
                                 layers=config.decoder_layers, vocab=config.vocab_size),
                            cells, repeats)

    tasks = {"timed": timed, "floors": floors,
             "greedy": lambda batch: cut(translate(batch, 1, False), pad)}
    while (request := conn.recv()) is not None:
        task, args = request
        answer(tasks[task], *args)


class Engine:
    """One engine in its own process (`spawn`: a fresh interpreter picks its Keras backend);
    `engine(task, *args)` runs a task there and returns its answer."""

    def __init__(self, name, model_dir, ct2_dir, length_buckets="auto", device="cpu"):
        import multiprocessing

        self.name = name
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, daemon=True, args=(
            child, name, model_dir, ct2_dir, length_buckets, device))
        self._process.start()
        self.load_s = self._answer("loading")

    def _answer(self, task):
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"{self.name} failed in {task!r}; its traceback:\n{value}")
        return value

    def __call__(self, task, *args):
        self._conn.send((task, args))
        return self._answer(task)

    def close(self):
        if self._process.is_alive():
            self._conn.send(None)
        self._process.join()


def run_engines(names, model_dir, ct2_dir, stream=30, repeats=5, batch64=False,
                length_buckets="auto", device="cpu"):
    """Every engine's cells, taken in turns: each call of a cell is followed by the same call
    on every other engine (the order rotating), so that the machine's drift (cells move
    ±10-20% over minutes on the development VM) falls on all engines alike. Returns, per
    engine: seconds, tokens/s, the linearity calls and its greedy tokens for the check."""
    begun = time.perf_counter()

    def progress(what):  # to stderr, as it happens: where the time of a long run goes
        print(f"[{time.perf_counter() - begun:7.1f} s] {what}", file=sys.stderr, flush=True)

    engines = []
    for name in names:
        engines.append(Engine(name, model_dir, ct2_dir, length_buckets, device))
        progress(f"{name} loaded")
    try:
        results = {e.name: {"engine": e.name, "load_s": e.load_s, "cells": {}} for e in engines}
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).pad_token_id + 1
        fixed, stream_sources, check = sources(vocab, stream)

        def in_turns(calls, turn):
            """`calls` rounds; in each, every engine (rotated order) answers `turn(engine)`."""
            out = {e.name: [] for e in engines}
            for i in range(calls):
                for e in engines[i % len(engines):] + engines[:i % len(engines)]:
                    out[e.name].append(turn(e, i))
            return out

        def record(cell, seconds, new_tokens):
            for name in results:
                results[name]["cells"][cell] = {
                    "seconds": seconds[name], "new_tokens": new_tokens[name],
                    "tokens_per_s": new_tokens[name] / statistics.median(seconds[name])}

        # First, with no warm-up and compilation included: the stream one source at a time
        # (each source on every engine in turn), then the same sources in batches of 16 of
        # mixed lengths (new shapes again; keras_tfm chunks the list itself, `batch_size`,
        # in one call, so this cell is taken an engine at a time).
        calls = in_turns(len(stream_sources), lambda e, i: e("timed", [stream_sources[i]], 1))
        record(STREAM, {n: [sum(s for s, _ in c)] for n, c in calls.items()},
               {n: sum(t for _, t in c) for n, c in calls.items()})
        progress(STREAM)
        stream16 = {}
        for e in engines:
            if e.name in PEERS:
                parts = [e("timed", stream_sources[i:i + 16], 1)
                         for i in range(0, len(stream_sources), 16)]
                stream16[e.name] = (sum(s for s, _ in parts), sum(t for _, t in parts))
            else:
                stream16[e.name] = e("timed", stream_sources, 1, NEW_TOKENS, 16)
            progress(f"{STREAM16}: {e.name}")
        record(STREAM16, {n: [s] for n, (s, _) in stream16.items()},
               {n: t for n, (_, t) in stream16.items()})

        cells = CELLS + ((BATCH64,) if batch64 else ())
        for cell, batch, beam in cells + ((LONG_CELL, 1, 1),):
            tokens = LONG if cell == LONG_CELL else NEW_TOKENS
            warm = {e.name: e("timed", fixed[:batch], beam, tokens)[1] for e in engines}
            calls = in_turns(repeats, lambda e, i: e("timed", fixed[:batch], beam, tokens)[0])
            record(cell, calls, warm)
            progress(cell)
        # Linearity: batch-1 calls of NEW_TOKENS and LONG tokens, in turns within each engine
        # too (the cells above are a minute apart: drift between them read as growth).
        calls = in_turns(LINEAR_REPEATS, lambda e, i: [e("timed", fixed[:1], 1, n)[0]
                                                        for n in (NEW_TOKENS, LONG)])
        for e in engines:
            results[e.name]["linearity_seconds"] = {
                str(n): [pair[j] for pair in calls[e.name]]
                for j, n in enumerate((NEW_TOKENS, LONG))}
            results[e.name]["greedy_tokens"] = e("greedy", check)
            if e.name in KERAS_ENGINES:
                for cell, floor in e("floors", cells, repeats).items():
                    results[e.name]["cells"][cell]["matmul_floor_s"] = floor
            progress(f"linearity, greedy check and floors: {e.name}")
        return results
    finally:
        for e in engines:
            e.close()


def agreement(results, reference="transformers"):
    """Per engine: how many greedy rows equal the reference's, and where the others part."""
    ref = results[reference]["greedy_tokens"]
    out = {}
    for name, result in results.items():
        rows = result["greedy_tokens"]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                 for x, y in zip(rows, ref) if x != y]
        out[name] = {"equal_rows": len(ref) - len(first), "rows": len(ref),
                     "first_difference_at": first,
                     "distinct_rows": len({tuple(r) for r in rows}),
                     "distinct_tokens_per_row": [len(set(r)) for r in rows]}
    return out


def ratios(results):
    """keras_tfm tokens/s over transformers' and CTranslate2 fp32's (int8 keras_tfm also over
    CTranslate2 int8's), per backend and cell."""
    out = {}
    for name in KERAS_ENGINES + KERAS_INT8:
        if name not in results:
            continue
        for peer in ("transformers", "ctranslate2-float32") + (
                ("ctranslate2-int8",) if name in KERAS_INT8 else ()):
            if peer not in results:
                continue
            out[f"{name} / {peer}"] = {
                cell: value["tokens_per_s"] / results[peer]["cells"][cell]["tokens_per_s"]
                for cell, value in results[name]["cells"].items()}
    return out


def linearity(result):
    """Seconds for LONG new tokens over seconds for NEW_TOKENS, batch 1 greedy: the median
    over the `LINEAR_REPEATS` turns of each turn's ratio (its two calls run back to back;
    a ratio of the two medians read the VM's drift across turns as growth: JAX, 12-05, 4.30
    against 3.81, its calls slower in the later turns)."""
    turns = result["linearity_seconds"]
    return statistics.median(long / short for short, long
                             in zip(turns[str(NEW_TOKENS)], turns[str(LONG)]))


def table(results):
    names = [n for n in ENGINES if n in results]
    cells = list(next(iter(results.values()))["cells"])
    lines = ["| cell | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for cell in cells:
        lines.append(f"| {cell} | " + " | ".join(
            f"{results[n]['cells'][cell]['tokens_per_s']:,.0f}" for n in names) + " |")
    pairs = ratios(results)
    if pairs:
        lines += ["", "| ratio | " + " | ".join(cells) + " |", "|---" * (len(cells) + 1) + "|"]
        lines += [f"| {pair} | " + " | ".join(f"{r[c]:.2f}×" for c in cells) + " |"
                  for pair, r in pairs.items()]
    if all("linearity_seconds" in r for r in results.values()):
        lines += ["", f"| {LONG} ÷ {NEW_TOKENS} new tokens, seconds at batch 1 | "
                  + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|",
                  f"| (linear: ≤ {LONG // NEW_TOKENS}) | " + " | ".join(
                      f"{linearity(results[n]):.2f}" for n in names) + " |"]
    floors = [n for n in KERAS_ENGINES if n in results]
    fixed = [c for c in cells if floors and "matmul_floor_s" in results[floors[0]]["cells"][c]]
    if floors and all("matmul_floor_s" in results[n]["cells"][c] for n in floors for c in fixed):
        lines += ["", "| seconds ÷ matmul floor | " + " | ".join(fixed) + " |",
                  "|---" * (len(fixed) + 1) + "|"]
        for n in floors:
            cell = results[n]["cells"]
            lines.append(f"| {n} | " + " | ".join(
                f"{statistics.median(cell[c]['seconds']):.3f} s ÷ {cell[c]['matmul_floor_s']:.3f}"
                f" s = {statistics.median(cell[c]['seconds']) / cell[c]['matmul_floor_s']:.1f}×"
                for c in fixed) + " |")
    return "\n".join(lines)


def plot(results, path, device="CPU"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ENGINES if n in results]
    cells = list(next(iter(results.values()))["cells"])
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(np.arange(len(cells)) + i * width, [results[name]["cells"][c]["tokens_per_s"]
                                                   for c in cells], width, label=name)
    ax.set_xticks(np.arange(len(cells)) + 0.4 - width / 2,
                  [c.replace(", ", "\n") for c in cells])
    ax.set_yscale("log")
    ax.set_ylabel("new tokens / s (log)")
    ax.set_title(f"Decoding, same MarianMT weights, {NEW_TOKENS} new tokens ({LONG} in the "
                 f"last cell), {device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny shape (tests)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--stream", type=int, default=30, help="sources in the stream cell")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls a fixed cell (the median), after a warm-up")
    parser.add_argument("--batch64", action="store_true", help="add the batch 64 greedy cell")
    parser.add_argument("--no-length-buckets", action="store_true",
                        help="keras_tfm without source-length buckets (length_buckets=None)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every engine computes (cuda: an NVIDIA GPU)")
    parser.add_argument("--output-dir", default=RESULTS)
    args = parser.parse_args()
    options = dict(stream=args.stream, repeats=args.repeats, batch64=args.batch64,
                   length_buckets=None if args.no_length_buckets else "auto",
                   device=args.device)
    shape_name = "small" if args.small else "base"
    with tempfile.TemporaryDirectory() as model_dir:
        write_model(model_dir, SHAPES[shape_name])
        convert_ctranslate2(model_dir, os.path.join(model_dir, "ct2"))
        results = run_engines(args.engines, model_dir, os.path.join(model_dir, "ct2"),
                              **options)
    for name, result in results.items():
        print(f"{name}: " + ", ".join(f"{c} {v['tokens_per_s']:,.0f}"
                                     for c, v in result["cells"].items()), flush=True)
    check = agreement(results) if "transformers" in results else {}
    print(table(results))
    print("greedy tokens equal to transformers' (rows):",
          {n: f"{c['equal_rows']}/{c['rows']}" for n, c in check.items()})
    os.makedirs(args.output_dir, exist_ok=True)
    stem = os.path.join(args.output_dir, "decode_peers" + ("_small" if args.small else "")
                        + ("_no_buckets" if args.no_length_buckets else "")
                        + ("_cuda" if args.device == "cuda" else ""))
    versions = {}
    for package in ("keras", "jax", "tensorflow", "torch", "transformers", "ctranslate2"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 (a package not installed is left out)
            pass
    machine = platform.processor() or platform.machine()
    if args.device == "cuda":
        import torch

        machine = torch.cuda.get_device_name()
    with open(stem + ".json", "w") as f:
        json.dump({"shape": SHAPES[shape_name], "options": options, "cpus": os.cpu_count(),
                   "machine": machine, "versions": versions,
                   "results": results, "ratios": ratios(results), "agreement": check,
                   "linearity": {n: linearity(r) for n, r in results.items()}},
                  f, indent=1)
    plot(results, stem + ".png", machine if args.device == "cuda" else "CPU")


if __name__ == "__main__":
    main()
