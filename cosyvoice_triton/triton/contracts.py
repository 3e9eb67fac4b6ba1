"""Tensor contracts of the Triton models: what each model takes and gives, and the code on both sides.

Every builder here (used by a caller, usually a BLS call) has its parser (used by the callee), so a
contract lives in one place. "[1]" is a scalar; "opt" marks an optional input. Models with
`max_batch_size > 0` (prompt_encoder and its steps, token2wav) get a leading batch dimension on every
tensor, which callers send as 1 (one request = one row; the dynamic batcher gathers requests). Outputs too
have a builder (the callee's: `waveform_outputs`, ...) and a reader (the caller's: `waveform_of`, ...); a
name that code beyond this page needs is a constant here (`WAVEFORM`, `STREAM_ID`, ...; `*_OUTPUTS`: what a
BLS caller asks a model for), so no other file spells a tensor name.

A cosyvoice2 request is typed once, for both sides: `SynthesisInputs` and `ConversionInputs` (the wire
requests; `RegisterInputs` for register_voice) go to tensors with `tensors()` and come back with the parsers,
and their `check` is the one check of their values (text, mode, seed, speed, chunk policy, sampling), run by
the caller (the gateway) and by the model. Errors name inputs; `INPUT_FIELDS` says which request field each
input carries, so a caller maps them to its own names without knowing the tensors.

cosyvoice2 (decoupled) and cosyvoice2_offline (its non-decoupled twin, same template), max_batch_size 0
  in   target_text            STRING [1] opt  the text to speak (split into sentences, streamed in order); required
                                              except in mode vc (voice conversion, below)
       mode                   STRING [1] opt  zero_shot (default) | cross_lingual | instruct2
       reference_audio_id     STRING [1] opt  a registered voice (see register_voice)
       owner                  STRING [1] opt  whose voices reference_audio_id and SSML's <voice name> name: that
                                              owner's voice of the id, else the shared one (absent: shared voices
                                              only); the gateway sends its caller's tag of the API key
       reference_wav          FP32 [-1]  opt  prompt samples, mono, in [-1, 1] ...
       reference_sample_rate  INT32 [1]  opt  ... at this rate (required with reference_wav)
       reference_wav_len      INT32 [1]  opt  ... of which only the first this many count (the rest is padding)
       reference_audio        STRING [1] opt  or: a WAV/FLAC/OGG file's bytes
       reference_text         STRING [1] opt  transcript of the prompt (zero_shot); overrides a stored one
       instruct_text          STRING [1] opt  the instruction (instruct2)
       seed                   UINT64 [1] opt  same seed, same inputs -> same audio (random when absent)
       chunk_first_hop        INT32 [1]  opt  chunk policy overrides (ChunkPolicy.first_hop, ...)
       chunk_hop_scale        FP32 [1]   opt
       chunk_max_hop          INT32 [1]  opt
       text_frontend          BOOL [1]   opt  false: the text as given: no normalization, no sentence splitting (nor of the prompt
                                              transcript), as the official text_frontend=False (default true)
       chunk_policy           STRING [1] opt  fixed | adaptive (ChunkPolicy.kind; default: the server's)
       speed                  FP32 [1]   opt  speaking speed, 0.25 .. 4.0 (default 1.0): the mel interpolated by 1 / speed
       text_type              STRING [1] opt  text | ssml (preprocess/ssml.py; default: ssml when target_text starts
                                              with <speak); SSML errors are INVALID_ARG naming target_text
       text_mode              STRING [1] opt  sentences (default) | bistream: target_text is only the first piece
                                              (may be empty); text_append requests bring the rest (decoupled only)
       text_stream_id         STRING [1] opt  bistream: the caller's id of the synthesis, named by its appends
       text_append            BOOL [1]   opt  true: target_text continues bistream synthesis text_stream_id (no
                                              other input); answered by one empty final response
       text_end               BOOL [1]   opt  with text_append: the text ends after this piece
       speech_marks           BOOL [1]   opt  true: speech marks in `marks` (pipeline/speech_marks.py; needs
                                              text_mode sentences)
       top_p FP32, top_k INT32, win_size INT32, tau_r FP32   [1] opt  sampling overrides (default: the yaml's)
  out  waveform               FP32 [-1]       24 kHz audio: one response per chunk (decoupled, then an
                                              empty final response), or the whole waveform (twin)
       marks                  STRING [1]      with speech_marks only: a JSON list of mark events, which come
                                              before the response's audio (decoupled: a sentence's mark with
                                              end_ms null, its mark_end later; a response may carry only
                                              marks); the twin: the complete marks
  Exactly one voice: reference_audio_id, reference_wav (+ reference_sample_rate) or reference_audio.
  Voice conversion, mode "vc" (the official inference_vc: no text, no LLM; target_text is then refused):
       source_wav             FP32 [-1]  opt  the recording to speak again in the voice, mono, in [-1, 1] ...
       source_sample_rate     INT32 [1]  opt  ... at this rate (required with source_wav)
       source_audio           STRING [1] opt  or: a WAV/FLAC/OGG file's bytes
  with exactly one source and one voice, plus seed, speed and chunk_* as above; 0.2 s .. 600 s, split into pieces
  of at most 30 s and spoken in order (pipeline/voice_conversion.py states the split rule).

cosyvoice2_official (decoupled) and cosyvoice2_official_offline (not decoupled): the same template and model in
  the official runtime's tensor form (config parameter tensor_form "official"), so that the official Triton
  clients (runtime/triton_trtllm: client_grpc.py, client_http.py) work unchanged but for --model-name. The
  official config has max_batch_size > 0, so these have max_batch_size 1 (no dynamic batching): every tensor
  above carries a leading batch dimension of 1 (reference_wav [1, N], the rest [1, 1]; another batch is refused
  naming the input), and `waveform` is [1, n]. `from_official_form` turns the arrays into the native form:
       reference_wav          at 16 kHz when reference_sample_rate is not sent (the official server's only rate)
       reference_wav_len      honoured (the official clients pad reference_wav with zeros past it)
       no voice tensors       the official "spk2info cache" request (target_text alone): the stored voice
                              `default` (DEFAULT_VOICE_ID; the gateway registers it at start); when it is not
                              stored, InvalidInput naming reference_wav
  Every other input (seed, speed, mode, reference_audio_id, ...) works as above, with its batch dimension.
  Triton checks ranks against a model's config before the model runs, so one name cannot take both forms;
  `official_model_for` says which model takes a request that names cosyvoice2 (a gateway's Triton facade).

llm (decoupled, max_batch_size 0; one in-flight batching engine per instance)
  in   stream_id              STRING [1]      caller-chosen id; a cancel request names it
       cancel                 BOOL [1]   opt  true: end stream `stream_id` (only stream_id needed)
       text_tokens            INT32 [-1]      the sentence's text tokens (required unless cancel)
       bistream               BOOL [1]   opt  true: text_tokens are the first text (may be empty); more comes
                                              with text_append requests (llm/bistream.py)
       text_append            BOOL [1]   opt  true: append text_tokens to bistream stream `stream_id`
       text_end               BOOL [1]   opt  with text_append: no text after these
       prompt_text_tokens     INT32 [-1] opt  (empty when absent)
       prompt_speech_tokens   INT32 [-1] opt  (empty when absent)
       seed                   UINT64 [1]      seeds the stream's sampler
       top_p FP32, top_k INT32, win_size INT32, tau_r FP32   [1] opt  default: the model yaml's sampling
  out  speech_tokens          INT32 [-1]      the tokens sampled since the previous response
  A stream ends with an empty final response (stop token, max length, or cancelled); a cancel request
  and a text_append request get one empty final response each. Errors end a stream with an error response.

token2wav (max_batch_size = engine max_batch, dynamic batching, one instance: see its config.pbtxt)
  in   stream_id              STRING [1]      chunks of one stream share it; state lives until finalize
       tokens                 INT32 [-1] opt  NEW speech tokens since the stream's previous chunk
       finalize               BOOL [1]   opt  last chunk: emit everything and free the state
       cancel                 BOOL [1]   opt  drop the stream's state now (no audio)
       seed                   UINT64 [1] opt  vocoder noise seed (first chunk)
       prompt_speech_tokens   INT32 [-1] opt  first chunk only: the voice's prompt tokens (P,)
       prompt_mel             FP32 [-1, 80] opt  first chunk only: (2P, 80)
       embedding              FP32 [192] opt  first chunk only: speaker embedding
       speed                  FP32 [1]   opt  first chunk only: speaking speed (default 1.0; token2wav/speed.py)
  out  waveform               FP32 [-1]       the chunk's audio (empty for a cancel)

prompt_encoder (ensemble, max_batch_size 8): prompt_audio -> (speaker_embedding || audio_tokenizer)
  in   reference_wav          FP32 [-1]       prompt samples at ...
       reference_sample_rate  INT32 [1]       ... this rate; checked (0.5 s .. 30 s, finite, not silent)
  out  embedding              FP32 [192]      CAM++ speaker embedding (of the 16 kHz audio)
       speech_tokens          INT32 [-1]      S3 tokens, 25 Hz (of the 16 kHz audio)
       prompt_mel             FP32 [-1, 80]   mel at 50 Hz (of the 24 kHz audio), not yet aligned
  steps: prompt_audio (reference_wav, reference_sample_rate -> wav16k FP32 [-1], prompt_mel);
         speaker_embedding (wav16k -> embedding); audio_tokenizer (wav16k -> speech_tokens).
  The caller aligns tokens and mel as `PromptEncoder.encode` does (`align_prompt_features`).

register_voice (max_batch_size 0)
  in   reference_wav + reference_sample_rate, or reference_audio   (as for cosyvoice2)
       reference_text         STRING [1] opt  the transcript (needed to use the voice in zero_shot)
       voice_id               STRING [1] opt  the id to register under (default: derived from the content)
       name                   STRING [1] opt  a label
       owner                  STRING [1] opt  the tenant the voice belongs to (the gateway's tag of an API
                                              key); absent: a shared voice
  out  voice_id               STRING [1]      idempotent: the same recording, text and owner give the same id
       audio_sha256           STRING [1]
       prompt_tokens          INT32 [1]       prompt speech tokens stored (25 per second)
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import (SEED_LIMIT, TEXT_MODES, VC_MODE, ChunkPolicy, ChunkRequest, FlowPrompt, LLMRequest,
                                       PromptFeatures, SamplingParams, check_mode, check_seed, check_speed,
                                       check_text_type, is_int)
from cosyvoice_triton.triton.tensors import TensorReader, string_array
from cosyvoice_triton.voices.store import check_owner

COSYVOICE2 = "cosyvoice2"
COSYVOICE2_OFFLINE = "cosyvoice2_offline"
COSYVOICE2_OFFICIAL = "cosyvoice2_official"  # the official runtime's tensor form (below)
COSYVOICE2_OFFICIAL_OFFLINE = "cosyvoice2_official_offline"
OFFICIAL_MODELS = (COSYVOICE2_OFFICIAL, COSYVOICE2_OFFICIAL_OFFLINE)
LLM = "llm"
TOKEN2WAV = "token2wav"
PROMPT_ENCODER = "prompt_encoder"
PROMPT_AUDIO = "prompt_audio"
SPEAKER_EMBEDDING = "speaker_embedding"
AUDIO_TOKENIZER = "audio_tokenizer"
REGISTER_VOICE = "register_voice"

# Tensor names that code beyond this page needs (the config.pbtxt files name them too). Outputs:
WAVEFORM = "waveform"  # cosyvoice2, cosyvoice2_offline, token2wav: FP32 audio at 24 kHz
MARKS = "marks"  # cosyvoice2, cosyvoice2_offline: STRING, a JSON list of speech mark events
SPEECH_TOKENS = "speech_tokens"  # llm, audio_tokenizer, prompt_encoder: INT32 S3 tokens, 25 Hz
EMBEDDING = "embedding"  # speaker_embedding, prompt_encoder: FP32 [192]
PROMPT_MEL = "prompt_mel"  # prompt_audio, prompt_encoder: FP32 [-1, 80]
WAV16K = "wav16k"  # prompt_audio's output, the input of speaker_embedding and audio_tokenizer
VOICE_ID, AUDIO_SHA256, PROMPT_TOKENS = "voice_id", "audio_sha256", "prompt_tokens"  # register_voice
# What a BLS caller asks each model for.
LLM_OUTPUTS = (SPEECH_TOKENS,)
TOKEN2WAV_OUTPUTS = (WAVEFORM,)
AUDIO_TOKENIZER_OUTPUTS = (SPEECH_TOKENS,)
PROMPT_ENCODER_OUTPUTS = (EMBEDDING, SPEECH_TOKENS, PROMPT_MEL)
# Inputs that errors raised beyond this page name.
STREAM_ID = "stream_id"  # llm, token2wav
TEXT_APPEND = "text_append"  # llm, cosyvoice2
LEAD_S = "lead_s"  # llm: FP32 [1], optional: the audio its listener still has to play (LLMRequest.lead_s)
TEXT_MODE = "text_mode"  # cosyvoice2
SPEECH_MARKS = "speech_marks"  # cosyvoice2
REFERENCE_WAV, REFERENCE_TEXT = "reference_wav", "reference_text"  # cosyvoice2, register_voice, prompt_audio
REFERENCE_WAV_LEN = "reference_wav_len"  # cosyvoice2
OWNER = "owner"  # cosyvoice2, register_voice: a tenant's tag (voices/store.py Owners), set by the gateway
TARGET_TEXT, TEXT_STREAM_ID = "target_text", "text_stream_id"  # cosyvoice2
SOURCE_AUDIO = "source_audio"  # cosyvoice2 mode vc
SENTENCES, BISTREAM = TEXT_MODES  # the values of text_mode

# The chunk-policy overrides of cosyvoice2: input (and request field of that name) -> ChunkPolicy attribute.
CHUNK_FIELDS = {"chunk_first_hop": "first_hop", "chunk_hop_scale": "hop_scale", "chunk_max_hop": "max_hop",
                "chunk_policy": "kind"}
# The per-request overrides of cosyvoice2 (sampling, then chunk policy) and their tensor types.
OPTION_TYPES: dict[str, type] = {"top_p": np.float32, "top_k": np.int32, "win_size": np.int32, "tau_r": np.float32,
                                 "chunk_first_hop": np.int32, "chunk_hop_scale": np.float32,
                                 "chunk_max_hop": np.int32, "text_frontend": np.bool_, "chunk_policy": str, "speed": np.float32,
                                 "text_mode": str, "text_stream_id": str, "text_type": str, "speech_marks": np.bool_}
INT32_MAX = 2**31 - 1
# Each input of cosyvoice2 and register_voice -> the request field it carries: text, voice_id, audio (the prompt
# recording), prompt_text, source (a conversion's recording), ...; an option keeps its own name (seed, speed,
# chunk_*, top_p, ...). Errors name inputs; a caller with field names of its own (the gateway's APIs) maps them
# back through this table and never needs the tensor names.
INPUT_FIELDS: dict[str, str] = {
    "target_text": "text", "mode": "mode", "instruct_text": "instruct_text", "seed": "seed",
    "reference_audio_id": "voice_id", "reference_wav": "audio", "reference_sample_rate": "audio",
    "reference_audio": "audio", "reference_wav_len": "audio", "reference_text": "prompt_text",
    "source_wav": "source", "source_sample_rate": "source", "source_audio": "source",
    "text_append": "text_append", "text_end": "text_end",
    "voice_id": "voice_id", "name": "name", OWNER: "owner",  # register_voice: the id to register under, ...
    **{name: name for name in OPTION_TYPES},
    SPEECH_MARKS: "marks",
}
INPUT_NAMES = frozenset(INPUT_FIELDS)


# ---- checks of request values (the gateway's parse and the models' tensor parse run the same ones) ------

def check_optional_text(value: object, name: str) -> None:
    """None, or a string without control characters or lone surrogates; InvalidInput naming `name`."""
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidInput(name, f"must be a string, got {type(value).__name__}")
    from cosyvoice_triton.preprocess.text import check_clean_text  # here: the client SDK imports this module

    check_clean_text(value, name)


def check_text_mode(text_mode: object) -> None:
    if text_mode not in TEXT_MODES:
        raise InvalidInput(TEXT_MODE, f"must be one of {', '.join(TEXT_MODES)}, got {text_mode!r}")


def check_text_piece(text: str, max_chars: int) -> None:
    """A bistream piece: any text (even none) of at most `max_chars` characters."""
    if len(text) > max_chars:
        raise InvalidInput("target_text", f"a text piece takes at most {max_chars} characters, got {len(text)}")


def chunk_overrides(fields: Mapping[str, object]) -> dict:
    """The chunk-policy fields a request sets (chunk_first_hop, ...; None: not set) as ChunkPolicy.with_overrides'
    keywords (first_hop, ...)."""
    return {attr: fields[name] for name, attr in CHUNK_FIELDS.items() if fields.get(name) is not None}


def chunk_options(overrides: Mapping[str, object]) -> dict:
    """ChunkPolicy overrides (first_hop, ...) as the inputs that carry them (chunk_first_hop, ...; None: not sent)."""
    return {name: overrides.get(attr) for name, attr in CHUNK_FIELDS.items()}


def check_chunk_overrides(overrides: Mapping[str, object]) -> None:
    """Types here (a number that fits its tensor), ranges by `ChunkPolicy` against its defaults (a server checks
    them again against its own policy when it applies them); InvalidInput naming the input (chunk_*)."""
    for name, attr in CHUNK_FIELDS.items():
        value, kind = overrides.get(attr), OPTION_TYPES[name]
        if value is None:
            continue
        if kind is str and not isinstance(value, str):
            raise InvalidInput(name, f"must be a string, got {type(value).__name__}")
        if kind is np.int32 and not is_int(value):
            raise InvalidInput(name, f"must be an integer, got {type(value).__name__}")
        if kind is np.int32 and value > INT32_MAX:  # ChunkPolicy checks the lower bounds
            raise InvalidInput(name, f"must be at most {INT32_MAX}, got {value}")
        if kind is np.float32 and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidInput(name, f"must be a number, got {type(value).__name__}")
    ChunkPolicy().with_overrides(**overrides)


# ---- sampling overrides (cosyvoice2 and llm) -------------------------------------------------------

def read_sampling(reader: TensorReader, defaults: SamplingParams) -> SamplingParams:
    """`defaults` with any of top_p, top_k, win_size, tau_r given in the request (not yet validated)."""
    return SamplingParams(top_p=reader.real("top_p", defaults.top_p),
                          top_k=reader.integer("top_k", defaults.top_k),
                          win_size=reader.integer("win_size", defaults.win_size),
                          tau_r=reader.real("tau_r", defaults.tau_r))


def sampling_inputs(sampling: SamplingParams) -> dict[str, np.ndarray]:
    return {"top_p": np.array([sampling.top_p], np.float32), "top_k": np.array([sampling.top_k], np.int32),
            "win_size": np.array([sampling.win_size], np.int32), "tau_r": np.array([sampling.tau_r], np.float32)}


# ---- llm ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamCancel:
    """A request to end stream `stream_id` (llm and token2wav)."""

    stream_id: str


@dataclass(frozen=True)
class TextAppend:
    """More text for bistream stream `stream_id` (llm: token ids; cosyvoice2: a text piece)."""

    stream_id: str
    text: list[int] | str
    end: bool = False


def llm_inputs(request: LLMRequest) -> dict[str, np.ndarray]:
    values = {STREAM_ID: string_array(request.stream_id),
              "text_tokens": np.asarray(request.text_tokens, dtype=np.int32),
              "seed": np.array([request.seed], dtype=np.uint64)}
    if request.prompt_text_tokens:
        values["prompt_text_tokens"] = np.asarray(request.prompt_text_tokens, dtype=np.int32)
    if request.prompt_speech_tokens:
        values["prompt_speech_tokens"] = np.asarray(request.prompt_speech_tokens, dtype=np.int32)
    values.update(sampling_inputs(request.sampling))
    if request.bistream:
        values["bistream"] = np.array([True])
    if request.lead_s is not None:
        values[LEAD_S] = np.array([request.lead_s], dtype=np.float32)
    return values


def llm_append_inputs(stream_id: str, tokens: list[int], end: bool) -> dict[str, np.ndarray]:
    return {STREAM_ID: string_array(stream_id), TEXT_APPEND: np.array([True]),
            "text_tokens": np.asarray(tokens, dtype=np.int32), "text_end": np.array([end])}


def llm_cancel_inputs(stream_id: str) -> dict[str, np.ndarray]:
    return {STREAM_ID: string_array(stream_id), "cancel": np.array([True])}


def speech_tokens_outputs(tokens, batched: bool = False) -> dict[str, np.ndarray]:
    """The answer of llm (the tokens since the previous response) or, `batched` (1, N), of audio_tokenizer."""
    array = np.asarray(tokens, dtype=np.int32)
    return {SPEECH_TOKENS: array.reshape(1, -1) if batched else array.reshape(-1)}


def speech_tokens_from_outputs(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The `speech_tokens` of an llm or audio_tokenizer answer: (N,) int32."""
    return np.asarray(outputs[SPEECH_TOKENS], dtype=np.int32).reshape(-1)


def parse_llm_request(reader: TensorReader,
                      default_sampling: SamplingParams) -> LLMRequest | StreamCancel | TextAppend:
    stream_id = reader.string(STREAM_ID, required=True)
    if not stream_id:
        raise InvalidInput(STREAM_ID, "must not be empty")
    if reader.boolean("cancel"):
        return StreamCancel(stream_id)
    if reader.boolean(TEXT_APPEND):
        return TextAppend(stream_id, reader.token_ids("text_tokens"), reader.boolean("text_end", default=False))
    seed = reader.integer("seed", required=True, low=0, high=SEED_LIMIT - 1)
    bistream = reader.boolean("bistream", default=False)
    lead_s = reader.real(LEAD_S)
    if lead_s is not None and not lead_s >= 0:
        raise InvalidInput(LEAD_S, f"must be >= 0 seconds, got {lead_s}")
    return LLMRequest(stream_id=stream_id, text_tokens=reader.token_ids("text_tokens", required=not bistream),
                      prompt_text_tokens=reader.token_ids("prompt_text_tokens"),
                      prompt_speech_tokens=reader.token_ids("prompt_speech_tokens"),
                      sampling=read_sampling(reader, default_sampling).validate(), seed=seed, bistream=bistream,
                      lead_s=lead_s)


# ---- token2wav ---------------------------------------------------------------------------------------

def chunk_inputs(chunk: ChunkRequest) -> dict[str, np.ndarray]:
    """One token2wav request (batch dimension 1 on every tensor)."""
    values = {STREAM_ID: string_array(chunk.stream_id, batched=True),
              "tokens": np.asarray(chunk.tokens, dtype=np.int32).reshape(1, -1),
              "finalize": np.array([[chunk.finalize]])}
    if chunk.seed is not None:
        values["seed"] = np.array([[chunk.seed]], dtype=np.uint64)
    if chunk.speed != 1.0:
        values["speed"] = np.array([[chunk.speed]], dtype=np.float32)
    if chunk.prompt is not None:
        prompt = chunk.prompt
        values["prompt_speech_tokens"] = np.asarray(prompt.speech_tokens, dtype=np.int32).reshape(1, -1)
        values[PROMPT_MEL] = np.asarray(prompt.mel, dtype=np.float32)  # (1, 2P, 80)
        values[EMBEDDING] = np.asarray(prompt.embedding, dtype=np.float32).reshape(1, -1)
    return values


def token2wav_cancel_inputs(stream_id: str) -> dict[str, np.ndarray]:
    return {STREAM_ID: string_array(stream_id, batched=True), "cancel": np.array([[True]])}


def parse_chunk(reader: TensorReader) -> ChunkRequest | StreamCancel:
    """A batched token2wav request (reader.batched is True); the prompt stays numpy (token2wav converts it)."""
    stream_id = reader.string(STREAM_ID, required=True)
    if not stream_id:
        raise InvalidInput(STREAM_ID, "must not be empty")
    if reader.boolean("cancel"):
        return StreamCancel(stream_id)
    prompt = None
    names = ("prompt_speech_tokens", PROMPT_MEL, EMBEDDING)
    given = [name for name in names if reader.has(name)]
    if given:
        missing = [name for name in names if name not in given]
        if missing:
            raise InvalidInput(missing[0], f"is required with {', '.join(given)} (a stream's first chunk)")
        tokens = reader.array("prompt_speech_tokens", np.int32, 1)
        mel = reader.array(PROMPT_MEL, np.float32, 2)
        embedding = reader.array(EMBEDDING, np.float32, 1)
        prompt = FlowPrompt(speech_tokens=tokens[None], mel=mel[None], embedding=embedding[None])
    return ChunkRequest(stream_id=stream_id, tokens=reader.token_ids("tokens"),
                        finalize=reader.boolean("finalize"), prompt=prompt,
                        seed=reader.integer("seed", low=0, high=SEED_LIMIT - 1),
                        speed=reader.real("speed", 1.0))


# ---- prompt encoder ----------------------------------------------------------------------------------

def prompt_encoder_inputs(samples: np.ndarray, sample_rate: int) -> dict[str, np.ndarray]:
    return {REFERENCE_WAV: np.asarray(samples, dtype=np.float32).reshape(1, -1),
            "reference_sample_rate": np.array([[sample_rate]], dtype=np.int32)}


def align_prompt_features(embedding: np.ndarray, speech_tokens: np.ndarray, mel: np.ndarray, text: str,
                          audio_sha256: str, token_mel_ratio: int = 2) -> PromptFeatures:
    """Keep n = min(frames // ratio, tokens) tokens and ratio * n mel frames, as `PromptEncoder.encode`."""
    n_tokens = min(mel.shape[0] // token_mel_ratio, speech_tokens.shape[0])
    return PromptFeatures(embedding=np.ascontiguousarray(embedding.reshape(-1), dtype=np.float32),
                          speech_tokens=np.ascontiguousarray(speech_tokens.reshape(-1)[:n_tokens], dtype=np.int32),
                          mel=np.ascontiguousarray(mel[:token_mel_ratio * n_tokens], dtype=np.float32),
                          text=text, audio_sha256=audio_sha256)


def prompt_features_from_outputs(outputs: dict[str, np.ndarray], text: str, audio_sha256: str,
                                 token_mel_ratio: int = 2) -> PromptFeatures:
    """prompt_encoder's batched outputs (batch of 1) -> aligned PromptFeatures."""
    return align_prompt_features(outputs[EMBEDDING][0], outputs[SPEECH_TOKENS][0], outputs[PROMPT_MEL][0],
                                 text, audio_sha256, token_mel_ratio)


def read_prompt_audio_batch(reader: TensorReader) -> tuple[np.ndarray, int]:
    """prompt_audio's batched inputs -> (samples (N,) float32, rate)."""
    samples = reader.array(REFERENCE_WAV, np.float32, 1, required=True)
    rate = reader.integer("reference_sample_rate", required=True, low=1, high=1_000_000)
    return samples, rate


def prompt_audio_outputs(wav16k: np.ndarray, mel: np.ndarray) -> dict[str, np.ndarray]:
    """prompt_audio's answer (batch of 1): the recording at 16 kHz (N,) and its prompt mel (T, 80)."""
    return {WAV16K: np.ascontiguousarray(wav16k, dtype=np.float32)[None],
            PROMPT_MEL: np.ascontiguousarray(mel, dtype=np.float32)[None]}


def wav16k_inputs(wav16k: np.ndarray) -> dict[str, np.ndarray]:
    """A speaker_embedding or audio_tokenizer request (batch of 1): (N,) float32 at 16 kHz."""
    return {WAV16K: np.asarray(wav16k, dtype=np.float32).reshape(1, -1)}


def read_wav16k(reader: TensorReader) -> np.ndarray:
    """The batched `wav16k` input of speaker_embedding and audio_tokenizer: (N,) float32 (finiteness unchecked)."""
    return reader.array(WAV16K, np.float32, 1, required=True)


def embedding_outputs(embedding) -> dict[str, np.ndarray]:
    """speaker_embedding's answer (batch of 1): the (192,) speaker embedding."""
    return {EMBEDDING: np.asarray(embedding).reshape(1, -1)}


# ---- voices in requests (cosyvoice2, register_voice) -------------------------------------------------

@dataclass(frozen=True)
class PromptAudio:
    """A reference recording as given: samples + rate, or the bytes of an audio file."""

    samples: np.ndarray | None = None
    sample_rate: int | None = None
    file_bytes: bytes | None = None

    @property
    def field(self) -> str:
        return "reference_audio" if self.file_bytes is not None else REFERENCE_WAV

    def keywords(self) -> dict:
        """As `voice_inputs` takes a recording (what is None is not sent)."""
        return {"samples": self.samples, "sample_rate": self.sample_rate, "audio_file": self.file_bytes}


def recording_keywords(audio: PromptAudio | None) -> dict:
    return {} if audio is None else audio.keywords()


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
    return read_audio(reader, REFERENCE_WAV, "reference_sample_rate", "reference_audio", REFERENCE_WAV_LEN)


def read_voice_choice(reader: TensorReader) -> tuple[str | None, PromptAudio | None]:
    """The request's voice: a stored voice's id or a recording, exactly one of the two."""
    voice_id = reader.string("reference_audio_id")
    audio = read_prompt_audio(reader)
    if voice_id is not None and audio is not None:
        raise InvalidInput("reference_audio_id", f"give reference_audio_id or {audio.field}, not both")
    if voice_id is None and audio is None:
        raise InvalidInput(REFERENCE_WAV, "a voice is required: reference_audio_id, reference_wav "
                                            "(+ reference_sample_rate) or reference_audio")
    return voice_id, audio


def read_chunk_overrides(reader: TensorReader) -> dict:
    """The chunk-policy fields the request sets (ChunkPolicy.with_overrides' keywords)."""
    return chunk_overrides({name: read_option(reader, name) for name in CHUNK_FIELDS})


def read_option(reader: TensorReader, name: str) -> str | int | float | None:
    """A string or number option input (`OPTION_TYPES`) as its Python value; None when absent."""
    kind = OPTION_TYPES[name]
    if kind is str:
        return reader.string(name)
    return reader.real(name) if kind is np.float32 else reader.integer(name)


@dataclass(frozen=True)
class SynthesisInputs:
    """A cosyvoice2 request as typed values (the voice still to be resolved): the wire request. A caller builds
    one and sends `tensors()` (the gateway, from each API's body); the model reads it back from the tensors
    (`parse_synthesis_inputs`). Both run `check`, the one check of its values, so a direct gRPC caller meets the
    same checks and the same error fields (inputs) as the gateway's APIs."""

    text: str
    mode: str = "zero_shot"
    instruct_text: str = ""
    voice_id: str | None = None
    audio: PromptAudio | None = None
    prompt_text: str | None = None
    owner: str | None = None  # whose voices voice_id and SSML's <voice name> name (None: the shared ones)
    seed: int | None = None
    sampling: SamplingParams | None = None  # None: the server's (the model yaml's)
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

    def check(self, max_chars: int) -> SynthesisInputs:
        """The text (at most `max_chars` characters) and every setting (`check_settings`); InvalidInput naming
        the input. Returns self."""
        check_text_mode(self.text_mode)
        check_text_type(self.text_type)
        if self.bistream:
            check_text_piece(self.text, max_chars)  # the first piece: may be empty
            if not self.text_stream_id:
                raise InvalidInput("text_stream_id", "is required with text_mode bistream (its appends name it)")
            if self.text_type == "ssml":
                raise InvalidInput("text_type", "ssml needs text_mode sentences (a whole <speak> document at once)")
        else:
            from cosyvoice_triton.preprocess.text import validate_text  # here: the client SDK imports this module

            validate_text(self.text, "target_text", max_chars)
            self.ssml_parts()  # bad SSML is refused here, before admission
        return self.check_settings()

    def ssml_parts(self) -> list | None:
        """The SSML document's parts (preprocess/ssml.py; <say-as> not expanded), or None for plain text;
        InvalidInput naming target_text for bad SSML."""
        from cosyvoice_triton.preprocess.ssml import is_ssml, parse_ssml  # here: the client SDK imports this module

        return parse_ssml(self.text, "target_text") if is_ssml(self.text, self.text_type) else None

    def check_settings(self) -> SynthesisInputs:
        """Everything but the text (a WebSocket session's settings come before its text). Returns self."""
        check_text_mode(self.text_mode)
        check_text_type(self.text_type)
        if self.bistream and self.text_type == "ssml":
            raise InvalidInput("text_type", "ssml needs text_mode sentences (a whole <speak> document at once)")
        if not isinstance(self.marks, bool):
            raise InvalidInput(SPEECH_MARKS, "must be true or false")
        if self.bistream and self.marks:
            raise InvalidInput(SPEECH_MARKS, "need text_mode sentences (bistream text has no sentences to mark)")
        check_optional_text(self.instruct_text, "instruct_text")
        check_mode(self.mode, self.instruct_text)
        check_optional_text(self.prompt_text, REFERENCE_TEXT)
        check_owner(self.owner)
        if self.seed is not None:
            check_seed(self.seed)
        if not isinstance(self.text_frontend, bool):
            raise InvalidInput("text_frontend", "must be true or false")
        check_speed(self.speed)
        if self.sampling is not None:
            self.sampling.validate()
        check_chunk_overrides(self.chunk_overrides)
        return self

    def tensors(self) -> dict[str, np.ndarray]:
        """The request as cosyvoice2 tensors (`synthesis_inputs`); a setting at its default is not sent."""
        sampling = {} if self.sampling is None else sampling_inputs(self.sampling)
        return synthesis_inputs(self.text, voice_id=self.voice_id, owner=self.owner, **recording_keywords(self.audio),
                                prompt_text=self.prompt_text, mode=self.mode, instruct_text=self.instruct_text or None,
                                seed=self.seed, text_frontend=None if self.text_frontend else False,
                                speed=None if self.speed == 1.0 else self.speed,
                                text_mode=None if self.text_mode == SENTENCES else self.text_mode,
                                text_stream_id=self.text_stream_id, text_type=self.text_type,
                                speech_marks=True if self.marks else None, **chunk_options(self.chunk_overrides), **sampling)


def read_text_append(reader: TensorReader, max_chars: int) -> TextAppend | None:
    """A cosyvoice2 text_append request (None for any other request)."""
    if not reader.boolean(TEXT_APPEND, default=False):
        return None
    stream_id = reader.string("text_stream_id", required=True)
    text = reader.string("target_text", default="")
    check_text_piece(text, max_chars)
    return TextAppend(stream_id, text, reader.boolean("text_end", default=False))


def text_append_inputs(stream_id: str, text: str, end: bool = False) -> dict[str, np.ndarray]:
    """A cosyvoice2 text_append request: `text` continues bistream synthesis `stream_id`."""
    return {"target_text": string_array(text), "text_stream_id": string_array(stream_id),
            TEXT_APPEND: np.array([True]), "text_end": np.array([end])}


def parse_cosyvoice2_request(reader: TensorReader, default_sampling: SamplingParams,
                             max_chars: int) -> SynthesisInputs | ConversionInputs | TextAppend:
    """Any cosyvoice2 request, checked: a voice conversion (mode vc), a bistream text piece (text_append) or a
    synthesis (the server's sampling filling what the request leaves out)."""
    if reader.string("mode") == VC_MODE:
        return parse_conversion_inputs(reader)
    return read_text_append(reader, max_chars) or parse_synthesis_inputs(reader, default_sampling, max_chars)


def parse_synthesis_inputs(reader: TensorReader, default_sampling: SamplingParams,
                           max_chars: int) -> SynthesisInputs:
    text_mode = reader.string(TEXT_MODE, default=SENTENCES)
    text = reader.string("target_text", default="", required=text_mode != BISTREAM)
    inputs = SynthesisInputs(text=text, mode=reader.string("mode", default="zero_shot"),
                             instruct_text=reader.string("instruct_text", default=""),
                             prompt_text=reader.string(REFERENCE_TEXT), owner=reader.string(OWNER),
                             seed=reader.integer("seed"), sampling=read_sampling(reader, default_sampling),
                             chunk_overrides=read_chunk_overrides(reader),
                             text_frontend=reader.boolean("text_frontend", default=True),
                             speed=reader.real("speed", 1.0),
                             text_mode=text_mode, text_stream_id=reader.string("text_stream_id"),
                             text_type=reader.string("text_type"),
                             marks=reader.boolean(SPEECH_MARKS, default=False)).check(max_chars)
    voice_id, audio = read_voice_choice(reader)  # after the text: an empty text is named before a missing voice
    return replace(inputs, voice_id=voice_id, audio=audio)


# ---- the official runtime's tensor form (cosyvoice2_official, cosyvoice2_official_offline) --------------

TENSOR_FORMS = ("native", "official")  # cosyvoice2's config parameter tensor_form (params.TensorForm)
NATIVE_FORM, OFFICIAL_FORM = TENSOR_FORMS
OFFICIAL_SAMPLE_RATE = 16000  # the official cosyvoice2 takes reference_wav at this rate, with no rate input
DEFAULT_VOICE_ID = "default"  # what a request without a voice means there (gateway/default_voice.py registers it)
VOICE_INPUTS = ("reference_audio_id", REFERENCE_WAV, "reference_audio")  # one of them names a request's voice


def from_official_form(arrays: Mapping[str, np.ndarray], has_voice: Callable[[str], bool]) -> dict[str, np.ndarray]:
    """An official-form request's inputs (each [1, ...]) as the native form's, for `parse_cosyvoice2_request`.

    The batch dimension goes (InvalidInput naming the input when it is not 1); reference_wav without
    reference_sample_rate is at 16 kHz; a request without a voice (the official "spk2info cache" request:
    target_text alone) speaks in voice `default`, which `has_voice(voice_id)` says is stored (else
    InvalidInput naming reference_wav: a client error, as a missing voice is in the native form).
    reference_wav_len stays: the native form honours it too (`read_prompt_audio`)."""
    values = {name: _unbatched(name, array) for name, array in arrays.items()}
    if REFERENCE_WAV in values and "reference_sample_rate" not in values:
        values["reference_sample_rate"] = np.array([OFFICIAL_SAMPLE_RATE], np.int32)
    if not any(name in values for name in VOICE_INPUTS) and TEXT_APPEND not in values:  # a text piece has none
        if not has_voice(DEFAULT_VOICE_ID):
            raise InvalidInput(REFERENCE_WAV, f"a voice is required: reference_wav (+ reference_wav_len, "
                                              f"reference_text) or reference_audio_id; without one the voice "
                                              f"{DEFAULT_VOICE_ID!r} is used, and none is registered under that id "
                                              f"(`cosyvoice-triton up` registers it at start)")
        values["reference_audio_id"] = string_array(DEFAULT_VOICE_ID)
    return values


def _unbatched(name: str, array: np.ndarray) -> np.ndarray:
    """One request's tensor without its batch dimension: [1, ...] -> [...]."""
    if array.ndim == 0 or array.shape[0] != 1:
        raise InvalidInput(name, f"expected a batch of one request ([1, ...]), got shape {list(array.shape)}")
    return array[0]


OWNER_MODELS = frozenset({COSYVOICE2, COSYVOICE2_OFFLINE, *OFFICIAL_MODELS, REGISTER_VOICE})  # take `owner`


def owner_input(model: str, owner: str | None) -> np.ndarray | None:
    """The `owner` tensor of a request to `model` on behalf of `owner` (a gateway's caller): [1], or [1, 1] for the
    official models (their tensors have a batch dimension); None when `model` takes none or `owner` is None."""
    if owner is None or model not in OWNER_MODELS:
        return None
    value = string_array(owner)
    return value.reshape(1, 1) if model in OFFICIAL_MODELS else value


def official_model_for(model: str, shapes: Mapping[str, Sequence[int]], streaming: bool) -> str:
    """The model to call for a request that names `model` with inputs of these shapes (name -> shape).

    The official clients can only name cosyvoice2, and Triton checks ranks against the config before a model
    runs, so a gateway in front of Triton (gateway/triton_facade.py, routes_kserve.py) sends their requests
    on: cosyvoice2 or cosyvoice2_offline in the official form (any input of rank 2: a native request has only
    rank-1 tensors, reference_wav_len [1] included) to cosyvoice2_official when streamed to cosyvoice2, else
    to cosyvoice2_official_offline. Any other request keeps its model."""
    official = any(len(shape) >= 2 for shape in shapes.values())
    if not official or model not in (COSYVOICE2, COSYVOICE2_OFFLINE):
        return model
    return COSYVOICE2_OFFICIAL if streaming and model == COSYVOICE2 else COSYVOICE2_OFFICIAL_OFFLINE


# ---- voice conversion (cosyvoice2 mode "vc") -----------------------------------------------------------

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

    def check(self) -> ConversionInputs:
        """The settings (the recordings are checked where they are decoded); InvalidInput naming the input."""
        if self.seed is not None:
            check_seed(self.seed)
        check_speed(self.speed)
        check_chunk_overrides(self.chunk_overrides)
        check_owner(self.owner)
        return self

    def tensors(self) -> dict[str, np.ndarray]:
        """The request as cosyvoice2 tensors in mode vc (`conversion_inputs`); a setting at its default is not sent."""
        return conversion_inputs(source_samples=self.source.samples, source_rate=self.source.sample_rate,
                                 source_file=self.source.file_bytes, voice_id=self.voice_id, owner=self.owner,
                                 **recording_keywords(self.audio), seed=self.seed,
                                 speed=None if self.speed == 1.0 else self.speed, **chunk_options(self.chunk_overrides))


def read_source_audio(reader: TensorReader) -> PromptAudio:
    audio = read_audio(reader, "source_wav", "source_sample_rate", SOURCE_AUDIO)
    if audio is None:
        raise InvalidInput(SOURCE_AUDIO, "the recording to convert is required in vc mode: source_audio or "
                                           "source_wav (+ source_sample_rate)")
    return audio


def parse_conversion_inputs(reader: TensorReader) -> ConversionInputs:
    if reader.has("target_text"):
        raise InvalidInput("target_text", "is not used in vc mode (the source recording is what is spoken)")
    source = read_source_audio(reader)
    voice_id, audio = read_voice_choice(reader)
    return ConversionInputs(source=source, voice_id=voice_id, audio=audio, owner=reader.string(OWNER),
                            seed=reader.integer("seed"), chunk_overrides=read_chunk_overrides(reader),
                            speed=reader.real("speed", 1.0)).check()


def conversion_inputs(*, source_samples: np.ndarray | None = None, source_rate: int | None = None,
                      source_file: bytes | None = None, seed: int | None = None, chunk_first_hop: int | None = None,
                      chunk_hop_scale: float | None = None, chunk_max_hop: int | None = None,
                      chunk_policy: str | None = None, speed: float | None = None, **voice) -> dict[str, np.ndarray]:
    """A cosyvoice2 voice-conversion request as tensors: the source (samples + rate, or a file's bytes), the
    voice as for `voice_inputs` (a registered id, or prompt samples / a prompt file), seed, chunk policy."""
    values = {"mode": string_array(VC_MODE)}
    if source_samples is not None:
        values["source_wav"] = np.asarray(source_samples, dtype=np.float32).reshape(-1)
        values["source_sample_rate"] = np.array([source_rate], dtype=np.int32)
    if source_file is not None:
        values[SOURCE_AUDIO] = np.array([source_file], dtype=object)
    values.update(voice_inputs(**voice))
    if seed is not None:
        values["seed"] = np.array([seed], dtype=np.uint64)
    for name, value in (("chunk_first_hop", chunk_first_hop), ("chunk_hop_scale", chunk_hop_scale),
                        ("chunk_max_hop", chunk_max_hop), ("chunk_policy", chunk_policy), ("speed", speed)):
        if value is not None:
            kind = OPTION_TYPES[name]
            values[name] = string_array(value) if kind is str else np.array([value], kind)
    return values


# ---- audio answers (cosyvoice2, cosyvoice2_offline, token2wav) ------------------------------------------

def waveform_outputs(audio: np.ndarray, batched: bool = False) -> dict[str, np.ndarray]:
    """An answer with audio: a cosyvoice2 chunk or the twin's whole waveform (N,), or, `batched` (1, N), a
    token2wav chunk or a cosyvoice2_official* answer."""
    waveform = np.ascontiguousarray(audio, dtype=np.float32)
    return {WAVEFORM: waveform.reshape(1, -1) if batched else waveform.reshape(-1)}


def waveform_of(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The `waveform` of a cosyvoice2, cosyvoice2_offline or token2wav answer: (N,) float32 at 24 kHz."""
    return np.asarray(outputs[WAVEFORM], dtype=np.float32).reshape(-1)


def chunk_of(outputs: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """A streamed cosyvoice2 response's audio as `waveform_of`; None when it carries none."""
    return waveform_of(outputs) if outputs.get(WAVEFORM) is not None and outputs[WAVEFORM].size else None


def marks_outputs(events: list[dict], batched: bool = False) -> dict[str, np.ndarray]:
    """A cosyvoice2 answer's speech mark events (pipeline/speech_marks.py) as its `marks` ([1, 1] `batched`)."""
    marks = string_array(json.dumps(events, ensure_ascii=False))
    return {MARKS: marks.reshape(1, 1) if batched else marks}


def marks_of(outputs: Mapping[str, np.ndarray]) -> list[dict]:
    """The speech mark events of a cosyvoice2 answer, in order ([] when it carries none)."""
    marks = outputs.get(MARKS)
    return json.loads(_first_string(marks)) if marks is not None and marks.size else []


# ---- register_voice's answer -------------------------------------------------------------------------

@dataclass(frozen=True)
class RegisterOutputs:
    """register_voice's answer: built by the model (`tensors()`), read by a caller (`parse_register_outputs`)."""

    voice_id: str
    audio_sha256: str
    prompt_tokens: int  # prompt speech tokens stored (25 per second)

    def tensors(self) -> dict[str, np.ndarray]:
        return {VOICE_ID: string_array(self.voice_id), AUDIO_SHA256: string_array(self.audio_sha256),
                PROMPT_TOKENS: np.array([self.prompt_tokens], dtype=np.int32)}


def parse_register_outputs(outputs: Mapping[str, np.ndarray]) -> RegisterOutputs:
    return RegisterOutputs(voice_id=registered_voice_id(outputs), audio_sha256=_first_string(outputs[AUDIO_SHA256]),
                           prompt_tokens=int(outputs[PROMPT_TOKENS].reshape(-1)[0]))


def registered_voice_id(outputs: Mapping[str, np.ndarray]) -> str:
    """The id in a register_voice answer."""
    return _first_string(outputs[VOICE_ID])


def _first_string(array: np.ndarray) -> str:
    return array.reshape(-1)[0].decode("utf-8")


def voice_inputs(*, voice_id: str | None = None, samples: np.ndarray | None = None, sample_rate: int | None = None,
                 audio_file: bytes | None = None, prompt_text: str | None = None,
                 owner: str | None = None) -> dict[str, np.ndarray]:
    """The voice tensors of cosyvoice2 and register_voice: a registered id, prompt samples (+ their rate), or a
    prompt file's bytes; the prompt transcript; the owner whose voices are meant (cosyvoice2) or who registers
    (register_voice). Only what is given is sent (the model checks the rest)."""
    values: dict[str, np.ndarray] = {}
    if voice_id is not None:
        values["reference_audio_id"] = string_array(voice_id)
    if owner is not None:
        values[OWNER] = string_array(owner)
    if samples is not None:
        values[REFERENCE_WAV] = np.asarray(samples, dtype=np.float32).reshape(-1)
        values["reference_sample_rate"] = np.array([sample_rate], dtype=np.int32)
    if audio_file is not None:
        values["reference_audio"] = np.array([audio_file], dtype=object)
    if prompt_text is not None:
        values[REFERENCE_TEXT] = string_array(prompt_text)
    return values


def synthesis_inputs(text: str, *, voice_id: str | None = None, samples: np.ndarray | None = None,
                     sample_rate: int | None = None, audio_file: bytes | None = None,
                     prompt_text: str | None = None, mode: str | None = None, instruct_text: str | None = None,
                     seed: int | None = None, owner: str | None = None, **options) -> dict[str, np.ndarray]:
    """A cosyvoice2 request as tensors: the one builder of the client SDK, the gateway and the tests.

    `options`: sampling and chunk-policy overrides by input name (`OPTION_TYPES`; None: not sent), a number
    typed here or an array sent as it is; any other input only as an array (tests send raw tensors)."""
    values = {"target_text": string_array(text)}
    values.update(voice_inputs(voice_id=voice_id, samples=samples, sample_rate=sample_rate, audio_file=audio_file,
                               prompt_text=prompt_text, owner=owner))
    for name, value in (("mode", mode), ("instruct_text", instruct_text)):
        if value is not None:
            values[name] = string_array(value)
    if seed is not None:
        values["seed"] = np.array([seed], dtype=np.uint64)
    for name, value in options.items():
        if isinstance(value, np.ndarray):
            values[name] = value
        elif name not in OPTION_TYPES:
            raise TypeError(f"unknown option {name!r}; known: {', '.join(OPTION_TYPES)}")
        elif value is not None:
            kind = OPTION_TYPES[name]
            values[name] = string_array(value) if kind is str else np.array([value], kind)
    return values


def register_inputs(*, voice_id: str | None = None, name: str | None = None, owner: str | None = None,
                    **voice) -> dict[str, np.ndarray]:
    """A register_voice request as tensors; `voice` as for `voice_inputs` (without voice_id, which here
    is the id to register under); `owner`: the owner tag (None: a shared voice)."""
    values = voice_inputs(**voice, owner=owner)
    for key, value in ((VOICE_ID, voice_id), ("name", name)):
        if value is not None:
            values[key] = string_array(value)
    return values


@dataclass(frozen=True)
class RegisterInputs:
    audio: PromptAudio
    text: str
    voice_id: str | None
    name: str | None
    owner: str | None = None  # None: a shared voice

    def tensors(self) -> dict[str, np.ndarray]:
        """The request as register_voice tensors (`register_inputs`)."""
        return register_inputs(voice_id=self.voice_id, name=self.name, owner=self.owner,
                               **recording_keywords(self.audio), prompt_text=self.text)


def parse_register_inputs(reader: TensorReader) -> RegisterInputs:
    audio = read_prompt_audio(reader)
    if audio is None:
        raise InvalidInput(REFERENCE_WAV, "is required (or reference_audio)")
    return RegisterInputs(audio=audio, text=reader.string(REFERENCE_TEXT, default=""),
                          voice_id=reader.string(VOICE_ID), name=reader.string("name"),
                          owner=reader.string(OWNER))
