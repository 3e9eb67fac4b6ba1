"""SSML (preprocess/ssml.py, docs/api/ssml.md): the parser without Triton, then each element's effect on the audio
through a real tritonserver + gateway (tiny model, one stack for the module).

Plain text is unchanged: tests/test_synthesis.py::test_same_seed_same_audio_other_seed_other_audio and the
golden/parity tests keep passing with the same audio for the same seed.
"""
from __future__ import annotations

import asyncio
import io

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import SAMPLE_RATE
from cosyvoice_triton.pipeline.seeds import sentence_seeds
from cosyvoice_triton.preprocess.ssml import (MAX_PARTS, Mark, Pause, Speech, expand_say_as, is_ssml, ordinal_words,
                                              parse_ssml)
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.gateway.fields import TTS_FIELDS
from cosyvoice_triton.gateway.synthesis import ssml_voice_ids
from cosyvoice_triton.wire.requests import SynthesisInputs

SEED = 1234
TIMEOUT = aiohttp.ClientTimeout(total=180)

BILLION_LAUGHS = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
                  + "".join(f'<!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">' for i in range(1, 10))
                  + ']><speak>&lol9;</speak>')
EXTERNAL_ENTITY = ('<?xml version="1.0"?><!DOCTYPE speak [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>'
                   '<speak>&xxe;</speak>')
MALFORMED = [
    "<speak>", "<speak>hi", "<speak>hi</speek>", "<speak><s>hi</speak>", "<speak>hi</speak><speak>x</speak>",
    "<speak>&foo;</speak>", "<speak>a & b</speak>", "<speak>a < b</speak>", "<speak><break time=500ms/>a</speak>",
    "<speak> </speak>", "<speak><!-- only a comment --></speak>", "<speak><mark name='m'/></speak>",
    "<speak><foo>a</foo></speak>", "<speak><audio src='x.wav'/>a</speak>", "<speak><phoneme ph='a'>a</phoneme></speak>",
    "<speak><speak>a</speak></speak>", "<speak><b>a</b></speak>", "<speak xml:lang='!!'>a</speak>",
    "<speak foo='1'>a</speak>", "<speak><break time='500'/>a</speak>", "<speak><break time='-1s'/>a</speak>",
    "<speak><break time='11s'/>a</speak>", "<speak><break time='10001ms'/>a</speak>",
    "<speak><break time='fast'/>a</speak>", "<speak><break strength='huge'/>a</speak>",
    "<speak><break size='1'/>a</speak>", "<speak><break>text</break>a</speak>",
    "<speak><prosody rate='9'>a</prosody></speak>", "<speak><prosody rate='0.1'>a</prosody></speak>",
    "<speak><prosody rate='quick'>a</prosody></speak>", "<speak><prosody rate='+20%'>a</prosody></speak>",
    "<speak><prosody pitch='high'>a</prosody></speak>", "<speak><prosody rate='x-fast'><prosody rate='x-fast'>"
    "<prosody rate='x-fast'><prosody rate='x-fast'>a</prosody></prosody></prosody></prosody></speak>",
    "<speak><emphasis level='loud'>a</emphasis></speak>", "<speak><emphasis><break/>a</emphasis></speak>",
    "<speak><sub>a</sub></speak>", "<speak><sub alias=''>a</sub></speak>", "<speak><sub alias='x'><s>a</s></sub></speak>",
    "<speak><say-as>1</say-as></speak>", "<speak><say-as interpret-as='money'>1</say-as></speak>",
    "<speak><say-as interpret-as='cardinal'><sub alias='x'>1</sub></say-as></speak>",
    "<speak><voice>a</voice></speak>", "<speak><voice name=''>a</voice></speak>",
    "<speak><voice gender='female'>a</voice></speak>", "<speak><lang>a</lang></speak>",
    "<speak><lang xml:lang='en_US'>a</lang></speak>", "<speak><mark/>a</speak>", "<speak><mark name='m'>x</mark>a</speak>",
    "<speak><strong x='1'>a</strong></speak>", "<speak><laughter><p>a</p></laughter></speak>",
    "<speak>" + "<break time='1ms'/>" * (MAX_PARTS + 1) + "</speak>",
    "<?xml version='1.0'?><!DOCTYPE speak><speak>a</speak>", BILLION_LAUGHS, EXTERNAL_ENTITY,
    "<speak><![CDATA[</speak>", "<speak><p>a</p></speak>after",
]


# ---- the parser ---------------------------------------------------------------------------------------------------

def test_parts_spans_and_text_elements():
    doc = ('<speak xml:lang="en-US">Hello there. <break time="300ms"/><prosody rate="slow">Slow <emphasis>words'
           '</emphasis> [breath].</prosody><s>A <sub alias="World Wide Web">WWW</sub> <laughter>ha</laughter></s>'
           '<mark name="m1"/><voice name="v2"><p>Hi <strong>you</strong></p></voice></speak>')
    parts = parse_ssml(doc)
    assert [type(p) for p in parts] == [Speech, Pause, Speech, Speech, Mark, Speech]
    hello, pause, slow, sub, mark, hi = parts
    assert hello == Speech("Hello there.", hello.span, 1.0, None, "en-US")
    assert pause.samples == round(0.3 * SAMPLE_RATE) and doc[slice(*pause.span)] == '<break time="300ms"/>'
    assert slow.text == "Slow <strong>words</strong> [breath]." and slow.speed == 0.75  # native tags kept
    assert doc[slice(*slow.span)].startswith("Slow <emphasis>")
    assert sub.text == "A World Wide Web <laughter>ha</laughter>"  # the alias is spoken
    assert mark.name == "m1" and doc[slice(*mark.span)] == '<mark name="m1"/>'
    assert hi.text == "Hi <strong>you</strong>" and hi.voice_id == "v2" and doc[slice(*hi.span)].startswith("Hi")


def test_breaks_rates_and_text_type():
    def pause(attrs: str) -> int:
        return parse_ssml(f"<speak>a<break {attrs}/>b</speak>")[1].samples

    assert [pause(f'strength="{s}"') for s in ("none", "x-weak", "weak", "medium", "strong", "x-strong")] == \
        [0, 2400, 6000, 12000, 18000, 24000]
    assert pause("") == 12000 and pause('time="1.5s"') == 36000 and pause('time="10s"') == 240000
    assert pause('time="333ms"') == round(0.333 * SAMPLE_RATE)
    nested = parse_ssml('<speak><prosody rate="200%"><prosody rate="1.5">a</prosody></prosody></speak>')
    assert nested[0].speed == 3.0  # nested rates multiply
    assert is_ssml("  <speak>a</speak>", None) and not is_ssml("<speak>a</speak>", "text") and is_ssml("a", "ssml")
    wrapped = 'Hi <break time="1s"/> there'  # text_type ssml without <speak>: read as its content
    assert [(type(p).__name__, p.span) for p in parse_ssml(wrapped)] == \
        [("Speech", (0, 3)), ("Pause", (3, 21)), ("Speech", (21, 27))]


@pytest.mark.parametrize("kind, content, lang, words", [
    ("cardinal", "1,234", "en", "one thousand, two hundred and thirty-four"),
    ("cardinal", "-20", "en", "minus twenty"), ("cardinal", "1234", "zh", "一千二百三十四"),
    ("ordinal", "21", "en", "twenty-first"), ("ordinal", "112", "en", "one hundred and twelfth"),
    ("ordinal", "3", "zh", "第三"), ("digits", "2024", "en", "two zero two four"), ("digits", "2024", "zh", "二零二四"),
    ("characters", "AB1", "en", "A B one"), ("spell-out", "cat", "en", "c a t"),
    ("date", "2024-05-05", "en", "the fifth of may twenty twenty four"), ("date", "2024-05-05", "zh", "二零二四年五月五日"),
    ("time", "10:30", "en", "ten thirty"), ("time", "10:30", "zh", "十点三十分"),
    ("telephone", "555-123-4567", "en", "five five five, one two three, four five six seven"),
    ("cardinal", "about ten", "en", "about ten"),  # not a number: stays as it is
])
def test_say_as(kind, content, lang, words):
    assert expand_say_as(kind, content, lang) == words
    doc = f'<speak><lang xml:lang="{"zh-CN" if lang == "zh" else "en"}"><say-as interpret-as="{kind}">{content}' \
          '</say-as></lang></speak>'
    assert parse_ssml(doc, say_as=expand_say_as)[0].text == words


def test_lang_chooses_the_normalizer_of_its_part(tiny_model_dir):
    """<lang xml:lang> reaches the text normalizer: the same words, read as Chinese inside it."""
    from cosyvoice_triton.messages import PromptFeatures, SamplingParams, SynthesisRequest
    from cosyvoice_triton.pipeline.pipeline import Pipeline
    from cosyvoice_triton.preprocess.text import TextPreprocessor

    pipeline = Pipeline(TextPreprocessor.from_model_dir(tiny_model_dir), llm=None, token2wav=None)
    decode = pipeline.preprocessor.tokenizer.decode

    def spoken(doc: str) -> list[str]:
        voice = PromptFeatures(np.zeros(192, np.float32), np.zeros(4, np.int32), np.zeros((8, 80), np.float32), "", "")
        request = SynthesisRequest(text=doc, voice=voice, mode="cross_lingual", seed=1, sampling=SamplingParams())
        return [decode(step.llm_request.text_tokens) for step in pipeline.ssml_plan(request, "s", 1)
                if hasattr(step, "llm_request")]

    assert spoken("<speak>I have 2 cats.</speak>") == ["I have two cats."]
    assert "二" in spoken('<speak><lang xml:lang="zh-CN">I have 2 cats.</lang></speak>')[0]
    assert spoken('<speak xml:lang="zh-CN"><lang xml:lang="en-US">I have 2 cats.</lang></speak>') == \
        ["I have two cats."]


def test_ordinal_words():
    assert [ordinal_words(w) for w in ("one", "twelve", "twenty", "ninety-nine", "seven")] == \
        ["first", "twelfth", "twentieth", "ninety-ninth", "seventh"]


@pytest.mark.parametrize("doc", MALFORMED)
def test_malformed_is_invalid_input_naming_the_text(doc):
    with pytest.raises(InvalidInput) as caught:
        parse_ssml(doc, "target_text")
    assert caught.value.field == "target_text" and ("SSML" in caught.value.problem or "speak" in caught.value.problem)
    with pytest.raises(InvalidInput) as caught:  # the gateway's one read of it: before admission, naming its field
        ssml_voice_ids(SynthesisInputs(text=doc, text_type="ssml").check(100_000), TTS_FIELDS)
    assert caught.value.field == "text"


def test_entity_attacks_are_refused_by_their_declarations():
    for doc in (BILLION_LAUGHS, EXTERNAL_ENTITY):
        with pytest.raises(InvalidInput, match="DOCTYPE"):
            parse_ssml(doc)


def test_text_type_checks():
    with pytest.raises(InvalidInput) as caught:
        SynthesisInputs(text="a", text_type="markdown").check(100)
    assert caught.value.field == "text_type"
    with pytest.raises(InvalidInput) as caught:
        SynthesisInputs(text="", text_type="ssml", text_mode="bistream", text_stream_id="s").check(100)
    assert caught.value.field == "text_type"
    assert SynthesisInputs(text="<speak>no <b>tags</b></speak>", text_type="text").check(100)  # plain text as today
    assert SynthesisInputs(text="a", text_type="ssml").tensors()["text_type"].tolist() == [b"ssml"]


# ---- against a real tritonserver + gateway -------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    from web.stack import serve_stack

    with serve_stack(tmp_path_factory.mktemp("ssml"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def other_voice(stack) -> str:
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    buffer = io.BytesIO()
    sf.write(buffer, speech_like(1.5, 16000, seed=8), 16000, format="WAV", subtype="PCM_16")

    async def register():
        form = aiohttp.FormData()
        form.add_field("audio", buffer.getvalue(), filename="prompt.wav", content_type="audio/wav")
        form.add_field("text", "another prompt")
        form.add_field("id", "ssml_other")
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(stack.gateway_url + "/v1/voices", data=form) as response:
                assert response.status in (200, 201), await response.text()

    asyncio.run(register())
    return "ssml_other"


def post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    async def send():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(url + path, json=body) as response:
                return response.status, await response.read()

    return asyncio.run(send())


def tts(stack, text: str, seed: int = SEED, stream: bool = False, **fields) -> np.ndarray:
    body = {"text": text, "voice_id": "default", "seed": seed, "format": "pcm_f32", "stream": stream, **fields}
    status, raw = post(stack.gateway_url, "/v1/tts", body)
    assert status == 200, raw[:300]
    return np.frombuffer(raw, "<f4")


def next_seed(index: int) -> int:
    """The request seed whose sentence 0 has the seeds of sentence `index` of a request with SEED."""
    return sentence_seeds(SEED, index).llm


@pytest.mark.parametrize("stream", [False, True])
def test_break_is_exact_silence_between_the_parts(stack, stream):
    whole = tts(stack, '<speak>Hello there.<break time="300ms"/>Good morning.</speak>', stream=stream)
    before = tts(stack, "<speak>Hello there.</speak>", stream=stream)
    after = tts(stack, "<speak>Good morning.</speak>", seed=next_seed(1), stream=stream)
    assert before.size > 0 and after.size > 0
    np.testing.assert_array_equal(whole, np.concatenate([before, np.zeros(7200, np.float32), after]))


def test_text_type_ssml_without_speak(stack):
    plain_doc = tts(stack, 'Hello there.<break time="100ms"/>Good morning.', text_type="ssml")
    np.testing.assert_array_equal(plain_doc, tts(stack, '<speak>Hello there.<break time="100ms"/>Good morning.</speak>'))


def test_prosody_rate_is_the_speed(stack):
    slow = tts(stack, '<speak><prosody rate="50%">Hello there.</prosody></speak>')
    np.testing.assert_array_equal(slow, tts(stack, "<speak>Hello there.</speak>", speed=0.5))
    normal = tts(stack, "<speak>Hello there.</speak>")
    assert abs(slow.size / normal.size - 2.0) < 0.05


def test_voice_switch_equals_that_voice_alone(stack, other_voice):
    mixed = tts(stack, f'<speak>Hi there.<voice name="{other_voice}">Hello again.</voice></speak>')
    first = tts(stack, "<speak>Hi there.</speak>")
    second = tts(stack, "<speak>Hello again.</speak>", seed=next_seed(1), voice_id=other_voice)
    np.testing.assert_array_equal(mixed, np.concatenate([first, second]))
    status, body = post(stack.gateway_url, "/v1/tts", {"text": '<speak><voice name="nobody">a</voice></speak>'})
    assert status == 404 and b'"param": "text"' in body.replace(b'":"', b'": "')


def test_malformed_ssml_is_400_naming_text(stack):
    statuses = []
    for doc in MALFORMED:
        status, body = post(stack.gateway_url, "/v1/tts", {"text": doc, "text_type": "ssml", "voice_id": "default"})
        statuses.append(status)
        assert status == 400 and b'"text"' in body, (doc[:60], status, body[:200])
    assert len(statuses) >= 50 and max(statuses) < 500


def test_websocket_and_openai_give_the_same_audio(stack):
    doc = '<speak>Hello there.<break time="200ms"/><prosody rate="fast">Good morning.</prosody></speak>'
    http = tts(stack, doc, stream=True)

    async def ws_audio() -> bytes:
        frames = []
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.ws_connect(stack.gateway_url.replace("http", "ws") + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", "seed": SEED, "text_type": "ssml"})
                await ws.send_json({"type": "text", "text": doc})
                await ws.send_json({"type": "end"})
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        frames.append(message.data)
                    elif message.type == aiohttp.WSMsgType.TEXT and message.json()["type"] in ("end", "error"):
                        assert message.json()["type"] == "end", message.data
                        break
        return b"".join(frames)

    np.testing.assert_array_equal(np.frombuffer(asyncio.run(ws_audio()), "<f4"), http)
    status, openai_pcm = post(stack.gateway_url, "/v1/audio/speech", {"model": "cosyvoice2", "input": doc,
                                                                      "voice": "default", "seed": SEED,
                                                                      "response_format": "pcm"})
    assert status == 200
    _, tts_pcm = post(stack.gateway_url, "/v1/tts", {"text": doc, "voice_id": "default", "seed": SEED,
                                                     "format": "pcm", "stream": True})
    assert openai_pcm == tts_pcm
