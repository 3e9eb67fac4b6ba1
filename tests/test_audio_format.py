"""The audio encoders (cosyvoice_triton.audio_out), without a server: every format decodes with its real
decoder to the samples it was given, fed whole or in uneven pieces, and a streamed WAV is read right."""
from __future__ import annotations

import io
import struct
import wave

import av
import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.audio_out import FORMATS, AudioEncoder, audio_format, encode

RATE = 24000
TONE_HZ = 375.0  # a whole number of cycles per 64 ms: an exact FFT bin at 24 and 48 kHz
CODECS = ("mp3", "opus", "aac", "flac", "wav")
# Samples a lossy decoder may add at the ends (encoder delay and the last frame's padding).
PADDING = {"mp3": 2 * 1152, "aac": 2 * 1024, "opus": 0, "flac": 0, "wav": 0}


def tone(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)


def decode(data: bytes) -> tuple[np.ndarray, int, str]:
    """(float32 samples, rate, container) through FFmpeg's demuxers and decoders."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        to_float = av.AudioResampler(format="flt", layout="mono")  # s16, s32, fltp ... -> float32
        frames = [out.to_ndarray().reshape(-1) for frame in container.decode(stream)
                  for out in to_float.resample(frame)]
        return (np.concatenate(frames).astype(np.float32) if frames else np.zeros(0, np.float32),
                stream.rate, container.format.name)


def peak_hz(samples: np.ndarray, rate: int) -> float:
    middle = samples[len(samples) // 4: 3 * len(samples) // 4]
    spectrum = np.abs(np.fft.rfft(middle * np.hanning(middle.size)))
    return float(np.argmax(spectrum) * rate / middle.size)


def streamed(fmt: str, samples: np.ndarray, cuts: list[int]) -> list[bytes]:
    encoder = AudioEncoder(fmt, RATE)
    return [encoder.feed(piece) for piece in np.split(samples, cuts)] + [encoder.finish()]


@pytest.mark.parametrize("fmt", CODECS)
def test_every_codec_decodes_to_what_it_was_given(fmt):
    audio = tone(2.0)
    containers = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}
    for data in (encode(audio, fmt), b"".join(streamed(fmt, audio, [1, 4801, 9000, 30011]))):
        decoded, rate, container = decode(data)
        assert container == containers[fmt] and rate == audio_format(fmt).output_rate(RATE)
        want = audio.size * rate // RATE
        assert want <= decoded.size <= want + PADDING[fmt] * rate // RATE, (fmt, decoded.size, want)
        assert abs(peak_hz(decoded, rate) - TONE_HZ) < 20  # the tone, not noise or silence
        assert 0.2 < np.abs(decoded).max() < 0.6


def test_the_bytes_do_not_depend_on_where_the_chunks_are_cut():
    rng = np.random.default_rng(0)
    audio = (0.2 * rng.standard_normal(RATE * 2)).astype(np.float32)
    for fmt in FORMATS:
        assert b"".join(streamed(fmt, audio, [])) == b"".join(streamed(fmt, audio, [5, 4800, 11111, 40000])), fmt


def test_lossless_formats_keep_the_samples():
    audio = tone(1.0) * np.linspace(0, 2.2, RATE, dtype=np.float32)  # past full scale: clipped
    s16 = np.clip(np.round(np.clip(audio, -1, 1) * 32768), -32768, 32767).astype(np.int16)
    flac, _, _ = decode(encode(audio, "flac"))
    np.testing.assert_array_equal(np.round(flac * 32768).astype(np.int16), s16)
    np.testing.assert_array_equal(np.frombuffer(encode(audio, "pcm"), "<i2"), s16)
    np.testing.assert_array_equal(np.frombuffer(encode(audio, "pcm_f32"), "<f4"), audio)
    pieces = b"".join(streamed("pcm_f32", audio, [3, 100, 1001]))
    np.testing.assert_array_equal(np.frombuffer(pieces, "<f4"), audio)


def test_bytes_come_out_while_the_stream_is_fed():
    audio = tone(3.0)
    cuts = list(range(4800, audio.size, 4800))  # 200 ms chunks, as a stream delivers them
    for fmt in FORMATS:
        parts = streamed(fmt, audio, cuts)
        fed = [p for p in parts[:-1] if p]
        assert len(fed) >= len(cuts) - 2, (fmt, [len(p) for p in parts])  # not held until the end
        assert sum(map(len, fed)) > 0.8 * sum(map(len, parts)), fmt


def test_whole_wav_has_exact_lengths():
    audio = tone(1.37)
    data = encode(audio, "wav")
    assert data[:4] == b"RIFF" and len(data) == 44 + 2 * audio.size  # no LIST chunk (bitexact)
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnframes(), w.getframerate(), w.getsampwidth(), w.getnchannels()) == (audio.size, RATE, 2, 1)
    assert sf.info(io.BytesIO(data)).frames == audio.size


def test_streamed_wav_says_unknown_length_and_readers_read_it_all():
    audio = tone(1.37)
    data = b"".join(streamed("wav", audio, [700, 12345]))
    # what FFmpeg writes on a pipe: both sizes 0xFFFFFFFF ("unknown"), never a wrong finite size
    assert struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert sf.info(io.BytesIO(data)).frames == audio.size  # libsndfile stops at the end of the data
    read, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and read.size == audio.size
    with wave.open(io.BytesIO(data)) as w:  # wave trusts the header's count, but reads to the end
        assert len(w.readframes(w.getnframes())) == 2 * audio.size
    assert decode(data)[0].size == audio.size


def test_empty_input():
    for fmt in FORMATS:
        for data in (encode(np.zeros(0, np.float32), fmt), AudioEncoder(fmt).finish()):
            if fmt in ("wav", "flac"):  # a header and no samples
                assert decode(data)[0].size == 0
            elif fmt in ("pcm", "pcm_f32"):
                assert data == b""
            else:  # mp3, aac, opus: no audio frame at all
                with pytest.raises((av.error.InvalidDataError, EOFError)):
                    decode(data)
    encoder = AudioEncoder("pcm")
    assert encoder.feed(np.zeros(0, np.float32)) == b""  # an empty chunk is accepted and adds nothing
    assert encoder.feed(np.ones(3, np.float32)) == b"\xff\x7f" * 3
    assert encoder.finish() == b"" and encoder.finish() == b""  # finish twice: nothing more


def test_names_and_media_types():
    assert {f: FORMATS[f].media_type for f in ("mp3", "opus", "aac", "flac", "wav", "pcm")} == {
        "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
        "pcm": "audio/pcm"}
    assert audio_format("pcm_s16le") is FORMATS["pcm"]
    with pytest.raises(KeyError):
        audio_format("ogg")
    encoder = AudioEncoder("opus")  # abandoned before its end (a cancelled stream)
    encoder.feed(tone(0.1))
    encoder.close()
    assert encoder.finish() == b""
