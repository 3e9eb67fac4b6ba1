"""A small Qwen-style tokenizer for random model folders.

It is a byte-level BPE trained with the Qwen2 pre-tokenizer on a few Chinese and English sentences
written for this purpose, saved in the released file layout of `CosyVoice-BlankEN/`: `vocab.json`,
`merges.txt` and `tokenizer_config.json` with the three added tokens of the Qwen2 base tokenizer.
`TextTokenizer.from_dir` then adds the family's special tokens on top, as it does for the real one.
Every byte is in the vocabulary, so any text encodes. Training is deterministic.

With `base_vocab` (CosyVoice3, whose LM looks for id 151646 = `<|endofprompt|>`), the vocabulary is padded
with entries no text can reach (their characters lie outside the byte-level alphabet) to the released
base size, so the added and special tokens get the released ids.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cosyvoice_triton.preprocess.tokenizer import COSYVOICE2_SPECIAL_TOKENS, TextTokenizer, qwen2_pipeline

UNREACHABLE = "\u2400"  # outside the byte-level alphabet: an entry made of it never comes out of text
PADDED_TRAINED_SIZE = 2048  # BPE entries trained before a vocabulary is padded to `base_vocab`

# Added tokens of the Qwen2 base tokenizer, right after the BPE vocabulary.
QWEN2_ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

TRAINING_TEXT = """\
今天天气很好，我们一起去公园散步吧。
春天来了，花园里的花都开了，红的、黄的、白的，非常漂亮。
请问去火车站怎么走？一直往前走，到第二个路口向左转。
这家餐厅的饺子特别好吃，价格也不贵。
他每天早上六点起床，先跑步半个小时，然后吃早饭。
我们的会议改到下午三点，请大家准时参加。
小明在图书馆借了三本书，一本小说，一本历史书和一本科学杂志。
听说明天会下雨，出门记得带伞。
这个城市的地铁四通八达，坐地铁上班非常方便。
妈妈做的红烧肉是全家人最喜欢的一道菜。
学习一门新的语言需要耐心和坚持。
孩子们在操场上踢足球，笑声传得很远。
飞机将在二十分钟后降落，请系好安全带。
感谢您的来电，我们会尽快处理您的问题。
秋天的山上，树叶变成了金黄色和红色。
他说：“只要努力，就一定会有收获。”
一年有十二个月，一个星期有七天。
声音合成技术让机器也能像人一样说话。
收到好友从远方寄来的生日礼物，心里充满了温暖。
人工智能正在改变我们的工作和生活方式。
The weather is lovely today, so let's take a walk in the park.
Could you tell me how to get to the train station, please?
She reads a chapter of her favourite novel every night before bed.
Our meeting has been moved to three o'clock this afternoon.
The children were playing football on the field, laughing loudly.
Please fasten your seat belt; we will be landing in twenty minutes.
Thank you for calling. We will look into your question as soon as we can.
I've never seen such a beautiful sunset over the mountains.
He doesn't like coffee, but he'll drink tea with honey and lemon.
Learning a new language takes patience, practice and a little courage.
The library opens at nine in the morning and closes at eight in the evening.
They're planning a trip to the seaside at the end of the summer.
What time does the last bus leave from the city centre?
Speech synthesis lets a computer read any text aloud in a natural voice.
A good voice clone needs only a few seconds of clear reference audio.
Numbers such as one, two, three, twenty, hundred and thousand are common.
The quick brown fox jumps over the lazy dog near the quiet river bank.
"Hello!" she said. "It's wonderful to see you again after all these years."
We're streaming the audio in small chunks so that playback starts quickly.
Every request carries its own text, its own voice and its own settings.
"""


def _train(bpe_size: int) -> Tokenizer:
    """A Qwen2-pipeline tokenizer whose BPE is trained on `TRAINING_TEXT` (no added tokens yet)."""
    tokenizer = qwen2_pipeline(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    return tokenizer


def _tokenizer_config(first_added_id: int) -> dict:
    added = {str(first_added_id + i): {"content": content, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for i, content in enumerate(QWEN2_ADDED_TOKENS)}
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_standin(qwen_dir: str | Path, vocab_size: int,
                            special_tokens: Sequence[str] = COSYVOICE2_SPECIAL_TOKENS,
                            base_vocab: int | None = None) -> int:
    """Write the tokenizer files into `qwen_dir`; return the total number of ids (≤ `vocab_size`).

    The BPE is trained to `vocab_size` ids in all (added and special tokens included), or, with `base_vocab`,
    to `PADDED_TRAINED_SIZE` entries and padded to `base_vocab` before the added tokens."""
    n_added = len(set(QWEN2_ADDED_TOKENS) | set(special_tokens))
    bpe_size = PADDED_TRAINED_SIZE if base_vocab else vocab_size - n_added
    if bpe_size < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte tokens "
                         f"and {n_added} added tokens")
    folder = Path(qwen_dir)
    folder.mkdir(parents=True, exist_ok=True)
    trained = _train(bpe_size)
    trained.model.save(str(folder))  # vocab.json, merges.txt
    base = trained.get_vocab_size(with_added_tokens=False)
    if base_vocab:
        vocab_file = folder / "vocab.json"
        vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
        vocab.update({f"{UNREACHABLE}{i}": i for i in range(base, base_vocab)})
        vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        base = base_vocab
    config = _tokenizer_config(first_added_id=base)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    total = TextTokenizer.from_dir(folder, special_tokens).vocab_size
    if total > vocab_size:
        raise ValueError(f"the tokenizer has {total} ids, more than the model's {vocab_size}")
    return total
