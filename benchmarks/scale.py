"""Models of the size users bring (issue 40, item 5): a coordinator and one client over the CLI
train one DiLoCo round with streaming fragments and an fp4 uplink on a Llama of 155M or 500M
parameters; then the coordinator's own functions are timed on that model in this process.

    .venv/bin/python benchmarks/scale.py --size 155m
    .venv/bin/python benchmarks/scale.py --size 500m      # needs about 18 GB free

The model is a ``config.json`` only (``--model hf:FOLDER``: seeded init, the character vocabulary
in a 256-entry table, as a byte tokenizer's), on Shakespeare (``--data-dir``, the plays of
``../shared/data/shakespeare``). The run: ``streaming-diloco`` with ``--num-fragments 4``,
``--codec fp4``, one round of ``--inner-steps 1`` at ``--batch-size 2``, one intra-op thread
for each process, a state directory (a checkpoint is written), server-side evaluation at
``--eval-batches 1``.

Reported:

- each process's peak RSS (``VmHWM``, polled) as a multiple of the fp32 model;
- bytes per outer step: the round's ``bytes_up`` and ``bytes_down`` from ``metrics.jsonl``;
- the server's seconds per outer step, split: ``decode`` (the fp4 payloads into tensors),
  ``acceptance`` (``RemoteFleet.upload`` of the client's fp4 frames, less the decode: assembly,
  checks, the spill), ``aggregation`` (the mean of the updates, tensor by tensor), ``outer step``
  (DiLoCo's ``aggregate`` less the mean: the Nesterov step) and ``encode`` (the new model's
  downlink frames). These are timed in this process, after the CLI run, on the same model and
  an fp4 update of it, with the same functions the coordinator runs (one thread).

Prints a table and writes JSON under ``benchmarks/results/`` (``scale-SIZE.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEDGRID = [sys.executable, "-m", "fedgrid.cli"]

#: Llama shapes: (hidden, intermediate, layers, heads). 155.7M and 498.8M parameters; tiny: a check of the script.
SIZES = {"155m": (768, 3200, 16, 12), "500m": (1280, 5120, 19, 20), "tiny": (64, 128, 2, 2)}


def write_config(folder: Path, size: str) -> Path:
    hidden, inter, layers, heads = SIZES[size]
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 1,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


class PeakRSS:
    """Polls ``/proc/PID/status`` until the process ends: ``VmHWM`` (the kernel's peak RSS) and,
    each time ``VmRSS`` moves by 5% of the peak, a ``(seconds since start, RSS)`` sample (where
    in the run the memory goes)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self.samples: list[tuple[float, int]] = []
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        path = Path(f"/proc/{self.pid}/status")
        while True:
            try:
                fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
            except (FileNotFoundError, ProcessLookupError):
                return
            if "VmHWM" not in fields:  # a zombie: it has exited
                return
            self.peak = max(self.peak, int(fields["VmHWM"].split()[0]) * 1024)
            rss = int(fields["VmRSS"].split()[0]) * 1024
            if not self.samples or abs(rss - self.samples[-1][1]) > 0.05 * self.peak:
                self.samples.append((round(time.monotonic() - self._start, 1), rss))
            time.sleep(0.1)

    def join(self) -> int:
        self._thread.join(timeout=5)
        return self.peak


def run_cli(model: Path, work: Path, data_dir: str, timeout: float) -> dict:
    """One streaming-DiLoCo round over the CLI; the processes' peak RSS, the round's metrics, wall seconds."""
    out = work / "run"
    common = ["--dataset", "shakespeare", "--data-dir", data_dir, "--model", f"hf:{model}", "--threads", "1"]
    common += ["--batch-size", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    coordinator_args = [
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--out",
        str(out),
        "--state-dir",
        str(work / "state"),
        "--strategy",
        "streaming-diloco",
        "--num-fragments",
        "4",
        "--codec",
        "fp4",
        "--inner-steps",
        "1",
        "--rounds",
        "1",
        "--min-clients",
        "1",
        "--eval-batches",
        "1",
        "--round-timeout-s",
        str(timeout),
        "--join-timeout-s",
        str(timeout),
    ]
    start = time.monotonic()
    with open(work / "coordinator.log", "w") as clog, open(work / "client.log", "w") as klog:
        coordinator = subprocess.Popen(
            [*FEDGRID, *coordinator_args, *common], stdout=clog, stderr=subprocess.STDOUT, env=env
        )
        crss = PeakRSS(coordinator.pid)
        address_file = out / "address"
        deadline = time.monotonic() + timeout
        while not (address_file.exists() and address_file.read_text().strip()):
            if coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"coordinator did not start: {(work / 'coordinator.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        client = subprocess.Popen(
            [*FEDGRID, "client", "--coordinator", address_file.read_text().strip(), *common],
            stdout=klog,
            stderr=subprocess.STDOUT,
            env=env,
        )
        krss = PeakRSS(client.pid)
        try:
            coordinator.wait(timeout=timeout)
            client.wait(timeout=60)
        finally:
            for proc in (coordinator, client):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    if coordinator.returncode != 0:
        raise RuntimeError(
            f"coordinator exited {coordinator.returncode}: {(work / 'coordinator.log').read_text()[-3000:]}"
        )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "wall_s": time.monotonic() - start,
        "coordinator_peak_rss": crss.join(),
        "client_peak_rss": krss.join(),
        "coordinator_rss_samples": crss.samples,
        "client_rss_samples": krss.samples,
        "round": rows[-1],
    }


def time_server(model: Path) -> dict:
    """The coordinator's functions on this model, timed (one thread): see the module docstring."""
    import torch

    from fedgrid.aggregation.diloco import DiLoCo
    from fedgrid.aggregation.updates import aggregate_deltas
    from fedgrid.client.uplink import UplinkEncoder
    from fedgrid.compression.spec import CodecSpec
    from fedgrid.proto import serde
    from fedgrid.server.remote_fleet import RemoteFleet
    from fedgrid.simulation.language import build_lm, lm_spec
    from fedgrid.types import ClientInfo, FitIns

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_lm(lm_spec(f"hf:{model}"))  # type: ignore[arg-type]
    state = OrderedDict((k, v.detach().contiguous()) for k, v in net.state_dict().items())
    del net
    gen = torch.Generator().manual_seed(1)
    update = OrderedDict((k, v + 1e-3 * torch.randn(v.shape, generator=gen)) for k, v in state.items())
    spec = CodecSpec.parse("fp4")
    encoded, _ = UplinkEncoder(spec).begin(1, {}, "site-0").encode(global_state=state, new_state=update)
    del update
    codec = spec.build()
    t = time.perf_counter()
    for name, _, payload in encoded.payloads():
        codec.decode(payload, dtype=state[name].dtype, shape=tuple(state[name].shape))
    decode_s = time.perf_counter() - t

    strategy = DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    strategy.initialize(initial_state=state)
    from fedgrid.fleet.codec_policy import CodecPolicy

    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=600), codec_policy=CodecPolicy(default=spec))
    try:
        info, token = fleet.join(ClientInfo("", name="site-0", num_examples=10, codecs=("fp4",)))
        outcome: list = []
        thread = threading.Thread(
            target=lambda: outcome.append(
                fleet.fit_round(
                    server_round=1,
                    global_state=strategy.global_state,
                    assignments=[(info, FitIns(round=1))],
                    timeout=timedelta(seconds=600),
                )
            ),
            daemon=True,
        )
        thread.start()
        while fleet.current_round is None:
            time.sleep(0.05)
        stream = serde.StreamInfo(
            run_id=fleet.run_id,
            task_id=fleet.current_round.task_id,
            round=1,
            client_id=info.client_id,
            num_examples=10,
            delta=True,
        )
        frames = list(encoded.frames(stream))
        t = time.perf_counter()
        fleet.upload(iter(frames), token)
        upload_s = time.perf_counter() - t
        del frames, encoded
        thread.join(600)
        results = outcome[0].results
        t = time.perf_counter()
        aggregate_deltas(global_state=state, results=results, names=list(state))
        mean_s = time.perf_counter() - t
        t = time.perf_counter()
        strategy.aggregate(server_round=1, results=results, failures=[])
        aggregate_s = time.perf_counter() - t
    finally:
        fleet.close()
    t = time.perf_counter()
    sent = sum(
        len(f)
        for f in serde.EncodedModel(strategy.global_state).frames(
            serde.StreamInfo(run_id="r", task_id="t", round=2, client_id="c", num_examples=0)
        )
    )
    encode_s = time.perf_counter() - t
    return {
        "decode_s": decode_s,
        "acceptance_s": max(upload_s - decode_s, 0.0),
        "aggregation_s": mean_s,
        "outer_step_s": max(aggregate_s - mean_s, 0.0),
        "encode_s": encode_s,
        "downlink_bytes": sent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="155m")
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "shakespeare"))
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    with tempfile.TemporaryDirectory(prefix=f"fedgrid-scale-{args.size}-") as tmp:
        work = Path(tmp)
        model = write_config(work / "model", args.size)
        hidden, inter, layers, heads = SIZES[args.size]
        params = layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + hidden + 2 * 256 * hidden
        model_bytes = 4 * params
        cli = run_cli(model, work, args.data_dir, args.timeout_s)
        server = time_server(model)
    rnd = cli["round"]
    result = {
        "size": args.size,
        "parameters": params,
        "model_bytes_fp32": model_bytes,
        "coordinator_peak_rss_x": cli["coordinator_peak_rss"] / model_bytes,
        "client_peak_rss_x": cli["client_peak_rss"] / model_bytes,
        "coordinator_peak_rss": cli["coordinator_peak_rss"],
        "client_peak_rss": cli["client_peak_rss"],
        "bytes_up": rnd.get("bytes_up"),
        "bytes_down": rnd.get("bytes_down"),
        "cli_wall_s": cli["wall_s"],
        "coordinator_rss_samples": cli["coordinator_rss_samples"],
        "client_rss_samples": cli["client_rss_samples"],
        "server_s": server,
        "command": " ".join(["benchmarks/scale.py", "--size", args.size]),
    }
    print(f"\n{args.size}: {params / 1e6:.1f}M parameters, {model_bytes / 1e6:.0f} MB in fp32")
    print("| figure | value |\n|---|---|")
    print(
        f"| coordinator peak RSS | {result['coordinator_peak_rss'] / 1e9:.2f} GB = {result['coordinator_peak_rss_x']:.2f}x |"
    )
    print(
        f"| client peak RSS | {result['client_peak_rss'] / 1e9:.2f} GB = {result['client_peak_rss_x']:.2f}x |"
    )
    print(
        f"| bytes up / down per outer step | {rnd.get('bytes_up', 0) / 1e6:.1f} MB / {rnd.get('bytes_down', 0) / 1e6:.1f} MB |"
    )
    for key in ("decode_s", "acceptance_s", "aggregation_s", "outer_step_s", "encode_s"):
        print(f"| server {key[:-2].replace('_', ' ')} | {server[key]:.2f} s |")
    print(f"| CLI run (start to exit) | {cli['wall_s']:.0f} s |")
    path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"scale-{args.size}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
