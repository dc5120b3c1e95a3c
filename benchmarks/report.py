"""The tables of benchmarks/README.md, remade from the JSON files in benchmarks/results.

    python benchmarks/report.py [--output-dir benchmarks/results]

Training throughput (train_*_*.json, and train_throughput.png) comes from
`train_throughput.py --report`; the attention (attention_*.json) and dropout (dropout_*.json)
tables from the files `attention.py --all` and `dropout.py --all` write.
"""

import argparse
import glob
import json
import os

import train_throughput

VARIANTS = ("keras_tfm_fused", "keras_tfm_explicit", "keras_mha")


def _load(output_dir, pattern):
    """The results files matching `pattern`, CPU ones first, then by name."""
    results = []
    for path in sorted(glob.glob(os.path.join(output_dir, pattern))):
        with open(path) as f:
            results.append((os.path.basename(path), json.load(f)))
    return sorted(results, key=lambda item: (item[1].get("device") not in (None, "cpu"),
                                             item[0]))


def _where(r):
    """The device and date a results file records (older CPU files name no device)."""
    return f"{r.get('device') or 'cpu'}, {r.get('date', '?')}"


def _mib(n):
    return "–" if n is None else f"{n / 2**20:.0f}"


def attention_table(output_dir):
    lines = ["| backend | device, date | policy | T | keras_tfm fused ms | keras_tfm explicit ms | "
             "Keras MHA ms | memory MiB, fused / explicit / MHA | fused ÷ explicit | "
             "keras_tfm (faster path) ÷ Keras MHA |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in _load(output_dir, "attention_*.json"):
        by_length = {}
        for row in r["rows"]:
            by_length.setdefault(row["length"], {})[row["variant"]] = row
        for length, rows in sorted(by_length.items()):
            if set(rows) != set(VARIANTS):
                continue
            fused, explicit, mha = (rows[v] for v in VARIANTS)
            memory = " / ".join(_mib(rows[v]["peak_bytes"]) for v in VARIANTS)
            lines.append(
                f"| {r['backend']} | {_where(r)} | {r.get('dtype_policy', 'float32')} | {length} | "
                f"{fused['ms']:.1f} | {explicit['ms']:.1f} | {mha['ms']:.1f} | {memory} | "
                f"{fused['ms'] / explicit['ms']:.2f} | "
                f"{min(fused['ms'], explicit['ms']) / mha['ms']:.2f} |")
    return "\n".join(lines)


def dropout_table(output_dir):
    lines = ["| backend | device, date | shape | keras.layers.Dropout µs | keras_tfm.Dropout µs | "
             "speed-up |", "|---|---|---|---|---|---|"]
    for _, r in _load(output_dir, "dropout_*.json"):
        for row in r["rows"]:
            lines.append(f"| {r['backend']} | {_where(r)} | {tuple(row['shape'])} | "
                         f"{row['keras_us']:,.0f} | {row['keras_tfm_us']:,.0f} | "
                         f"{row['keras_us'] / row['keras_tfm_us']:.2f}× |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__),
                                                             "results"))
    args = parser.parse_args(argv)
    print("## Training throughput\n")
    train_throughput.report(args.output_dir)
    print("\n## One attention layer\n\n" + attention_table(args.output_dir))
    print("\n## Dropout alone\n\n" + dropout_table(args.output_dir))


if __name__ == "__main__":
    main()
