"""`cosyvoice-client`: speak text through the gateway or straight through Triton, and manage voices (the commands
and options: docs/api/sdk.md#command-line, and `cosyvoice-client --help`). Errors print the server's message
(which names the field) and exit with 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from cosyvoice_triton.audio_out import FORMATS, AudioEncoder
from cosyvoice_triton.messages import CHUNK_POLICIES, MODES, VC_MODE
from cosyvoice_triton.wire.names import FAMILY_MODELS

from .common import SAMPLE_RATE, TTSError, write_wav

SUFFIX_FORMATS = {".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".aac": "aac", ".flac": "flac", ".pcm": "pcm",
                  ".wav": "wav"}


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("COSYVOICE_URL", "http://localhost:8080"),
                   help="the gateway (default $COSYVOICE_URL or http://localhost:8080)")
    p.add_argument("--triton", default=None, metavar="grpc://HOST:PORT",
                   help="talk to a Triton server's gRPC endpoint directly instead of the gateway")
    p.add_argument("--api-key", default=os.environ.get("COSYVOICE_API_KEY"), help="gateway API key")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="give up on a request after S seconds (default %(default)g)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosyvoice-client", description="CosyVoice2 and CosyVoice3 service client")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="speak a text into a wav file")
    p.add_argument("--text", default=None, help="the text ('-': read it from standard input; not with --mode vc)")
    voice = p.add_mutually_exclusive_group()
    voice.add_argument("--voice", default=None, help="a registered voice id (gateway default: 'default')")
    voice.add_argument("--prompt-audio", "--prompt-wav", dest="prompt_audio", type=Path, default=None,
                       help="a prompt recording to clone instead (--prompt-wav: its older name)")
    p.add_argument("--prompt-text", default=None, help="transcript of --prompt-audio (zero_shot needs it)")
    p.add_argument("--model", choices=tuple(FAMILY_MODELS), default=None,
                   help="the model family (default: the gateway's; with --triton, the server's synthesis models "
                        "of that family, default cosyvoice2)")
    p.add_argument("--mode", choices=(*MODES, VC_MODE), default=None,
                   help="vc: voice conversion of --source-wav into the voice (no text)")
    p.add_argument("--source-wav", type=Path, default=None, help="--mode vc: the recording to convert")
    p.add_argument("--instruct", default=None, help="the instruction (instruct2 mode)")
    p.add_argument("--seed", type=int, default=None, help="same seed and inputs: same audio")
    p.add_argument("--speed", type=float, default=None, metavar="X",
                   help="speaking speed, 0.25 to 4 (default 1): the mel interpolated by 1 / X, as the official code")
    p.add_argument("--no-text-frontend", dest="text_frontend", action="store_const", const=False, default=None,
                   help="speak the text as given: no normalization, no sentence splitting")
    p.add_argument("--chunk-first-hop", type=int, default=None, metavar="TOKENS",
                   help="speech tokens in the first streamed chunk (>= 4; default: the server's policy)")
    p.add_argument("--chunk-hop-scale", type=float, default=None, metavar="X",
                   help="each later chunk is the previous one times X (1 to 16)")
    p.add_argument("--chunk-max-hop", type=int, default=None, metavar="TOKENS",
                   help="chunks never grow beyond this many tokens")
    p.add_argument("--chunk-policy", choices=CHUNK_POLICIES, default=None,
                   help="fixed: the official schedule; adaptive: hops follow the listener's lead (default: the "
                        "server's)")
    p.add_argument("--out", required=True, type=Path, help="the audio file to write (24 kHz; opus 48 kHz)")
    p.add_argument("--format", choices=tuple(FORMATS), default=None,
                   help="the file's format (default: from the --out suffix, else wav: 16-bit)")
    p.add_argument("--stream", action="store_true",
                   help="stream: print each audio chunk as it arrives (index, arrival ms, seconds of audio)")
    p.add_argument("--ws", action="store_true", help="stream over the gateway's WebSocket (implies --stream)")
    p.add_argument("--float", dest="float32", action="store_true", help="wav: write 32-bit float samples")
    p.add_argument("--marks", type=Path, default=None, metavar="JSON",
                   help="write the speech marks (sentence, <mark> and <break> times and text spans; "
                        "docs/api/speech-marks.md) to this JSON file")
    _add_target(p)
    p.set_defaults(func=_synth)

    v = sub.add_parser("voices", help="register, list, show and delete voices")
    vsub = v.add_subparsers(dest="voices_command", required=True)
    add = vsub.add_parser("add", help="register a voice from a recording")
    add.add_argument("audio", type=Path, help="the recording (WAV, FLAC or OGG; 0.5 to 30 s)")
    add.add_argument("--prompt-text", default="", help="its transcript (needed for zero_shot)")
    add.add_argument("--id", dest="voice_id", default=None, help="the id to register under")
    add.add_argument("--name", default=None, help="a label")
    _add_target(add)
    add.set_defaults(func=_voices_add)
    q = vsub.add_parser("list", help="list registered voices (id, name, prompt length, transcript)")
    _add_target(q)
    q.set_defaults(func=_voices_list)
    for name, func, helptext in (("show", _voices_show, "show one voice"),
                                 ("delete", _voices_delete, "delete a voice")):
        q = vsub.add_parser(name, help=helptext)
        q.add_argument("voice_id", help="the voice's id")
        _add_target(q)
        q.set_defaults(func=func)
    return parser


def _gateway(args):
    from .gateway_client import GatewayTTS

    return GatewayTTS(args.url, api_key=args.api_key, timeout_s=args.timeout)


def _triton(args):
    from .triton_client import TritonTTS

    models = FAMILY_MODELS[getattr(args, "model", None) or "cosyvoice2"]  # (synth's --model; voices need none)
    return TritonTTS(args.triton.removeprefix("grpc://"), model=models[0], offline_model=models[1],
                     timeout_s=args.timeout)


def _synth(args) -> int:
    if args.mode == VC_MODE:
        return _convert(args)
    if args.text is None or args.source_wav is not None:
        raise SystemExit("cosyvoice-client: --text is required (--source-wav only with --mode vc)")
    text = sys.stdin.read() if args.text == "-" else args.text
    options = {"mode": args.mode, "instruct": args.instruct, "seed": args.seed, "text_frontend": args.text_frontend,
               "chunk_first_hop": args.chunk_first_hop, "chunk_hop_scale": args.chunk_hop_scale,
               "chunk_max_hop": args.chunk_max_hop, "chunk_policy": args.chunk_policy,
               "speed": args.speed, "marks": True if args.marks else None}  # None: not sent
    if not args.triton:  # with --triton, the model is the client's (`_triton`)
        options["model"] = args.model
    if args.prompt_audio is not None:
        options.update(prompt_audio=args.prompt_audio.read_bytes(), prompt_text=args.prompt_text)
    else:
        options.update(voice_id=args.voice, prompt_text=args.prompt_text)
    fmt = args.format or SUFFIX_FORMATS.get(args.out.suffix.lower(), "wav")
    if args.float32 and fmt != "wav":
        raise SystemExit("cosyvoice-client: --float is for wav files only")
    if args.triton and args.prompt_audio is None and options["voice_id"] is None:
        raise SystemExit("cosyvoice-client: --voice or --prompt-audio is needed with --triton")
    streaming = args.stream or args.ws
    started = time.monotonic()
    if not args.triton and not streaming and fmt != "wav" and not args.marks:
        data = _gateway(args).synthesize_file(text, fmt, **options)  # encoded by the gateway
        args.out.write_bytes(data)
        print(f"wrote {args.out}: {len(data)} bytes of {fmt} in {time.monotonic() - started:.2f} s", file=sys.stderr)
        return 0
    with _AudioWriter(args.out, fmt, args.float32) as writer:
        if args.triton:
            client = _triton(args)
            try:
                marks = _collect(client.stream(text, **options), started, streaming, writer.add)
            finally:
                client.close()
        else:
            client = _gateway(args)
            if args.ws:
                marks = _collect(client.stream_ws(text, **options), started, streaming, writer.add)
            elif streaming:
                marks = _collect(client.stream(text, **options), started, streaming, writer.add)
            else:
                audio = client.synthesize(text, **options)
                writer.add(audio)
                marks = getattr(audio, "marks", [])
    if args.marks:
        args.marks.write_text(json.dumps(marks, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.marks}: {len(marks)} speech marks", file=sys.stderr)
    elapsed = time.monotonic() - started
    print(f"wrote {args.out}: {writer.samples / SAMPLE_RATE:.2f} s of audio in {elapsed:.2f} s", file=sys.stderr)
    return 0


def _convert(args) -> int:
    """--mode vc: POST /v1/vc with --source-wav, in --voice or the voice of --prompt-audio."""
    if args.source_wav is None or args.text is not None or args.triton:
        raise SystemExit("cosyvoice-client: --mode vc takes --source-wav (no --text), through the gateway")
    voice = {"prompt_audio": args.prompt_audio.read_bytes()} if args.prompt_audio else {"voice_id": args.voice}
    source, started = args.source_wav.read_bytes(), time.monotonic()
    fmt = args.format or SUFFIX_FORMATS.get(args.out.suffix.lower(), "wav")
    client = _gateway(args)
    with _AudioWriter(args.out, fmt, args.float32) as writer:
        if args.stream:
            _collect(client.convert_stream(source, seed=args.seed, speed=args.speed, model=args.model, **voice),
                     started, True, writer.add)
        else:
            writer.add(client.convert(source, seed=args.seed, speed=args.speed, model=args.model, **voice))
    print(f"wrote {args.out}: {writer.samples / SAMPLE_RATE:.2f} s of audio in {time.monotonic() - started:.2f} s",
          file=sys.stderr)
    return 0


class _AudioWriter:
    """Chunks -> the --out file: a wav is written whole at the end (exact lengths in its header; 16-bit or
    float), any other format is encoded (cosyvoice_triton.audio_out) and written as the chunks arrive."""

    def __init__(self, path: Path, fmt: str, float32: bool):
        self.path, self.float32 = path, float32
        self.samples = 0
        self._chunks: list = []
        self._encoder = None if fmt == "wav" else AudioEncoder(fmt, SAMPLE_RATE)
        self._file = None if fmt == "wav" else open(path, "wb")  # noqa: SIM115 - closed in __exit__

    def add(self, chunk) -> None:
        self.samples += chunk.size
        if self._encoder is None:
            self._chunks.append(chunk)
        else:
            self._file.write(self._encoder.feed(chunk))

    def __enter__(self) -> _AudioWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._encoder is None:
            if exc_type is None:
                audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
                write_wav(self.path, audio, SAMPLE_RATE, float32=self.float32)
            return
        try:
            if exc_type is None:
                self._file.write(self._encoder.finish())
            else:
                self._encoder.close()
        finally:
            self._file.close()


def _collect(stream, started: float, verbose: bool, add) -> list[dict]:
    """Feed each audio chunk of `stream` to `add`; verbose: print one line per chunk as the service sent it
    (a gRPC response, a WebSocket frame, a chunk of the HTTP body): its index, its arrival after the
    request, in ms, and its seconds of audio. Returns the stream's complete speech marks ([] without)."""
    count, total = 0, 0
    with stream:
        for chunk in stream:
            add(chunk)
            count += 1
            total += chunk.size
            if verbose:
                print(chunk_line(count - 1, time.monotonic() - started, chunk.size / SAMPLE_RATE,
                                 total / SAMPLE_RATE), file=sys.stderr)
    if verbose and count:
        first = stream.stats.first_chunk_s
        print(f"first chunk after {first * 1000:.0f} ms; {count} chunks, {total / SAMPLE_RATE:.3f} s of audio",
              file=sys.stderr)
    return getattr(stream, "marks", [])


def chunk_line(index: int, arrival_s: float, seconds: float, total_s: float) -> str:
    """One streamed chunk as --stream prints it: chunk 3: at 812 ms, 0.480 s of audio (total 1.920 s)."""
    return f"chunk {index}: at {arrival_s * 1000:.0f} ms, {seconds:.3f} s of audio (total {total_s:.3f} s)"


def _voice_line(info) -> str:
    seconds = f"{info.prompt_seconds:.2f} s" if info.prompt_seconds is not None else "?"
    return f"{info.voice_id}\t{info.name or ''}\t{seconds}\t{info.prompt_text or ''}"


def _voices_add(args) -> int:
    if args.triton:
        client = _triton(args)
        try:
            info = client.register_voice(args.audio, prompt_text=args.prompt_text, voice_id=args.voice_id,
                                         name=args.name)
        finally:
            client.close()
    else:
        info = _gateway(args).add_voice(args.audio, args.prompt_text, voice_id=args.voice_id, name=args.name)
    print(info.voice_id)
    return 0


def _gateway_only(args, what: str) -> None:
    if args.triton:
        raise SystemExit(f"cosyvoice-client: voices {what} needs the gateway (Triton has no voice listing)")


def _voices_list(args) -> int:
    _gateway_only(args, "list")
    for info in _gateway(args).list_voices():
        print(_voice_line(info))
    return 0


def _voices_show(args) -> int:
    _gateway_only(args, "show")
    info = _gateway(args).get_voice(args.voice_id)
    print(json.dumps({"id": info.voice_id, "name": info.name, "text": info.prompt_text,
                      "audio_sha256": info.audio_sha256, "prompt_tokens": info.prompt_tokens, **(info.extra or {})},
                     indent=2))
    return 0


def _voices_delete(args) -> int:
    _gateway_only(args, "delete")
    _gateway(args).delete_voice(args.voice_id)
    print(f"deleted {args.voice_id}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TTSError as exc:
        print(f"cosyvoice-client: error: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as exc:
        print(f"cosyvoice-client: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
