"""`megaft-scale mode=strong nodes=[1,2]` on the real single-host Slurm: a CPU strong-scaling
study of 1 vs 2 gloo ranks (a "node" is one rank here: ranks_per_node=1 place_nodes=false)
as one multirun through megaft's launcher, then megaft-report's speedup, efficiency and
communication-share columns and scaling.png (checked chunk by chunk, with its plotted points)."""
import json
import os
import statistics
import struct
import subprocess
import zlib

from .conftest import ROOT

SCALE = os.path.join(ROOT, ".venv", "bin", "megaft-scale")
TINY = ["device=cpu", "parallel.tp=1", "model.dim=64", "model.n_layers=1", "data.task_train_size=500",
        "data.task_eval_size=16", "data.seq_len=32", "train.max_steps=5", "train.progress=false",
        "train.global_batch_size=8", "train.micro_batch_size=4"]


def png_chunks(path):
    """[(type, data)] of a PNG file, asserting its signature and every chunk's CRC."""
    blob = open(path, "rb").read()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = [], 8
    while pos < len(blob):
        (length,) = struct.unpack(">I", blob[pos:pos + 4])
        kind, data = blob[pos + 4:pos + 8], blob[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", blob[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + data) == crc, kind
        chunks.append((kind.decode(), data))
        pos += 12 + length
    assert chunks[0][0] == "IHDR" and chunks[-1][0] == "IEND"
    return chunks


def steady_tokens_per_s(run_dir):
    """The median tokens/s of the train lines after the first step, read here independently."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [json.loads(line) for line in f if '"loss"' in line]
    return statistics.median(r["tokens_per_s"] for r in train[1:])


def test_cpu_strong_scaling_1_vs_2_ranks_through_slurm(slurm_cluster, tmp_path):
    sweep = tmp_path / "scale"
    cmd = [SCALE, "mode=strong", "nodes=[1,2]", "ranks_per_node=1", "place_nodes=false", "hydra/launcher=slurm_cpu",
           "hydra.launcher.timeout_min=5", f"hydra.launcher.job_name=megaft-scale-{os.getpid()}",
           f"hydra.sweep.dir={sweep}", *TINY]
    out = subprocess.run(cmd, cwd=ROOT, env=slurm_cluster, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    # One multirun: a point per node count, 1 and 2 ranks, the same global batch (strong scaling).
    record = json.loads((sweep / "submitted.json").read_text())
    assert [(p["status"], p["shape"]["world_size"]) for p in record["points"]] == [("submitted", 1), ("submitted", 2)]
    summaries = [json.loads(open(os.path.join(p["run_dir"], "summary.json")).read()) for p in record["points"]]
    assert [(s["world_size"], s["dp"], s["steps"]) for s in summaries] == [(1, 1, 5), (2, 2, 5)]
    assert summaries[0]["tokens"] == summaries[1]["tokens"] == 5 * 8 * 32

    # The report: every run done, with speedup, efficiency and communication share.
    rows = json.loads((sweep / "report.json").read_text())
    assert [(r["status"], r["nodes"], r["world_size"]) for r in rows] == [("done", 1, 1), ("done", 2, 2)]
    tps = [steady_tokens_per_s(p["run_dir"]) for p in record["points"]]
    assert abs(rows[0]["steady_tokens_per_s"] - tps[0]) < 1e-6 * tps[0]
    assert rows[0]["speedup"] == 1.0 and rows[0]["efficiency"] == 1.0
    assert abs(rows[1]["speedup"] - tps[1] / tps[0]) < 1e-9 * tps[1] / tps[0]
    assert rows[1]["ideal"] == 2.0 and abs(rows[1]["efficiency"] - rows[1]["speedup"] / 2) < 1e-12
    for row in rows:
        assert 0.0 <= row["comm_share"] < 1.0
        share = row["comm_s"] / sum(row[k] for k in ("forward_s", "backward_s", "optimizer_s", "comm_s"))
        assert abs(row["comm_share"] - share) < 1e-9  # the same steady steps as the phase columns
    header = next(line for line in out.stdout.splitlines() if line.startswith("run "))
    assert all(col in header.split() for col in ("speedup", "ideal", "efficiency", "comm_share"))
    csv_header = (sweep / "report.csv").read_text().splitlines()[0].split(",")
    assert csv_header[-4:] == ["speedup", "ideal", "efficiency", "comm_share"]

    # scaling.png: a valid PNG whose plotted points are the report's two rows.
    chunks = png_chunks(sweep / "scaling.png")
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width > 100 and height > 100 and any(kind == "IDAT" for kind, _ in chunks)
    text = dict(data.split(b"\0", 1) for kind, data in chunks if kind == "tEXt")
    plotted = json.loads(text[b"megaft-scaling"])
    assert plotted["mode"] == "strong" and len(plotted["points"]) == len(rows) == 2
    for point, row in zip(plotted["points"], rows):
        assert {k: point[k] for k in ("nodes", "speedup", "ideal", "efficiency")} == \
            {k: row[k] for k in ("nodes", "speedup", "ideal", "efficiency")}
