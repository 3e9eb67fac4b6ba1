"""torch vs ONNX Runtime (CPU) vs OpenVINO on this machine: per-call times of the flow encoder, the flow
estimator, HiFT's decode and CAM++, then the whole in-process pipeline's first chunk and RTF.

    python -m cosyvoice_triton.perf.engine_compare --model-dir FULL_MODEL [--rounds 7] [--e2e-rounds 2]
        [--seconds 3] [--ort-openvino-python VENV/bin/python] [--out report.md]

Interleaved: each round calls every engine once (A, B, C, A, B, C, ...), so the load of other processes
falls on all of them alike; the tables give medians, ratios to torch (> 1: faster than torch), the load
average before and after, and each engine's error against torch on the same inputs (max abs and SNR in
dB). CAM++ ships as ONNX only: its reference is ONNX Runtime on the CPU. FULL_MODEL: a model folder, e.g. one
written by `cosyvoice-triton export --size full --no-backbone-weights`.

`--ort-openvino-python`: a Python whose onnxruntime is the `onnxruntime-openvino` wheel (it replaces the
`onnxruntime` module, so it lives in an environment of its own). It runs the same graphs on ONNX Runtime's
OpenVINO execution provider in a worker process driven round by round like the others (this file, run
as a script with `--ep-worker`: it needs only numpy and onnxruntime).

End to end: the torch pipeline and one per graph engine sharing its LLM (torch; a random LLM speaks its
maximum length, chosen to give `--seconds` of audio, and the same seed gives the same tokens), streamed,
voice encoded once per engine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What a module call looks like in a streaming request of the full model: the estimator's guided batch
# of 2 over a 3 s prompt plus a chunk (200 mel frames); the encoder over 100 tokens; HiFT over 2 s of
# mel; CAM++ over 3 s of fbank.
SHAPES = {"flow_encoder": (1, 200), "flow_estimator": (2, 200), "hift_decode": (1, 100)}
CAMPPLUS_FRAMES = 300


def ep_worker() -> int:
    """Serve JSON lines on stdin: open a graph on the OpenVINO provider, time calls (ONNX Runtime only)."""
    import numpy as np
    import onnxruntime as ort

    sessions, feeds = {}, {}
    for line in sys.stdin:
        command = json.loads(line)
        name = command["name"]
        if command["op"] == "open":
            options = ort.SessionOptions()
            options.intra_op_num_threads = command["threads"]
            provider = ("OpenVINOExecutionProvider", {"device_type": "CPU", "precision": "FP32",
                                                      "num_of_threads": str(command["threads"])})
            sessions[name] = ort.InferenceSession(command["path"], options, providers=[provider])
            with np.load(command["inputs"]) as data:
                feeds[name] = {key: data[key] for key in data.files}
            (output,) = sessions[name].run(None, feeds[name])  # warm-up, and the output to compare
            np.save(command["out"], output)
            reply = {"providers": sessions[name].get_providers(), "version": ort.__version__}
        else:
            start = time.perf_counter()
            sessions[name].run(None, feeds[name])
            reply = {"seconds": time.perf_counter() - start}
        print(json.dumps(reply), flush=True)
    return 0


class EPWorker:
    """The `--ep-worker` process, one call per round."""

    def __init__(self, python: str):
        self.process = subprocess.Popen([python, __file__, "--ep-worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the --ep-worker process ended (exit code {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def module_runners(model_dir: Path, onnx_dir: Path, threads: int, ep_python: str | None, work: Path):
    """{graph: (inputs, {engine: callable})} for the four graphs; engines that cannot run here are skipped
    with their reason in `unavailable`."""
    import numpy as np
    import torch

    from cosyvoice_triton.config import ModelPaths
    from cosyvoice_triton.errors import EngineUnavailable
    from cosyvoice_triton.engines.onnx_export import token2wav_onnx
    from cosyvoice_triton.engines.onnx_graphs import campplus_spec, example_inputs, token2wav_specs
    from cosyvoice_triton.engines.openvino_runner import OPENVINO_PRECISIONS, OpenVINORunner
    from cosyvoice_triton.engines.ort_runner import OrtRunner
    from cosyvoice_triton.engines.torch_runner import TorchRunner
    from cosyvoice_triton.models.flow import FlowModel
    from cosyvoice_triton.models.hift import HiFTGenerator

    flow, hift = FlowModel.from_model_dir(model_dir), HiFTGenerator.from_model_dir(model_dir)
    paths = token2wav_onnx(model_dir, onnx_dir)
    paths["campplus"] = ModelPaths(model_dir).campplus
    specs = {**token2wav_specs(flow.config), "campplus": campplus_spec()}
    reference = {"flow_encoder": flow.encoder, "flow_estimator": flow.decoder.estimator, "hift_decode": hift.decode}
    worker = EPWorker(ep_python) if ep_python else None
    graphs, unavailable = {}, {}
    for name, spec in specs.items():
        if name == "campplus":
            inputs = (torch.randn(1, CAMPPLUS_FRAMES, 80, generator=torch.Generator().manual_seed(0)),)
        else:
            batch, frames = SHAPES[name]
            inputs = example_inputs(name, flow.config, hift.config, batch=batch, frames=frames)
        engines = {}
        if name in reference:
            engines["torch"] = TorchRunner(reference[name], spec, "cpu")
        engines["onnxruntime CPU"] = OrtRunner(paths[name], spec, "cpu", intra_op_threads=threads)
        for precision in OPENVINO_PRECISIONS:
            try:
                engines[f"openvino {precision}"] = OpenVINORunner(paths[name], spec, precision=precision,
                                                                  threads=threads)
            except EngineUnavailable as exc:
                unavailable[f"openvino {precision}"] = str(exc)
        if worker is not None:
            feeds = work / f"{name}.inputs.npz"
            np.savez(feeds, **{key: x.numpy() for key, x in zip(spec.inputs, inputs)})
            opened = worker.ask(op="open", name=name, path=str(paths[name]), inputs=str(feeds), threads=threads,
                                out=str(work / f"{name}.ep.npy"))
            label = f"onnxruntime-openvino {opened['version']} EP"
            engines[label] = _worker_call(worker, name, work / f"{name}.ep.npy")
        graphs[name] = (inputs, engines)
    return graphs, unavailable, worker


def _worker_call(worker: EPWorker, name: str, output_path: Path):
    import numpy as np
    import torch

    output = torch.from_numpy(np.load(output_path))

    def call(*_inputs):
        call.seconds = worker.ask(op="run", name=name)["seconds"]
        return output
    return call


def time_modules(graphs: dict, rounds: int) -> list[str]:
    """Interleaved rounds: each engine of each graph once per round; a table row per (graph, engine)."""
    import numpy as np
    import torch

    from cosyvoice_triton.perf.quality import snr_db

    outputs, times = {}, {}
    with torch.inference_mode():
        for name, (inputs, engines) in graphs.items():  # warm-up, and outputs to compare
            for label, run in engines.items():
                outputs[name, label] = run(*inputs).numpy()
        for _ in range(rounds):
            for name, (inputs, engines) in graphs.items():
                for label, run in engines.items():
                    start = time.perf_counter()
                    run(*inputs)
                    elapsed = time.perf_counter() - start
                    times.setdefault((name, label), []).append(getattr(run, "seconds", elapsed))
    rows = ["| graph (input) | engine | median ms | vs reference | max abs error | SNR dB |", "|---|---|---:|---:|---:|---:|"]
    for name, (inputs, engines) in graphs.items():
        labels = list(engines)
        reference = labels[0]
        shape = "x".join(str(d) for d in inputs[0].shape)
        base = float(np.median(times[name, reference]))
        for label in labels:
            median = float(np.median(times[name, label]))
            out, ref = outputs[name, label], outputs[name, reference]
            error = "—" if label == reference else f"{np.abs(out - ref).max():.1e}"
            snr = "—" if label == reference else f"{snr_db(ref, out):.0f}"
            rows.append(f"| {name} ({shape}) | {label} | {median * 1e3:.1f} | {base / median:.2f}x | {error} | {snr} |")
    return rows


def time_pipelines(model_dir: Path, onnx_dir: Path, rounds: int, seconds: float) -> list[str]:
    """Streamed synthesis on torch, ONNX Runtime and OpenVINO, sharing one LLM; interleaved rounds."""
    import numpy as np

    from cosyvoice_triton.engines.select import build_token2wav, open_campplus
    from cosyvoice_triton.preprocess.prompt import PromptEncoder
    from cosyvoice_triton.messages import SynthesisRequest
    from cosyvoice_triton.perf.cpu_synth_timing import run_once, text_with_tokens
    from cosyvoice_triton.random_folder.sample_prompt import speech_like
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2
    from cosyvoice_triton.token2wav.stream import Token2Wav

    pipelines = {"torch": CosyVoice2.from_model_dir(model_dir)}
    base = pipelines["torch"]
    for engine in ("onnxruntime", "openvino"):
        prompt_encoder = PromptEncoder.from_model_dir(model_dir)
        prompt_encoder.campplus = open_campplus(model_dir, engine, "cpu")
        flow, hift = build_token2wav(model_dir, engine, onnx_dir=onnx_dir)
        pipelines[engine] = CosyVoice2(base.model_dir, base.preprocessor, prompt_encoder, base.llm, Token2Wav(flow, hift))
    prompt = speech_like(3.0, 16000)
    text = text_with_tokens(base, round(seconds * 25 / 20))
    requests = {engine: SynthesisRequest(text=text, voice=tts.encode_voice(prompt, 16000, "hello there"), seed=1)
                for engine, tts in pipelines.items()}
    runs = {engine: [] for engine in pipelines}
    for _ in range(rounds):
        for engine, tts in pipelines.items():
            runs[engine].append(run_once(tts, requests[engine], stream=True))
    rows = ["| engine (token2wav + CAM++) | first chunk s | total s | audio s | RTF | first chunk vs torch | "
            "RTF vs torch |", "|---|---:|---:|---:|---:|---:|---:|"]
    medians = {engine: [float(np.median([r[i] for r in result])) for i in range(3)] for engine, result in runs.items()}
    first_torch, total_torch, _ = medians["torch"]
    for engine, (first, total, audio) in medians.items():
        rows.append(f"| {engine} | {first:.2f} | {total:.2f} | {audio:.1f} | {total / audio:.2f} | "
                    f"{first_torch / first:.2f}x | {total_torch / total:.2f}x |")
    return rows


def machine_lines(threads: int) -> list[str]:
    import platform

    import onnxruntime
    import openvino
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    capabilities = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return [f"Date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU {cpu}, {os.cpu_count()} cores; "
            f"{threads} threads per engine; Python {platform.python_version()}, torch {torch.__version__}, "
            f"onnxruntime {onnxruntime.__version__}, openvino {openvino.__version__} (CPU capabilities: "
            f"{', '.join(capabilities)})."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--onnx-dir", type=Path, default=None, help="default: MODEL_DIR/onnx")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of module calls (0: none)")
    parser.add_argument("--e2e-rounds", type=int, default=2, help="interleaved rounds of whole requests (0: none)")
    parser.add_argument("--seconds", type=float, default=3.0, help="audio per end-to-end request")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--ort-openvino-python", default=None,
                        help="a Python with the onnxruntime-openvino wheel, for ONNX Runtime's OpenVINO provider")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.ep_worker:
        return ep_worker()
    if args.model_dir is None:
        parser.error("--model-dir is required")
    import torch

    torch.set_num_threads(args.threads)
    onnx_dir = args.onnx_dir or args.model_dir / "onnx"
    lines = machine_lines(args.threads) + [f"Model folder {args.model_dir}.", ""]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        if not args.rounds:
            return _pipelines_only(args, onnx_dir, lines, started)
        graphs, unavailable, worker = module_runners(args.model_dir, onnx_dir, args.threads,
                                                     args.ort_openvino_python, Path(work))
        before = load_average()
        try:
            lines += [f"Module calls: {args.rounds} interleaved rounds, load average before {before} (1/5/15 min).", ""]
            lines += time_modules(graphs, args.rounds)
        finally:
            if worker is not None:
                worker.close()
        lines += ["", f"Load average after: {load_average()}."]
        lines += [f"Not measured: {label}: {reason}." for label, reason in unavailable.items()]
    return _pipelines_only(args, onnx_dir, lines, started)


def _pipelines_only(args, onnx_dir: Path, lines: list[str], started: float) -> int:
    """The end-to-end part (if `--e2e-rounds`), then the report."""
    if args.e2e_rounds:
        before = load_average()
        lines += ["", f"Streamed synthesis, ~{args.seconds:g} s of audio, {args.e2e_rounds} interleaved rounds, "
                      f"load average before {before}:", ""]
        lines += time_pipelines(args.model_dir, onnx_dir, args.e2e_rounds, args.seconds)
        lines += ["", f"Load average after: {load_average()}."]
    lines += ["", f"Whole run: {time.perf_counter() - started:.0f} s."]
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
