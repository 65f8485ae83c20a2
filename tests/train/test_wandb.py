"""logger=wandb for real, offline: a two-job multirun of train.py writes each job's own Weights & Biases run into its
run dir, whose metrics and config read back as metrics.csv and the composed config have them, and the process
exits by itself (no login prompt, no network, nothing left running)."""

import csv
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

ROOT = Path(__file__).resolve().parents[2]
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4  # LevelDB log record types


def wandb_records(path: Path) -> list:
    """The records of a run's transaction log (run-ID.wandb), which wandb writes and ``wandb sync`` uploads: the
    LevelDB log format (32 KiB blocks of records, each a 7-byte header (crc32, length, type) then its bytes, a
    record cut across blocks as FIRST, MIDDLE..., LAST parts) after a 7-byte file header (':W&B', 0xBEE1, version
    0); each record is a wandb.proto Record message. wandb has no Python reader of it since its Go core."""
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    records, parts, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little of the block left for a header: zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        assert kind in (FULL, FIRST, MIDDLE, LAST), (pos, kind)
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def read_run(run_dir: Path) -> dict:
    """The one offline wandb run in run_dir: its project, name and exit code, its config (key: value) and its
    history rows ({key: value}), values decoded from their JSON."""
    import json

    def items(update) -> dict:  # an item names its key in key, or as the parts of a nested_key
        return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}

    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    run = {"config": {}, "history": []}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"], run["name"] = record.run.project, record.run.display_name
        elif kind == "config":
            run["config"].update(items(record.config.update))
        elif kind == "history":
            run["history"].append(items(record.history.item))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


@pytest.mark.slow
def test_an_offline_wandb_multirun_logs_each_job_into_its_own_run(tmp_path):
    sweep = tmp_path / "sweep"
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           # wandb's own files (its settings, caches, core logs) in the test's directory, not the user's
           "HOME": str(home), "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"),
           # a closed port: any attempt to reach a server would fail here instead of going out
           "WANDB_BASE_URL": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9"}
    env.pop("WANDB_API_KEY", None)
    args = ["-m", "attention=softmax,window", "logger=wandb", "logger.wandb.offline=true", "experiment=tiny",
            "trainer.max_steps=10", "trainer.val_check_interval=5", "trainer.log_every_n_steps=5", "threads=1",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.sweep.dir={sweep}"]
    # no stdin: a login prompt would fail at once; the timeout: a process that does not exit by itself fails
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, attention in enumerate(["softmax", "window"]):
        run_dir = sweep / f"{job}_{attention}"
        run = read_run(run_dir)
        assert (run["project"], run["name"], run["exit_code"]) == ("vqattn", attention, 0)
        # the config: the module's hyperparameters and the optimisation's settings, as the run composed them
        assert run["config"]["model"]["attention"] == attention and run["config"]["model"]["n_embd"] == 32
        assert run["config"]["optim"]["lr"] == 0.002 and run["config"]["optimizer"]["_target_"] == "torch.optim.AdamW"
        # the metrics: metrics.csv's rows, at the same steps, with the same values
        with open(run_dir / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        for key, steps in (("val_bpb", [5, 10]), ("train_bpb", [4, 9])):
            logged = [row for row in run["history"] if key in row]
            expected = [r for r in rows if r.get(key)]
            assert [row["trainer/global_step"] for row in logged] == [int(r["step"]) for r in expected] == steps
            assert [row[key] for row in logged] == pytest.approx([float(r[key]) for r in expected], rel=1e-6), key
        assert any("lr-AdamW/pg1" in row for row in run["history"])  # the callbacks' metrics too
    assert not list(tmp_path.glob("wandb")) and not list(sweep.glob("wandb"))  # every file in a run dir
