// CosyVoice web page: the model family (a picker when the gateway serves several), voices (GET/POST/DELETE /v1/voices), microphone recording, and streamed
// synthesis over WS /v1/tts/ws played through Web Audio as the chunks arrive (audio.js), with the chunk
// timeline (timeline.js), which marks the first audible audio, and the text with the sentence being spoken
// highlighted from the speech marks (marks.js); the convert tab is convert.js. Errors show beside the control that caused them.
//
// WebSocket protocol (gateway/routes_ws.py): we send {"type": "start", voice_id, mode, instruct, seed, model,
// format: "pcm_f32", marks: true, text} and {"type": "end"}; the gateway answers {"type": "started", seed, model, ...},
// binary frames of little-endian float32 samples at 24 kHz, {"type": "mark"} / {"type": "mark_end"} speech
// marks before the audio they describe, {"type": "segment", ...} after each
// sentence, then {"type": "end", audio_seconds, first_chunk_ms, first_audible_ms, ...}, or {"type": "error", param, message}.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  ws: null,
  player: null, // Player (audio.js) of the speak tab
  spoken: null, // SpokenText (marks.js): the text, its sentence being spoken highlighted
  arrivals: [], // seconds from sending the text to each chunk's arrival (the chunk timeline)
  durations: [], // seconds of audio of each chunk
  audible: null, // AudibleDetector (timeline.js) of the stream: which chunk holds its first audible sample
  sentAt: 0,
  firstChunkMs: null,
  ended: false,
  failed: false,
  recorded: null, // Blob (WAV) of the last recording for a voice
  downloadUrl: null,
};

// ---- small helpers -------------------------------------------------------------------------------

function apiKey() {
  return $("api-key").value.trim();
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? {...extra, Authorization: `Bearer ${key}`} : extra;
}

// An error answer of the gateway as an Error with the request field it names (`param`), if any.
async function apiError(response) {
  let message = `${response.status} ${response.statusText}`;
  let param = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      param = body.error.param || null;
    }
  } catch (_) { /* not JSON */ }
  return Object.assign(new Error(message), {param});
}

// Show `message` beside the control with id `controlId` (in its <p id="{controlId}-error">); "" hides it.
function showError(controlId, message) {
  const box = $(`${controlId}-error`);
  box.textContent = message || "";
  box.hidden = !message;
  const control = $(controlId);
  if (message) control.setAttribute("aria-invalid", "true");
  else control.removeAttribute("aria-invalid");
  if (message) control.setAttribute("aria-errormessage", box.id);
}

function clearErrors(scope) {
  for (const box of scope.querySelectorAll(".error[id$='-error']")) showError(box.id.slice(0, -"-error".length), "");
}

// The control to show a server error beside: the one for the request field it names, else the action's button.
function errorControl(fields, param, fallback) {
  return (param && fields[param]) || fallback;
}

function setStatus(text, key) {
  const el = $("status");
  el.textContent = text;
  el.dataset.state = key;
}

function setBusy(busy) {
  $("speak").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- server and voices ---------------------------------------------------------------------------

async function checkServer() {
  const el = $("server");
  try {
    const response = await fetch("/readyz", {cache: "no-store"});
    const body = await response.json();
    const servers = Object.keys(body.servers || {}).length;
    el.dataset.ready = body.ready ? "yes" : "no";
    const waiting = (body.waiting_for || []).join(", ");
    el.textContent = body.ready
      ? `Ready: ${servers} Triton server${servers === 1 ? "" : "s"}`
      : `Starting${waiting ? `: waiting for ${waiting}` : ""}`;
    showModelNotice(body.model);
    showFamilies(body.families, body.family);
    return body.ready;
  } catch (err) {
    el.dataset.ready = "no";
    el.textContent = "The gateway cannot be reached.";
    return false;
  }
}

// /readyz names the model when it is a random folder (model_hub / random_folder.marker): say so plainly.
function showModelNotice(note) {
  $("model-notice").hidden = !note;
  $("model-note").textContent = note || "";
}

// ---- model families ------------------------------------------------------------------------------
// /readyz names the families the gateway's servers serve and the one a request naming none gets. With
// several, the picker shows them (that one chosen first) and its choice goes as `model` on every request;
// with one it stays hidden and requests name none: the servers' family answers.

function familyName(family) {
  return family.replace(/^cosyvoice/, "CosyVoice");
}

function showFamilies(families, family) {
  const box = $("model");
  const served = families && families.length ? families : (family ? [family] : []);
  const keep = box.value || family;
  box.replaceChildren(...served.map((f) => new Option(familyName(f), f)));
  if (served.length) box.value = served.includes(keep) ? keep : served[0];
  $("model-field").hidden = served.length < 2;
  showFamilyName();
}

function showFamilyName() {
  $("family-name").textContent = $("model").value ? familyName($("model").value) : "CosyVoice";
}

// The `model` of a request: the picker's choice, or null when it is hidden (one family served).
function chosenModel() {
  return $("model-field").hidden ? null : $("model").value || null;
}

let voices = [];

async function loadVoices(select) {
  const box = $("voice");
  try {
    const response = await fetch("/v1/voices", {headers: headers(), cache: "no-store"});
    if (!response.ok) throw await apiError(response);
    voices = (await response.json()).voices || [];
  } catch (err) {
    showError("voice", `Could not list voices: ${err.message}`);
    showError("vc-voice", `Could not list voices: ${err.message}`);
    return;
  }
  showError("voice", "");
  showError("vc-voice", "");
  fillVoices(box, select || box.value || "default");
  fillVoices($("vc-voice"), $("vc-voice").value || "default");
  describeVoice();
}

function fillVoices(box, keep) {
  box.replaceChildren();
  if (!voices.length) {
    box.append(new Option("No voices registered yet", ""));
  }
  for (const voice of voices) {
    const label = voice.name && voice.name !== voice.id ? `${voice.name} (${voice.id})` : voice.id;
    box.append(new Option(`${label} — ${Number(voice.prompt_seconds).toFixed(1)} s`, voice.id));
  }
  if (voices.some((v) => v.id === keep)) box.value = keep;
  else if (voices.length) box.value = voices[0].id;
}

function describeVoice() {
  const voice = voices.find((v) => v.id === $("voice").value);
  $("voice-info").textContent = voice
    ? (voice.text ? `Transcript: “${voice.text}”` : "Registered without a transcript (use cross-lingual mode).")
    : "";
  $("delete-voice").disabled = !voice;
}

async function deleteVoice() {
  const id = $("voice").value;
  if (!id || !window.confirm(`Delete voice “${id}”?`)) return;
  showError("voice", "");
  const response = await fetch(`/v1/voices/${encodeURIComponent(id)}`, {method: "DELETE", headers: headers()});
  if (!response.ok) {
    showError("voice", `Could not delete the voice: ${(await apiError(response)).message}`);
    return;
  }
  await loadVoices("");
}

// ---- recording and registration ------------------------------------------------------------------

function preview(player, blob) {
  if (player.src) URL.revokeObjectURL(player.src);
  player.src = URL.createObjectURL(blob);
  player.hidden = false;
}

async function chosenRecording() {
  const file = $("voice-file").files[0];
  if (!file) return state.recorded ? {blob: state.recorded, name: "recording.wav"} : null;
  return uploadable(file);
}

const REGISTER_FIELDS = {audio: "voice-file", text: "voice-text", prompt_text: "voice-text", id: "voice-id",
  voice_id: "voice-id", name: "voice-name"};

async function registerVoice() {
  clearErrors($("panel-speak").querySelector("[aria-labelledby='add-title']"));
  const status = $("register-status");
  let recording;
  try {
    recording = await chosenRecording();
  } catch (err) {
    showError("voice-file", `This file cannot be decoded: ${err.message}`);
    return;
  }
  if (!recording) {
    showError("voice-file", "Choose a recording file or record one first.");
    return;
  }
  const form = new FormData();
  form.append("audio", recording.blob, recording.name);
  form.append("text", $("voice-text").value);
  if ($("voice-id").value.trim()) form.append("id", $("voice-id").value.trim());
  if ($("voice-name").value.trim()) form.append("name", $("voice-name").value.trim());
  $("register").disabled = true;
  status.textContent = "Registering…";
  try {
    const response = await fetch("/v1/voices", {method: "POST", body: form, headers: headers()});
    if (!response.ok) throw await apiError(response);
    const voice = await response.json();
    status.textContent = voice.created === false
      ? `Already registered as “${voice.id}”.` : `Registered “${voice.id}” (${voice.prompt_seconds.toFixed(1)} s).`;
    await loadVoices(voice.id);
  } catch (err) {
    status.textContent = "";
    showError(errorControl(REGISTER_FIELDS, err.param, "register"), `Could not register the voice: ${err.message}`);
  } finally {
    $("register").disabled = false;
  }
}

// ---- streamed synthesis --------------------------------------------------------------------------

function resetStats() {
  state.player.reset();
  state.arrivals = [];
  state.durations = [];
  state.audible = new AudibleDetector(SAMPLE_RATE);
  $("first-audible").textContent = "–";
  $("stalls").textContent = "0";
  $("stall-ms").textContent = "0";
  $("timeline").replaceChildren();
  $("timeline-figure").hidden = true;
  state.firstChunkMs = null;
  state.ended = false;
  state.failed = false;
  $("first-chunk").textContent = "–";
  $("audio-seconds").textContent = "0.00";
  $("chunks").textContent = "0";
  $("used-seed").textContent = "–";
  $("used-model").textContent = "–";
  $("meter-bar").style.width = "0";
  $("download").hidden = true;
}

function onAudio(data) {
  const samples = new Float32Array(data);
  if (!samples.length) return;
  if (state.firstChunkMs === null) {
    state.firstChunkMs = performance.now() - state.sentAt;
    $("first-chunk").textContent = state.firstChunkMs.toFixed(0);
    setStatus("Streaming", "streaming");
  }
  state.arrivals.push((performance.now() - state.sentAt) / 1000);
  state.durations.push(samples.length / SAMPLE_RATE);
  state.audible.feed(samples);
  state.player.add(samples);
  const seconds = state.player.samples / SAMPLE_RATE;
  $("audio-seconds").textContent = seconds.toFixed(2);
  $("chunks").textContent = String(state.arrivals.length);
  $("meter-bar").style.width = `${Math.min(100, seconds * 10)}%`;
  drawStream();
}

// The chunk timeline, the stalls and the first audible audio (the arrival of the chunk holding it) so far.
function drawStream() {
  const audibleChunk = state.audible.chunk;
  const {stalls, stallSeconds} = drawTimeline($("timeline"), state.arrivals, state.durations, audibleChunk);
  $("timeline-figure").hidden = false;
  $("stalls").textContent = String(stalls);
  $("stall-ms").textContent = (1000 * stallSeconds).toFixed(0);
  if (audibleChunk !== null) $("first-audible").textContent = (1000 * state.arrivals[audibleChunk]).toFixed(0);
}

// The last scheduled chunk has played.
function onDrained() {
  if (!state.ended) return;
  state.spoken.stop();
  setStatus("Done", "done");
}

const SPEAK_FIELDS = {voice_id: "voice", text: "text", seed: "seed", mode: "mode", instruct: "instruct",
  model: "model"};

function onMessage(message, raw) {
  if (message.type === "started") {
    const seed = /"seed":\s*(\d+)/.exec(raw); // exact digits (JSON.parse rounds numbers past 2^53)
    $("used-seed").textContent = seed ? seed[1] : String(message.seed);
    $("used-model").textContent = message.model || "–";
  } else if (message.type === "mark") { // speech marks: which sentence plays when (marks.js)
    state.spoken.add(message.mark);
  } else if (message.type === "mark_end") {
    state.spoken.add(message);
  } else if (message.type === "queued") { // admission: the segment waits for a server to start it
    setStatus(`Queued: position ${message.position}, starts in about ${message.expected_start_s.toFixed(1)} s`,
              "queued");
  } else if (message.type === "end") {
    state.ended = true;
    if (state.audible.finish()) drawStream(); // a window that runs past the last sample
    finishDownload();
    setBusy(false);
    const playing = state.player.playing;
    if (!playing) state.spoken.stop();
    setStatus(playing ? "Received all audio, playing" : "Done", playing ? "playing" : "done");
    $("status").dataset.serverFirstChunkMs = message.first_chunk_ms == null ? "" : message.first_chunk_ms.toFixed(0);
    $("status").dataset.serverFirstAudibleMs = message.first_audible_ms == null ? "" : message.first_audible_ms.toFixed(0);
  } else if (message.type === "error") {
    state.failed = true;
    showError(errorControl(SPEAK_FIELDS, message.param, "speak"), message.message || "The synthesis failed.");
    setStatus("Failed", "error");
    setBusy(false);
  }
}

function finishDownload() {
  if (!state.player.samples) return;
  if (state.downloadUrl) URL.revokeObjectURL(state.downloadUrl);
  state.downloadUrl = URL.createObjectURL(wavBlob(state.player.all(), SAMPLE_RATE));
  const link = $("download");
  link.href = state.downloadUrl;
  link.hidden = false;
}

// The seed field's digits as they are ("" for none), or null (and the error shown beside it) if it is not one.
function seedDigits(controlId) {
  const seed = $(controlId).value.trim().replace(/^0+(?=\d)/, ""); // JSON numbers have no leading zeros
  if (seed !== "" && !/^\d+$/.test(seed)) {
    showError(controlId, "The seed must be a whole number from 0 to 2^64 - 1.");
    return null;
  }
  return seed;
}

function speak() {
  clearErrors($("panel-speak").querySelector("[aria-labelledby='speak-title']"));
  showError("model", "");
  const text = $("text").value;
  if (!text.trim()) {
    showError("text", "Type some text first.");
    $("text").focus();
    return;
  }
  const voice = $("voice").value;
  if (!voice) {
    showError("voice", "Choose a voice first (or register one below).");
    return;
  }
  const start = {type: "start", voice_id: voice, mode: $("mode").value, format: "pcm_f32", marks: true, text};
  if (start.mode === "instruct2") start.instruct = $("instruct").value;
  const model = chosenModel();
  if (model) start.model = model;
  const seed = seedDigits("seed");
  if (seed === null) return;
  // Seeds go up to 2^64 - 1, past what a JavaScript number holds exactly: the digits go into the JSON as they are.
  const startJson = seed === "" ? JSON.stringify(start) : `${JSON.stringify(start).slice(0, -1)},"seed":${seed}}`;

  stopSpeaking(false);
  resetStats();
  state.spoken.reset(text);
  state.spoken.start();
  state.player.open(); // inside the click: browsers let it play
  setBusy(true);
  setStatus("Connecting", "connecting");

  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const key = apiKey();
  const ws = new WebSocket(`${scheme}//${location.host}/v1/tts/ws${key ? `?api_key=${encodeURIComponent(key)}` : ""}`);
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  ws.onopen = () => {
    state.sentAt = performance.now();
    ws.send(startJson);
    ws.send(JSON.stringify({type: "end"}));
    setStatus("Waiting for audio", "waiting");
  };
  ws.onmessage = (event) => {
    if (ws !== state.ws) return;
    if (typeof event.data === "string") onMessage(JSON.parse(event.data), event.data);
    else onAudio(event.data);
  };
  ws.onerror = () => {
    if (ws !== state.ws || state.failed) return;
    state.failed = true;
    showError("speak", "The WebSocket connection failed.");
  };
  ws.onclose = (event) => {
    if (ws !== state.ws) return;
    state.ws = null;
    setBusy(false);
    if (!state.ended && !state.failed) {
      state.failed = true;
      showError("speak", `The connection closed before the end (code ${event.code}${event.reason ? `: ${event.reason}` : ""}).`);
      setStatus("Failed", "error");
    }
  };
}

function stopSpeaking(update = true) {
  const ws = state.ws;
  state.ws = null;
  if (ws && ws.readyState <= WebSocket.OPEN) ws.close(1000, "stopped"); // the gateway cancels the synthesis
  state.player.stop();
  state.spoken.stop();
  if (update) {
    setBusy(false);
    finishDownload();
    if (!state.ended) setStatus("Stopped", "stopped");
  }
}

// ---- tabs ----------------------------------------------------------------------------------------

function selectTab(name) {
  for (const tab of document.querySelectorAll("[role='tab']")) {
    const selected = tab.id === `tab-${name}`;
    tab.setAttribute("aria-selected", String(selected));
    tab.tabIndex = selected ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !selected;
  }
}

// ---- wiring --------------------------------------------------------------------------------------

function init() {
  state.player = new Player($("waveform"), onDrained);
  state.spoken = new SpokenText($("spoken"), () => 1000 * state.player.playedSeconds());
  $("api-key").value = localStorage.getItem("cosyvoice-api-key") || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("cosyvoice-api-key", apiKey());
    loadVoices();
  });
  $("settings").addEventListener("submit", (event) => { event.preventDefault(); $("api-key").blur(); });
  $("tab-speak").addEventListener("click", () => selectTab("speak"));
  $("tab-convert").addEventListener("click", () => selectTab("convert"));
  if (location.hash === "#convert") selectTab("convert");
  $("model").addEventListener("change", () => { showError("model", ""); showFamilyName(); });
  $("voice").addEventListener("change", describeVoice);
  $("refresh-voices").addEventListener("click", () => { showError("voice", ""); loadVoices(); });
  $("delete-voice").addEventListener("click", deleteVoice);
  $("mode").addEventListener("change", () => { $("instruct-field").hidden = $("mode").value !== "instruct2"; });
  $("speak").addEventListener("click", speak);
  $("stop").addEventListener("click", () => stopSpeaking(true));
  $("text").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) speak();
  });
  microphoneButton($("record"), {
    onStart: () => {
      showError("record", "");
      $("register-status").textContent = "Recording… speak now, then press Stop recording.";
    },
    onDone: (wav) => {
      state.recorded = wav;
      $("voice-file").value = "";
      preview($("voice-preview"), wav);
      $("register-status").textContent = "Recording ready: type its transcript and register it.";
    },
    onError: (message) => showError("record", message),
  });
  $("voice-file").addEventListener("change", () => {
    const file = $("voice-file").files[0];
    showError("voice-file", "");
    if (file) { state.recorded = null; preview($("voice-preview"), file); }
  });
  $("register").addEventListener("click", registerVoice);
  checkServer().then((ready) => {
    loadVoices();
    if (!ready) {
      const timer = setInterval(async () => {
        if (await checkServer()) { clearInterval(timer); loadVoices(); }
      }, 2000);
    }
  });
}

document.addEventListener("DOMContentLoaded", init);
