"""Ours against one other backend from benchmark_attention.py's JSON: the ratio of TFLOP/s for
fwd, bwd and fwd+bwd per (dtype, head dim, causal) over seqlen >= --min-seqlen, and every point
below 1.0. Usage: python3 benchmarks/compare.py results.json [--against fa2]"""

import argparse
import json
import signal


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--against", default="fa2")
    ap.add_argument("--min-seqlen", type=int, default=1024)
    args = ap.parse_args()
    rows = [r for path in args.json for r in json.load(open(path))["rows"] if r["seqlen"] >= args.min_seqlen]
    by = {(r["impl"], r["dtype"], r["headdim"], r["causal"], r["seqlen"]): r for r in rows}
    below = []
    print(f"ours / {args.against} (TFLOP/s ratio), seqlen >= {args.min_seqlen}: min-max")
    for key in sorted({(r["dtype"], r["headdim"], r["causal"]) for r in rows}):
        ratios = {m: [] for m in ("fwd", "bwd", "fwdbwd")}
        for r in rows:
            if r["impl"] != "ours" or (r["dtype"], r["headdim"], r["causal"]) != key:
                continue
            other = by.get((args.against, *key, r["seqlen"]))
            for m in ratios:
                a, b = r.get(f"{m}_tflops"), other and other.get(f"{m}_tflops")
                if a and b:
                    ratios[m].append(a / b)
                    if a / b < 1.0:
                        below.append((*key, r["seqlen"], m, round(a / b, 3)))
        cells = [f"{m} {min(v):.2f}-{max(v):.2f}" if v else f"{m} -" for m, v in ratios.items()]
        print(f"  {key[0]} d={key[1]} causal={int(key[2])}: " + ", ".join(cells))
    print(f"{len(below)} points below 1.0" + (":" if below else ""))
    for b in below:
        print("  ", b)


if __name__ == "__main__":
    main()
