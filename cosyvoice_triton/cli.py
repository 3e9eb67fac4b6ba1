"""`cosyvoice-triton`: serve CosyVoice2 on Triton (`up`: tritonserver and the gateway; `serve`: tritonserver
alone), synthesize offline, export random model folders, fine-tune, import voices, and benchmark (`bench`,
`bench-official`)."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .errors import CosyVoiceError

if TYPE_CHECKING:
    from .server.launcher import ServeOptions

COMMANDS_GROUP = "cosyvoice_triton.commands"  # entry points: name = "module:add_command"
SERVE_EXTRA = "pip install 'cosyvoice-triton[serve]'"  # what a client-only install lacks for these commands


def _add_export(sub) -> None:
    from .family import COSYVOICE2, FAMILIES

    p = sub.add_parser("export", help="write a model folder with random weights in the released layout")
    p.add_argument("--family", choices=[family.name for family in FAMILIES], default=COSYVOICE2.name,
                   help="the model generation whose released layout the folder has (default %(default)s)")
    p.add_argument("--size", choices=["tiny", "full"], default="tiny",
                   help="tiny (seconds to make; the tests' size) or full (the released model's shapes, for benchmarks)")
    p.add_argument("--out", required=True, type=Path, help="the folder to write (new, or empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    p.add_argument("--no-backbone-weights", action="store_true",
                   help="skip CosyVoice-BlankEN/model.safetensors (not needed by this stack; 1 GB at full size)")
    p.set_defaults(func=_run_export)


def _run_export(args) -> int:
    from .random_folder.write import write_random_model

    write_random_model(args.out, size=args.size, seed=args.seed, backbone_weights=not args.no_backbone_weights,
                       family=args.family)
    print(f"wrote {args.size} {args.family} model folder to {args.out}")
    return 0


def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="synthesize one text to a 24 kHz wav file")
    p.add_argument("--model-dir", required=True,
                   help="model folder (CosyVoice2 or CosyVoice3: its yaml decides), or a hub model id")
    p.add_argument("--prompt-audio", "--prompt-wav", dest="prompt_audio", required=True, type=Path,
                   help="the prompt recording (wav, flac, ogg); --prompt-wav is its older name")
    p.add_argument("--prompt-text", default="", help="transcript of the prompt audio (zero_shot mode)")
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--mode", default="zero_shot", choices=["zero_shot", "cross_lingual", "instruct2"],
                   help="zero_shot (default: needs --prompt-text), cross_lingual (no transcript) or instruct2 "
                        "(with --instruct)")
    p.add_argument("--instruct", default="", help="style instruction (instruct2 mode)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed, the same audio "
                                                           "(default: a random one)")
    p.add_argument("--stream", action="store_true", help="stream: write chunks as they come, print their times")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda[:N]")
    p.add_argument("--out", required=True, type=Path, help="the wav file to write (24 kHz, float32)")
    p.set_defaults(func=_run_synth)


def _run_synth(args) -> int:
    import numpy as np
    import soundfile as sf

    from .preprocess.audio import decode_audio
    from .model_hub import resolve_model_dir
    from .pipeline.cosyvoice2 import CosyVoice, SynthesisRequest

    t0 = time.perf_counter()
    tts = CosyVoice.from_model_dir(resolve_model_dir(args.model_dir), device=args.device)  # the folder decides
    samples, rate = decode_audio(args.prompt_audio.read_bytes(), field="prompt_audio")
    voice = tts.encode_voice(samples, rate, args.prompt_text)
    print(f"loaded model and voice in {time.perf_counter() - t0:.2f} s", file=sys.stderr)

    request = SynthesisRequest(text=args.text, voice=voice, mode=args.mode, instruct_text=args.instruct,
                               seed=args.seed)
    start = time.perf_counter()
    total = 0
    with sf.SoundFile(args.out, "w", samplerate=tts.sample_rate, channels=1, subtype="FLOAT") as out:
        for i, chunk in enumerate(tts.synthesize(request, stream=args.stream)):
            out.write(np.asarray(chunk, dtype=np.float32).reshape(-1))
            out.flush()
            total += chunk.size
            if args.stream:
                print(f"chunk {i}: {chunk.size / tts.sample_rate:.2f} s of audio at "
                      f"{(time.perf_counter() - start) * 1000:.0f} ms", file=sys.stderr)
    elapsed = time.perf_counter() - start
    seconds = total / tts.sample_rate
    print(f"wrote {args.out}: {seconds:.2f} s of audio in {elapsed:.2f} s (RTF {elapsed / max(seconds, 1e-9):.3f})",
          file=sys.stderr)
    return 0


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start tritonserver with every CosyVoice2 model; Ctrl-C stops it")
    add_serve_arguments(p)
    p.set_defaults(func=_run_serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`serve`'s flags (`serve_options_from_args` reads them), also for tools that start a server their own way."""
    from .messages import CHUNK_POLICIES
    from .models.flow import FLOW_PRECISIONS
    from .models.llm_precision import LLM_PRECISIONS
    from .pipeline.chunk_policy import CHUNK_PRESETS
    from .server.launcher import ENGINES, PRECISIONS, ROLES

    p.add_argument("--model-dir", default=None,
                   help="model folder or hub id (default: a tiny random model made on first use)")
    p.add_argument("--run-dir", type=Path, default=None, help="where the rendered repository and log go")
    p.add_argument("--address", default="127.0.0.1",
                   help="address tritonserver listens on (default loopback: Triton has no keys or limits, so "
                        "clients go through the gateway; 0.0.0.0 only on a private network)")
    p.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP/REST port (default %(default)s)")
    p.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="Triton's Prometheus metrics port (default %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="torch device of llm and token2wav: cpu, cuda[:N], or xpu, npu, mps, hpu where torch and its "
                        "plugin support them (checked at start)")
    p.add_argument("--instances", type=int, default=1,
                   help="instances of the stateless models (cosyvoice2, prompt encoder steps, register_voice)")
    p.add_argument("--workers", type=int, default=16, help="requests synthesized at once per cosyvoice2 instance")
    p.add_argument("--max-queue-wait", type=float, default=2.0, metavar="S",
                   help="admission: refuse (UNAVAILABLE, 'retry after N s') a request that would wait more than S "
                        "seconds for a worker (cosyvoice_triton/admission.py)")
    add_realtime_arguments(p)
    p.add_argument("--voice-store", default=None,
                   help="sqlite path or redis://host:port/db (default: $COSYVOICE_HOME/voices.sqlite)")
    p.add_argument("--llm-max-batch", type=int, default=8, help="LLM streams decoded together (KV slots)")
    p.add_argument("--t2w-max-streams", type=int, default=64, help="token2wav streams with state at once")
    p.add_argument("--t2w-max-batch", type=int, default=16, help="token2wav chunks per flow batch")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads per llm/token2wav instance (default 0: from the core count, the LLM a third "
                        "of the cores, at most 4, token2wav the rest, so that the two run side by side)")
    p.add_argument("--llm-precision", choices=(*LLM_PRECISIONS, "auto"), default="auto",
                   help="the LLM backbone's precision: fp32 (the reference), bf16, int8 (weight-only), int8-dynamic "
                        "(int8 weights and activations, CPU), or auto (default: int8 on CPUs with AVX512-BF16/AMX, "
                        "bf16 on GPUs, int8-dynamic on other x86 CPUs with AVX2, else fp32; quality and speed "
                        "against fp32 in "
                        "perf/RESULTS.md)")
    p.add_argument("--flow-precision", choices=(*FLOW_PRECISIONS, "auto"), default="auto",
                   help="the torch flow estimator's arithmetic: fp32 (the reference), bf16, int8-dynamic (CPU), or auto "
                        "(default: fp32, as bf16's and int8-dynamic's waveforms miss the 30 dB bound; quality in "
                        "perf/RESULTS.md)")
    p.add_argument("--compile", choices=("off", "auto", "on"), default="off",
                   help="torch.compile (inductor) of the LLM's, the flow estimator's and HiFT's blocks, cached on "
                        "disk ($COSYVOICE_HOME/inductor): off (default: on a CPU it gains ~1%% of a stream for a "
                        "cold compile of about a minute), on, or auto (the modules that measured faster compiled "
                        "on this device kind; perf/RESULTS.md); eager after a failure")
    p.add_argument("--cuda-graphs", choices=("off", "auto", "on"), default="auto",
                   help="with --device cuda: the LLM's decode step replayed from CUDA graphs per slot-count bucket and "
                        "the torch flow estimator's step per (rows, frames) bucket, which turns the flow cache off "
                        "(engines/cuda_graphs.py): auto (default: on for CUDA devices), on, or off; eager after a "
                        "failed capture, with one log line")
    p.add_argument("--engine", choices=ENGINES, default="torch",
                   help="engine of token2wav's flow and HiFT decode (torch: the reference); openvino and tensorrt "
                        "also run CAM++. One that cannot run here falls back (tensorrt -> onnxruntime -> torch, "
                        "openvino -> onnxruntime)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="precision of TensorRT plans and OpenVINO's hint (torch and onnxruntime run fp32)")
    p.add_argument("--ort-providers", default=None, metavar="LIST",
                   help="with --engine onnxruntime: execution providers, most preferred first, with options, e.g. "
                        "'OpenVINOExecutionProvider:device_type=CPU;precision=FP32,rocm,cpu'; missing ones fall "
                        "back to the next with one log line (default: CPU, or CUDA on a GPU)")
    p.add_argument("--onnx-dir", type=Path, default=None,
                   help="exported ONNX graphs and TensorRT plans (default: MODEL_DIR/onnx, or RUN_DIR/onnx when "
                        "the model folder is read-only)")
    p.add_argument("--role", choices=ROLES, default="all",
                   help="all: every model in this server; split deployment: frontend (cosyvoice2, llm, prompt "
                        "encoder, register_voice; token2wav on --backend) or backend (token2wav only)")
    p.add_argument("--backend", action="append", default=[], metavar="SPEC",
                   help="with --role frontend: token2wav servers, grpc://HOST:PORT[?metrics=URL] (repeatable), or "
                        "dns://NAME:PORT for every address NAME resolves to (a Kubernetes headless Service, "
                        "re-resolved as pods come and go); each stream stays on one, new streams go to the one "
                        "with the least outstanding work")
    p.add_argument("--chunk-policy", choices=CHUNK_POLICIES, default="fixed",
                   help="chunk schedule of requests that name none: fixed (the official one: first hop 25 tokens "
                        "+ pad, then x2 up to 100) or adaptive (hops grow while a listener is ahead, stay small "
                        "when its lead runs low; audio then depends on the load)")
    p.add_argument("--chunk-preset", choices=tuple(CHUNK_PRESETS), default="official",
                   help="official (default: the official schedule and last chunk) or quick: a 15-token first hop "
                        "and a last chunk that computes only its new frames (sooner first audio, less work; its "
                        "audio difference from the official pass is in perf/RESULTS.md)")
    p.add_argument("--official-models", action=argparse.BooleanOptionalAction, default=True,
                   help="also serve cosyvoice2_official (streaming) and cosyvoice2_official_offline (on a "
                        "CosyVoice3 folder cosyvoice3_official and cosyvoice3_official_offline): the synthesis model "
                        "in the official runtime's tensor form, so the official Triton clients (client_grpc.py, "
                        "client_http.py) work unchanged but for --model-name (default: on; off saves two model "
                        "processes)")
    p.add_argument("--t2w-idle-timeout", type=float, default=120.0,
                   help="seconds a token2wav stream may go without a chunk before it is freed (its frontend is "
                        "presumed gone): counted from its latest chunk's answer, and only while token2wav runs no "
                        "batch, so a live stream waiting behind other streams' chunks is kept")
    p.add_argument("--flow-cache-frames", type=int, default=None, metavar="N",
                   help="mel frames of flow state each streaming token2wav stream keeps between chunks, so a "
                        "chunk computes only its new frames (torch flow; 0: off; default: the family's, CosyVoice2 "
                        "1000 at 1.15 MB per frame at full size, CosyVoice3 300 at 3.6 MB)")
    p.add_argument("--prompt-cache-mb", type=float, default=512.0, metavar="MB",
                   help="MB of voices' prompt frames token2wav keeps, least recently used evicted, so that a new "
                        "stream of a prompt seen before computes only the frames after them (torch flow with the "
                        "flow cache; 0: off; full size: 115 MB per 75-token prompt)")


def add_realtime_arguments(p) -> None:
    """serve's and up's flags of admission in real-time units (cosyvoice_triton/pipeline/capacity.py)."""
    from .pipeline.capacity import DEFAULT_REALTIME_MARGIN

    p.add_argument("--realtime-margin", type=float, default=DEFAULT_REALTIME_MARGIN, metavar="X",
                   help="a new stream starts only while every running stream still gets its audio X times faster "
                        "than real time (from the measured capacity); else it waits in the queue or is refused "
                        f"(default {DEFAULT_REALTIME_MARGIN:g}; 0: off, streams admitted by cost only)")
    p.add_argument("--realtime-capacity", type=float, default=None, metavar="S_PER_S",
                   help="audio seconds per second each cosyvoice2 instance makes, all streams together "
                        "(default: measured, a conservative figure until then)")


def serve_options_from_args(args: argparse.Namespace) -> ServeOptions:
    """The `ServeOptions` of the arguments `add_serve_arguments` added."""
    from .server.launcher import ServeOptions

    return ServeOptions(model_dir=args.model_dir, run_dir=args.run_dir, address=args.address,
                        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                        device=args.device, instances=args.instances, workers=args.workers,
                        max_queue_wait_s=args.max_queue_wait, realtime_margin=args.realtime_margin,
                        realtime_capacity=args.realtime_capacity, voice_store=args.voice_store, llm_max_batch=args.llm_max_batch,
                        t2w_max_streams=args.t2w_max_streams, t2w_max_batch=args.t2w_max_batch,
                        torch_threads=args.torch_threads, llm_precision=args.llm_precision,
                        flow_precision=args.flow_precision, engine=args.engine, precision=args.precision,
                        ort_providers=args.ort_providers, onnx_dir=args.onnx_dir, role=args.role,
                        backends=tuple(args.backend),
                        t2w_idle_timeout_s=args.t2w_idle_timeout, flow_cache_frames=args.flow_cache_frames,
                        prompt_cache_mb=args.prompt_cache_mb, chunk_policy=args.chunk_policy,
                        chunk_preset=args.chunk_preset, official_models=args.official_models, compile=args.compile,
                        cuda_graphs=args.cuda_graphs)


def _run_serve(args) -> int:
    from .server.launcher import serve

    return serve(serve_options_from_args(args))


def _add_finetune(sub) -> None:
    from .training.cli import add_arguments  # argparse only: torch loads when the command runs

    p = sub.add_parser("finetune", help="fine-tune the LLM and/or flow on recordings with transcripts; writes a "
                                        "model folder that serve loads unchanged (torchrun: -m cosyvoice_triton.training)")
    add_arguments(p)
    p.set_defaults(func=_run_finetune)


def _run_finetune(args) -> int:
    from .training.cli import run

    return run(args)


def _add_voices(sub) -> None:
    p = sub.add_parser("voices", help="manage the voice store")
    commands = p.add_subparsers(dest="voices_command", required=True)
    imp = commands.add_parser("import", help="store the speakers of an official spk2info.pt (add_zero_shot_spk + "
                                             "save_spkinfo) as voices named by their speaker ids")
    imp.add_argument("spk2info", type=Path, help="the spk2info.pt file the official code saved")
    imp.add_argument("--model-dir", type=Path, required=True,
                     help="the model folder that saved the speakers: its tokenizer decodes their prompt "
                          "transcripts, its family is the one their features serve")
    imp.add_argument("--voice-store", default=None,
                     help="sqlite path or redis://host:port/db (default: $COSYVOICE_HOME/voices.sqlite)")
    owner = imp.add_mutually_exclusive_group()
    owner.add_argument("--owner", metavar="KEY", default=None,
                       help="the API key the voices belong to (as if registered with it)")
    owner.add_argument("--shared", action="store_true", help="shared voices, seen by every key (the default)")
    imp.set_defaults(func=_run_voices_import)


def _run_voices_import(args) -> int:
    from .preprocess.text import TextPreprocessor
    from .voices.spk2info import import_spk2info
    from .voices.store import owner_tag
    from .voices.stores import open_voice_store

    preprocessor = TextPreprocessor.from_model_dir(args.model_dir)
    store = open_voice_store(args.voice_store)
    try:
        stored, skipped = import_spk2info(args.spk2info, store, preprocessor.tokenizer.decode,
                                          owner=owner_tag(args.owner) if args.owner else None,
                                          family=preprocessor.family.name)
    finally:
        store.close()
    for info in stored:
        print(f"{info.voice_id}\t{info.tokens} prompt tokens")
    if skipped:
        print(f"skipped (no zero-shot prompt): {', '.join(skipped)}", file=sys.stderr)
    return 0


def _add_tool_commands(sub) -> None:
    """The tool folders' commands (`up` from gateway/, `bench` from perf/): each is an entry point in the
    `cosyvoice_triton.commands` group (pyproject.toml) naming a function that adds its subparser. The
    library loads them by group, so it never names a tool folder and the tools stay optional."""
    for entry in entry_points(group=COMMANDS_GROUP):
        entry.load()(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosyvoice-triton", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (default: warnings only)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_export(sub)
    _add_synth(sub)
    _add_serve(sub)
    _add_finetune(sub)
    _add_voices(sub)
    _add_tool_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ModuleNotFoundError as exc:  # a client-only install: the SDK's packages, not the server's
        return _without_server_packages(exc, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _without_server_packages(exc: ModuleNotFoundError, argv: list[str]) -> int:
    """The commands' flags are read from the server's modules (torch and the rest), which a client-only
    install (`pip install '.[client]'`) does not have: say which extra brings them; --version still answers."""
    if "--version" in argv:
        print(f"cosyvoice-triton {__version__}")
        return 0
    print(f"cosyvoice-triton: its commands need the server's packages ({exc.name} is not installed): "
          f"{SERVE_EXTRA}, or from a clone `pip install '.[serve]'`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
