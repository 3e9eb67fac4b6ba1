"""`cosyvoice-client`: speak text through the gateway or straight through Triton, and manage voices.

```
cosyvoice-client synth --text "Hello there." --voice default --out hello.wav            # gateway
cosyvoice-client synth --text "Hello there." --voice default --out hello.wav --stream   # chunks + times
cosyvoice-client synth --text - --prompt-wav me.wav --prompt-text "..." --out a.wav      # text from stdin
cosyvoice-client synth --triton grpc://localhost:8001 --voice v_123 --text "Hi." --out a.wav
cosyvoice-client synth --text "Hello there." --stream --chunk-first-hop 10 --out a.wav  # earlier first audio
cosyvoice-client voices add me.wav --prompt-text "what I say in me.wav" [--id me] [--name Me]
cosyvoice-client voices list | show ID | delete ID
```
The target is the gateway at `--url` (default `$COSYVOICE_URL` or http://localhost:8080), or, with
`--triton`, a Triton server's gRPC endpoint. `--api-key` (or `$COSYVOICE_API_KEY`) authenticates to
the gateway. Errors print the server's message (which names the field) and exit with 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .common import SAMPLE_RATE, TTSError, write_wav

MODES = ("zero_shot", "cross_lingual", "instruct2")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("COSYVOICE_URL", "http://localhost:8080"),
                   help="the gateway (default $COSYVOICE_URL or http://localhost:8080)")
    p.add_argument("--triton", default=None, metavar="grpc://HOST:PORT",
                   help="talk to a Triton server's gRPC endpoint directly instead of the gateway")
    p.add_argument("--api-key", default=os.environ.get("COSYVOICE_API_KEY"), help="gateway API key")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosyvoice-client", description="CosyVoice2 service client")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="speak a text into a wav file")
    p.add_argument("--text", required=True, help="the text ('-': read it from standard input)")
    voice = p.add_mutually_exclusive_group()
    voice.add_argument("--voice", default=None, help="a registered voice id (gateway default: 'default')")
    voice.add_argument("--prompt-wav", type=Path, default=None, help="a prompt recording to clone instead")
    p.add_argument("--prompt-text", default=None, help="transcript of --prompt-wav (zero_shot needs it)")
    p.add_argument("--mode", choices=MODES, default=None)
    p.add_argument("--instruct", default=None, help="the instruction (instruct2 mode)")
    p.add_argument("--seed", type=int, default=None, help="same seed and inputs: same audio")
    p.add_argument("--chunk-first-hop", type=int, default=None, metavar="TOKENS",
                   help="speech tokens in the first streamed chunk (>= 4; default: the server's policy)")
    p.add_argument("--chunk-hop-scale", type=float, default=None, metavar="X",
                   help="each later chunk is the previous one times X (1 to 16)")
    p.add_argument("--chunk-max-hop", type=int, default=None, metavar="TOKENS",
                   help="chunks never grow beyond this many tokens")
    p.add_argument("--out", required=True, type=Path, help="the wav file to write (16-bit, 24 kHz)")
    p.add_argument("--stream", action="store_true", help="stream: print each chunk's arrival time")
    p.add_argument("--ws", action="store_true", help="stream over the gateway's WebSocket (implies --stream)")
    p.add_argument("--float", dest="float32", action="store_true", help="write 32-bit float samples")
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
        q.add_argument("voice_id")
        _add_target(q)
        q.set_defaults(func=func)
    return parser


def _gateway(args):
    from .gateway_client import GatewayTTS

    return GatewayTTS(args.url, api_key=args.api_key, timeout_s=args.timeout)


def _triton(args):
    from .triton_client import TritonTTS

    return TritonTTS(args.triton.removeprefix("grpc://"), timeout_s=args.timeout)


def _synth(args) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    options = {"mode": args.mode, "instruct": args.instruct, "seed": args.seed,
               "chunk_first_hop": args.chunk_first_hop, "chunk_hop_scale": args.chunk_hop_scale,
               "chunk_max_hop": args.chunk_max_hop}  # None: not sent, on either path
    if args.prompt_wav is not None:
        options.update(prompt_audio=args.prompt_wav.read_bytes(), prompt_text=args.prompt_text)
    else:
        options.update(voice_id=args.voice, prompt_text=args.prompt_text)
    streaming = args.stream or args.ws
    started = time.monotonic()
    chunks = []
    if args.triton:
        if options["voice_id"] is None and args.prompt_wav is None:
            raise SystemExit("cosyvoice-client: --voice or --prompt-wav is needed with --triton")
        client = _triton(args)
        try:
            stream = client.stream(text, **options)
            chunks = _collect(stream, started, streaming)
        finally:
            client.close()
    else:
        client = _gateway(args)
        if args.ws:
            stream = client.stream_ws(text, **options)
        elif streaming:
            stream = client.stream(text, **options)
        else:
            stream = None
            chunks = [client.synthesize(text, **options)]
        if stream is not None:
            chunks = _collect(stream, started, streaming)
    import numpy as np

    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    write_wav(args.out, audio, SAMPLE_RATE, float32=args.float32)
    elapsed = time.monotonic() - started
    seconds = audio.size / SAMPLE_RATE
    print(f"wrote {args.out}: {seconds:.2f} s of audio in {elapsed:.2f} s", file=sys.stderr)
    return 0


def _collect(stream, started: float, verbose: bool) -> list:
    chunks, total = [], 0
    with stream:
        for chunk in stream:
            chunks.append(chunk)
            total += chunk.size
            if verbose:
                print(f"chunk {len(chunks) - 1}: {chunk.size / SAMPLE_RATE:.2f} s of audio at "
                      f"{(time.monotonic() - started) * 1000:.0f} ms (total {total / SAMPLE_RATE:.2f} s)",
                      file=sys.stderr)
    if verbose and chunks:
        first = stream.stats.first_chunk_s
        print(f"first chunk after {first * 1000:.0f} ms", file=sys.stderr)
    return chunks


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
