"""Model folders with random weights in the released CosyVoice2 layout, and a speech-like prompt.

`write.write_random_model` writes one (`cosyvoice-triton export`, and `serve` without `--model-dir`);
`model_yaml`, `onnx_standins` and `tokenizer_standin` write its parts; `sample_prompt.speech_like` makes
a prompt recording without downloads. Everything here runs on these folders, and on the real one alike.
"""
