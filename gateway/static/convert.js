// The convert tab: voice conversion through POST /v1/vc (gateway/routes_vc.py). A source recording
// (uploaded or recorded) is spoken again in a registered voice, or in the voice of a target recording.
//
// Request: multipart/form-data with `source_audio` (the source file), `voice_id` or `prompt_audio` (a target
// recording file), `seed` (optional digits), `model` (the picker's choice, app.js `chosenModel`; none when one
// family is served), format "pcm_f32" and stream "true"; the answer streams
// little-endian float32 samples at 24 kHz (X-Seed: the seed used), played as they arrive (audio.js), or is
// a JSON error naming the field (`param`), shown beside that field's control.
"use strict";

const vc = {
  player: null, // Player (audio.js) of the convert tab
  controller: null, // AbortController of the request in flight
  recorded: null, // Blob (WAV) of the last recording
  ended: false,
  downloadUrl: null,
};

const CONVERT_FIELDS = {source_audio: "vc-file", voice_id: "vc-voice", prompt_audio: "vc-target-file", seed: "vc-seed",
  model: "model"};

function setConvertStatus(text, key) {
  const el = $("vc-status");
  el.textContent = text;
  el.dataset.state = key;
}

function setConvertBusy(busy) {
  $("convert").disabled = busy;
  $("vc-stop").disabled = !busy;
}

// The source: the chosen file, else the last recording; null when there is neither.
async function sourceRecording() {
  const file = $("vc-file").files[0];
  if (file) return uploadable(file);
  return vc.recorded ? {blob: vc.recorded, name: "source.wav"} : null;
}

// The form of /v1/vc, or null when a field is missing or wrong (its error shown beside it).
async function conversionForm() {
  let source;
  let target = null;
  try {
    source = await sourceRecording();
  } catch (err) {
    showError("vc-file", `This file cannot be decoded: ${err.message}`);
    return null;
  }
  if (!source) {
    showError("vc-file", "Choose a source recording or record one first.");
    return null;
  }
  const targetFile = $("vc-target-file").files[0];
  try {
    target = targetFile ? await uploadable(targetFile) : null;
  } catch (err) {
    showError("vc-target-file", `This file cannot be decoded: ${err.message}`);
    return null;
  }
  if (!target && !$("vc-voice").value) {
    showError("vc-voice", "Choose a voice (or a recording of one).");
    return null;
  }
  const seed = seedDigits("vc-seed");
  if (seed === null) return null;
  const form = new FormData();
  form.append("source_audio", source.blob, source.name);
  if (target) form.append("prompt_audio", target.blob, target.name);
  else form.append("voice_id", $("vc-voice").value);
  if (seed !== "") form.append("seed", seed);
  const model = chosenModel();
  if (model) form.append("model", model);
  form.append("format", "pcm_f32");
  form.append("stream", "true");
  return form;
}

function resetConversion() {
  vc.player.reset();
  vc.ended = false;
  $("vc-first-audio").textContent = "–";
  $("vc-audio-seconds").textContent = "0.00";
  $("vc-used-seed").textContent = "–";
  $("vc-download").hidden = true;
}

// Float32 samples from a byte stream read in arbitrary pieces: whole samples out, the rest kept.
function pcmReader() {
  let rest = new Uint8Array(0);
  return (bytes) => {
    const data = new Uint8Array(rest.length + bytes.length);
    data.set(rest);
    data.set(bytes, rest.length);
    const whole = data.length - (data.length % 4);
    rest = data.slice(whole);
    return new Float32Array(data.buffer, 0, whole / 4);
  };
}

async function convert() {
  clearErrors($("panel-convert"));
  showError("model", "");
  const form = await conversionForm();
  if (!form) return;
  stopConverting(false);
  resetConversion();
  vc.player.open(); // inside the click: browsers let it play
  setConvertBusy(true);
  setConvertStatus("Converting", "waiting");
  const controller = new AbortController();
  vc.controller = controller;
  const sentAt = performance.now();
  try {
    const response = await fetch("/v1/vc", {method: "POST", body: form, headers: headers(), signal: controller.signal});
    if (!response.ok) throw await apiError(response);
    $("vc-used-seed").textContent = response.headers.get("X-Seed") || "–";
    const reader = response.body.getReader();
    const samplesOf = pcmReader();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      const samples = samplesOf(value);
      if (!samples.length) continue;
      if (vc.player.samples === 0) {
        $("vc-first-audio").textContent = (performance.now() - sentAt).toFixed(0);
        setConvertStatus("Streaming", "streaming");
      }
      vc.player.add(samples);
      $("vc-audio-seconds").textContent = (vc.player.samples / SAMPLE_RATE).toFixed(2);
    }
    vc.ended = true;
    finishConversionDownload();
    const playing = vc.player.playing;
    setConvertStatus(playing ? "Received all audio, playing" : "Done", playing ? "playing" : "done");
  } catch (err) {
    if (controller.signal.aborted) return; // stopped
    showError(errorControl(CONVERT_FIELDS, err.param, "convert"), `Could not convert: ${err.message}`);
    setConvertStatus("Failed", "error");
  } finally {
    if (vc.controller === controller) {
      vc.controller = null;
      setConvertBusy(false);
    }
  }
}

function finishConversionDownload() {
  if (!vc.player.samples) return;
  if (vc.downloadUrl) URL.revokeObjectURL(vc.downloadUrl);
  vc.downloadUrl = URL.createObjectURL(wavBlob(vc.player.all(), SAMPLE_RATE));
  $("vc-download").href = vc.downloadUrl;
  $("vc-download").hidden = false;
}

function stopConverting(update = true) {
  const controller = vc.controller;
  vc.controller = null;
  if (controller) controller.abort(); // the gateway cancels the conversion when the connection goes
  vc.player.stop();
  if (update) {
    setConvertBusy(false);
    finishConversionDownload();
    if (!vc.ended) setConvertStatus("Stopped", "stopped");
  }
}

function initConvert() {
  vc.player = new Player($("vc-waveform"), () => { if (vc.ended) setConvertStatus("Done", "done"); });
  $("convert").addEventListener("click", convert);
  $("vc-stop").addEventListener("click", () => stopConverting(true));
  $("vc-file").addEventListener("change", () => {
    const file = $("vc-file").files[0];
    showError("vc-file", "");
    if (file) { vc.recorded = null; preview($("vc-preview"), file); }
  });
  $("vc-target-file").addEventListener("change", () => showError("vc-target-file", ""));
  microphoneButton($("vc-record"), {
    onStart: () => showError("vc-record", ""),
    onDone: (wav) => {
      vc.recorded = wav;
      $("vc-file").value = "";
      showError("vc-file", "");
      preview($("vc-preview"), wav);
    },
    onError: (message) => showError("vc-record", message),
  });
}

document.addEventListener("DOMContentLoaded", initConvert);
