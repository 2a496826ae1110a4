"""How close is the course's model to real clusters? A backtest against published measurements.

    python bench/fidelity.py            # every row: case · published · predicted · ratio

Each row of bench/published.csv is a published measurement (what, configuration, number, unit,
source) and is predicted with the course's own functions: distlab.hardware's devices
(`gemm_seconds`), links (`Link.seconds` through `Cluster.link_between`, what the emulator
charges) and its per-step model of a transformer (`hardware.step_seconds`). Rows marked
`calibration` set a constant of the model (their match says only that the constant is what the
source says); rows marked `validation` were NOT used to set anything. A row is "within" when
the ratio predicted/published is within ±20 %.

What the model still misses — today `fidelity (validation): 24 of 25`, `(calibration): 11 of
11` — the rows outside the band, and what no row tests:
- GEMMs: the curve (output tiles × depth, fitted to three OpenXLA H100 shapes) is within ±13 %
  of the table's other shapes, but it is smooth: wave quantization (the last, partly filled
  wave of tiles) makes real efficiency jump between neighbouring shapes, and the A100's curve
  is H100's scaled by SM count (no measured A100 shape table was found);
- small-message latency is NCCL's own tuning model (src/graph/tuning.cc), 15 µs for 8 ranks,
  where a measured Hopper node does 12.5 µs (1.20×). The 64 KiB-64 MiB protocol switch is not
  modeled: there real busbw climbs more slowly than latency + bytes/B (see
  tests/data/all_reduce_perf_8xh100.txt and nccl_tests.busbw_table: 0.45-0.8 of the model there);
- end-to-end steps carry one fitted factor (hardware.SUSTAINED, from two calibration rows) for
  what kernels lose inside a training loop, and a trend it cannot absorb: Megatron's small
  models come out 0.88× their measured rate, its largest 1.17×; no optimizer step, data loading or stragglers; TP
  communication never overlapped; 1F1B without interleaving; Megatron's micro-batch size is not
  in its table (1 is assumed); torchtitan's network is assumed to be 8 HDR NICs per node;
- what no row covers: all_to_all, cross-node small-message latency (the model says 25 µs),
  H100/H200 end to end (torchtitan's H100 runs used 500 W, 2.4 TB/s HBM2e parts, not SXM).
"""
import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))

from distlab import cost, hardware  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(HERE, "published.csv")
BAND = 0.20
_DEVICES = {"A100": hardware.A100, "H100": hardware.H100, "H200": hardware.H200}
_TERM = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
         "reduce_scatter": "ring_reduce_scatter"}


def _config(text):
    out = {}
    for item in text.split():
        key, value = item.split("=", 1)
        out[key] = value
    return out


def load(path=TABLE):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["config"] = _config(r["config"])
        r["value"] = float(r["value"])
    return rows


def _ranks(text):
    return [int(x) for x in text.split(";")] if ";" in text else list(range(int(text)))


def predict_gemm(c):
    # a benchmark loop: kernels back to back, the host's dispatch hidden (graphs-mode floor)
    dev = _DEVICES[c["device"]].with_mode("graphs")
    m, n, k = int(c["m"]), int(c["n"]), int(c["k"])
    return 2.0 * m * n * k / dev.gemm_seconds(m, n, k) / 1e12


def _collective(c):
    cluster = hardware.PRESETS[c["preset"]]
    ranks = _ranks(c["ranks"])
    link = cluster.link_between(ranks)
    seconds = link.seconds(c["op"], int(c["bytes"]), len(ranks))
    return seconds, ranks


def predict_busbw(c):
    seconds, ranks = _collective(c)
    return cost.bus_bandwidth(_TERM[c["op"]], int(c["bytes"]), len(ranks), seconds) / 1e9


def predict_latency(c):
    return _collective(c)[0] * 1e6


def _model(c):
    glu = c["model"] == "llama"
    ffn = int(c.get("ffn", 4 * int(c["hidden"])))
    return hardware.Transformer(int(c["layers"]), int(c["hidden"]), int(c["heads"]), ffn,
                                int(c["vocab"]), int(c["kv"]) if "kv" in c else None, glu)


def predict_train(c):
    model = _model(c)
    n, batch, seq = int(c["gpus"]), int(c["batch"]), int(c["seq"])
    parts = hardware.step_seconds(model, hardware.PRESETS[c["preset"]], n, batch, seq,
                                  tp=int(c["tp"]), pp=int(c["pp"]), recompute=c["recompute"],
                                  flash=c["flash"] == "1", fsdp=c.get("fsdp") == "1",
                                  fused=c.get("fused", "1") == "1")
    if c["metric"] == "tokens":
        return batch * seq / parts["step"] / n
    # Megatron's count (Narayanan et al. 2021, eq. 3): 96·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs
    # per step with full recomputation, divided by the step time and the GPUs.
    h, layers, vocab = model.hidden, model.layers, model.vocab
    flops = 96 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    return flops / parts["step"] / n / 1e12


PREDICT = {"gemm": predict_gemm, "busbw": predict_busbw, "latency": predict_latency,
           "train": predict_train}


def backtest(rows=None):
    """[(row, predicted, ratio, within)] for every published row."""
    out = []
    for r in rows or load():
        predicted = PREDICT[r["kind"]](r["config"])
        ratio = predicted / r["value"]
        out.append((r, predicted, ratio, abs(ratio - 1) <= BAND + 1e-9))
    return out


def summary(results):
    """{use: (within, total)}."""
    out = {}
    for r, _, _, ok in results:
        k, m = out.get(r["use"], (0, 0))
        out[r["use"]] = (k + ok, m + 1)
    return out


def main():
    results = backtest()
    width = max(len(r["case"]) for r, *_ in results)
    print(f"{'case':<{width}}  {'use':<11} {'published':>10} {'predicted':>10} {'ratio':>6}  unit")
    for r, predicted, ratio, ok in results:
        flag = "" if ok else "  <- outside ±20 %"
        print(f"{r['case']:<{width}}  {r['use']:<11} {r['value']:>10.4g} {predicted:>10.4g} "
              f"{ratio:>6.2f}  {r['unit']}{flag}")
    print()
    for use, (k, m) in sorted(summary(results).items()):
        print(f"fidelity ({use}): {k} of {m} within ±20 %")


if __name__ == "__main__":
    main()
