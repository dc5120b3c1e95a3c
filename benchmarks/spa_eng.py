"""English-to-Spanish on the keras.io tutorial's corpus: keras_tfm's recipe against the tutorial's,
the same wall-clock training budget, scored on one held-out split.

    python benchmarks/spa_eng.py                                   # 15 minutes each, every engine
    python benchmarks/spa_eng.py --minutes 1 --test-size 200 --engines tutorial jax

The corpus (`spa.txt`: English TAB Spanish, 118,964 pairs) is shuffled with `--seed`; `--test-size`
pairs with distinct English sources are held out, and every pair whose English source is one of
them is removed from training. Engines, one process at a time: `tutorial` (the keras.io tutorial
"English-to-Spanish translation with a sequence-to-sequence Transformer" as published,
`spa_eng_tutorial.py`, TensorFlow) and keras_tfm's `examples/translate_text.py` under `jax`,
`tensorflow` and `torch`; each trains for `--minutes` and translates the test sources. Recorded:
the wall clock of the train and the translate process, steps and seconds a step where the engine
reports them, and corpus BLEU and chrF (sacrebleu) against the references on the raw text, and
"normalized BLEU" with hypotheses and references lower-cased and stripped of punctuation (the
tutorial's view of text), with keras_tfm ÷ tutorial on normalized BLEU and keras_tfm − tutorial
on chrF. Results: results/spa_eng.json.
"""

import argparse
import json
import os
import platform
import random
import re
import shutil
import string
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENGINES = ("tutorial", "jax", "tensorflow", "torch")
TUTORIAL = os.path.join(HERE, "spa_eng_tutorial.py")
EXAMPLE = os.path.join(ROOT, "examples", "translate_text.py")
PUNCTUATION = str.maketrans("", "", string.punctuation + "¿¡")


def split_pairs(path, test_size=2000, seed=0):
    """(train, test) lists of (English, Spanish) from the first two TAB columns of `path`: after a
    seeded shuffle, the first `test_size` pairs with distinct English sources are the test set,
    and training keeps only the pairs whose English source is not a test source."""
    with open(path, encoding="utf-8") as f:
        pairs = [tuple(line.rstrip("\n").split("\t")[:2]) for line in f if "\t" in line]
    random.Random(seed).shuffle(pairs)
    test, sources = [], set()
    for pair in pairs:
        if len(test) == test_size:
            break
        if pair[0] not in sources:
            sources.add(pair[0])
            test.append(pair)
    if len(test) < test_size:
        raise ValueError(f"{path} has {len(test)} distinct English sources, fewer than "
                         f"--test-size {test_size}")
    return [pair for pair in pairs if pair[0] not in sources], test


def write_split(work, train, test):
    """WORK/train.tsv (source TAB target), WORK/test.src and WORK/test.ref."""
    os.makedirs(work, exist_ok=True)
    for name, lines in (("train.tsv", [f"{s}\t{t}" for s, t in train]),
                        ("test.src", [s for s, _ in test]), ("test.ref", [t for _, t in test])):
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))


def timed(command, backend):
    """Wall seconds of `command` run with KERAS_BACKEND=backend."""
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "KERAS_BACKEND": backend})
    return time.perf_counter() - start


def run_engine(engine, work, minutes):
    """Trains and translates with one engine; the record of what it measured. The hypotheses go
    to WORK/hyp_<engine>.txt."""
    print(f"=== {engine} ===", file=sys.stderr, flush=True)
    model_dir = os.path.join(work, "tutorial" if engine == "tutorial" else f"model_{engine}")
    shutil.rmtree(model_dir, ignore_errors=True)  # (a kept work directory: no stale outputs)
    if os.path.exists(os.path.join(work, f"hyp_{engine}.txt")):
        os.remove(os.path.join(work, f"hyp_{engine}.txt"))
    if engine == "tutorial":
        record = {"train_s": timed([sys.executable, TUTORIAL, "train", work,
                                    "--minutes", str(minutes)], "tensorflow"),
                  "decode_s": timed([sys.executable, TUTORIAL, "translate", work], "tensorflow")}
        for name in ("train.json", "translate.json"):
            with open(os.path.join(model_dir, name)) as f:
                record.update(json.load(f))
        return record
    record = {
        "train_s": timed([sys.executable, EXAMPLE, "train", "--pairs",
                          os.path.join(work, "train.tsv"), "--out", model_dir,
                          "--minutes", str(minutes)], engine),
        "decode_s": timed([sys.executable, EXAMPLE, "translate", model_dir, "--input",
                           os.path.join(work, "test.src"), "--output",
                           os.path.join(work, f"hyp_{engine}.txt")], engine)}
    training = os.path.join(model_dir, "training.json")  # steps, s_per_step, ... if it writes one
    if os.path.exists(training):
        with open(training) as f:
            record.update(json.load(f))
    return record


def normalize(text):
    """Lower-cased, punctuation (with ¿ and ¡) removed, whitespace collapsed."""
    return " ".join(text.lower().translate(PUNCTUATION).split())


def scores(hypotheses, references):
    import sacrebleu

    return {"bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
            "normalized_bleu": sacrebleu.corpus_bleu([normalize(h) for h in hypotheses],
                                                     [[normalize(r) for r in references]]).score}


def against_tutorial(results):
    """keras_tfm ÷ tutorial on normalized BLEU, keras_tfm − tutorial on chrF (points)."""
    tutorial = results.get("tutorial", {})
    if "bleu" not in tutorial:
        return {}
    return {engine: {"normalized_bleu_ratio": (r["normalized_bleu"] / tutorial["normalized_bleu"]
                                               if tutorial["normalized_bleu"] else None),
                     "chrf_difference": r["chrf"] - tutorial["chrf"]}
            for engine, r in results.items() if engine != "tutorial" and "bleu" in r}


def table(results, ratios):
    def number(value, digits):
        return "–" if value is None else f"{value:,.{digits}f}"

    rows = ["| engine | steps | s/step | train s | decode s | BLEU | chrF | normalized BLEU "
            "| norm. BLEU ÷ tutorial | chrF − tutorial |", "|---" * 10 + "|"]
    for engine, r in results.items():
        if "error" in r:
            rows.append(f"| {engine} | {r['error']} |" + " |" * 8)
            continue
        ratio = ratios.get(engine, {})
        bleu_ratio, chrf_difference = (ratio.get("normalized_bleu_ratio"),
                                       ratio.get("chrf_difference"))
        rows.append("| " + " | ".join([
            engine, number(r.get("steps"), 0), number(r.get("s_per_step"), 3),
            number(r["train_s"], 0), number(r["decode_s"], 0), number(r["bleu"], 1),
            number(r["chrf"], 1), number(r["normalized_bleu"], 1),
            "–" if bleu_ratio is None else f"{bleu_ratio:.2f}×",
            "–" if chrf_difference is None else f"{chrf_difference:+.1f}"]) + " |")
    return "\n".join(rows)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions():
    found = {"python": platform.python_version()}
    for package in ("keras", "tensorflow", "jax", "torch", "sacrebleu"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default=os.path.join(os.path.dirname(ROOT), "shared", "data",
                                                        "spa-eng", "spa.txt"))
    parser.add_argument("--minutes", type=float, default=15.0, help="training budget per engine")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--test-size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", help="kept (default: a temporary directory, removed)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "spa_eng.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spa_eng_") as temporary:
        work = args.work_dir or temporary
        train, test = split_pairs(args.pairs, args.test_size, args.seed)
        write_split(work, train, test)
        references = [t for _, t in test]
        results = {}
        for engine in args.engines:
            try:
                results[engine] = run_engine(engine, work, args.minutes)
            except subprocess.CalledProcessError as error:
                results[engine] = {"error": f"exit {error.returncode}: {' '.join(error.cmd)}"}
                continue
            with open(os.path.join(work, f"hyp_{engine}.txt"), encoding="utf-8") as f:
                hypotheses = [line.rstrip("\n") for line in f]
            if len(hypotheses) != len(references):
                results[engine]["error"] = (f"{len(hypotheses)} hypotheses for "
                                            f"{len(references)} sources")
                continue
            results[engine].update(scores(hypotheses, references))
    ratios = against_tutorial(results)
    print(table(results, ratios))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"),
                   "command": " ".join(["python", os.path.relpath(__file__, ROOT)]
                                       + (sys.argv[1:] if argv is None else argv)),
                   "cpu": cpu_model(), "cpus": os.cpu_count(), "versions": versions(),
                   "pairs": args.pairs, "minutes": args.minutes, "seed": args.seed,
                   "test_size": args.test_size, "train_pairs": len(train),
                   "results": results, "against_tutorial": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
