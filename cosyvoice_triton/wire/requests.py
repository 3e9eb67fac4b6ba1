"""The public requests of the Triton models: a synthesis, a voice conversion and a bistream text piece to
`cosyvoice2`, a registration to `register_voice`. Each is one typed value with one builder (`tensors()`, what
the gateway, the SDK and the tests send) and one parser (`parse_*`, what the model reads); errors name inputs.

Never imports torch or the library's model floors: the client SDK imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import VC_MODE, ChunkPolicy, check_mode, check_seed, check_speed, check_text_type
from cosyvoice_triton.wire.checks import (check_chunk_overrides, check_one_voice, check_optional_text, check_sampling,
                                          check_text_mode, check_text_piece, validate_text)
from cosyvoice_triton.wire.names import (BISTREAM, CHUNK_FIELDS, INSTRUCT_TEXT, INT32_MAX, MODE, NAME, OPTION_TYPES,
                                         OWNER, REFERENCE_AUDIO, REFERENCE_AUDIO_ID, REFERENCE_SAMPLE_RATE,
                                         REFERENCE_TEXT, REFERENCE_WAV, REFERENCE_WAV_LEN, SAMPLING_NAMES, SEED,
                                         SENTENCES, SOURCE_AUDIO, SOURCE_SAMPLE_RATE, SOURCE_WAV, SPEECH_MARKS, SPEED,
                                         TARGET_TEXT, TEXT_APPEND, TEXT_END, TEXT_FRONTEND, TEXT_MODE, TEXT_STREAM_ID,
                                         TEXT_TYPE, VOICE_ID)
from cosyvoice_triton.wire.tensors import TensorReader, string_array


@dataclass(frozen=True)
class PromptAudio:
    """A recording as given: samples + rate, or the bytes of an audio file."""

    samples: np.ndarray | None = None
    sample_rate: int | None = None
    file_bytes: bytes | None = None

    @property
    def field(self) -> str:
        """The input a prompt recording of this form arrives in."""
        return REFERENCE_AUDIO if self.file_bytes is not None else REFERENCE_WAV

    def tensors(self, wav: str, rate: str, blob: str) -> dict[str, np.ndarray]:
        """The recording under these input names: `wav` + `rate`, or the file in `blob`."""
        if self.file_bytes is not None:
            return {blob: np.array([self.file_bytes], dtype=object)}
        return {wav: np.asarray(self.samples, dtype=np.float32).reshape(-1),
                rate: np.array([self.sample_rate], dtype=np.int32)}


def prompt_tensors(audio: PromptAudio | None) -> dict[str, np.ndarray]:
    """A voice's prompt recording as cosyvoice2 and register_voice take it (nothing when None)."""
    return {} if audio is None else audio.tensors(REFERENCE_WAV, REFERENCE_SAMPLE_RATE, REFERENCE_AUDIO)


def option_tensor(name: str, value: object) -> np.ndarray:
    """An option input (`OPTION_TYPES`) holding `value`."""
    kind = OPTION_TYPES[name]
    return string_array(value) if kind is str else np.array([value], kind)


def option_tensors(options: dict[str, object]) -> dict[str, np.ndarray]:
    """The options given (None: not sent) as their inputs."""
    return {name: option_tensor(name, value) for name, value in options.items() if value is not None}


def chunk_overrides(fields: dict[str, object]) -> dict:
    """The chunk-policy fields a request sets (chunk_first_hop, ...; None: not set) as ChunkPolicy.with_overrides'
    keywords (first_hop, ...)."""
    return {attr: fields[name] for name, attr in CHUNK_FIELDS.items() if fields.get(name) is not None}


def chunk_options(overrides: dict[str, object]) -> dict:
    """ChunkPolicy overrides (first_hop, ...) as the inputs that carry them (chunk_first_hop, ...; None: not sent)."""
    return {name: overrides.get(attr) for name, attr in CHUNK_FIELDS.items()}


# ---- cosyvoice2: a synthesis -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SynthesisInputs:
    """A cosyvoice2 request as typed values (the voice still to be resolved). A caller builds one and sends
    `tensors()`; the model reads it back (`parse_synthesis_inputs`). `check` is the one check of its values,
    run where the request enters a process: the gateway's parse and the model's."""

    text: str
    mode: str = "zero_shot"
    instruct_text: str = ""
    voice_id: str | None = None
    audio: PromptAudio | None = None
    prompt_text: str | None = None
    owner: str | None = None  # whose voices voice_id and SSML's <voice name> name (None: the shared ones)
    seed: int | None = None
    sampling: dict = field(default_factory=dict)  # sampling overrides (top_p, ...); the rest: the server's
    chunk_overrides: dict = field(default_factory=dict)  # ChunkPolicy field -> value
    text_frontend: bool = True  # False: the text as given: no normalization, no sentence splitting
    speed: float = 1.0  # speaking speed (messages.check_speed)
    text_mode: str = SENTENCES  # bistream: `text` is the first piece, text_append requests bring the rest
    text_stream_id: str | None = None  # bistream: the caller's id of the synthesis
    text_type: str | None = None  # text | ssml; None: ssml when the text starts with <speak (preprocess/ssml.py)
    marks: bool = False  # speech marks among the audio (pipeline/speech_marks.py)

    @property
    def bistream(self) -> bool:
        """text_mode bistream: the text comes in pieces (text_append requests), as it is written."""
        return self.text_mode == BISTREAM

    def check(self, max_chars: int, chunk_policy: ChunkPolicy = ChunkPolicy()) -> SynthesisInputs:
        """The text (at most `max_chars` characters) and every setting (`check_settings`); InvalidInput naming
        the input. SSML is read (and its errors found) by whoever reads its parts. Returns self."""
        check_text_mode(self.text_mode)
        if self.bistream:
            check_text_piece(self.text, max_chars)  # the first piece: may be empty
            if not self.text_stream_id:
                raise InvalidInput(TEXT_STREAM_ID, "is required with text_mode bistream (its appends name it)")
        else:
            validate_text(self.text, TARGET_TEXT, max_chars)
        return self.check_settings(chunk_policy)

    def check_settings(self, chunk_policy: ChunkPolicy = ChunkPolicy()) -> SynthesisInputs:
        """Everything but the text (a WebSocket session's settings come before its text), the chunk policy's
        overrides against `chunk_policy`. Returns self."""
        check_text_mode(self.text_mode)
        check_text_type(self.text_type)
        if self.bistream and self.text_type == "ssml":
            raise InvalidInput(TEXT_TYPE, "ssml needs text_mode sentences (a whole <speak> document at once)")
        if not isinstance(self.marks, bool):
            raise InvalidInput(SPEECH_MARKS, "must be true or false")
        if self.bistream and self.marks:
            raise InvalidInput(SPEECH_MARKS, "need text_mode sentences (bistream text has no sentences to mark)")
        check_optional_text(self.instruct_text, INSTRUCT_TEXT)
        check_mode(self.mode, self.instruct_text)
        check_optional_text(self.prompt_text, REFERENCE_TEXT)
        if self.seed is not None:
            check_seed(self.seed)
        if not isinstance(self.text_frontend, bool):
            raise InvalidInput(TEXT_FRONTEND, "must be true or false")
        check_speed(self.speed)
        check_sampling(self.sampling)
        check_chunk_overrides(self.chunk_overrides, chunk_policy)
        return self

    def tensors(self) -> dict[str, np.ndarray]:
        """The request as cosyvoice2 tensors; a setting at its default is not sent."""
        values = {TARGET_TEXT: string_array(self.text), MODE: string_array(self.mode),
                  **voice_tensors(self.voice_id, self.audio, self.prompt_text, self.owner)}
        if self.instruct_text:
            values[INSTRUCT_TEXT] = string_array(self.instruct_text)
        if self.seed is not None:
            values[SEED] = np.array([self.seed], dtype=np.uint64)
        values.update(option_tensors({
            **self.sampling, TEXT_FRONTEND: None if self.text_frontend else False,
            SPEED: None if self.speed == 1.0 else self.speed,
            TEXT_MODE: None if self.text_mode == SENTENCES else self.text_mode, TEXT_STREAM_ID: self.text_stream_id,
            TEXT_TYPE: self.text_type, SPEECH_MARKS: True if self.marks else None,
            **chunk_options(self.chunk_overrides)}))
        return values


def voice_tensors(voice_id: str | None, audio: PromptAudio | None, prompt_text: str | None,
                  owner: str | None) -> dict[str, np.ndarray]:
    """The voice inputs of cosyvoice2: a registered id or a prompt recording, its transcript, the owner whose
    voices are meant; only what is given is sent."""
    values = {name: string_array(value) for name, value in ((REFERENCE_AUDIO_ID, voice_id), (OWNER, owner),
                                                             (REFERENCE_TEXT, prompt_text)) if value is not None}
    return {**values, **prompt_tensors(audio)}


def read_sampling(reader: TensorReader) -> dict:
    """The sampling overrides a request gives (top_p, top_k, win_size, tau_r), not yet checked."""
    values = {name: read_option(reader, name) for name in SAMPLING_NAMES}
    return {name: value for name, value in values.items() if value is not None}


def read_option(reader: TensorReader, name: str) -> str | int | float | None:
    """A string or number option input (`OPTION_TYPES`) as its Python value; None when absent."""
    kind = OPTION_TYPES[name]
    if kind is str:
        return reader.string(name)
    return reader.real(name) if kind is np.float32 else reader.integer(name)


def read_chunk_overrides(reader: TensorReader) -> dict:
    """The chunk-policy fields the request sets (ChunkPolicy.with_overrides' keywords)."""
    return chunk_overrides({name: read_option(reader, name) for name in CHUNK_FIELDS})


def read_audio(reader: TensorReader, wav: str, rate_name: str, blob: str,
               length_name: str | None = None) -> PromptAudio | None:
    """A recording sent as samples (`wav` + `rate_name`, the first `length_name` of them when that is sent) or
    as a file (`blob`), or None when neither came."""
    samples = reader.array(wav, np.float32, 1)
    rate = reader.integer(rate_name, low=1, high=1_000_000)
    file_bytes = reader.blob(blob)
    if samples is not None and file_bytes is not None:
        raise InvalidInput(blob, f"give {wav} or {blob}, not both")
    if length_name is not None:
        samples = _first_samples(reader, samples, wav, length_name)
    if samples is not None:
        if rate is None:
            raise InvalidInput(rate_name, f"is required with {wav}")
        return PromptAudio(samples=np.array(samples, dtype=np.float32), sample_rate=rate)
    if rate is not None:
        raise InvalidInput(wav, f"is required with {rate_name}")
    if file_bytes is not None:
        return PromptAudio(file_bytes=file_bytes)
    return None


def _first_samples(reader: TensorReader, samples: np.ndarray | None, wav: str, length_name: str) -> np.ndarray | None:
    """`samples` up to the count `length_name` gives (the rest is padding: the official clients pad to a round
    length); all of them when it is not sent."""
    length = reader.integer(length_name, low=0, high=INT32_MAX)
    if length is None:
        return samples
    if samples is None:
        raise InvalidInput(length_name, f"is only used with {wav}")
    if length > samples.shape[0]:
        raise InvalidInput(length_name, f"must be at most the {samples.shape[0]} samples of {wav}, got {length}")
    return samples[:length]


def read_prompt_audio(reader: TensorReader) -> PromptAudio | None:
    return read_audio(reader, REFERENCE_WAV, REFERENCE_SAMPLE_RATE, REFERENCE_AUDIO, REFERENCE_WAV_LEN)


def read_voice_choice(reader: TensorReader) -> tuple[str | None, PromptAudio | None]:
    """The request's voice: a stored voice's id or a recording, exactly one of the two."""
    voice_id = reader.string(REFERENCE_AUDIO_ID)
    audio = read_prompt_audio(reader)
    check_one_voice(voice_id, audio, REFERENCE_AUDIO_ID, REFERENCE_WAV if audio is None else audio.field,
                    required=False)
    if voice_id is None and audio is None:
        raise InvalidInput(REFERENCE_WAV, f"a voice is required: {REFERENCE_AUDIO_ID}, {REFERENCE_WAV} "
                                          f"(+ {REFERENCE_SAMPLE_RATE}) or {REFERENCE_AUDIO}")
    return voice_id, audio


def parse_synthesis_inputs(reader: TensorReader, max_chars: int,
                           chunk_policy: ChunkPolicy = ChunkPolicy()) -> SynthesisInputs:
    """A cosyvoice2 synthesis, checked (`SynthesisInputs.check`; chunk overrides against the server's policy)."""
    text_mode = reader.string(TEXT_MODE, default=SENTENCES)
    text = reader.string(TARGET_TEXT, default="", required=text_mode != BISTREAM)
    inputs = SynthesisInputs(text=text, mode=reader.string(MODE, default="zero_shot"),
                             instruct_text=reader.string(INSTRUCT_TEXT, default=""),
                             prompt_text=reader.string(REFERENCE_TEXT), owner=reader.string(OWNER),
                             seed=reader.integer(SEED), sampling=read_sampling(reader),
                             chunk_overrides=read_chunk_overrides(reader),
                             text_frontend=reader.boolean(TEXT_FRONTEND, default=True),
                             speed=reader.real(SPEED, 1.0),
                             text_mode=text_mode, text_stream_id=reader.string(TEXT_STREAM_ID),
                             text_type=reader.string(TEXT_TYPE),
                             marks=reader.boolean(SPEECH_MARKS, default=False)).check(max_chars, chunk_policy)
    voice_id, audio = read_voice_choice(reader)  # after the text: an empty text is named before a missing voice
    return replace(inputs, voice_id=voice_id, audio=audio)


# ---- cosyvoice2: a bistream text piece ------------------------------------------------------------------------

@dataclass(frozen=True)
class TextAppend:
    """More text for bistream stream `stream_id` (cosyvoice2: a text piece; llm: token ids)."""

    stream_id: str
    text: list[int] | str
    end: bool = False

    def tensors(self) -> dict[str, np.ndarray]:
        """A cosyvoice2 text_append request: `text` continues bistream synthesis `stream_id`."""
        return {TARGET_TEXT: string_array(self.text), TEXT_STREAM_ID: string_array(self.stream_id),
                TEXT_APPEND: np.array([True]), TEXT_END: np.array([self.end])}


def read_text_append(reader: TensorReader, max_chars: int) -> TextAppend | None:
    """A cosyvoice2 text_append request (None for any other request)."""
    if not reader.boolean(TEXT_APPEND, default=False):
        return None
    stream_id = reader.string(TEXT_STREAM_ID, required=True)
    text = reader.string(TARGET_TEXT, default="")
    check_text_piece(text, max_chars)
    return TextAppend(stream_id, text, reader.boolean(TEXT_END, default=False))


# ---- cosyvoice2: a voice conversion (mode "vc") ----------------------------------------------------------------

@dataclass(frozen=True)
class ConversionInputs:
    """A cosyvoice2 voice-conversion request as typed values (the voice still to be resolved)."""

    source: PromptAudio  # the recording to speak again (source_wav + source_sample_rate, or source_audio)
    voice_id: str | None = None
    audio: PromptAudio | None = None  # or the voice's prompt recording
    owner: str | None = None  # whose voices voice_id names (None: the shared ones)
    seed: int | None = None
    chunk_overrides: dict = field(default_factory=dict)  # ChunkPolicy field -> value
    speed: float = 1.0  # speaking speed (messages.check_speed)

    @property
    def text(self) -> str:
        """No text is spoken (a request cost counts none)."""
        return ""

    def check(self, chunk_policy: ChunkPolicy = ChunkPolicy()) -> ConversionInputs:
        """The settings (the recordings are checked where they are decoded); InvalidInput naming the input."""
        if self.seed is not None:
            check_seed(self.seed)
        check_speed(self.speed)
        check_chunk_overrides(self.chunk_overrides, chunk_policy)
        return self

    def tensors(self) -> dict[str, np.ndarray]:
        """The request as cosyvoice2 tensors in mode vc; a setting at its default is not sent."""
        values = {MODE: string_array(VC_MODE), **self.source.tensors(SOURCE_WAV, SOURCE_SAMPLE_RATE, SOURCE_AUDIO),
                  **voice_tensors(self.voice_id, self.audio, None, self.owner)}
        if self.seed is not None:
            values[SEED] = np.array([self.seed], dtype=np.uint64)
        values.update(option_tensors({SPEED: None if self.speed == 1.0 else self.speed,
                                      **chunk_options(self.chunk_overrides)}))
        return values


def parse_conversion_inputs(reader: TensorReader, chunk_policy: ChunkPolicy = ChunkPolicy()) -> ConversionInputs:
    if reader.has(TARGET_TEXT):
        raise InvalidInput(TARGET_TEXT, "is not used in vc mode (the source recording is what is spoken)")
    source = read_audio(reader, SOURCE_WAV, SOURCE_SAMPLE_RATE, SOURCE_AUDIO)
    if source is None:
        raise InvalidInput(SOURCE_AUDIO, f"the recording to convert is required in vc mode: {SOURCE_AUDIO} or "
                                         f"{SOURCE_WAV} (+ {SOURCE_SAMPLE_RATE})")
    voice_id, audio = read_voice_choice(reader)
    return ConversionInputs(source=source, voice_id=voice_id, audio=audio, owner=reader.string(OWNER),
                            seed=reader.integer(SEED), chunk_overrides=read_chunk_overrides(reader),
                            speed=reader.real(SPEED, 1.0)).check(chunk_policy)


def parse_cosyvoice2_request(reader: TensorReader, max_chars: int, chunk_policy: ChunkPolicy = ChunkPolicy()
                             ) -> SynthesisInputs | ConversionInputs | TextAppend:
    """Any cosyvoice2 request, checked: a voice conversion (mode vc), a bistream text piece (text_append) or a
    synthesis; chunk-policy overrides against the server's `chunk_policy`."""
    if reader.string(MODE) == VC_MODE:
        return parse_conversion_inputs(reader, chunk_policy)
    return read_text_append(reader, max_chars) or parse_synthesis_inputs(reader, max_chars, chunk_policy)


# ---- register_voice -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RegisterInputs:
    """A register_voice request: the prompt recording and its transcript, the id asked for, a label, the owner
    (None: a shared voice)."""

    audio: PromptAudio
    text: str = ""
    voice_id: str | None = None
    name: str | None = None
    owner: str | None = None

    def tensors(self) -> dict[str, np.ndarray]:
        values = {**voice_tensors(None, self.audio, self.text or None, self.owner)}
        values.update({key: string_array(value) for key, value in ((VOICE_ID, self.voice_id), (NAME, self.name))
                       if value is not None})
        return values


def parse_register_inputs(reader: TensorReader) -> RegisterInputs:
    audio = read_prompt_audio(reader)
    if audio is None:
        raise InvalidInput(REFERENCE_WAV, f"is required (or {REFERENCE_AUDIO})")
    text = reader.string(REFERENCE_TEXT, default="")
    check_optional_text(text, REFERENCE_TEXT)
    return RegisterInputs(audio=audio, text=text, voice_id=reader.string(VOICE_ID), name=reader.string(NAME),
                          owner=reader.string(OWNER))
