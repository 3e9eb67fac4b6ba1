"""Model families: what differs between a CosyVoice2 and a CosyVoice3 folder, described once.

The folder decides: `cosyvoice2.yaml` makes it CosyVoice2, `cosyvoice3.yaml` CosyVoice3 (`family_of`). A
`ModelFamily` is plain data (no torch): the file names, the classes its yaml must name, the speech LM's ids
and prompt frame (`LMLayout`), the text tokenizer's special tokens, the prompt-text prefix, the chunk
schedule. The module classes are chosen in one registry (`models/family.py`: the flow and the vocoder;
each class checks that the yaml builds the official class it mirrors), so nothing else asks which family
it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cosyvoice_triton.errors import ModelFolderError
from cosyvoice_triton.messages import ChunkPolicy

END_OF_PROMPT = "<|endofprompt|>"  # ends the prompt text; id 151646 with the released Qwen vocabulary
END_OF_PROMPT_ID = 151646  # the CosyVoice3 LM checks for this id in prompt_text ++ text

# Added to the Qwen tokenizer in this order, so their ids follow the base vocabulary's added tokens.
COSYVOICE2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>", "<|im_end|>", END_OF_PROMPT,
    "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]",
    "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)
# CosyVoice3 adds a system-prompt end and pronunciation tokens: CMU phones (vowels with and without a
# stress digit) and pinyin initials and finals with tone marks, each in brackets, in code-point order.
_CMU_VOWELS = "AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW".split()
_CMU_CONSONANTS = "B CH D DH F G HH JH K L M N NG P R S SH T TH V W Y Z ZH".split()
_PINYIN = """a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng
ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà
uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài
àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē
ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ""".split()
CMU_PHONES = tuple(sorted([v + stress for v in _CMU_VOWELS for stress in ("", "0", "1", "2")] + _CMU_CONSONANTS))
PRONUNCIATION_TOKENS = tuple(f"[{unit}]" for unit in (*CMU_PHONES, *sorted(_PINYIN)))
COSYVOICE3_SPECIAL_TOKENS = (*COSYVOICE2_SPECIAL_TOKENS, "<|endofsystem|>", *PRONUNCIATION_TOKENS)


@dataclass(frozen=True)
class LMLayout:
    """The speech LM's ids and prompt frame.

    Ids are offsets from the codebook size (`speech_token_size` in the yaml, 6561): the speech embedding
    and the speech head have codebook + `head_ids` rows, and the ids codebook + k, k < `stop_ids`, end
    decoding. The prefill input is [sos, text(prompt_text ++ text), task_id, speech(prompt speech)].
    """

    head_ids: int
    stop_ids: int
    eos: int
    sos: int
    task_id: int
    # True: sos and task_id are rows `sos` and `task_id` of a table of their own (`llm_embedding`);
    # False: rows codebook + `sos` / codebook + `task_id` of `speech_embedding`.
    own_special_table: bool
    decoder_bias: bool
    # The id held back while fewer than min_len tokens are decoded, as the official torch loop does: it
    # masks index `speech_token_size` in both families, which in CosyVoice3 is SOS, not EOS, so min_len does
    # not hold back CosyVoice3's stop ids (its vLLM path, `min_tokens`, does: the two official paths differ).
    min_len_masked: int = 0
    required_text_id: int | None = None  # a text id that must occur in prompt_text ++ text
    # Bistream input (llm/bistream.py): the fill token that closes each group of speech tokens is id
    # codebook + `fill`. A `required_text_id` ends the prompt's head: the prompt text up to it is fed right
    # after sos, before any text and speech are interleaved (the official CosyVoice3 bistream).
    fill: int = 2


@dataclass(frozen=True)
class ModelFamily:
    name: str  # what /v1/models, /readyz and the Triton model metadata show
    yaml_file: str
    speech_tokenizer_file: str
    llm_class: str  # the LM class the yaml's `llm` section must build (one module class serves both layouts)
    lm: LMLayout
    special_tokens: tuple[str, ...]
    # What the official frontend expects before a zero-shot prompt transcript (and, in cross-lingual mode,
    # before the text itself): "" for CosyVoice2. See `zero_shot_prompt`, `text_prefix`, `instruction`.
    prompt_prefix: str = ""
    # Tokens that text normalization passes through untouched (CosyVoice3's pronunciation hints: wetext
    # would turn the digit of `[AA1]` into a word, or fail on it).
    verbatim_tokens: tuple[str, ...] = ()
    token_rate: int = 25  # speech tokens per second
    chunk: ChunkPolicy = field(default_factory=ChunkPolicy)  # the official streaming schedule
    # Speech tokens that are silence or breath: beyond `max_silent_run` in a row they do not reach the flow
    # (the LLM still feeds them back). Empty: no such rule.
    silent_tokens: frozenset[int] = frozenset()
    max_silent_run: int = 0
    # Mel frames a stream's flow cache keeps by default (`FlowCacheSettings.max_frames`): about 1.1 GB per
    # stream at the released size in fp32 for both (CosyVoice2 1.15 MB a frame, CosyVoice3's DiT 3.6 MB).
    flow_cache_frames: int = 1000

    def __str__(self) -> str:
        return self.name

    # ---- the frontend's text forms -----------------------------------------------------------------

    @property
    def system_prompt(self) -> str:
        """The system prompt before `<|endofprompt|>` ("" for CosyVoice2)."""
        return self.prompt_prefix.removesuffix(END_OF_PROMPT)

    def zero_shot_prompt(self, transcript: str) -> str:
        """A zero-shot prompt transcript in the form the LM was trained on: as given if it holds
        `<|endofprompt|>` (the official API's form), else behind `prompt_prefix`."""
        return transcript if END_OF_PROMPT in transcript else self.prompt_prefix + transcript

    def text_prefix(self, text: str) -> str:
        """What goes before a sentence that has no prompt text in front of it (cross_lingual): `prompt_prefix`
        unless the text itself holds `<|endofprompt|>` (the official API's form)."""
        return "" if END_OF_PROMPT in text else self.prompt_prefix

    def instruction(self, instruct_text: str) -> str:
        """An instruct2 instruction in the trained form: `<|endofprompt|>` at its end and, where the family has
        a system prompt, that prompt and a space in front ("You are a helpful assistant. Speak slowly.").
        An instruction that holds `<|endofprompt|>` already is taken as it is."""
        text = instruct_text.strip()
        if END_OF_PROMPT in text:
            return text
        if self.system_prompt and not text.startswith(self.system_prompt):
            text = f"{self.system_prompt} {text}"
        return text + END_OF_PROMPT


COSYVOICE2 = ModelFamily(
    name="cosyvoice2", yaml_file="cosyvoice2.yaml", speech_tokenizer_file="speech_tokenizer_v2.onnx",
    llm_class="Qwen2LM",
    lm=LMLayout(head_ids=3, stop_ids=3, eos=0, sos=0, task_id=1, own_special_table=True, decoder_bias=True),
    special_tokens=COSYVOICE2_SPECIAL_TOKENS)

COSYVOICE3 = ModelFamily(
    name="cosyvoice3", yaml_file="cosyvoice3.yaml", speech_tokenizer_file="speech_tokenizer_v3.onnx",
    llm_class="CosyVoice3LM",
    lm=LMLayout(head_ids=200, stop_ids=200, eos=1, sos=0, task_id=2, own_special_table=False, decoder_bias=False,
                required_text_id=END_OF_PROMPT_ID, fill=3),
    special_tokens=COSYVOICE3_SPECIAL_TOKENS,
    prompt_prefix="You are a helpful assistant." + END_OF_PROMPT,
    verbatim_tokens=PRONUNCIATION_TOKENS,
    silent_tokens=frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323}), max_silent_run=5,
    # 300 frames (6 s, the prompt's included) x 3.6 MB = 1.08 GB at the released size in fp32 (half with
    # the bf16 estimator); the frames after them are computed again at each chunk.
    flow_cache_frames=300)

FAMILIES = (COSYVOICE2, COSYVOICE3)


def family_named(name: str) -> ModelFamily:
    """The family called `name` ("cosyvoice2", "cosyvoice3")."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}: one of {', '.join(f.name for f in FAMILIES)}")


def family_of(model_dir: str | Path) -> ModelFamily:
    """The family of a model folder: the one whose yaml it holds."""
    root = Path(model_dir)
    present = [family for family in FAMILIES if (root / family.yaml_file).is_file()]
    names = " or ".join(family.yaml_file for family in FAMILIES)
    if not present:
        raise ModelFolderError(f"{root}: no {names}: not a CosyVoice model folder")
    if len(present) > 1:
        raise ModelFolderError(f"{root}: holds both {names}; keep the one that belongs to its weights")
    return present[0]


def yaml_class(section: dict) -> str:
    """The class name of a yaml section built with `!new:pkg.module.Class` (`config.read_yaml` keeps the tag)."""
    return str(section.get("__tag__", "")).rsplit(".", 1)[-1]


def check_yaml_class(section: dict, expected: str, where: str, yaml_path: Path) -> None:
    """ModelFolderError naming the yaml when its section `where` builds another class than `expected`."""
    found = yaml_class(section)
    if found != expected:
        raise ModelFolderError(f"{yaml_path}: `{where}` builds {found or 'nothing'}, not {expected}")
