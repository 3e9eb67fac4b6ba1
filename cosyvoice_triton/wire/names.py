"""The names on the wire: every Triton model's name and every tensor name, spelled here once.

Code elsewhere names a model or a tensor by these constants, never by a literal (tests/test_architecture.py
checks it); the config.pbtxt files name the tensors too. What each model takes and gives, with shapes and
types: docs/api/triton.md.
"""
from __future__ import annotations

import numpy as np

from cosyvoice_triton.messages import TEXT_MODES

# ---- models ----------------------------------------------------------------------------------------------
COSYVOICE2 = "cosyvoice2"
COSYVOICE2_OFFLINE = "cosyvoice2_offline"
COSYVOICE2_OFFICIAL = "cosyvoice2_official"  # the official runtime's tensor form (official.py)
COSYVOICE2_OFFICIAL_OFFLINE = "cosyvoice2_official_offline"
COSYVOICE3 = "cosyvoice3"  # cosyvoice2's counterparts on a CosyVoice3 folder: the same model, named for its family
COSYVOICE3_OFFLINE = "cosyvoice3_offline"
COSYVOICE3_OFFICIAL = "cosyvoice3_official"
COSYVOICE3_OFFICIAL_OFFLINE = "cosyvoice3_official_offline"
# The synthesis models of each model family (`family.ModelFamily.name`): streaming, offline, then the official
# tensor form's (streaming, offline). A server renders its folder's family's only.
FAMILY_MODELS = {"cosyvoice2": (COSYVOICE2, COSYVOICE2_OFFLINE, COSYVOICE2_OFFICIAL, COSYVOICE2_OFFICIAL_OFFLINE),
                 "cosyvoice3": (COSYVOICE3, COSYVOICE3_OFFLINE, COSYVOICE3_OFFICIAL, COSYVOICE3_OFFICIAL_OFFLINE)}
OFFICIAL_MODELS = tuple(name for models in FAMILY_MODELS.values() for name in models[2:])  # every family's
SYNTHESIS_MODELS = frozenset(name for models in FAMILY_MODELS.values() for name in models)
LLM = "llm"
TOKEN2WAV = "token2wav"
PROMPT_ENCODER = "prompt_encoder"
PROMPT_AUDIO = "prompt_audio"
SPEAKER_EMBEDDING = "speaker_embedding"
AUDIO_TOKENIZER = "audio_tokenizer"
REGISTER_VOICE = "register_voice"

# ---- cosyvoice2's inputs (and register_voice's voice inputs) ---------------------------------------------
TARGET_TEXT = "target_text"
MODE = "mode"
INSTRUCT_TEXT = "instruct_text"
SEED = "seed"
REFERENCE_AUDIO_ID = "reference_audio_id"  # a registered voice
OWNER = "owner"  # a tenant's tag (voices/store.py Owners), set by the gateway
REFERENCE_WAV, REFERENCE_SAMPLE_RATE = "reference_wav", "reference_sample_rate"  # prompt samples and their rate
REFERENCE_WAV_LEN = "reference_wav_len"  # how many of reference_wav count (the rest is padding)
REFERENCE_AUDIO = "reference_audio"  # or the prompt file's bytes
REFERENCE_TEXT = "reference_text"  # the prompt's transcript
SOURCE_WAV, SOURCE_SAMPLE_RATE, SOURCE_AUDIO = "source_wav", "source_sample_rate", "source_audio"  # mode vc
CHUNK_FIRST_HOP, CHUNK_HOP_SCALE, CHUNK_MAX_HOP = "chunk_first_hop", "chunk_hop_scale", "chunk_max_hop"
CHUNK_POLICY = "chunk_policy"
TEXT_FRONTEND = "text_frontend"
SPEED = "speed"
TEXT_TYPE = "text_type"
TEXT_MODE = "text_mode"
TEXT_STREAM_ID = "text_stream_id"
TEXT_APPEND = "text_append"  # cosyvoice2 and llm
TEXT_END = "text_end"  # cosyvoice2 and llm
SPEECH_MARKS = "speech_marks"
TOP_P, TOP_K, WIN_SIZE, TAU_R = "top_p", "top_k", "win_size", "tau_r"  # cosyvoice2 and llm
SAMPLING_NAMES = (TOP_P, TOP_K, WIN_SIZE, TAU_R)
# register_voice
VOICE_ID, NAME = "voice_id", "name"  # the id to register under (and register_voice's answer), a label

# ---- the stage models' inputs ----------------------------------------------------------------------------
STREAM_ID = "stream_id"  # llm, token2wav
CANCEL = "cancel"  # llm, token2wav
TEXT_TOKENS = "text_tokens"  # llm
LEAD_S = "lead_s"  # llm: FP32 [1], optional: the audio its listener still has to play (LLMRequest.lead_s)
PROMPT_TEXT_TOKENS = "prompt_text_tokens"  # llm
PROMPT_SPEECH_TOKENS = "prompt_speech_tokens"  # llm, token2wav
TOKENS, FINALIZE = "tokens", "finalize"  # token2wav

# ---- outputs ---------------------------------------------------------------------------------------------
WAVEFORM = "waveform"  # cosyvoice2, cosyvoice2_offline, token2wav: FP32 audio at 24 kHz
MARKS = "marks"  # cosyvoice2, cosyvoice2_offline: STRING, a JSON list of speech mark events
SPEECH_TOKENS = "speech_tokens"  # llm, audio_tokenizer, prompt_encoder: INT32 S3 tokens, 25 Hz
EMBEDDING = "embedding"  # speaker_embedding, prompt_encoder (and token2wav's input): FP32 [192]
PROMPT_MEL = "prompt_mel"  # prompt_audio, prompt_encoder (and token2wav's input): FP32 [-1, 80]
WAV16K = "wav16k"  # prompt_audio's output, the input of speaker_embedding and audio_tokenizer
AUDIO_SHA256, PROMPT_TOKENS = "audio_sha256", "prompt_tokens"  # register_voice (with voice_id)
# What a BLS caller asks each model for.
LLM_OUTPUTS = (SPEECH_TOKENS,)
TOKEN2WAV_OUTPUTS = (WAVEFORM,)
AUDIO_TOKENIZER_OUTPUTS = (SPEECH_TOKENS,)
PROMPT_ENCODER_OUTPUTS = (EMBEDDING, SPEECH_TOKENS, PROMPT_MEL)

# ---- values and tables -----------------------------------------------------------------------------------
SENTENCES, BISTREAM = TEXT_MODES  # text_mode's values; "bistream" is also the llm input that opens such a stream
# The chunk-policy overrides of cosyvoice2: input (and request field of that name) -> ChunkPolicy attribute.
CHUNK_FIELDS = {CHUNK_FIRST_HOP: "first_hop", CHUNK_HOP_SCALE: "hop_scale", CHUNK_MAX_HOP: "max_hop",
                CHUNK_POLICY: "kind"}
# The per-request overrides of cosyvoice2 (sampling, then chunk policy and the rest) and their tensor types.
OPTION_TYPES: dict[str, type] = {TOP_P: np.float32, TOP_K: np.int32, WIN_SIZE: np.int32, TAU_R: np.float32,
                                 CHUNK_FIRST_HOP: np.int32, CHUNK_HOP_SCALE: np.float32, CHUNK_MAX_HOP: np.int32,
                                 TEXT_FRONTEND: np.bool_, CHUNK_POLICY: str, SPEED: np.float32, TEXT_MODE: str,
                                 TEXT_STREAM_ID: str, TEXT_TYPE: str, SPEECH_MARKS: np.bool_}
INT32_MAX = 2**31 - 1
# Each input of cosyvoice2 and register_voice -> the request field it carries: text, voice_id, audio (the prompt
# recording), prompt_text, source (a conversion's recording), ...; an option keeps its own name (seed, speed,
# chunk_*, top_p, ...). Errors name inputs; a caller with field names of its own (the gateway's APIs) maps them
# back through this table and never needs the tensor names.
INPUT_FIELDS: dict[str, str] = {
    TARGET_TEXT: "text", MODE: "mode", INSTRUCT_TEXT: "instruct_text", SEED: "seed",
    REFERENCE_AUDIO_ID: "voice_id", REFERENCE_WAV: "audio", REFERENCE_SAMPLE_RATE: "audio",
    REFERENCE_AUDIO: "audio", REFERENCE_WAV_LEN: "audio", REFERENCE_TEXT: "prompt_text",
    SOURCE_WAV: "source", SOURCE_SAMPLE_RATE: "source", SOURCE_AUDIO: "source",
    TEXT_APPEND: "text_append", TEXT_END: "text_end",
    VOICE_ID: "voice_id", NAME: "name", OWNER: "owner",  # register_voice: the id to register under, ...
    **{name: name for name in OPTION_TYPES},
    SPEECH_MARKS: "marks",
}
INPUT_NAMES = frozenset(INPUT_FIELDS)
VOICE_INPUTS = (REFERENCE_AUDIO_ID, REFERENCE_WAV, REFERENCE_AUDIO)  # one of them names a request's voice
OWNER_MODELS = SYNTHESIS_MODELS | {REGISTER_VOICE}  # the models that take `owner`
DEFAULT_VOICE_ID = "default"  # the voice `up` registers; the official form's request without a voice means it
