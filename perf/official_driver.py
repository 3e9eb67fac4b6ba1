"""The official side of `bench_official`: runs in the official code's own virtualenv, never imported.

    OFFICIAL_VENV/bin/python perf/official_driver.py --official-src DIR --model-dir DIR --inputs NPZ \
        --speech-tokens N [--threads 2] [--audible-module PATH] [--device cpu|cuda]

The folder's yaml decides the family, as the official `AutoModel` does: `cosyvoice2.yaml` builds
`CosyVoice2Model`, `cosyvoice3.yaml` `CosyVoice3Model` (hyperpyyaml, as the official `CosyVoice2` and
`CosyVoice3` classes do; those classes themselves also load the frontend, which the benchmark does not
use). `llm.pt`, `flow.pt`, `hift.pt` load with the model's `load` (strict).
A folder without backbone weights (`export --no-backbone-weights`) gets its Qwen2 built from its
`config.json`; `llm.pt` then sets every weight. Every call decodes exactly N speech tokens: the LM's stop
tokens (`stop_token_ids`: 3 in CosyVoice2, 200 in CosyVoice3) are masked and min_len = max_len = N. Then it
serves the parent on stdin/stdout, one JSON line
each way: {"concurrency": c} -> {"streams": [{"first_s", "first_audible_s", "total_s", "audio_s", "chunks"}...],
"wall_s"}. first_audible_s (the arrival of the chunk holding the first audible sample) comes from our
cosyvoice_triton/pipeline/audible.py, loaded by path (`--audible-module`: it needs numpy only), so that both
sides use one definition; without it, None.
c threads call the model's `tts(stream=True)` at once, as the official server does.
The official model class takes the GPU whenever torch sees one; `--device cpu` (the default) hides it, so
that both sides run where the parent asked.
`token_hop_len` is reset to 25 before each round (`tts()` doubles it on the model and never resets it).
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import torch

TOKEN_HOP_LEN = 25  # CosyVoice2Model's and CosyVoice3Model's initial value
MODEL_CLASSES = {"cosyvoice2.yaml": "CosyVoice2Model", "cosyvoice3.yaml": "CosyVoice3Model"}  # by the folder's yaml
UNUSED_MODULES = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "torchaudio.transforms",
                  "whisper", "whisper.tokenizer", "tiktoken", "pyworld", "pyarrow", "pyarrow.parquet")


def stub_unused_imports() -> None:
    """Modules the official package imports at load time that synthesis from features never calls."""
    for name in UNUSED_MODULES:
        try:
            __import__(name)
            continue
        except ImportError:
            pass
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules.setdefault(name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    if not hasattr(sys.modules["torchaudio.transforms"], "Spectrogram"):
        sys.modules["torchaudio.transforms"].Spectrogram = lambda *args, **kwargs: torch.nn.Identity()
    if not hasattr(sys.modules["whisper.tokenizer"], "Tokenizer"):
        sys.modules["whisper.tokenizer"].Tokenizer = object


def use_device(device: str) -> None:
    """Make the official code run on `device`: it asks torch.cuda.is_available() and takes the GPU if so."""
    if torch.device(device).type == "cpu":
        torch.cuda.is_available = lambda: False
    elif not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: torch in the official virtualenv sees no GPU")


def build_model(official: Path, model_dir: Path):
    sys.path[:0] = [str(official), str(official / "third_party" / "Matcha-TTS")]
    stub_unused_imports()
    import transformers
    from hyperpyyaml import load_hyperpyyaml

    import cosyvoice.cli.model

    [yaml_file] = [name for name in MODEL_CLASSES if (model_dir / name).is_file()]
    model_class = getattr(cosyvoice.cli.model, MODEL_CLASSES[yaml_file])
    qwen_dir = model_dir / "CosyVoice-BlankEN"
    if not any(qwen_dir.glob("*.safetensors")) and not any(qwen_dir.glob("*.bin")):
        def from_config(path, *args, **kwargs):  # llm.pt holds every backbone weight
            config = transformers.AutoConfig.from_pretrained(path)  # float32, as from_pretrained's default
            return transformers.Qwen2ForCausalLM._from_config(config, torch_dtype=torch.float32)
        transformers.Qwen2ForCausalLM.from_pretrained = from_config
    with open(model_dir / yaml_file) as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(qwen_dir)})
    model = model_class(configs["llm"], configs["flow"], configs["hift"], fp16=False)
    model.load(str(model_dir / "llm.pt"), str(model_dir / "flow.pt"), str(model_dir / "hift.pt"))
    return model


def force_exact_length(llm, n: int) -> None:
    """Exactly n tokens per call: every stop token masked, min_len = max_len = n."""
    stop = list(llm.stop_token_ids)
    sampling_ids, wrapper = llm.sampling_ids, llm.inference_wrapper

    def masked_sampling_ids(weighted_scores, decoded_tokens, sampling, ignore_eos=True):
        weighted_scores[stop] = -float("inf")
        return sampling_ids(weighted_scores, decoded_tokens, sampling, ignore_eos=False)

    llm.sampling_ids = masked_sampling_ids
    llm.inference_wrapper = lambda lm_input, sampling, min_len, max_len, uuid: wrapper(lm_input, sampling, n, n, uuid)


def load_audible(path: Path | None):
    """Our pipeline/audible.py as a module of its own (the official virtualenv has no cosyvoice_triton)."""
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("cosyvoice_audible", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_stream(model, inputs: dict[str, torch.Tensor], sample_rate: int, result: dict, audible=None) -> None:
    start = time.perf_counter()
    first, samples, chunks = None, 0, 0
    heard = audible.AudibleDetector(sample_rate) if audible is not None else None
    for out in model.tts(text=inputs["text"], flow_embedding=inputs["embedding"], llm_embedding=inputs["embedding"],
                         prompt_text=inputs["prompt_text"], llm_prompt_speech_token=inputs["prompt_speech"],
                         flow_prompt_speech_token=inputs["prompt_speech"], prompt_speech_feat=inputs["mel"],
                         stream=True):
        size = out["tts_speech"].numel()
        now = time.perf_counter() - start
        if size and first is None:
            first = now
        if heard is not None:
            heard.feed(out["tts_speech"].detach().float().cpu().numpy(), now)
        samples += size
        chunks += 1
    if heard is not None:
        heard.finish()
    result.update(first_s=first, first_audible_s=heard.at if heard is not None else None,
                  total_s=time.perf_counter() - start, audio_s=samples / sample_rate, chunks=chunks)


def run_round(model, inputs: dict[str, torch.Tensor], sample_rate: int, concurrency: int, audible=None) -> dict:
    model.token_hop_len = TOKEN_HOP_LEN
    torch.manual_seed(0)
    results = [{} for _ in range(concurrency)]
    threads = [threading.Thread(target=one_stream, args=(model, inputs, sample_rate, r, audible)) for r in results]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"streams": results, "wall_s": time.perf_counter() - start}


def load_inputs(path: Path) -> dict[str, torch.Tensor]:
    data = np.load(path)
    return {"text": torch.tensor(data["text_tokens"], dtype=torch.int32)[None],
            "prompt_text": torch.tensor(data["prompt_text_tokens"], dtype=torch.int32)[None],
            "prompt_speech": torch.tensor(data["prompt_speech_tokens"], dtype=torch.int32)[None],
            "embedding": torch.tensor(data["embedding"], dtype=torch.float32).reshape(1, -1),
            "mel": torch.tensor(data["mel"], dtype=torch.float32)[None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official-src", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--speech-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--audible-module", type=Path, default=None, help="our pipeline/audible.py")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU the official code picks")
    args = parser.parse_args()
    use_device(args.device)
    audible = load_audible(args.audible_module)
    torch.set_num_threads(args.threads)
    protocol = sys.stdout
    sys.stdout = sys.stderr  # the official code prints; only protocol lines go to the parent
    model = build_model(args.official_src.resolve(), args.model_dir.resolve())
    force_exact_length(model.llm, args.speech_tokens)
    inputs = load_inputs(args.inputs)
    sample_rate = int(model.hift.sampling_rate) if hasattr(model.hift, "sampling_rate") else 24000
    protocol.write(json.dumps({"ready": True, "torch": torch.__version__}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        command = json.loads(line)
        protocol.write(json.dumps(run_round(model, inputs, sample_rate, int(command["concurrency"]), audible)) + "\n")
        protocol.flush()


if __name__ == "__main__":
    main()
