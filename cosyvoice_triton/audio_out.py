"""Audio out: float32 mono chunks (24 kHz, as token2wav makes them) -> the bytes of an audio format, with
FFmpeg's codecs and muxers through PyAV.

  name     container / codec              rate     bit rate   media type
  mp3      MPEG audio / LAME              24 kHz   64 kb/s    audio/mpeg
  opus     Ogg / libopus                  48 kHz   32 kb/s    audio/ogg   (Opus runs at 48 kHz: resampled)
  aac      ADTS / FFmpeg's AAC            24 kHz   64 kb/s    audio/aac
  flac     FLAC                           24 kHz   lossless   audio/flac
  wav      WAV / 16-bit PCM               24 kHz              audio/wav
  pcm      raw 16-bit little-endian       24 kHz              audio/pcm   (OpenAI's pcm)
  pcm_f32  raw 32-bit float little-endian 24 kHz              audio/L32   (the model's samples, unchanged)

`AudioEncoder` encodes one stream incrementally: `feed(chunk)` returns the bytes the muxer has written
for it (possibly none yet: encoders work on frames of 20-100 ms), `finish()` flushes the encoder and
writes the container's end. Streamed output is non-seekable, so FFmpeg writes what it cannot know yet
the way it does for a pipe: a streamed WAV's RIFF and data sizes are 0xFFFFFFFF ("unknown";
libsndfile/soundfile, FFmpeg and browsers read to the end of the data; Python's `wave` reads every
frame with readframes but reports 2^31-1 from getnframes; `soxi` prints 24:51:18 from the header),
a streamed FLAC has no total sample count, a streamed MP3 no Xing header. `encode(samples, fmt)` makes a
whole file into a seekable buffer, so its headers carry the exact lengths.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np

from cosyvoice_triton.messages import SAMPLE_RATE


@dataclass(frozen=True)
class AudioFormat:
    name: str
    media_type: str
    muxer: str  # FFmpeg's container format
    codec: str  # FFmpeg's encoder
    sample_rate: int | None = None  # the encoder's rate; None: the input's
    bit_rate: int | None = None
    muxer_options: tuple[tuple[str, str], ...] = ()

    def output_rate(self, input_rate: int) -> int:
        return self.sample_rate or input_rate


FORMATS: dict[str, AudioFormat] = {f.name: f for f in (
    AudioFormat("mp3", "audio/mpeg", "mp3", "libmp3lame", bit_rate=64_000),
    # one Ogg page per ~20 ms packet (FFmpeg's default is 1 s per page), so a stream is not held back
    AudioFormat("opus", "audio/ogg", "ogg", "libopus", sample_rate=48_000, bit_rate=32_000,
                muxer_options=(("page_duration", "20000"),)),
    AudioFormat("aac", "audio/aac", "adts", "aac", bit_rate=64_000),
    AudioFormat("flac", "audio/flac", "flac", "flac"),
    AudioFormat("wav", "audio/wav", "wav", "pcm_s16le"),
    AudioFormat("pcm", "audio/pcm", "s16le", "pcm_s16le"),
    AudioFormat("pcm_f32", "audio/L32", "f32le", "pcm_f32le"),
)}
# Older names still accepted by the gateway's own routes.
ALIASES = {"pcm_s16le": "pcm"}


def audio_format(name: str) -> AudioFormat:
    """The format called `name` (or one of its ALIASES); KeyError if there is none."""
    return FORMATS[ALIASES.get(name, name)]


class _Pipe:
    """A write-only, non-seekable file for PyAV: what the muxer writes is taken out after each call."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class AudioEncoder:
    """One stream of float32 mono samples at `sample_rate` -> bytes of `fmt`, chunk by chunk.

    seekable False (streaming): bytes come out of `feed` as the muxer writes them (flushed per packet);
    True (a whole file): everything comes out of `finish`, with the exact lengths in the headers.
    """

    def __init__(self, fmt: str | AudioFormat, sample_rate: int = SAMPLE_RATE, *, seekable: bool = False):
        self.format = fmt if isinstance(fmt, AudioFormat) else audio_format(fmt)
        self.sample_rate = sample_rate
        self.samples_in = 0
        self._file = io.BytesIO() if seekable else _Pipe()
        options = {"fflags": "+bitexact", "flush_packets": "1", **dict(self.format.muxer_options)}
        self._container = av.open(self._file, "w", format=self.format.muxer, options=options)
        rate = self.format.output_rate(sample_rate)
        self._stream = self._container.add_stream(self.format.codec, rate=rate, layout="mono")
        if self.format.bit_rate:
            self._stream.bit_rate = self.format.bit_rate
        self._container.start_encoding()  # opens the encoder (its sample format and frame size) and
        codec = self._stream.codec_context  # writes the header: even an empty stream is a valid file
        # Converts to the encoder's sample format and rate, and regroups into its frame size (0: any).
        self._resampler = av.AudioResampler(format=codec.format, layout="mono", rate=rate,
                                            frame_size=codec.frame_size or None)
        self._finished = False

    def feed(self, samples: np.ndarray) -> bytes:
        """Samples (N,) float32 -> the bytes ready now."""
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(1, -1)  # (channels=1, N)
        if samples.shape[1]:
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate = self.sample_rate
            frame.time_base = Fraction(1, self.sample_rate)
            frame.pts = self.samples_in
            self.samples_in += samples.shape[1]
            self._encode(self._resampler.resample(frame))
        return self._take()

    def finish(self) -> bytes:
        """Flush the resampler and the encoder, end the container: the last bytes (all, if seekable)."""
        if self._finished:
            return b""
        self._finished = True
        self._encode(self._resampler.resample(None))
        self._encode([None])  # drains the encoder
        self._container.close()
        if isinstance(self._file, io.BytesIO):
            return self._file.getvalue()
        return self._take()

    def close(self) -> None:
        """Abandon the stream (a cancelled request): frees FFmpeg's state without writing more."""
        if not self._finished:
            self._finished = True
            self._container.close()

    def _encode(self, frames) -> None:
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)

    def _take(self) -> bytes:
        return self._file.take() if isinstance(self._file, _Pipe) else b""


def encode(samples: np.ndarray, fmt: str | AudioFormat, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A whole file of `fmt` from samples (N,) float32, with exact lengths in its headers."""
    encoder = AudioEncoder(fmt, sample_rate, seekable=True)
    encoder.feed(samples)
    return encoder.finish()
