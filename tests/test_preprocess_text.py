"""Text normalization, sentence splitting, validation and the Qwen-style tokenizer."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cosyvoice_triton.errors import InvalidInput, ModelFolderError
from cosyvoice_triton.family import COSYVOICE2
from cosyvoice_triton.random_folder.tokenizer_standin import write_tokenizer_standin
from cosyvoice_triton.preprocess.text import (TextPreprocessor, TextNormalizer, clean_chinese, cut_at_punctuation,
                                            is_only_punctuation, merge_pieces, spell_out_integer,
                                            spell_out_numbers)
from cosyvoice_triton.wire.checks import validate_text
from cosyvoice_triton.preprocess.tokenizer import COSYVOICE2_SPECIAL_TOKENS, TextTokenizer

VOCAB_SIZE = 1000


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`CosyVoice-BlankEN/` with the stand-in tokenizer, inside a model folder that holds only it and the yaml that
    names its family (the text preprocessor reads the family's special tokens)."""
    folder = tmp_path_factory.mktemp("model") / "CosyVoice-BlankEN"
    write_tokenizer_standin(folder, VOCAB_SIZE)
    (folder.parent / COSYVOICE2.yaml_file).touch()
    return folder


@pytest.fixture(scope="module")
def tokenizer(qwen_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def normalizer(tokenizer: TextTokenizer) -> TextNormalizer:
    return TextNormalizer(tokenizer.count)


# --- validation ---

@pytest.mark.parametrize("text, problem", [("", "empty"), ("  \n\t ", "empty"), ("x" * 2001, "limit is 2000"),
                                           (None, "string"), (b"abc", "string")])
def test_validate_text_rejects(text: object, problem: str) -> None:
    with pytest.raises(InvalidInput) as error:
        validate_text(text, "text")
    assert error.value.field == "text"
    assert problem in str(error.value)


def test_validate_text_limit_is_configurable() -> None:
    assert validate_text("hello", "prompt_text", max_chars=5) == "hello"
    with pytest.raises(InvalidInput, match="prompt_text"):
        validate_text("hello!", "prompt_text", max_chars=5)


# --- numbers ---

@pytest.mark.parametrize("digits, words", [
    ("0", "zero"), ("7", "seven"), ("13", "thirteen"), ("21", "twenty-one"), ("100", "one hundred"),
    ("101", "one hundred and one"), ("1001", "one thousand and one"), ("1100", "one thousand, one hundred"),
    ("1234", "one thousand, two hundred and thirty-four"), ("2000100", "two million, one hundred"),
    ("007", "seven"), ("1000000", "one million"),
])
def test_spell_out_integer(digits: str, words: str) -> None:
    assert spell_out_integer(digits) == words


def test_spell_out_integer_reads_huge_numbers_digit_by_digit() -> None:
    assert spell_out_integer("1" + "0" * 36) == "one " + " ".join(["zero"] * 36)


def test_spell_out_integer_matches_inflect() -> None:
    inflect = pytest.importorskip("inflect")
    engine = inflect.engine()
    numbers = [str(n) for n in range(0, 1200)] + [str(7 ** k) for k in range(1, 40)] + ["1000010", "900000000001"]
    for digits in numbers:
        assert spell_out_integer(digits) == engine.number_to_words(digits), digits


def test_spell_out_numbers_in_text() -> None:
    assert spell_out_numbers("room 12, floor 3") == "room twelve, floor three"


# --- normalization ---

def test_chinese_numbers_become_words(normalizer: TextNormalizer) -> None:
    text = normalizer.normalize("今天是2024年3月5日，气温25度。")
    assert "二零二四年三月五日" in text and "二十五度" in text
    assert not re.search(r"\d", text)


def test_english_numbers_become_words(normalizer: TextNormalizer) -> None:
    text = normalizer.normalize("I bought 23 apples and 7 pears.")
    assert "twenty" in text and "three" in text and "seven" in text
    assert not re.search(r"\d", text)


def test_chinese_cleanups() -> None:
    assert clean_chinese("你 好 a b（括号）【注】x²，") == "你好a b括号注x平方。"
    assert clean_chinese("第一行\n第二行.好") == "第一行第二行。好"
    assert clean_chinese("前 - 后") == "前-后"  # blanks next to a Chinese character go first
    assert clean_chinese("前a - b后——完、") == "前a，b后 完。"


def test_markup_skips_normalization(normalizer: TextNormalizer) -> None:
    text = "<|endofprompt|>有123个 [breath] 人"
    assert normalizer.split(text) == [text]
    assert normalizer.normalize(text) == text


def test_is_only_punctuation() -> None:
    assert is_only_punctuation("。，！?…—“”") and is_only_punctuation("") and is_only_punctuation("$+")
    assert not is_only_punctuation("a.") and not is_only_punctuation(" ") and not is_only_punctuation("好。")


def test_punctuation_only_text_is_dropped(normalizer: TextNormalizer) -> None:
    assert normalizer.split("。。！") == []
    assert normalizer.split("?!...") == []


def test_cut_keeps_closing_quotes_and_drops_repeated_marks() -> None:
    marks = frozenset("。？！；：、.?!;")
    assert cut_at_punctuation("他说：“你好。”然后走了。。", marks) == ["他说：", "“你好。”", "然后走了。"]


def test_merge_pieces_follows_the_length_rules() -> None:
    pieces = ["a" * 30, "b" * 30, "c" * 30, "d" * 10]
    # 30+30 = 60 is not > 60, so c joins; 90 > 80 and 90 > 60 would cut before d, but d < 20 merges back.
    assert merge_pieces(pieces, len) == ["a" * 30 + "b" * 30 + "c" * 30 + "d" * 10]
    pieces = ["a" * 31, "b" * 31, "c" * 31, "d" * 25]
    assert merge_pieces(pieces, len) == ["a" * 31 + "b" * 31, "c" * 31 + "d" * 25]


def test_long_chinese_paragraph_splits_by_characters(normalizer: TextNormalizer) -> None:
    sentence = "春天来了，花园里的花都开了，非常漂亮。"  # 19 characters
    text = sentence * 12
    pieces = normalizer.split(text)
    assert len(pieces) > 1
    assert "".join(pieces) == text
    assert all(60 < len(p) <= 80 for p in pieces[:-1])
    assert len(pieces[-1]) <= 80 + 20


def test_long_english_paragraph_splits_by_tokens(normalizer: TextNormalizer,
                                                 tokenizer: TextTokenizer) -> None:
    sentence = "The children were playing football on the field, laughing loudly. "
    text = (sentence * 10).strip()
    pieces = normalizer.split(text)
    assert len(pieces) > 1
    assert "".join(pieces) == text  # cut after each mark; the space starts the next piece
    lengths = [tokenizer.count(p) for p in pieces]
    longest_piece = tokenizer.count(" " + sentence.strip())
    assert all(60 < n <= max(80, 60 + longest_piece) for n in lengths[:-1])


def test_a_language_hint_chooses_the_normalizer(normalizer: TextNormalizer) -> None:
    """SSML's <lang xml:lang> (pipeline.ssml_plan): the part is normalized in that language, not the detected one."""
    assert normalizer.split("I have 2 cats.") == ["I have two cats."]  # detected: English
    chinese = normalizer.split("I have 2 cats.", lang="zh")
    assert "two" not in "".join(chinese) and "二" in "".join(chinese)  # the Chinese normalizer read the number
    assert normalizer.split("I have 2 cats.", lang="en") == ["I have two cats."]


def test_frontend_splits_and_names_text_with_nothing_to_speak(qwen_dir: Path) -> None:
    """The text itself was checked where the request entered (`validate_text`, above)."""
    preprocessor = TextPreprocessor.from_model_dir(qwen_dir.parent)
    assert preprocessor.split("你好，世界。今天是3月5日。") == ["你好，世界。今天是三月五日。"]
    assert preprocessor.normalize("I have 2 cats") == "I have two cats"
    for text, problem in [("   ", "nothing to speak"), ("?!。", "nothing to speak")]:
        with pytest.raises(InvalidInput, match=problem) as error:
            preprocessor.split(text, field="tts_text")
        assert error.value.field == "tts_text"


# --- tokenizer ---

def test_standin_layout_and_size(qwen_dir: Path, tokenizer: TextTokenizer) -> None:
    assert {p.name for p in qwen_dir.iterdir()} >= {"vocab.json", "merges.txt", "tokenizer_config.json"}
    assert tokenizer.vocab_size <= VOCAB_SIZE
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    for token_id, spec in config["added_tokens_decoder"].items():
        assert tokenizer.token_to_id(spec["content"]) == int(token_id)


def test_standin_is_deterministic(tmp_path: Path, qwen_dir: Path) -> None:
    size = write_tokenizer_standin(tmp_path, VOCAB_SIZE)
    assert size == TextTokenizer.from_dir(qwen_dir).vocab_size
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (qwen_dir / name).read_bytes()


def test_special_tokens_are_single_ids_in_order(tokenizer: TextTokenizer) -> None:
    ids = [tokenizer.token_to_id(t) for t in COSYVOICE2_SPECIAL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # added right after the BPE vocabulary
    for token, token_id in zip(COSYVOICE2_SPECIAL_TOKENS, ids, strict=True):
        assert tokenizer.encode(token) == [token_id]
    encoded = tokenizer.encode("hi<|endofprompt|>there")
    assert tokenizer.token_to_id("<|endofprompt|>") in encoded


@pytest.mark.parametrize("text", ["今天天气很好，我们去公园吧。", "It's 3 o'clock,  isn't it?\n",
                                  "Ünïcode ☃ 😀 ok"])
def test_round_trip(tokenizer: TextTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_decode_skips_special_tokens(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("hello [breath] world")
    assert tokenizer.decode(ids) == "hello  world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hello [breath] world"


def test_tokenizer_json_is_accepted(tmp_path: Path, qwen_dir: Path, tokenizer: TextTokenizer) -> None:
    (tmp_path / "tokenizer_config.json").write_bytes((qwen_dir / "tokenizer_config.json").read_bytes())
    tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    reloaded = TextTokenizer.from_dir(tmp_path)
    text = "混合 text 与<|endofprompt|>特殊 [laughter] tokens"
    assert reloaded.encode(text) == tokenizer.encode(text)
    assert reloaded.vocab_size == tokenizer.vocab_size


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError):
        TextTokenizer.from_dir(tmp_path)
